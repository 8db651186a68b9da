"""Backend slots and the prefill budget."""

from __future__ import annotations

import asyncio
import time

from gateway.config import LaneSettings
from gateway.scheduling.scheduler import Scheduler
from gateway.upstream.pool import Backend, BackendPool


def test_least_busy_backend_with_a_free_slot_is_chosen() -> None:
    a, b = Backend("a", "http://a", 2), Backend("b", "http://b", 1)
    pool = BackendPool([a, b], clock=time.monotonic)
    first, second, third = (pool.try_take("x", 10) for _ in range(3))
    assert first is not None and second is not None and third is not None
    assert [s.backend.name for s in (first, second, third)] == ["a", "b", "a"]
    assert pool.try_take("x", 10) is None
    pool.give_back(second)
    assert b.in_flight == 0 and b.prefilling_tokens == 0


def test_prefill_budget_holds_a_second_long_prompt_but_not_a_short_one() -> None:
    backend = Backend("a", "http://a", 8, max_prefill_tokens=4096)
    pool = BackendPool([backend], clock=time.monotonic)
    long_one = pool.try_take("bulk", 3000)
    assert long_one is not None and backend.prefilling_tokens == 3000
    assert pool.try_take("bulk", 3000) is None  # two long prefills would stack up
    short = pool.try_take("interactive", 50)
    assert short is not None  # a short prompt fits beside it
    pool.prefill_done(long_one)
    pool.prefill_done(long_one)  # idempotent
    assert backend.prefilling_tokens == 50
    second_long = pool.try_take("bulk", 3000)
    assert second_long is not None
    for slot in (long_one, short, second_long):
        pool.give_back(slot)
    assert backend.in_flight == 0 and backend.prefilling_tokens == 0


def test_a_prompt_bigger_than_the_budget_goes_alone() -> None:
    backend = Backend("a", "http://a", 8, max_prefill_tokens=4096)
    pool = BackendPool([backend], clock=time.monotonic)
    huge = pool.try_take("bulk", 20_000)
    assert huge is not None
    assert pool.try_take("bulk", 20_000) is None
    pool.prefill_done(huge)
    assert pool.try_take("bulk", 20_000) is not None


def test_no_budget_means_no_limit() -> None:
    pool = BackendPool([Backend("a", "http://a", 8, max_prefill_tokens=0)], clock=time.monotonic)
    assert all(pool.try_take("bulk", 10_000) is not None for _ in range(8))


async def test_scheduler_dispatches_the_held_prompt_when_the_first_byte_arrives() -> None:
    pool = BackendPool([Backend("a", "http://a", 8, max_prefill_tokens=4096)], clock=time.monotonic)
    scheduler = Scheduler([LaneSettings(name="bulk")], {"bulk": 8}, pool)
    first = await scheduler.acquire("bulk", 3000)
    second = asyncio.create_task(scheduler.acquire("bulk", 3000))
    await asyncio.sleep(0.01)
    assert not second.done()
    scheduler.prefill_done(first)
    granted = await asyncio.wait_for(second, 1)
    scheduler.release(first)
    scheduler.release(granted)
    assert pool.backends[0].in_flight == 0 and pool.backends[0].prefilling_tokens == 0
