"""A restarted gateway starts from what it learned, not from the priors (#40).

A real gateway process learns a slow engine (the start-up probe), is stopped with
SIGTERM and started again without a probe: before any request, its backend's prefill
rate is the one learned before, its age logged, and the lane's deadline fitted to it
at once rather than the provisional one a gateway that knows nothing has.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp

from tests.conftest import StartSimulator, free_port, stop, wait_ready

ROOT = Path(__file__).resolve().parents[2]


async def serve(config: Path, port: int, log: Path) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    with log.open("ab") as err:
        return await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "gateway", "serve", "--config", str(config)),
            *("--port", str(port)),
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=err,
        )


async def learned(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/debug/backends") as resp:
        return dict(await resp.json())


async def test_a_restarted_gateway_keeps_what_it_learned(
    start_simulator_at: StartSimulator, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # About 500 prompt tokens/s: a 1024-token probe takes 2 s, far from the GPU prior.
    sim = await start_simulator_at(prefill_ms_per_token=2.0)
    state, log = tmp_path / "learned.json", tmp_path / "gateway.log"
    config = tmp_path / "gateway.toml"
    body = f'[[backends]]\nurl = "{sim}"\nmax_concurrency = 4\n'
    config.write_text(f'[health]\nstate_file = "{state}"\nprobe_on_start = true\n\n{body}')
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    first = await serve(config, port, log)
    try:
        await wait_ready(http, url, timeout_s=60)
        seen = await learned(http, url)
        rate = seen["backends"][0]["learned"]["prefill_tokens_per_s"]
        assert 250 < rate < 1000, rate
    finally:
        await stop(first)
    saved = json.loads(state.read_text())["backends"][sim]
    assert abs(saved["figures"]["prefill_tokens_per_s"] - rate) < 0.2 * rate

    config.write_text(f'[health]\nstate_file = "{state}"\nprobe_on_start = false\n\n{body}')
    second = await serve(config, port, log)
    try:
        await wait_ready(http, url, timeout_s=30)
        seen = await learned(http, url)
        again = seen["backends"][0]["learned"]
        assert abs(again["prefill_tokens_per_s"] - rate) < 0.2 * rate
        assert again["prefill_samples"] >= 3
        restored = [
            json.loads(line)
            for line in log.read_text().splitlines()
            if '"backend_state_restored"' in line
        ]
        assert restored and restored[-1]["age_s"] >= 0
    finally:
        await stop(second)
