"""SIGTERM on a real gateway process: refuse new work, send the queued away, finish streams, exit 0."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp

from tests.conftest import StartSimulator, chat, free_port, wait_ready

ROOT = Path(__file__).resolve().parents[2]


async def test_sigterm_drains_and_exits_zero(
    start_simulator_at: StartSimulator, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    sim = await start_simulator_at()
    port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[server]\ndrain_timeout_s = 15\n\n[[backends]]\nurl = "{sim}"\nmax_concurrency = 1\n'
        '\n[[lanes]]\nname = "only"\nqueue_timeout_s = 30\nreject_predicted_wait = false\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "serve",
        "--config",
        str(config),
        "--port",
        str(port),
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(http, url)
        stream = await http.post(
            url + "/v1/chat/completions", json=chat(max_tokens=250, stream=True)
        )
        assert stream.status == 200
        queued = asyncio.create_task(
            http.post(url + "/v1/chat/completions", json=chat(max_tokens=5))
        )
        await asyncio.sleep(0.3)
        process.send_signal(signal.SIGTERM)

        answer = await asyncio.wait_for(queued, 5)
        assert answer.status == 503
        assert (await answer.json())["error"]["code"] == "shutting_down"
        assert int(answer.headers["Retry-After"]) >= 1
        async with http.get(url + "/readyz") as resp:
            assert resp.status == 503
        async with http.post(url + "/v1/chat/completions", json=chat(max_tokens=2)) as resp:
            assert resp.status == 503
        body = await stream.read()  # the stream in flight runs to its end
        assert body.rstrip().endswith(b"data: [DONE]")
        assert await asyncio.wait_for(process.wait(), 10) == 0
        assert process.stdout is not None
        lines = (await process.stdout.read()).decode()
        assert '"outcome":"ok"' in lines and '"rejected_shutting_down"' in lines
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
