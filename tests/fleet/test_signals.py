"""Fleet signals over a real redis-server: three replicas (three stores, three real
schedulers over counted slots) publish their queueing and each exports the same view.

The ticks are called by hand (`Fleet.tick`, what the fleet's timer calls), so the
test decides who has published; expiry and liveness are real Redis time. Most
replicas have one pool (`*`, the one-model config's); the multi-model ones have two,
each with its own scheduler, as `build_pools` makes them.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from gateway.config import LaneSettings, RedisSettings
from gateway.fleet.fleet import Fleet
from gateway.fleet.signals import FleetSignals, ReplicaFigures, combine, decode_figures
from gateway.fleet.store import SharedStore
from gateway.observability.logs import make_logger
from gateway.scheduling.scheduler import Grant, Scheduler
from gateway.upstream.models import CATCH_ALL
from tests.redis_server import RedisServer
from tests.scheduling.test_scheduler import Clock, CountingSlots, settle

#: Fast ticks: a replica's figures expire 3 ticks (0.6 s) after it last published.
TICK_S = 0.2
LANES = ("interactive", "bulk")
#: The default pool of the one-model config: the `pool` label `gateway_pool_*` gives it.
ONE_POOL = CATCH_ALL


@dataclass
class Replica:
    """One gateway replica's fleet parts, without the HTTP around them."""

    store: SharedStore
    fleet: Fleet
    signals: FleetSignals
    schedulers: dict[str, Scheduler]
    clock: Clock
    registry: CollectorRegistry
    log: io.StringIO
    draining: bool = False
    held: list[Grant] = field(default_factory=list)
    waiting: list[asyncio.Task[Grant]] = field(default_factory=list)

    @property
    def scheduler(self) -> Scheduler:
        """The default pool's (the first)."""
        return next(iter(self.schedulers.values()))

    def sample(self, name: str, lane: str | None = None, pool: str = ONE_POOL) -> float | None:
        return self.registry.get_sample_value(name, {"pool": pool, "lane": lane} if lane else {})

    async def hold(self, lane: str, count: int, pool: str | None = None) -> None:
        scheduler = self.schedulers[pool] if pool else self.scheduler
        self.held += [await scheduler.acquire(lane) for _ in range(count)]

    async def queue(self, lane: str, count: int, pool: str | None = None) -> None:
        scheduler = self.schedulers[pool] if pool else self.scheduler
        self.waiting += [asyncio.create_task(scheduler.acquire(lane)) for _ in range(count)]
        await settle()

    async def learn_hold_time(self, lane: str, seconds: float, pool: str | None = None) -> None:
        """One request held a slot `seconds` (the scheduler's clock): waits become
        predictable."""
        scheduler = self.schedulers[pool] if pool else self.scheduler
        grant = await scheduler.acquire(lane)
        self.clock.advance(seconds)
        scheduler.release(grant)

    async def close(self) -> None:
        for task in self.waiting:
            task.cancel()
        await asyncio.gather(*self.waiting, return_exceptions=True)
        await self.store.close()


def make_replica(url: str, slots: int, pools: tuple[str, ...] = (ONE_POOL,)) -> Replica:
    """A replica with a scheduler of `slots` per pool; the first pool is the default."""
    settings = RedisSettings(url=url, tick_s=TICK_S)
    log = io.StringIO()
    registry = CollectorRegistry()
    store = SharedStore(settings, events=make_logger(log), registry=registry)
    fleet = Fleet(settings, store)
    clock = Clock()
    lanes = [LaneSettings(name=name, queue_timeout_s=30) for name in LANES]
    schedulers = {
        pool: Scheduler(lanes, dict.fromkeys(LANES, slots), CountingSlots(slots), clock=clock)
        for pool in pools
    }
    replica: Replica
    signals = FleetSignals(
        store, fleet, schedulers, default_pool=pools[0], draining=lambda: replica.draining
    )
    signals.install(registry)
    replica = Replica(store, fleet, signals, schedulers, clock, registry, log)
    return replica


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[list[Replica]]:
    made = [make_replica(redis_server.url, slots) for slots in (2, 1, 4)]
    yield made
    for replica in made:
        await replica.close()


async def tick_all(replicas: list[Replica], rounds: int = 2) -> None:
    """Every replica publishes; the second round lets each read all the others."""
    for _ in range(rounds):
        for replica in replicas:
            await replica.fleet.tick()


async def test_every_replica_exports_the_fleet_s_sums_and_worst_wait(
    replicas: list[Replica],
) -> None:
    a, b, c = replicas
    # a: 2 slots, both held, 3 waiting (hold time 2 s learned: 2 s per place / 2 slots).
    await a.learn_hold_time("interactive", 2.0)
    await a.learn_hold_time("bulk", 1.0)  # bulk waits behind a's interactive queue
    await a.hold("interactive", 2)
    await a.queue("interactive", 3)
    # b: 1 slot held by bulk, 1 bulk waiting (hold 6 s learned: the worst bulk wait).
    await b.learn_hold_time("bulk", 6.0)
    await b.hold("bulk", 1)
    await b.queue("bulk", 1)
    # c: idle, draining.
    c.draining = True
    await tick_all(replicas)

    waits = {lane: [r.scheduler.predicted_wait_s(lane) for r in replicas] for lane in LANES}
    assert waits["interactive"][0] == pytest.approx(4 * 2.0 / 2)  # 4th place, 1 s each
    assert waits["bulk"][1] == pytest.approx(2 * 6.0)  # 2nd place, 6 s each
    assert waits["bulk"][0] == pytest.approx(4 * 1.0 / 2)  # behind 3 interactive
    assert waits["interactive"][2] == waits["bulk"][2] == 0.0  # c: starts at once
    for replica in replicas:
        assert replica.fleet.replicas_seen == 3
        assert replica.sample("gateway_fleet_replicas") == 3
        assert replica.sample("gateway_fleet_replicas_draining") == 1
        assert replica.sample("gateway_fleet_queue_depth", "interactive") == 3
        assert replica.sample("gateway_fleet_queue_depth", "bulk") == 1
        assert replica.sample("gateway_fleet_in_flight", "interactive") == 2
        assert replica.sample("gateway_fleet_in_flight", "bulk") == 1
        for lane in LANES:
            expected = max(w or 0.0 for w in waits[lane])
            assert replica.sample("gateway_fleet_predicted_wait_seconds", lane) == (
                pytest.approx(expected)
            ), lane
        age = replica.sample("gateway_fleet_view_age_seconds")
        assert age is not None and 0 <= age < 2

    # This replica's own figures are read live at scrape time, the others' at the tick.
    a.scheduler.release(a.held.pop())
    await settle()  # one waiter got the slot
    assert a.sample("gateway_fleet_queue_depth", "interactive") == 2
    assert b.sample("gateway_fleet_queue_depth", "interactive") == 3  # until a publishes
    await tick_all(replicas, rounds=1)
    assert b.sample("gateway_fleet_queue_depth", "interactive") == 2


async def test_a_replica_that_stops_ticking_leaves_the_view_after_its_expiry(
    replicas: list[Replica], redis_server: RedisServer
) -> None:
    a, b, c = replicas
    await c.hold("bulk", 3)
    await tick_all(replicas)
    assert a.fleet.replicas_seen == 3
    assert a.sample("gateway_fleet_in_flight", "bulk") == 3
    expiry_s = c.signals.expiry_s
    assert expiry_s == pytest.approx(3 * TICK_S)

    # c stops ticking (as if killed); a and b go on at their pace.
    loop = asyncio.get_running_loop()
    stopped_at = loop.time()
    while loop.time() - stopped_at < expiry_s + 4 * TICK_S:
        await tick_all([a, b], rounds=1)
        await asyncio.sleep(TICK_S)
    for replica in (a, b):
        assert replica.fleet.replicas_seen == 2
        assert replica.sample("gateway_fleet_replicas") == 2
        assert replica.sample("gateway_fleet_in_flight", "bulk") == 0
    assert a.fleet.local_share() == pytest.approx(0.5)

    # In Redis itself: c is out of the live set and its figures are gone.
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        members: list[Any] = list(await client.zrange(a.store.key("replicas"), 0, -1))
        live = {member.decode() for member in members}
        assert live == {a.store.replica_id, b.store.replica_id}
        assert not await client.exists(c.store.key("replica", c.store.replica_id))
        assert await client.exists(a.store.key("replica", a.store.replica_id))
        ttl_ms = await client.pttl(a.store.key("replicas"))
        assert 0 < ttl_ms <= expiry_s * 1000 + 50, "the live set would outlive its members"
    finally:
        await client.aclose()

    # c comes back: it is counted again at once.
    await tick_all(replicas)
    assert a.fleet.replicas_seen == 3 and a.sample("gateway_fleet_in_flight", "bulk") == 3


async def test_redis_stopped_leaves_a_local_view_whose_age_grows_then_rejoins(
    replicas: list[Replica], redis_server: RedisServer
) -> None:
    a, b, _ = replicas
    await a.hold("interactive", 1)
    await b.hold("interactive", 1)
    await b.queue("interactive", 2)
    await tick_all([a, b])
    assert a.sample("gateway_fleet_replicas") == 2
    assert a.sample("gateway_fleet_queue_depth", "interactive") == 2

    redis_server.stop()
    await tick_all([a, b], rounds=1)  # fails, falls back: no exception
    await a.fleet.tick()  # while down: only a ping, which fails too
    assert not a.store.up and not b.store.up
    assert a.sample("gateway_redis_up") == 0
    assert '"redis_unavailable"' in a.log.getvalue()
    # The view is a alone: its own slot, none of b's queue.
    assert a.sample("gateway_fleet_replicas") == 1
    assert a.sample("gateway_fleet_queue_depth", "interactive") == 0
    assert a.sample("gateway_fleet_in_flight", "interactive") == 1
    # The replica count for the local share is the last one seen.
    assert a.fleet.replicas_seen == 2 and a.fleet.local_share() == pytest.approx(0.5)
    first = a.sample("gateway_fleet_view_age_seconds")
    await asyncio.sleep(0.5)
    later = a.sample("gateway_fleet_view_age_seconds")
    assert first is not None and later is not None and later >= first + 0.4

    # Redis back (empty: it kept nothing): each replica rejoins on its next tick and
    # publishes at once, and the view is the fleet's again.
    redis_server.start()
    await tick_all([a, b], rounds=1)
    assert a.store.up and b.store.up
    assert b.sample("gateway_fleet_replicas") == 2  # b rejoined after a had published
    await tick_all([a, b], rounds=1)
    assert a.sample("gateway_fleet_replicas") == 2
    assert a.sample("gateway_fleet_queue_depth", "interactive") == 2
    age = a.sample("gateway_fleet_view_age_seconds")
    assert age is not None and age < 1


async def test_a_stale_view_is_dropped_even_while_redis_is_up(replicas: list[Replica]) -> None:
    """Ticks that stop (a stuck loop, a dead timer) must not export old figures as live."""
    a, b, _ = replicas
    await b.hold("bulk", 1)
    await tick_all([a, b])
    assert a.sample("gateway_fleet_in_flight", "bulk") == 1
    await asyncio.sleep(a.signals.expiry_s + 0.2)
    assert a.store.up
    assert a.sample("gateway_fleet_replicas") == 1
    assert a.sample("gateway_fleet_in_flight", "bulk") == 0


async def test_garbled_figures_of_another_replica_count_it_but_add_nothing(
    replicas: list[Replica], redis_server: RedisServer
) -> None:
    a, b, _ = replicas
    await a.hold("bulk", 1)
    await tick_all([a, b])
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        key = b.store.key("replica", b.store.replica_id)
        for garbage in (
            b"not json",
            b'{"lanes": {"bulk": {"queue_depth": -5}}}',
            b'{"lanes": {"bulk": {"in_flight": "many"}}}',
            b'{"lanes": []}',
            b"\xff\xfe",
        ):
            await client.set(key, garbage, px=5000)
            await a.fleet.tick()
            assert a.store.up, garbage
            assert a.sample("gateway_fleet_replicas") == 2, garbage
            assert a.sample("gateway_fleet_in_flight", "bulk") == 1, garbage
        # Unknown fields (a newer replica) are ignored; known ones still count.
        await client.set(
            key, b'{"lanes": {"bulk": {"in_flight": 2, "future": 1}}, "x": {}}', px=5000
        )
        await a.fleet.tick()
        assert a.sample("gateway_fleet_in_flight", "bulk") == 3
    finally:
        await client.aclose()


def test_combine_sums_depths_and_takes_the_worst_known_wait() -> None:
    def figures(**lanes: Any) -> ReplicaFigures:
        return msgspec.convert({"lanes": lanes}, ReplicaFigures)

    view = combine(
        [
            figures(interactive={"queue_depth": 2, "in_flight": 1, "predicted_wait_s": 0.5}),
            figures(interactive={"queue_depth": 1, "predicted_wait_s": 3.0}, bulk={}),
            figures(interactive={"predicted_wait_s": 0.0}, bulk={"predicted_wait_s": 0.0}),
            None,
        ]
    )
    assert view.replicas == 4
    i, b = (ONE_POOL, "interactive"), (ONE_POOL, "bulk")
    assert view.queue_depth == {i: 3, b: 0}
    assert view.in_flight == {i: 1, b: 0}
    # bulk: one replica has no estimate yet (no free slot, no waits measured); the
    # others' 0 s is real (a free slot there: a request would start at once).
    assert view.predicted_wait_s == {i: 3.0, b: 0.0}
    assert decode_figures(b'{"lanes": {"a": {"predicted_wait_s": -1}}}') is None


# ------------------------------------------------------------------ many models (#28)

#: Two model pools, named as `build_pools` names them (their models, in config order).
LLAMA, MISTRAL = "llama", "mistral,mistral-lora"


@pytest.fixture
async def two_pool_replicas(redis_server: RedisServer) -> AsyncIterator[list[Replica]]:
    made = [make_replica(redis_server.url, 2, (LLAMA, MISTRAL)) for _ in range(2)]
    yield made
    for replica in made:
        await replica.close()


async def test_every_pool_s_lanes_are_published_and_combined_separately(
    two_pool_replicas: list[Replica],
) -> None:
    a, b = two_pool_replicas
    # a: llama's interactive full (2 held, 1 waiting); mistral idle.
    await a.hold("interactive", 2, LLAMA)
    await a.queue("interactive", 1, LLAMA)
    # b: mistral's interactive full (2 held, 3 waiting, 4 s learned); llama's bulk 1 held.
    await b.learn_hold_time("interactive", 4.0, MISTRAL)
    await b.hold("interactive", 2, MISTRAL)
    await b.queue("interactive", 3, MISTRAL)
    await b.hold("bulk", 1, LLAMA)
    await tick_all(two_pool_replicas)

    mistral_wait = b.schedulers[MISTRAL].predicted_wait_s("interactive")
    assert mistral_wait == pytest.approx(4 * 4.0 / 2)  # 4th place, 2 s each
    for replica in (a, b):
        assert replica.sample("gateway_fleet_replicas") == 2
        fleet = {
            (pool, lane): (
                replica.sample("gateway_fleet_queue_depth", lane, pool),
                replica.sample("gateway_fleet_in_flight", lane, pool),
            )
            for pool in (LLAMA, MISTRAL)
            for lane in LANES
        }
        assert fleet == {
            (LLAMA, "interactive"): (1, 2),
            (LLAMA, "bulk"): (0, 1),
            (MISTRAL, "interactive"): (3, 2),
            (MISTRAL, "bulk"): (0, 0),
        }
        wait = replica.sample("gateway_fleet_predicted_wait_seconds", "interactive", MISTRAL)
        assert wait == pytest.approx(mistral_wait)
        # The pool label is the one `gateway_pool_*` gives each pool; no unlabelled series.
        assert replica.sample("gateway_fleet_queue_depth", "interactive", ONE_POOL) is None
        assert replica.registry.get_sample_value(
            "gateway_fleet_queue_depth", {"lane": "interactive"}
        ) is None  # fmt: skip

    # An older replica (one pool, no `pool`/`pools`) reads a new one's figures: the
    # default pool's lanes where it always found them, the rest ignored.
    class OldFigures(msgspec.Struct):
        lanes: dict[str, dict[str, Any]] = {}
        draining: bool = False

    old = msgspec.json.decode(msgspec.json.encode(b.signals.own_figures()), type=OldFigures)
    assert old.lanes["bulk"]["in_flight"] == 1 and old.lanes["interactive"]["in_flight"] == 0


async def test_an_older_replica_s_untagged_lanes_count_as_the_default_pool(
    two_pool_replicas: list[Replica], redis_server: RedisServer
) -> None:
    a, b = two_pool_replicas
    await a.hold("bulk", 1, LLAMA)
    await a.hold("bulk", 1, MISTRAL)
    await tick_all(two_pool_replicas)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        # b as an older replica publishes it (one pool, untagged): 2 bulk in flight,
        # 3 interactive waiting. And a pool that only another config has: left out.
        key = b.store.key("replica", b.store.replica_id)
        old = b'{"lanes": {"bulk": {"in_flight": 2}, "interactive": {"queue_depth": 3}}}'
        await client.set(key, old, px=5000)
        await a.fleet.tick()
        assert a.sample("gateway_fleet_replicas") == 2
        assert a.sample("gateway_fleet_in_flight", "bulk", LLAMA) == 1 + 2
        assert a.sample("gateway_fleet_queue_depth", "interactive", LLAMA) == 3
        assert a.sample("gateway_fleet_in_flight", "bulk", MISTRAL) == 1
        assert a.sample("gateway_fleet_queue_depth", "interactive", MISTRAL) == 0

        tagged = (
            b'{"lanes": {}, "pool": "llama", '
            b'"pools": {"other": {"bulk": {"in_flight": 9}}, '
            b'"mistral,mistral-lora": {"bulk": {"in_flight": 4}}}}'
        )
        await client.set(key, tagged, px=5000)
        await a.fleet.tick()
        assert a.sample("gateway_fleet_in_flight", "bulk", MISTRAL) == 1 + 4
        assert a.sample("gateway_fleet_in_flight", "bulk", "other") is None
    finally:
        await client.aclose()


def test_combine_keys_by_pool_and_lane_and_untagged_lanes_are_the_default_pool_s() -> None:
    old = decode_figures(b'{"lanes": {"bulk": {"queue_depth": 2, "predicted_wait_s": 1.0}}}')
    new = decode_figures(
        b'{"lanes": {"bulk": {"queue_depth": 1, "predicted_wait_s": 3.0}}, "pool": "llama",'
        b' "pools": {"mistral": {"bulk": {"queue_depth": 5, "predicted_wait_s": 0.5}}}}'
    )
    assert old is not None and old.pool is None and old.pools == {}
    view = combine([old, new], default_pool="llama", pools={"llama", "mistral"})
    assert view.queue_depth == {("llama", "bulk"): 3, ("mistral", "bulk"): 5}
    assert view.predicted_wait_s == {("llama", "bulk"): 3.0, ("mistral", "bulk"): 0.5}
    # Another reader's default: the old replica's lanes are its default pool's.
    view = combine([old, new], default_pool="mistral", pools={"llama", "mistral"})
    assert view.queue_depth == {("mistral", "bulk"): 7, ("llama", "bulk"): 1}
