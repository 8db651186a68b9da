"""A gateway and a simulator served by an event loop in another thread, for sync tests.

hypothesis and schemathesis drive requests from plain (sync) test functions; running
the servers on their own loop keeps them away from pytest-asyncio's per-test loops.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from aiohttp import web

from gateway.app import build_app
from gateway.config import (
    BackendSettings,
    LimitsSettings,
    ServerSettings,
    Settings,
    default_lanes,
    validate,
)
from gateway.state import GATEWAY, GatewayState
from gateway.tools.simulator import SimulatorConfig, start_simulator
from tests.conftest import encoding
from tests.helpers import held

T = TypeVar("T")


def gateway_settings(
    backend_url: str, *, max_n: int = 4, max_body_bytes: int | None = None
) -> Settings:
    """Small output caps so that every accepted request finishes in tens of milliseconds."""
    server = (
        ServerSettings()
        if max_body_bytes is None
        else ServerSettings(max_body_bytes=max_body_bytes)
    )
    return Settings(
        server=server,
        limits=LimitsSettings(default_max_tokens=4, max_output_tokens=8, max_n=max_n),
        backends=[BackendSettings(url=backend_url, name="sim", max_concurrency=8)],
        lanes=default_lanes(),
    )


class LiveGateway:
    """The simulator and a gateway in front of it, served by a loop in another thread."""

    def __init__(self, make_settings: Callable[[str], Settings] = gateway_settings) -> None:
        self.make_settings = make_settings
        self.loop = asyncio.new_event_loop()
        self.url = ""
        self.app: web.Application | None = None
        # Strict UTF-8 like the stdout it replaces: a line that stdout could not take fails here too.
        self._log_bytes = io.BytesIO()
        self.log = io.TextIOWrapper(self._log_bytes, encoding="utf-8", errors="strict")
        self._runners: list[web.AppRunner] = []
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="live-gateway", daemon=True)

    def start(self) -> LiveGateway:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the gateway did not start within 30 s")
        if self._failure is not None:
            raise self._failure
        return self

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._start_servers())
        except BaseException as exc:  # reported to the test thread by start()
            self._failure = exc
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self._stop_servers())
        self.loop.close()

    async def _start_servers(self) -> None:
        # 1 ms steps: a request of 8 tokens takes ~10-20 ms in the simulator.
        sim_runner, sim_port = await start_simulator(
            SimulatorConfig(step_base_ms=1.0, prefill_ms_per_token=0.01, decode_ms_per_seq=0.1)
        )
        self._runners.append(sim_runner)
        settings = validate(self.make_settings(f"http://127.0.0.1:{sim_port}"))
        app = build_app(settings, log_stream=self.log, encoding=encoding())
        # As `serve` runs it: handler cancellation on, no automatic body decompression.
        runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, auto_decompress=False
        )
        await runner.setup()
        self._runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.app = app
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"

    async def _stop_servers(self) -> None:
        for runner in reversed(self._runners):
            await runner.cleanup()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)

    def run(self, make: Callable[[], Coroutine[Any, Any, T]], timeout_s: float = 10.0) -> T:
        """Run a coroutine on the servers' loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result(timeout_s)

    def log_lines(self) -> list[dict[str, Any]]:
        """The request log lines written so far."""

        async def read() -> str:
            self.log.flush()
            return self._log_bytes.getvalue().decode("utf-8")

        return [json.loads(line) for line in self.run(read).splitlines() if line.strip()]

    @property
    def state(self) -> GatewayState:
        assert self.app is not None
        return self.app[GATEWAY]

    def leftovers(self, within_s: float = 5.0) -> list[str]:
        """What is still held once every request has ended (a stream's handler may end
        a moment after its client read the last byte, so this waits a little)."""

        async def check() -> list[str]:
            return held(self.state)

        deadline = time.monotonic() + within_s
        while True:
            found = self.run(check)
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.02)
