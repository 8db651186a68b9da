"""Shared fixtures: real servers on 127.0.0.1 (the simulator, the gateway in front of it)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import tiktoken
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import is_hypothesis_test

from gateway.admission.tokens import load_encoding
from gateway.app import build_app
from gateway.config import (
    BackendSettings,
    HealthSettings,
    LaneSettings,
    Settings,
    default_lanes,
    validate,
)
from gateway.state import GATEWAY, GatewayState
from gateway.tools.simulator import SimulatorConfig, start_simulator

_ENCODING: tiktoken.Encoding | None = None

# Gateways the tests start as processes (`serve`) learn each engine afresh: a state file
# in the user's directory would carry one test's figures into another's gateway.
os.environ.setdefault("GATEWAY_HEALTH_STATE_FILE", "off")


@pytest.fixture(autouse=True)
def _own_state_directory(tmp_path_factory: pytest.TempPathFactory, monkeypatch: Any) -> None:
    """Each test's processes have a state directory of their own: a test that strips the
    GATEWAY_* variables gets `serve`'s default state file, and one in the user's directory
    restored another run's figures for a backend on a reused port."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))


def encoding() -> tiktoken.Encoding:
    """Load the BPE once for the whole session (it takes ~0.2 s)."""
    global _ENCODING
    if _ENCODING is None:
        _ENCODING = load_encoding("cl100k_base")
    return _ENCODING


@dataclass
class RunningGateway:
    url: str
    app: web.Application
    log: io.StringIO

    @property
    def state(self) -> GatewayState:
        return self.app[GATEWAY]

    def log_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.getvalue().splitlines() if line.strip()]

    def request_lines(self) -> list[dict[str, Any]]:
        return [line for line in self.log_lines() if line.get("event") == "request"]


StartSimulator = Callable[..., Awaitable[str]]
StartGateway = Callable[..., Awaitable[RunningGateway]]


@pytest.fixture
async def start_simulator_at() -> AsyncIterator[StartSimulator]:
    runners = []

    async def start(**knobs: Any) -> str:
        runner, port = await start_simulator(SimulatorConfig(**knobs))
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def start_gateway() -> AsyncIterator[StartGateway]:
    """Start a gateway in front of `backends` with settings adjusted by `configure`.

    Settings are frozen: `configure` returns new ones (`msgspec.structs.replace`).
    """
    servers: list[TestServer] = []

    async def start(
        backends: list[str],
        *,
        max_concurrency: int = 8,
        lanes: list[LaneSettings] | None = None,
        configure: Callable[[Settings], Settings] | None = None,
    ) -> RunningGateway:
        settings = Settings(
            backends=[
                BackendSettings(url=url, name=f"b{i}", max_concurrency=max_concurrency)
                for i, url in enumerate(backends)
            ],
            lanes=lanes or default_lanes(),
            # No start-up probe requests: tests count what reaches their simulators.
            health=HealthSettings(probe_on_start=False),
        )
        if configure:
            settings = configure(settings)
        settings = validate(settings)
        log = io.StringIO()
        app = build_app(settings, log_stream=log, encoding=encoding())
        server = TestServer(app, host="127.0.0.1")
        await server.start_server(auto_decompress=False)  # as `serve` runs it
        servers.append(server)
        return RunningGateway(str(server.make_url("")).rstrip("/"), app, log)

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


#: The fields DESIGN.md promises on every request log line.
DOCUMENTED_LOG_FIELDS = frozenset(
    {
        "event",
        "request_id",
        "route",
        "model",
        "pool",
        "stream",
        "lane",
        "backend",
        "engine",
        "status",
        "outcome",
        "prompt_tokens",
        "max_tokens_requested",
        "max_tokens",
        "completion_tokens",
        "queue_ms",
        "backend_ttft_ms",
        "ttft_ms",
        "tpot_ms",
        "e2e_ms",
        "engine_queue_ms",
        "prefill_ms",
        "decode_ms",
        "timing_source",
        "tenant",
        "retry_of",
        "retry_gap_ms",
        "retried_outcome",
        "resumes",
        "resumed_from",
        "resume_reason",
    }
)


def free_port() -> int:
    """A port nothing listens on now, for a server a test starts as a process."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def stop(process: asyncio.subprocess.Process) -> None:
    """A gateway process stopped as an operator stops it (SIGTERM), killed if it is still
    running 20 s later (and that is a failure)."""
    process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), 20)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise


async def wait_ready(http: aiohttp.ClientSession, url: str, timeout_s: float = 10.0) -> None:
    """Until a gateway started as a process answers /readyz with 200 (or the time runs out)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        try:
            async with http.get(url + "/readyz") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url}/readyz did not answer 200 within {timeout_s:g} s")


def chat(prompt: str = "Hello there!", **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": prompt}], **extra}


def sse_events(raw: bytes) -> list[Any]:
    """Parsed `data:` payloads of an SSE body; `[DONE]` stays a string."""
    events: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ----------------------------------------------------------------------------- slow tests

#: Directories (under tests/) whose every test is `slow`: real gateways and simulators
#: under load (the 2000-request burst, 1000 open streams), fault injection with its
#: settle-and-check waits, clusters, loadgen runs, a subprocess drained by SIGTERM.
SLOW_DIRS = ("integration",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `slow` what `make test-fast` (`-m "not slow"`) leaves to `make test`: the
    directories above and every hypothesis-driven test (schemathesis' included), which
    runs hundreds of examples. A single slow test elsewhere carries `@pytest.mark.slow`."""
    tests = Path(__file__).parent
    slow_dirs = [tests / name for name in SLOW_DIRS]
    for item in items:
        in_slow_dir = any(item.path.is_relative_to(d) for d in slow_dirs)
        if in_slow_dir or is_hypothesis_test(getattr(item, "obj", None)):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def redis_server() -> Any:
    """A real redis-server on a free loopback port for this test, stopped by PID after."""
    from tests.redis_server import RedisServer, redis_binary

    server = RedisServer(redis_binary())
    server.start()
    yield server
    server.cleanup()
