"""The replica's shared-state parts and the one periodic tick that keeps them true.

Every `[redis] tick_s` (a third of the lease TTL by default): renew this
replica's leases and refresh the fleet's counts, publish this replica's
signals and read the others'; while Redis is down, try it again instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from gateway.config import RedisSettings
from gateway.fleet.store import SharedStore

if TYPE_CHECKING:
    from gateway.fleet.leases import SlotLeases

Tick = Callable[[], Awaitable[None]]


class Fleet:
    """Runs the parts' ticks; knows this replica's share for when Redis is down."""

    def __init__(self, settings: RedisSettings, store: SharedStore) -> None:
        self.settings = settings
        self.store = store
        #: Each part's periodic work, in order (leases first: slots matter most).
        self.ticks: list[Tick] = []
        #: Gateway replicas last seen in Redis (this one included); signals keep it.
        self.replicas_seen = 1
        #: The backends' slots, leased across replicas.
        self.leases: SlotLeases | None = None
        self._task: asyncio.Task[None] | None = None

    def local_share(self) -> float:
        """This replica's share of each backend and each quota while Redis is down."""
        return self.settings.replica_share or 1.0 / max(1, self.replicas_seen)

    async def start(self) -> None:
        if self.leases is not None:
            await self.leases.start()
        if await self.store.ping():
            await self.tick()
        elif self.leases is not None:
            self.leases.go_local()
        self._task = asyncio.create_task(self._run(), name="fleet-tick")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            await self.tick()

    async def tick(self) -> None:
        if not self.store.up:
            await self.store.ping()  # rejoins (on_up) when Redis answers
            return
        for tick in self.ticks:
            await tick()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.leases is not None:
            await self.leases.stop()
        await self.store.close()
