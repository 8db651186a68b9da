"""SIGTERM on a real gateway process: refuse new work, send the queued away, finish streams
(cut at the drain deadline; with [redis], their leases given back at once), exit 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis

from tests.conftest import StartSimulator, chat, free_port, sse_events, wait_ready
from tests.helpers import eventually
from tests.redis_server import RedisServer

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


def replica_config(path: Path, backend: str, redis_url: str, drain_s: float) -> Path:
    """A replica with [redis] in front of `backend` (2 slots). The lease TTL is long, so
    slots freed only by their TTL would come back far too late for the test."""
    path.write_text(
        f"[server]\ndrain_timeout_s = {drain_s}\n\n"
        f'[[backends]]\nurl = "{backend}"\nmax_concurrency = 2\n\n'
        "[health]\nprobe_on_start = false\n\n"
        f'[redis]\nurl = "{redis_url}"\nlease_ttl_s = 30\n'
    )
    return path


async def served_gateway(config: Path, port: int, log: Path) -> asyncio.subprocess.Process:
    """`python -m gateway serve` as a process, its request log (stdout) written to `log`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    with log.open("w") as out:
        return await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "gateway", "serve", "--config", str(config)),
            *("--port", str(port)),
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=asyncio.subprocess.DEVNULL,
        )


async def test_sigterm_of_a_replica_with_redis_cuts_at_the_deadline_and_frees_its_leases(
    redis_server: RedisServer,
    start_simulator_at: StartSimulator,
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    """Replica A holds both of the backend's slots with long streams; replica B's request
    waits for one. SIGTERM to A: A is unready at once; its streams run on until its drain
    deadline, then end with a `shutting_down` event; B gets the slots at once (not after
    the 30-s lease TTL), and A exits 0."""
    drain_s = 1.5
    backend = await start_simulator_at(step_base_ms=20.0)  # 400 tokens: ~8 s a stream
    ports = free_port(), free_port()
    a_url, b_url = (f"http://127.0.0.1:{port}" for port in ports)
    processes = [
        await served_gateway(
            replica_config(tmp_path / f"{name}.toml", backend, redis_server.url, drain_s),
            port,
            tmp_path / f"{name}.log",
        )
        for name, port in zip("ab", ports, strict=True)
    ]
    a = processes[0]
    streams: list[aiohttp.ClientResponse] = []
    firsts: list[bytes] = []
    try:
        await wait_ready(http, a_url, timeout_s=20)
        await wait_ready(http, b_url, timeout_s=20)
        body = chat("Tell me a story.", stream=True, max_tokens=400)
        for _ in range(2):
            stream = await http.post(a_url + "/v1/chat/completions", json=body)
            assert stream.status == 200
            firsts.append(await stream.content.readuntil(b"\n\n"))  # the slot is held
            streams.append(stream)
        waiting = asyncio.ensure_future(
            http.post(b_url + "/v1/chat/completions", json=chat(max_tokens=3))
        )
        await asyncio.sleep(0.5)
        assert not waiting.done(), "B had no slot while A held both"

        a.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        while True:  # the signal is handled by A's loop, a moment after it was sent
            async with http.get(a_url + "/readyz") as ready:
                if ready.status == 503:
                    break
            assert time.monotonic() - sent < 0.5, "still ready 0.5 s after SIGTERM"
            await asyncio.sleep(0.02)

        ends = await asyncio.gather(*(s.read() for s in streams))
        cut_after = time.monotonic() - sent
        assert drain_s - 0.2 <= cut_after <= drain_s + 3, cut_after
        for first, rest in zip(firsts, ends, strict=True):
            events = sse_events(first + rest)
            assert events[-1]["error"]["code"] == "shutting_down", events[-1]
            assert events[-1]["error"]["retry_after"] == 1
            assert any("choices" in e for e in events[:-1])  # part of the answer came first
            assert "[DONE]" not in events

        answer = await asyncio.wait_for(waiting, 5)
        assert answer.status == 200
        served_after = time.monotonic() - sent
        assert served_after < drain_s + 4, served_after  # the lease TTL is 30 s
        assert await asyncio.wait_for(a.wait(), 10) == 0
        cut = [
            line
            for line in map(json.loads, (tmp_path / "a.log").read_text().splitlines())
            if line.get("event") == "request"
        ]
        assert [(line["status"], line["outcome"]) for line in cut] == [
            (200, "rejected_shutting_down")
        ] * 2
        await answer.read()  # B's own lease is given back when its answer ends
        client = aioredis.Redis.from_url(redis_server.url)

        async def no_lease_left() -> bool:
            # Given back in the background once B's answer ended.
            return await client.zcard(f"llmgw:slots:{backend}") == 0

        try:
            await eventually(no_lease_left, within_s=5.0)
        finally:
            await client.aclose()
    finally:
        for stream in streams:
            stream.close()
        for process in processes:
            if process.returncode is None:
                process.kill()
                await process.wait()
