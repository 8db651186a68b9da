"""The contract suite's gateway: a `serve` process started from a TOML file, as an operator
starts it, so what the file writes goes through the same loading (what was written is
exact: `config/written.py`) as in production.

A gateway is started in one of three states of knowledge, each a test's parameter:

- `fresh`: nothing learned (no start-up probe, no state file): every figure a prior;
- `learned`: the start-up probe measured each engine (the test waits for it);
- `restarted`: a second process that kept the first one's state file, probe off.

Engines are the project's simulator: `FAST` (a GPU-like prefill, milliseconds) and
`SLOW` (a CPU-like one, ~250 prompt tokens/s: a 2000-token prompt is 8 s of prefill).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import free_port, stop, wait_ready

ROOT = Path(__file__).resolve().parents[2]

#: Engine steps of 20 ms, so a 200-token answer streams for about 4 s.
FAST: dict[str, Any] = {"step_base_ms": 20.0, "max_batch": 1}
SLOW: dict[str, Any] = {
    "step_base_ms": 20.0,
    "max_batch": 1,
    "prefill_ms_per_token": 4.0,
    "prefill_tokens_per_step": 256,
}
ENGINES = {"fast": FAST, "slow": SLOW}
#: A test that writes [[api_keys]] writes this one as an admin's, for /debug/backends
#: (without keys the header is ignored).
ADMIN_KEY = "contract-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
#: Prefill samples that make a rate learned (`scheduling/learning.py` MIN_SAMPLES; the
#: start-up probe leaves three).
PROBE_SAMPLES = 3
KNOWLEDGE = ("fresh", "learned", "restarted")


@dataclass
class Written:
    """A gateway process started from a written config, and what it said."""

    url: str
    process: asyncio.subprocess.Process
    lines: list[dict[str, Any]]

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line.get("event") == name]

    def request_lines(self) -> list[dict[str, Any]]:
        return self.events("request")

    async def lines_of(self, count: int, within_s: float = 5.0, **fields: Any) -> list[dict]:
        """The request lines with these fields, once there are `count` of them (a served
        gateway writes a request's line within about 0.1 s of its end)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while True:
            found = [
                line
                for line in self.request_lines()
                if all(line.get(key) == value for key, value in fields.items())
            ]
            if len(found) >= count or loop.time() > deadline:
                assert len(found) >= count, f"{len(found)} of {count} lines with {fields}"
                return found
            await asyncio.sleep(0.05)


#: `start(toml, knowledge)`: the TOML's [[backends]] and [[lanes]] are the test's; the
#: fixture adds [health] for the knowledge asked for.
StartWritten = Callable[[str, str], Awaitable[Written]]


async def _collect(stream: asyncio.StreamReader | None, lines: list[dict[str, Any]]) -> None:
    """Its JSON lines as they come: the request lines (stdout) and the others (stderr)."""
    assert stream is not None
    async for raw in stream:
        try:
            lines.append(json.loads(raw))
        except ValueError:
            lines.append({"event": "text", "text": raw.decode(errors="replace")})


@pytest.fixture
async def start_written(http: aiohttp.ClientSession, tmp_path: Path) -> AsyncIterator[StartWritten]:
    started: list[tuple[asyncio.subprocess.Process, asyncio.Future[Any]]] = []
    state = tmp_path / "learned.json"

    async def launch(toml: str, health: str) -> Written:
        config = tmp_path / f"gateway{len(started)}.toml"
        config.write_text(f"[health]\ninterval_s = 0.5\n{health}\n{toml}")
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--config", str(config),
            "--port", str(port),
            cwd=ROOT, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        lines: list[dict[str, Any]] = []
        readers = asyncio.gather(_collect(process.stdout, lines), _collect(process.stderr, lines))
        started.append((process, readers))
        written = Written(f"http://127.0.0.1:{port}", process, lines)
        try:
            await wait_ready(http, written.url, timeout_s=60)
        except AssertionError:
            said = [line.get("text") or line for line in lines[-5:]]
            raise AssertionError(f"the gateway did not start: {said}") from None
        return written

    async def start(toml: str, knowledge: str) -> Written:
        if knowledge == "fresh":
            return await launch(toml, 'state_file = "off"\nprobe_on_start = false')
        learning = await launch(toml, f'state_file = "{state}"\nprobe_on_start = true')
        await _probed(http, learning.url)
        if knowledge == "learned":
            return learning
        await stop(learning.process)
        return await launch(toml, f'state_file = "{state}"\nprobe_on_start = false')

    yield start
    for process, reader in started:
        if process.returncode is None:
            process.kill()
            await process.wait()
        reader.cancel()


async def _probed(http: aiohttp.ClientSession, url: str, within_s: float = 60.0) -> None:
    """Until the start-up probe has measured every backend's prefill (it runs after the
    gateway is ready, and stops at the first request of a test)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while loop.time() < deadline:
        async with http.get(url + "/debug/backends", headers=ADMIN) as resp:
            backends = (await resp.json())["backends"]
        if all(b["learned"]["prefill_samples"] >= PROBE_SAMPLES for b in backends):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the start-up probe of {url} did not end within {within_s:g} s")


async def sim_requests(http: aiohttp.ClientSession, sim: str) -> list[dict[str, Any]]:
    """What the simulator received (`/sim/requests`), oldest first."""
    async with http.get(sim + "/sim/requests") as resp:
        body = await resp.json()
    return list(body["requests"] if isinstance(body, dict) else body)
