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


# -- the prefill budget in seconds, learned rates, engine queues -------------------------


def engine_at(rate: float, name: str = "a", budget_s: float = 0.5) -> Backend:
    """A backend whose prefill rate has been learned as `rate` tokens/s."""
    backend = Backend(name, f"http://{name}", 8, prefill_budget_s=budget_s)
    for tokens in (300, 1000, 2000, 3000, 4000):
        backend.model.observe_ttft(tokens, 0, 0.02 + tokens / rate)
    for _ in range(3):
        backend.model.observe_ttft(20, 0, 0.02 + 20 / rate)
    return backend


def test_budget_in_seconds_admits_several_long_prompts_on_a_fast_engine() -> None:
    backend = engine_at(40_000.0)  # an H100: a 3000-token prefill is ~0.1 s
    pool = BackendPool([backend], clock=time.monotonic)
    longs = [pool.try_take("bulk", 3000) for _ in range(4)]
    assert all(slot is not None for slot in longs)
    assert backend.prefilling_s <= 0.5


def test_budget_in_seconds_admits_one_long_prompt_on_a_slow_engine() -> None:
    backend = engine_at(500.0)  # a CPU: 1500 tokens are 3 s
    pool = BackendPool([backend], clock=time.monotonic)
    first = pool.try_take("bulk", 1500)
    assert first is not None  # over the budget, but alone
    assert pool.try_take("bulk", 1500) is None
    assert pool.try_take("interactive", 50) is None  # would only wait behind it in the engine
    pool.prefill_done(first)
    shorts = [pool.try_take("interactive", 50) for _ in range(3)]
    assert all(slot is not None for slot in shorts)  # 3 x 0.12 s fit in 0.5 s
    assert pool.try_take("bulk", 1500) is None  # a long one waits for the shorts' first bytes
    for slot in [first, *shorts]:
        assert slot is not None
        pool.give_back(slot)
    assert backend.prefilling_s == 0 and backend.prefilling_tokens == 0


def test_prefill_still_ahead_is_predicted_from_the_rate_and_the_time_passed() -> None:
    now = [100.0]
    backend = engine_at(1000.0, budget_s=0)
    pool = BackendPool([backend], clock=lambda: now[0])
    first = pool.try_take("bulk", 2000)
    now[0] += 1.5  # 1500 of its 2000 tokens are done by now
    second = pool.try_take("interactive", 50)
    assert first is not None and second is not None
    assert 450 <= second.ahead_tokens <= 550


def test_an_engine_reporting_its_own_queue_gets_no_more_than_it_runs() -> None:
    backend = Backend("a", "http://a", 8)
    pool = BackendPool([backend], clock=time.monotonic)
    slots = [pool.try_take("x", 10) for _ in range(6)]
    backend.note_engine_load(waiting=2, running=4, kv_usage=0.9)
    assert backend.slot_limit == 4
    assert pool.try_take("x", 10) is None
    pool.give_back(slots.pop())
    pool.give_back(slots.pop())
    pool.give_back(slots.pop())
    taken = pool.try_take("x", 10)
    assert taken is not None and taken.engine_queued
    backend.note_engine_load(waiting=0, running=4, kv_usage=0.5)
    assert backend.slot_limit == 8
    for slot in [*slots, taken]:
        assert slot is not None
        pool.give_back(slot)


def test_token_ratio_is_the_largest_of_the_backends() -> None:
    a, b = Backend("a", "http://a", 1), Backend("b", "http://b", 1)
    for _ in range(5):
        b.model.observe_prompt_count(1000, 1250)
    pool = BackendPool([a, b], clock=time.monotonic)
    assert pool.token_ratio() == 1.25
