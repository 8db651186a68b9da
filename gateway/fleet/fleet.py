"""The replica's shared-state parts and the one periodic tick that keeps them true.

Every `[redis] tick_s` (a third of the lease TTL by default): renew this
replica's leases and refresh the fleet's counts, publish this replica's
signals and read the others'; while Redis is down, try it again instead.

Slot leases are per pool (one `SlotLeases` per model's pool, #28): a full pool's
line never holds another pool's slots back. Every pool's leases start, stop, tick,
fall back to the local share and rejoin together (one store, one Redis).
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
        #: Each pool's backends' slots, leased across replicas, by pool name.
        self.leases_by_pool: dict[str, SlotLeases] = {}
        #: The default pool's name (TGI routes, signals, `leases`).
        self.default_pool: str | None = None
        self._task: asyncio.Task[None] | None = None

    def add_leases(self, pool: str, leases: SlotLeases, *, default: bool = False) -> None:
        """Lease `pool`'s slots through the fleet: ticked, rejoined, stopped with it."""
        self.leases_by_pool[pool] = leases
        if default:
            self.default_pool = pool
        self.ticks.append(leases.tick)
        self.store.on_up.append(leases.rejoin)

    @property
    def leases(self) -> SlotLeases | None:
        """The default pool's leases (None without them)."""
        return None if self.default_pool is None else self.leases_by_pool.get(self.default_pool)

    def leases_of(self, pool: str) -> SlotLeases | None:
        """The leases of the pool named `pool` (None: that pool's slots are local)."""
        return self.leases_by_pool.get(pool)

    def local_share(self) -> float:
        """This replica's share of each backend and each quota while Redis is down."""
        return self.settings.replica_share or 1.0 / max(1, self.replicas_seen)

    async def start(self) -> None:
        for leases in self.leases_by_pool.values():
            await leases.start()
        if await self.store.ping() and await self.store.warm():
            await self.tick()
        else:
            for leases in self.leases_by_pool.values():
                leases.go_local()
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
        # Together: each waits up to a listener's turn, which would add up pool by pool.
        await asyncio.gather(*(leases.stop() for leases in self.leases_by_pool.values()))
        await self.store.close()
