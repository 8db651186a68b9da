"""Active health checks: GET <url><path> on every backend, every few seconds.

Passive checks (request failures) live in the pool; this task only answers
"does the server answer its health route". A backend that stops answering
gets no new requests; one that answers again comes back by itself.

A backend whose entry names no `models` has what it serves read in the same check,
before it is marked healthy (`served.py`): one that comes back with another model is
routed by its new list from its first request. The first round's end (`checked`) is
when `/readyz` may say ready.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from gateway.config import HealthSettings
from gateway.upstream.pool import Backend, BackendPool
from gateway.upstream.telemetry import fetch_listing

#: Most names one `models_listed` line shows.
LOGGED_NAMES = 20


class HealthMonitor:
    def __init__(self, pool: BackendPool, settings: HealthSettings, events: Any = None) -> None:
        self.pool = pool
        self.settings = settings
        self.events = events
        #: A first round of checks (and of model listings) has ended.
        self.checked = False
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        #: Reads of what a backend that joined at run time serves (`joined`), under way.
        self._reads: set[asyncio.Task[None]] = set()
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
        for read in list(self._reads):
            read.cancel()
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
        self.checked = True

    async def _check(self, backend: Backend) -> bool:
        assert self._session is not None
        headers = backend.auth_headers
        try:
            async with self._session.get(backend.url + self.settings.path, headers=headers) as resp:
                healthy = resp.status < 500
        except (aiohttp.ClientError, TimeoutError):
            return False
        if healthy and backend.served.from_engine:
            await self.read_models(backend)
        return healthy

    def joined(self, backend: Backend) -> None:
        """A backend joined at run time (a reload, a DNS name's new address): what it serves
        is read now, in the background, not at the next round (until then it takes every
        name, as it did before models were read)."""
        if backend.served.from_engine and self._session is not None:
            read = asyncio.get_running_loop().create_task(
                self.read_models(backend), name=f"models-{backend.name}"
            )
            self._reads.add(read)
            read.add_done_callback(self._reads.discard)

    async def read_models(self, backend: Backend) -> None:
        """What its engine serves now (`served.py`); one line when that changed, or when
        reading it began to fail (the last list read is kept)."""
        assert self._session is not None
        # Within one check's timeout in all (it may ask up to three routes): a slow listing
        # must not hold the round, and with it the other backends' results.
        listing = await fetch_listing(
            self._session, backend.url, backend.auth_headers, timeout_s=self.settings.timeout_s
        )
        served = backend.served
        change = served.note(listing, backend.engine if backend.engine_configured else None)
        if change is None or self.events is None:
            return
        if change == "listed":
            names = sorted(served.names or ())
            self.events.info(
                "models_listed",
                backend=backend.name,
                models=names[:LOGGED_NAMES],
                listed=len(names),
                engine=served.engine,
                any_name=served.any_name,
            )
        else:
            kept = sorted(served.names or ())[:LOGGED_NAMES] if served.known else None
            self.events.warning(
                "models_listing_failed",
                backend=backend.name,
                kept=kept,
                treated_as="its last list" if served.known else "serving any name",
            )
