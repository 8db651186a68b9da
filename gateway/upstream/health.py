"""Active health checks: GET <url><path> on every backend, every few seconds.

Passive checks (request failures) live in the pool; this task only answers
"does the server answer its health route". A backend that stops answering
gets no new requests; one that answers again comes back by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import aiohttp

from gateway.config import HealthSettings
from gateway.upstream.pool import Backend, BackendPool


class HealthMonitor:
    def __init__(self, pool: BackendPool, settings: HealthSettings) -> None:
        self.pool = pool
        self.settings = settings
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        #: Runs after each round of checks with the checks' session (the sizer's round).
        self.after_round: Callable[[aiohttp.ClientSession], Awaitable[None]] | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=self.settings.timeout_s),
        )
        self._task = asyncio.create_task(self._run(), name="health-checks")

    @property
    def session(self) -> aiohttp.ClientSession | None:
        """The checks' HTTP session (for other calls to the backends' own routes)."""
        return self._session

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            await self._session.close()

    async def _run(self) -> None:
        while True:
            await self.check_all()
            if self.after_round is not None and self._session is not None:
                await self.after_round(self._session)
            await asyncio.sleep(self.settings.interval_s)

    async def check_all(self) -> None:
        backends = list(self.pool.backends)  # a reload may change them meanwhile
        results = await asyncio.gather(*(self._check(b) for b in backends))
        for backend, healthy in zip(backends, results, strict=True):
            self.pool.set_health(backend, healthy)

    async def _check(self, backend: Backend) -> bool:
        assert self._session is not None
        headers = backend.auth_headers
        try:
            async with self._session.get(backend.url + self.settings.path, headers=headers) as resp:
                return resp.status < 500
        except (aiohttp.ClientError, TimeoutError):
            return False
