"""Backend slots, the prefill budget, cache-aware routing and session affinity."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.admission.prefix import PromptPrefix, prefix_of
from gateway.config import LaneSettings, RoutingSettings
from gateway.scheduling.scheduler import Deferred, Scheduler
from gateway.upstream.affinity import rendezvous_weight
from gateway.upstream.pool import (
    BY_LOAD,
    BY_PREFIX,
    BY_SESSION,
    Backend,
    BackendPool,
    RouteHint,
    Slot,
)


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
    # Small prompts ride along beside it (0.1 s each of a 0.5-s budget), up to one
    # budget together as one prompt of their tokens (the first token's fixed cost once:
    # four, 0.02 + 0.4 s).
    shorts = []
    while (slot := pool.try_take("interactive", 50)) is not None and len(shorts) < 8:
        shorts.append(slot)
    assert len(shorts) == 4 and backend.model.prefill_s(backend.riding_tokens) <= 0.5
    pool.prefill_done(first)
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


def test_an_engine_that_tells_its_batch_tokens_gets_no_request_past_them() -> None:
    """TGI reserves each request's prompt and max_tokens in its batch's KV tokens: one
    sent past them would wait inside it behind whole answers, so it waits in its lane,
    and goes where there is room, or when room is given back."""
    tgi, other = Backend("tgi", "http://a", 128), Backend("other", "http://b", 1)
    tgi.batch_tokens = 1000
    pool = BackendPool([tgi], clock=time.monotonic)
    first = pool.try_take("x", 300, 300)
    assert first is not None and tgi.batch_tokens_held == 600
    assert pool.try_take("x", 300, 200) is None  # 1100 of 1000
    small = pool.try_take("x", 100, 100)
    assert small is not None and tgi.batch_tokens_held == 800
    pool.give_back(first)
    assert tgi.batch_tokens_held == 200
    second = pool.try_take("x", 300, 200)
    assert second is not None and tgi.batch_tokens_held == 700
    for slot in (small, second):
        pool.give_back(slot)
    assert tgi.batch_tokens_held == 0
    alone = pool.try_take("x", 5000, 500)  # bigger than all of it: it goes alone
    assert alone is not None and pool.try_take("x", 1, 1) is None
    # With another backend beside it, the request that does not fit goes there.
    both = BackendPool([tgi, other], clock=time.monotonic)
    elsewhere = both.try_take("x", 10, 10)
    assert elsewhere is not None and elsewhere.backend is other
    both.give_back(elsewhere)
    # A lower lane leaves what the lanes above keep of them (their headroom, in their
    # requests' tokens): without it a short request would wait for a long answer's end.
    pool.give_back(alone)
    held = pool.try_take("x", 100, 100)
    assert pool.try_take("bulk", 300, 300, keep_batch_tokens=300) is None  # 200+600+300
    kept_room = pool.try_take("bulk", 300, 300, keep_batch_tokens=200)
    assert kept_room is not None and tgi.batch_tokens_held == 800
    for slot in (held, kept_room):
        pool.give_back(slot)
    # ... never more than a quarter of them, whatever the headroom says.
    held = pool.try_take("x", 100, 100)
    capped = pool.try_take("bulk", 300, 250, keep_batch_tokens=900)  # 200+550+250 of 1000
    assert capped is not None
    for slot in (held, capped):
        pool.give_back(slot)


def test_token_ratio_is_the_largest_of_the_backends() -> None:
    a, b = Backend("a", "http://a", 1), Backend("b", "http://b", 1)
    for _ in range(5):
        b.model.observe_prompt_count(1000, 1250)
    pool = BackendPool([a, b], clock=time.monotonic)
    assert pool.token_ratio() == 1.25


# -- cache-aware routing and session affinity --------------------------------------------


def long(text: str) -> str:
    return f"{text}: " + "words of this message " * 4


def conversation(*turns: str, tokens: int = 500) -> PromptPrefix:
    texts = [long(t) for t in ("system prompt", *turns)]
    prefix = prefix_of(texts, [tokens] * len(texts))
    assert prefix is not None
    return prefix


def four(slots: int = 8) -> list[Backend]:
    return [Backend(f"b{n}", f"http://b{n}", slots) for n in range(4)]


def test_a_conversations_next_turn_goes_where_its_prefix_was_sent() -> None:
    backends = four()
    pool = BackendPool(backends, clock=time.monotonic)
    first = pool.try_take("x", 1000, hint=RouteHint(conversation("q1")))
    assert first is not None and first.reason == BY_LOAD and first.cached_tokens == 0
    pool.prefill_done(first)
    # Busier than the others (within the margin), it still starts the next turn sooner.
    second = pool.try_take("x", 2000, hint=RouteHint(conversation("q1", "a1 q2")))
    assert second is not None
    assert second.backend is first.backend and second.reason == BY_PREFIX
    assert second.cached_tokens == 1000 and second.prefill_tokens == 1000
    assert first.backend.prefilling_tokens == 1000  # only the uncached part prefills


def test_a_backend_over_the_margin_is_not_chosen_for_its_cache() -> None:
    backends = four()
    pool = BackendPool(
        backends, routing=RoutingSettings(cache_load_margin=0.25), clock=time.monotonic
    )
    hot = conversation("shared question")
    slots = [pool.try_take("x", 1000, hint=RouteHint(hot)) for _ in range(40)]
    # Every request shares the hot prefix: it still spreads over all four, none more than
    # the margin above the least loaded.
    counts = [b.in_flight for b in backends]
    assert sum(counts) == 32 and max(counts) - min(counts) <= 2, counts
    assert sum(1 for slot in slots if slot is None) == 8


def test_prefix_affinity_off_balances_by_load_only() -> None:
    backends = four()
    pool = BackendPool(
        backends, routing=RoutingSettings(prefix_affinity=False), clock=time.monotonic
    )
    first = pool.try_take("x", 1000, hint=RouteHint(conversation("q1")))
    assert first is not None
    second = pool.try_take("x", 1000, hint=RouteHint(conversation("q1")))
    assert second is not None and second.backend is not first.backend
    assert second.cached_tokens == 0 and not any(len(b.prefixes) for b in backends)


def test_a_session_goes_to_its_rendezvous_backend_and_moves_only_when_it_is_gone() -> None:
    backends = four()
    pool = BackendPool(backends, clock=time.monotonic)
    owner = max(backends, key=lambda b: rendezvous_weight("conv-9", b.name))
    slot = pool.try_take("x", 100, hint=RouteHint(None, "conv-9"))
    assert slot is not None and slot.backend is owner and slot.reason == BY_SESSION
    pool.give_back(slot)
    owner.healthy = False
    moved = pool.try_take("x", 100, hint=RouteHint(None, "conv-9"))
    assert moved is not None and moved.backend is not owner
    second = max(
        (b for b in backends if b is not owner), key=lambda b: rendezvous_weight("conv-9", b.name)
    )
    assert moved.backend is second


def test_an_engine_that_serves_nothing_from_cache_is_no_longer_trusted_with_it() -> None:
    backend, other = Backend("a", "http://a", 8), Backend("b", "http://b", 8)
    pool = BackendPool([backend, other], clock=time.monotonic)
    for _ in range(5):
        backend.model.observe_cache(1000, 0)
    backend.prefixes.add(conversation("q1"))
    slot = pool.try_take("x", 2000, hint=RouteHint(conversation("q1", "q2")))
    assert slot is not None and slot.cached_tokens == 0 and slot.reason == BY_LOAD
    assert slot.matched_tokens in (0, 1000)


def test_the_prefill_budget_counts_only_the_uncached_part() -> None:
    backend = Backend("a", "http://a", 8, max_prefill_tokens=4096)
    pool = BackendPool([backend], clock=time.monotonic)
    long_history = conversation("a long history", tokens=1500)
    first = pool.try_take("bulk", 3000, hint=RouteHint(long_history))
    assert first is not None
    # Same 3000-token prefix and 200 more: only 200 to prefill, so it fits the budget.
    turn = prefix_of(
        [long("system prompt"), long("a long history"), long("more")], [1500, 1500, 200]
    )
    second = pool.try_take("bulk", 3200, hint=RouteHint(turn))
    assert second is not None and second.prefill_tokens == 200
    assert pool.try_take("bulk", 3000) is None  # an uncached long one still waits


def test_a_turn_waits_for_its_full_home_only_as_long_as_the_prefill_it_saves() -> None:
    backends = [Backend(f"b{n}", f"http://b{n}", 1) for n in range(2)]
    pool = BackendPool(backends, clock=time.monotonic)
    first = pool.try_take("x", 2000, hint=RouteHint(conversation("q1", tokens=1000)))
    assert isinstance(first, Slot)
    pool.prefill_done(first)  # it streams its answer now
    home = first.backend
    turn = RouteHint(conversation("q1", "a1 q2", tokens=1000))
    home.hold_s = 0.2  # its slot frees about every 0.2 s
    # Home is full; the other backend would prefill 2000 tokens more (0.24 s at the prior
    # 8192 tokens/s), and every request behind it there would wait as long: wait for
    # home up to twice that.
    deferred = pool.try_take("x", 3000, hint=turn, waited_s=0.05)
    assert isinstance(deferred, Deferred)
    assert deferred.retry_in_s == pytest.approx(2 * 2000 / 8192, abs=0.01)
    assert all(b.in_flight == (b is home) for b in backends), "nothing was reserved"
    # A second and a third request for the same home: the third would wait 0.6 s for a
    # slot there (three releases), more than it saves: it goes elsewhere at once.
    twin = RouteHint(conversation("q1", "a1 q2", tokens=1000))
    assert isinstance(pool.try_take("x", 3000, hint=twin, waited_s=0.0), Deferred)
    third = pool.try_take("x", 3000, hint=RouteHint(twin.prefix), waited_s=0.0)
    assert isinstance(third, Slot) and third.backend is not home
    pool.give_back(third)
    # Waited its budget (half its queue deadline), or may not wait at all (a retry):
    # the free backend.
    for waited in (0.3, None):
        spent = RouteHint(turn.prefix, wait_budget_s=0.25)
        moved = pool.try_take("x", 3000, hint=spent, waited_s=waited)
        assert isinstance(moved, Slot) and moved.backend is not home
        pool.give_back(moved)
    # Home's slot time unknown (nothing ended there yet): no waiting.
    home.hold_s = None
    elsewhere = pool.try_take("x", 3000, hint=RouteHint(turn.prefix), waited_s=0.0)
    assert isinstance(elsewhere, Slot)
    pool.give_back(elsewhere)
    # A prompt with nothing cached anywhere never waits.
    other = pool.try_take("x", 3000, hint=RouteHint(conversation("q9")), waited_s=0.0)
    assert isinstance(other, Slot)


def test_a_freed_slot_goes_to_the_turn_waiting_for_it_while_another_backend_has_room() -> None:
    backends = [Backend(f"b{n}", f"http://b{n}", 1) for n in range(3)]
    pool = BackendPool(backends, clock=time.monotonic)
    first = pool.try_take("x", 2000, hint=RouteHint(conversation("q1", tokens=1000)))
    assert isinstance(first, Slot)
    pool.prefill_done(first)
    home = first.backend
    home.hold_s = 0.1
    turn = RouteHint(conversation("q1", "a1 q2", tokens=1000))
    assert isinstance(pool.try_take("x", 3000, hint=turn, waited_s=0.0), Deferred)
    pool.give_back(first)  # home frees its slot while the turn waits in line for it
    # Served first, a request with no prompt of its own cached takes another free backend,
    # and so does one that may not wait (a retry).
    other = pool.try_take("x", 100, hint=RouteHint(), waited_s=0.0)
    assert isinstance(other, Slot) and other.backend is not home
    retry = pool.try_take("x", 100, hint=RouteHint())
    assert isinstance(retry, Slot) and retry.backend not in (home, other.backend)
    # With home the only free one, the request first in line takes it: no slot idles.
    ahead = pool.try_take("x", 100)
    assert isinstance(ahead, Slot) and ahead.backend is home
    pool.give_back(ahead)
    # The waiting turn gets its home, with its history cached.
    served = pool.try_take("x", 3000, hint=turn, waited_s=0.05)
    assert isinstance(served, Slot) and served.backend is home and served.cached_tokens == 2000
    assert not home.waiters


def test_prefill_room_freed_at_home_goes_to_the_turn_waiting_for_it() -> None:
    # 0.48 s of prefill at once per backend; at the prior rate (8192 tokens/s) that is
    # about 3900 tokens, and a prompt of under ~980 uncached tokens rides along (the
    # turn below, 1000 more, does not).
    backends = [Backend(f"b{n}", f"http://b{n}", 4, prefill_budget_s=0.48) for n in range(2)]
    pool = BackendPool(backends, clock=time.monotonic)
    first = pool.try_take("x", 8000, hint=RouteHint(conversation("q1", tokens=4000)))
    assert isinstance(first, Slot)
    home = first.backend
    pool.give_back(first)
    home.hold_s = 0.1
    blocker = pool.try_take("x", 3500)  # prefills at home: no room beside it
    assert isinstance(blocker, Slot) and blocker.backend is home
    # The next turn, 1000 tokens more, would start cold elsewhere: it waits for home.
    turn = RouteHint(conversation("q1", "a1 q2", tokens=4000))
    assert isinstance(pool.try_take("x", 9000, hint=turn, waited_s=0.0), Deferred)
    pool.prefill_done(blocker)
    elsewhere = pool.try_take("x", 500, exclude=blocker)  # the other one prefills a bit
    assert isinstance(elsewhere, Slot) and elsewhere.backend is not home
    # Home's prefill room is the turn's now: a prompt served first, which would fill
    # it, goes to the other backend, though home would start it sooner...
    other = pool.try_take("x", 3000, hint=RouteHint(), waited_s=0.0)
    assert isinstance(other, Slot) and other.backend is elsewhere.backend
    # ...and one that fits beside the turn's prefill still goes home.
    small = pool.try_take("x", 500, hint=RouteHint(), waited_s=0.0)
    assert isinstance(small, Slot) and small.backend is home
    pool.give_back(small)
    served = pool.try_take("x", 9000, hint=turn, waited_s=0.05)
    assert isinstance(served, Slot) and served.backend is home and served.cached_tokens == 8000
    assert not home.waiters


def test_max_wait_for_sooner_caps_the_wait_and_zero_turns_it_off() -> None:
    for cap, expected in ((0.1, 0.1), (0.0, None)):
        backends = [Backend(f"b{n}", f"http://b{n}", 1) for n in range(2)]
        pool = BackendPool(
            backends, routing=RoutingSettings(max_wait_for_sooner_s=cap), clock=time.monotonic
        )
        first = pool.try_take("x", 8000, hint=RouteHint(conversation("q1", tokens=4000)))
        assert isinstance(first, Slot)
        pool.prefill_done(first)
        first.backend.hold_s = 0.01
        answer = pool.try_take(
            "x", 9000, hint=RouteHint(conversation("q1", "q2", tokens=4000)), waited_s=0.0
        )
        if expected is None:
            assert isinstance(answer, Slot) and answer.backend is not first.backend
        else:
            assert isinstance(answer, Deferred) and answer.retry_in_s == pytest.approx(expected)


def fast_one_busy(slow_slots: int) -> tuple[BackendPool, Backend, Backend, Slot]:
    """A fast engine with its one slot streaming, and one learned 4x slower."""
    fast, slow = Backend("fast", "http://fast", 1), Backend("slow", "http://slow", slow_slots)
    for _ in range(5):  # the slow engine is learned at a quarter of the fast one's rate
        slow.model.observe_ttft(4000, 0, 0.02 + 4000 / 2048)
    pool = BackendPool([fast, slow], clock=time.monotonic)
    running = pool.try_take("x", 100)
    assert isinstance(running, Slot) and running.backend is fast
    pool.prefill_done(running)
    return pool, fast, slow, running


def test_waiters_get_the_freed_slot_in_the_order_they_began_to_wait() -> None:
    pool, fast, _, running = fast_one_busy(slow_slots=2)
    fast.hold_s = 0.2
    hints = [RouteHint(), RouteHint()]
    assert all(isinstance(pool.try_take("x", 4000, hint=h, waited_s=0.0), Deferred) for h in hints)
    pool.give_back(running)  # one slot frees for two waiters
    # The second in line goes on waiting: the slot is the first's...
    assert isinstance(pool.try_take("x", 4000, hint=hints[1], waited_s=0.1), Deferred)
    # ...who takes it, though another waits for it too.
    first = pool.try_take("x", 4000, hint=hints[0], waited_s=0.1)
    assert isinstance(first, Slot) and first.backend is fast
    assert list(fast.waiters) == [hints[1]]


def test_a_long_prompt_waits_for_the_fast_engine_rather_than_start_on_a_slow_one() -> None:
    pool, fast, slow, _ = fast_one_busy(slow_slots=1)
    fast.hold_s = 0.5  # its slot frees about every 0.5 s
    # 4000 tokens: ~0.5 s on the fast engine after a ~0.5 s wait, ~2 s on the slow one.
    # Behind three requests in line, the fast slot is 2 s away: past the gain, go slow.
    behind = pool.try_take("x", 4000, hint=RouteHint(), waited_s=0.0, ahead=3)
    assert isinstance(behind, Slot) and behind.backend is slow
    pool.give_back(behind)
    slow.hold_s = None
    hints = [RouteHint() for _ in range(3)]  # one per request, alive while it waits
    deferred = pool.try_take("x", 4000, hint=hints[0], waited_s=0.0)
    assert isinstance(deferred, Deferred)
    assert 1.0 < deferred.retry_in_s < 2.0, "at most what it gains"
    # The second would wait two releases (1 s) for that slot, still worth it; the third
    # 1.5 s, past its gain: it starts on the slow engine at once.
    assert isinstance(pool.try_take("x", 4000, hint=hints[1], waited_s=0.0), Deferred)
    third = pool.try_take("x", 4000, hint=hints[2], waited_s=0.0)
    assert isinstance(third, Slot) and third.backend is slow
    assert len(fast.waiters) == 2
    del hints[:2]  # those two requests went away: they wait for nothing any more
    assert len(fast.waiters) == 0
    # A short prompt gains little from the fast engine: it takes the slow one's slot.
    pool.give_back(third)
    short = pool.try_take("x", 50, hint=RouteHint(), waited_s=0.0)
    assert isinstance(short, Slot) and short.backend is slow
