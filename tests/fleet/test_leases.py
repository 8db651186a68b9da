"""Slot leases against a real Redis: several replicas (each its own store, pool and
scheduler, as in separate processes) share one backend's slots and prefill budget."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from gateway.config import LaneSettings, RedisSettings
from gateway.fleet.leases import SlotLeases, leased
from gateway.fleet.store import SharedStore, mask_url_password
from gateway.observability.logs import make_logger
from gateway.observability.record import RequestRecord
from gateway.scheduling.scheduler import Grant, Scheduler
from gateway.upstream.pool import Backend, BackendPool
from tests.helpers import eventually
from tests.redis_server import RedisServer

URL = "http://engine.test:8000"
#: Prompt tokens the prior rate (8192 tok/s) predicts at 0.25-0.5 s of prefill.
LONG_PROMPT = 3000


class Replica:
    """One replica's parts: store, pool (one backend), scheduler, leases."""

    def __init__(self, redis_url: str, *, slots: int = 3, budget_s: float = 0.0, **redis: Any):
        settings = RedisSettings(url=redis_url, **redis)
        self.events = make_logger(open("/dev/null", "w"))
        self.store = SharedStore(settings, events=self.events, registry=CollectorRegistry())
        self.backend = Backend("b0", URL, max_concurrency=slots, prefill_budget_s=budget_s)
        self.pool = BackendPool([self.backend], clock=time.monotonic)
        self.scheduler = Scheduler(
            [LaneSettings(name="all", queue_timeout_s=5.0)], {"all": slots}, self.pool
        )
        self.pool.on_available = self.scheduler.notify_capacity
        self.notified = 0
        notify = self.scheduler.notify_capacity

        def counting() -> None:
            self.notified += 1
            notify()

        self.scheduler.notify_capacity = counting  # type: ignore[method-assign]
        self.leases = SlotLeases(self.store, self.pool, self.scheduler, share=lambda: 0.5)
        self.store.on_up.append(self.leases.rejoin)

    def take_local(self, prompt_tokens: int = 100) -> Any:
        return self.pool.try_take("all", prompt_tokens)

    async def close(self) -> None:
        await self.leases.stop()
        await self.store.close()


@pytest.fixture
async def replicas(redis_server: RedisServer) -> Any:
    made: list[Replica] = []

    def make(**knobs: Any) -> Replica:
        replica = Replica(redis_server.url, **knobs)
        made.append(replica)
        return replica

    yield make
    for replica in made:
        await replica.close()


async def test_concurrent_leases_never_exceed_the_slots(replicas: Any) -> None:
    fleet = [replicas(slots=3) for _ in range(3)]
    # Connected as a started replica is (Fleet.start): nine cold connections at once on
    # the request path's 0.1 s took longer on a loaded machine, and were taken locally.
    assert all(await asyncio.gather(*(replica.store.warm() for replica in fleet)))
    taken = [(replica, replica.take_local()) for replica in fleet for _ in range(3)]
    assert all(slot is not None for _, slot in taken), "each replica believes it has 3"
    granted = await asyncio.gather(*(replica.leases.take(slot) for replica, slot in taken))
    assert sum(granted) == 3
    for (replica, slot), ok in zip(taken, granted, strict=True):
        assert (slot.lease is not None) == ok
        if not ok:
            replica.pool.give_back(slot)
    # Each replica now counts the slots the others hold (as of its latest answer from
    # Redis: the tick's renewal brings them all up to date): none offers the backend.
    for replica in fleet:
        await replica.leases.tick()
    for replica in fleet:
        assert replica.backend.in_flight + replica.backend.others_in_flight == 3
        assert replica.take_local() is None


async def test_a_release_is_published_to_the_replicas_that_were_refused(replicas: Any) -> None:
    first, second = replicas(slots=1), replicas(slots=1)
    await second.leases.start()
    await asyncio.sleep(0.1)  # subscribed
    held = first.take_local()
    assert await first.leases.take(held)
    refused = second.take_local()
    assert not await second.leases.take(refused)
    second.pool.give_back(refused)
    assert second.backend.others_in_flight == 1 and second.take_local() is None
    before = second.notified
    first.pool.give_back(held)  # released in the background, published
    await eventually(lambda: second.backend.others_in_flight == 0, within_s=2)
    assert second.notified > before, "the waiting replica serves its queue at once"
    slot = second.take_local()
    assert slot is not None and await second.leases.take(slot)


async def test_the_prefill_budget_holds_across_replicas(replicas: Any) -> None:
    first, second = replicas(slots=4, budget_s=0.5), replicas(slots=4, budget_s=0.5)
    await second.leases.start()
    await asyncio.sleep(0.1)  # subscribed
    long_one = first.take_local(LONG_PROMPT)
    assert 0.25 < long_one.prefill_s <= 0.5, "predicted by the prior prefill rate"
    assert await first.leases.take(long_one)
    other = second.take_local(LONG_PROMPT)
    assert not await second.leases.take(other), "0.8 s of prefill is over the 0.5 s budget"
    second.pool.give_back(other)
    assert second.backend.others_prefilling_s == pytest.approx(long_one.prefill_s, abs=0.01)
    # Its first byte came: the budget is free again, and the fleet's line grants it to
    # the request refused before (the next one of that replica to take the backend).
    first.pool.prefill_done(long_one)
    await eventually(lambda: len(second.leases._prepaid[second.backend]) == 1, within_s=2)
    again = second.take_local(LONG_PROMPT)
    assert again is not None and await second.leases.take(again)
    assert again.lease is not None and again.lease.startswith("line:")


async def test_leases_expire_unless_renewed(replicas: Any, redis_server: RedisServer) -> None:
    keeper = replicas(slots=2, lease_ttl_s=0.5)
    crashed = replicas(slots=2, lease_ttl_s=0.5)
    kept, lost = keeper.take_local(), crashed.take_local()
    assert await keeper.leases.take(kept) and await crashed.leases.take(lost)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        for _ in range(4):  # 1 s: the keeper renews, the crashed one does not
            await asyncio.sleep(0.25)
            await keeper.leases.tick()
        assert keeper.backend.others_in_flight == 0, "the crashed replica's slot came back"
        assert await client.zcard(f"llmgw:slots:{URL}") == 1
    finally:
        await client.aclose()


async def test_redis_down_falls_back_to_the_share_and_rejoins(
    replicas: Any, redis_server: RedisServer
) -> None:
    replica = replicas(slots=4)
    assert await replica.store.ping()
    redis_server.kill()
    slot = replica.take_local()
    assert await replica.leases.take(slot), "Redis down: the request goes on"
    assert not replica.store.up and replica.leases.local
    assert replica.backend.others_in_flight == 2, "half of 4 slots is this replica's share"
    other = replica.take_local()
    assert other is not None and await replica.leases.take(other)
    assert replica.take_local() is None
    redis_server.start()
    assert await replica.store.ping()  # the fleet's tick: rejoins
    assert replica.store.up and not replica.leases.local
    assert replica.backend.others_in_flight == 0
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        assert await client.zcard(f"llmgw:slots:{URL}") == 2, "both running slots leased again"
    finally:
        await client.aclose()


async def test_a_release_during_a_renewal_is_not_undone_by_it(
    replicas: Any, redis_server: RedisServer
) -> None:
    """The tick's renewal re-adds leases it names (expired ones still run); a release that
    reaches Redis while the renewal is on its way must still free the slot, at once, not
    when the TTL (5 s) ends. Before the fix 156 of 160 such leases came back."""
    replica = replicas(slots=4)
    client = aioredis.Redis.from_url(redis_server.url)
    key = f"llmgw:slots:{URL}"
    try:
        for _ in range(10):
            replica.backend.others_in_flight = 0
            slots = [replica.take_local() for _ in range(4)]
            for slot in slots:
                assert await replica.leases.take(slot)
            tick = asyncio.ensure_future(replica.leases.tick())
            await asyncio.sleep(0)  # the renewal is being sent
            for slot in slots:
                replica.pool.give_back(slot)  # released in the background meanwhile
            await tick

            async def freed() -> bool:
                return bool(await client.zcard(key) == 0)

            await eventually(freed, within_s=1.0)
    finally:
        await client.aclose()


def test_a_password_in_the_url_is_masked() -> None:
    assert mask_url_password("redis://user:s3cret@host:6379/0") == "redis://user:***@host:6379/0"
    assert mask_url_password("redis://:s3cret@host") == "redis://:***@host"
    assert mask_url_password("redis://host:6379") == "redis://host:6379"


class TwoLanes(Replica):
    """A replica with the default lanes' order: interactive before bulk."""

    def __init__(self, redis_url: str, *, slots: int = 1) -> None:
        super().__init__(redis_url, slots=slots)
        lanes = [LaneSettings(name=n, queue_timeout_s=5.0) for n in ("interactive", "bulk")]
        self.scheduler = Scheduler(lanes, {n.name: slots for n in lanes}, self.pool)
        self.pool.on_available = self.scheduler.notify_capacity
        self.leases = SlotLeases(self.store, self.pool, self.scheduler, share=lambda: 0.5)
        self.store.on_up.append(self.leases.rejoin)

    async def run(self, lane: str) -> Grant:
        """Wait for a slot as the proxy does: the lane's queue, then the lease."""
        grant = await self.scheduler.acquire(lane, 100)
        record = RequestRecord("r", "/", 0.0)
        return await leased(
            self.leases, self.scheduler, grant, record,
            prompt_tokens=100, output_tokens=0, deadline_s=5.0,
        )  # fmt: skip


async def test_a_replica_holds_its_bulk_lane_back_while_another_has_interactive_waiting(
    redis_server: RedisServer,
) -> None:
    a, b = TwoLanes(redis_server.url), TwoLanes(redis_server.url)
    try:
        for replica in (a, b):
            await replica.leases.start()
        await asyncio.sleep(0.1)  # subscribed
        running = await a.run("bulk")  # a's bulk holds the one slot
        a_next = asyncio.ensure_future(a.run("bulk"))
        b_short = asyncio.ensure_future(b.run("interactive"))  # refused: waits in b's line
        await eventually(lambda: a.scheduler.lane("bulk").held_back, within_s=2)
        a.scheduler.release(running)  # the slot frees: b's short request gets it, not a's bulk
        short = await asyncio.wait_for(b_short, 2)
        await asyncio.sleep(0.1)
        assert not a_next.done(), "one gateway would not give the slot to bulk either"
        b.scheduler.release(short)  # b has nobody waiting any more: a's bulk goes
        await eventually(lambda: not a.scheduler.lane("bulk").held_back, within_s=2)
        a.scheduler.release(await asyncio.wait_for(a_next, 2))
    finally:
        for replica in (a, b):
            await replica.close()


async def test_a_freed_slot_goes_to_the_longest_waiting_request_of_the_fleet(
    replicas: Any,
) -> None:
    """The fleet's line: one gateway's queue would serve the oldest first, so does Redis."""
    holder, older, newer = (replicas(slots=1) for _ in range(3))
    for replica in (older, newer):
        await replica.leases.start()
    await asyncio.sleep(0.1)  # subscribed
    held = holder.take_local()
    assert await holder.leases.take(held)
    # Both are refused; `older` has waited longer (its request joined its queue first).
    late, early = newer.take_local(), older.take_local()
    assert not await newer.leases.take(late, "all", ticket=newer.leases.ticket(), waited_s=0.1)
    assert not await older.leases.take(early, "all", ticket=older.leases.ticket(), waited_s=0.5)
    newer.pool.give_back(late)
    older.pool.give_back(early)
    holder.pool.give_back(held)  # released: granted to `older` in the same step
    await eventually(lambda: len(older.leases._prepaid[older.backend]) == 1, within_s=2)
    assert not newer.leases._prepaid[newer.backend]
    served = older.take_local()
    assert served is not None and await older.leases.take(served), "no round trip needed"
    older.pool.give_back(served)  # and the next in line, `newer`, is granted at once
    await eventually(lambda: len(newer.leases._prepaid[newer.backend]) == 1, within_s=2)


async def test_a_dead_replicas_slot_goes_to_the_line_when_its_lease_ends(replicas: Any) -> None:
    """No tick needed: the refused replica serves the line when the lease would expire."""
    dead, waiting = replicas(slots=1, lease_ttl_s=0.5), replicas(slots=1, lease_ttl_s=0.5)
    await waiting.leases.start()
    await asyncio.sleep(0.1)  # subscribed
    lost = dead.take_local()
    assert await dead.leases.take(lost)  # then never renewed, never released
    refused = waiting.take_local()
    assert not await waiting.leases.take(refused, "all", ticket=waiting.leases.ticket())
    waiting.pool.give_back(refused)
    took = await eventually(lambda: bool(waiting.leases._prepaid[waiting.backend]), within_s=2)
    assert took < 0.5 + 0.2, "granted when the dead one's lease ended, not a tick later"


class SwallowingPubSub:
    """A pub/sub connection whose wait for a message swallows a cancellation, as redis-py's
    can while its connection is torn down (seen under load when Redis went away)."""

    async def __aenter__(self) -> SwallowingPubSub:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def subscribe(self, channel: str) -> None:
        return None

    async def get_message(
        self,
        *,
        ignore_subscribe_messages: bool,
        timeout: float,  # noqa: ASYNC109 - redis-py's signature
    ) -> None:
        try:
            await asyncio.sleep(timeout)
        except asyncio.CancelledError:
            pass  # the bug: the listener's cancel never reaches it
        return None


class SwallowingSubscriber:
    def pubsub(self) -> SwallowingPubSub:
        return SwallowingPubSub()

    async def aclose(self) -> None:
        return None


async def test_stop_ends_even_when_the_listener_swallows_its_cancellation(
    redis_server: RedisServer,
) -> None:
    replica = Replica(redis_server.url)
    leases = SlotLeases(
        replica.store,
        replica.pool,
        replica.scheduler,
        share=lambda: 0.5,
        subscriber=SwallowingSubscriber(),  # type: ignore[arg-type]
    )
    await leases.start()
    await asyncio.sleep(0.05)  # the listener waits in get_message
    started = time.monotonic()
    await asyncio.wait_for(leases.stop(), timeout=5.0)
    assert time.monotonic() - started < 3.0
    assert leases._listener is not None and leases._listener.done()
    await replica.store.close()


class Pools:
    """One replica with two model pools ("a", the default, and "b"), each one backend
    with one slot and the default lanes' order, each its own scheduler and leases, all
    over this replica's one store (as `app.build_fleet` wires them)."""

    def __init__(self, redis_url: str) -> None:
        self.events = make_logger(open("/dev/null", "w"))
        settings = RedisSettings(url=redis_url)
        self.store = SharedStore(settings, events=self.events, registry=CollectorRegistry())
        lanes = [LaneSettings(name=n, queue_timeout_s=5.0) for n in ("interactive", "bulk")]
        self.backends: dict[str, Backend] = {}
        self.schedulers: dict[str, Scheduler] = {}
        self.leases: dict[str, SlotLeases] = {}
        for name in ("a", "b"):
            backend = Backend(f"{name}0", f"http://{name}.engine.test:8000", max_concurrency=1)
            pool = BackendPool([backend], clock=time.monotonic)
            scheduler = Scheduler(lanes, {lane.name: 1 for lane in lanes}, pool)
            pool.on_available = scheduler.notify_capacity
            leases = SlotLeases(
                self.store, pool, scheduler, share=lambda: 0.5,
                pool_name=None if name == "a" else name,
            )  # fmt: skip
            self.store.on_up.append(leases.rejoin)
            self.backends[name], self.schedulers[name] = backend, scheduler
            self.leases[name] = leases

    async def start(self) -> None:
        for leases in self.leases.values():
            await leases.start()

    async def run(self, pool: str, lane: str) -> Grant:
        """Wait for a slot of `pool` as the proxy does: the lane's queue, then the lease."""
        scheduler = self.schedulers[pool]
        grant = await scheduler.acquire(lane, 100)
        record = RequestRecord("r", "/", 0.0)
        return await leased(
            self.leases[pool], scheduler, grant, record,
            prompt_tokens=100, output_tokens=0, deadline_s=5.0,
        )  # fmt: skip

    async def close(self) -> None:
        for leases in self.leases.values():
            await leases.stop()
        await self.store.close()


@pytest.fixture
async def two_pool_replicas(redis_server: RedisServer) -> Any:
    made = [Pools(redis_server.url), Pools(redis_server.url)]
    for replica in made:
        await replica.start()
    await asyncio.sleep(0.1)  # subscribed
    yield made
    for replica in made:
        await replica.close()


async def test_each_pool_leases_its_own_backends_slots(
    two_pool_replicas: list[Pools], redis_server: RedisServer
) -> None:
    x, y = two_pool_replicas
    held = await x.run("a", "interactive")  # a's one slot, over the fleet
    a_slot = y.leases["a"].pool.try_take("interactive", 100)
    assert a_slot is not None, "y's own view: a's slot looks free"
    assert not await y.leases["a"].take(a_slot), "x holds a's one slot in Redis"
    y.leases["a"].pool.give_back(a_slot)
    assert y.backends["a"].others_in_flight == 1
    b_grant = await asyncio.wait_for(y.run("b", "interactive"), 1)  # b's slot is b's own
    assert y.backends["b"].others_in_flight == 0
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        for name in ("a", "b"):
            assert await client.zcard(f"llmgw:slots:{x.backends[name].url}") == 1
        # The channels: the default pool's keeps the one-pool name, b's has its own.
        assert x.leases["a"].channel == "llmgw:slots-freed"
        assert x.leases["b"].channel == "llmgw:slots-freed:b"
    finally:
        await client.aclose()
    x.schedulers["a"].release(held)
    y.schedulers["b"].release(b_grant)


async def test_one_pools_waiting_line_does_not_hold_another_pools_slots_back(
    two_pool_replicas: list[Pools], redis_server: RedisServer
) -> None:
    """y's interactive request waits for b's slot: x holds its bulk lane back in pool b
    (one gateway would), but never in pool a, whose slots nobody of b's line can use."""
    x, y = two_pool_replicas
    b_running = await x.run("b", "bulk")  # x's bulk holds b's one slot
    y_short = asyncio.ensure_future(y.run("b", "interactive"))  # refused: b's line
    await eventually(lambda: x.schedulers["b"].lane("bulk").held_back, within_s=2)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        waiting_b = await client.zrange("llmgw:waiting:b", 0, -1)
        assert waiting_b == [f"0|{y.store.replica_id}".encode()], "y's interactive, in b's"
        assert await client.zrange("llmgw:waiting", 0, -1) == [], "nothing waits in a's"
    finally:
        await client.aclose()
    # Pool a: x's bulk requests take a's slot one after the other while b's line waits.
    first = await asyncio.wait_for(x.run("a", "bulk"), 1)
    second = asyncio.ensure_future(x.run("a", "bulk"))
    await asyncio.sleep(0.2)
    assert not x.schedulers["a"].lane("bulk").held_back
    x.schedulers["a"].release(first)  # a's release goes to a's next, b's line aside
    x.schedulers["a"].release(await asyncio.wait_for(second, 2))
    assert not y_short.done(), "b's slot is still x's bulk's"
    x.schedulers["b"].release(b_running)  # now b's line is served: y's short request
    y.schedulers["b"].release(await asyncio.wait_for(y_short, 2))
