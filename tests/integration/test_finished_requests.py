"""A served gateway writes a finished request's log line and metrics a moment later, with
the others that end meanwhile (`GatewayState.finish`): a scrape still counts every request
that ended before it, and each line carries the time its request ended."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

from tests.conftest import StartSimulator, chat, free_port, wait_ready
from tests.helpers import eventually
from tests.integration.test_shutdown import served_gateway


def request_lines(log: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [line for line in lines if line.get("event") == "request"]


async def test_a_scrape_counts_what_just_ended_and_lines_carry_their_end(
    start_simulator_at: StartSimulator, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    sim = await start_simulator_at()
    port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(f'[[backends]]\nurl = "{sim}"\nmax_concurrency = 8\n')
    log = tmp_path / "requests.jsonl"
    process = await served_gateway(config, port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(http, url)

        async def one(request_id: str) -> None:
            async with http.post(
                url + "/v1/chat/completions",
                json=chat(max_tokens=3, stream=True),
                headers={"x-request-id": request_id},
            ) as resp:
                assert resp.status == 200
                await resp.read()

        await asyncio.gather(*(one(f"burst-{i}") for i in range(8)))
        async with http.get(url + "/metrics") as resp:  # at once: nothing waits for a timer
            text = await resp.text()
        assert 'gateway_requests_total{lane="interactive",outcome="ok",status="200"} 8.0' in text
        assert 'gateway_ttft_seconds_count{lane="interactive"} 8.0' in text

        await one("alone")
        ended_by = time.time()
        await eventually(lambda: len(request_lines(log)) == 9)
        alone = next(line for line in request_lines(log) if line["request_id"] == "alone")
        stamped = datetime.fromisoformat(alone["timestamp"].replace("Z", "+00:00")).timestamp()
        # Its end, not the moment its line was written (a batch goes 50 ms later).
        assert ended_by - 1.0 < stamped <= ended_by + 0.02, (stamped, ended_by)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
