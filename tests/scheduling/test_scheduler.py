"""Scheduler order, promotion, per-lane slot limits and the fail-fast paths.

The scheduler reads one injected clock for every estimate (ages, hold times), so
these tests move time with `Clock.advance` instead of sleeping; only the queue
timeout is a real loop timer (it must fire), tested with a short one.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import LaneSettings
from gateway.http.errors import status_of
from gateway.outcomes import Refusal
from gateway.scheduling.scheduler import PRESSURE_SAMPLES, Deferred, Grant, Scheduler, WaitNote


class CountingSlots:
    """A SlotSource with a fixed number of interchangeable slots."""

    def __init__(self, slots: int) -> None:
        self.free = slots

    def try_take(
        self,
        lane: str,
        prompt_tokens: int,
        output_tokens: int = 0,
        exclude: object = None,
        hint: object = None,
        waited_s: float | None = None,
        ahead: int = 0,
        keep_batch_tokens: int = 0,
    ) -> object | None:
        if self.free == 0:
            return None
        self.free -= 1
        return object()

    def has_free_slot(self, lane: str) -> bool:
        return self.free > 0

    def prefill_done(self, slot: object) -> None:
        pass

    def give_back(self, slot: object) -> None:
        self.free += 1

    def known_wait_s(self, lane: str, ahead: object) -> float:
        """Nothing is known of these slots' work: the measured waits alone decide."""
        return 0.0


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(
    slots: int = 1,
    *,
    interactive: dict | None = None,
    bulk: dict | None = None,
    limits: dict[str, int] | None = None,
    clock: Clock | None = None,
) -> tuple[Scheduler, CountingSlots]:
    lanes = [
        LaneSettings(name="interactive", **{"queue_timeout_s": 5, **(interactive or {})}),
        LaneSettings(name="bulk", **{"queue_timeout_s": 5, **(bulk or {})}),
    ]
    source = CountingSlots(slots)
    limits = limits or {"interactive": slots, "bulk": slots}
    return Scheduler(lanes, limits, source, clock=clock or Clock()), source


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_free_slot_is_granted_at_once() -> None:
    scheduler, source = make(2)
    grant = await scheduler.acquire("bulk")
    assert grant.lane == "bulk" and grant.queued_s == pytest.approx(0, abs=0.01)
    assert source.free == 1
    scheduler.release(grant)
    assert source.free == 2


async def test_higher_lane_goes_first_then_fifo_within_a_lane() -> None:
    scheduler, _ = make(1)
    held = await scheduler.acquire("interactive")
    order: list[str] = []

    async def request(lane: str, tag: str) -> None:
        grant = await scheduler.acquire(lane)
        order.append(tag)
        await asyncio.sleep(0.01)
        scheduler.release(grant)

    tasks = [asyncio.create_task(request("bulk", "bulk-1"))]
    await settle()
    tasks.append(asyncio.create_task(request("bulk", "bulk-2")))
    await settle()
    tasks.append(asyncio.create_task(request("interactive", "short-1")))
    await settle()
    tasks.append(asyncio.create_task(request("interactive", "short-2")))
    await settle()
    scheduler.release(held)
    await asyncio.gather(*tasks)
    assert order == ["short-1", "short-2", "bulk-1", "bulk-2"]


async def test_a_request_waiting_past_promote_after_goes_first() -> None:
    clock = Clock()
    scheduler, _ = make(1, bulk={"promote_after_s": 0.05}, clock=clock)
    held = await scheduler.acquire("interactive")
    bulk = asyncio.create_task(scheduler.acquire("bulk"))
    await settle()
    clock.advance(0.1)  # past promote_after_s
    short = asyncio.create_task(scheduler.acquire("interactive"))
    await settle()
    scheduler.release(held)
    await settle()
    assert bulk.done() and not short.done()
    scheduler.release(bulk.result())
    grant = await asyncio.wait_for(short, 1)
    scheduler.release(grant)


async def test_a_promoted_request_goes_after_those_already_waiting_when_it_was_starved() -> None:
    """Promotion puts a starved request in line as of the moment it was starved: short
    requests already waiting then go first, those that come later wait behind it. On an
    engine whose long prefill freezes every decode beside it, going before the waiting
    ones too froze them all and left the short ones that came during the prefill no
    slot (a CPU engine at 150%: short P99 1.8x the floor, 1.3x in line)."""
    clock = Clock()
    scheduler, _ = make(1, bulk={"promote_after_s": 0.05}, clock=clock)
    held = await scheduler.acquire("interactive")
    bulk = asyncio.create_task(scheduler.acquire("bulk"))
    await settle()
    clock.advance(0.03)
    before = asyncio.create_task(scheduler.acquire("interactive"))  # waiting at 0.03
    await settle()
    clock.advance(0.07)  # bulk starved since 0.05
    after = asyncio.create_task(scheduler.acquire("interactive"))  # came at 0.1
    await settle()
    scheduler.release(held)
    await settle()
    assert before.done() and not bulk.done() and not after.done()
    scheduler.release(before.result())
    await settle()
    assert bulk.done() and not after.done()
    scheduler.release(bulk.result())
    scheduler.release(await asyncio.wait_for(after, 1))


async def test_a_lane_that_got_a_slot_lately_is_progressing_not_promoted() -> None:
    """On one slot, a long request that waited past promote_after_s while another long one
    got the slot is not starved: it waits its turn behind short requests (each promotion
    would hold them behind a whole long answer). Starved, it is promoted."""
    clock = Clock()
    scheduler, _ = make(1, bulk={"promote_after_s": 0.05}, clock=clock)
    first = await scheduler.acquire("bulk")
    second = asyncio.create_task(scheduler.acquire("bulk"))
    third = asyncio.create_task(scheduler.acquire("bulk"))
    await settle()
    clock.advance(0.04)
    scheduler.release(first)
    await settle()
    assert second.done()  # bulk got a slot at 0.04
    clock.advance(0.02)
    short = asyncio.create_task(scheduler.acquire("interactive"))
    await settle()
    clock.advance(0.02)  # the third waited 0.08 s; bulk got a slot 0.04 s ago
    scheduler.release(second.result())
    await settle()
    assert short.done() and not third.done(), "a progressing lane went before a short one"
    clock.advance(0.1)  # bulk got no slot for 0.14 s: starved, it goes first
    later = asyncio.create_task(scheduler.acquire("interactive"))
    await settle()
    scheduler.release(short.result())
    await settle()
    assert third.done() and not later.done()
    scheduler.release(third.result())
    scheduler.release(await asyncio.wait_for(later, 1))


async def test_a_lane_whose_request_ran_past_promote_after_is_not_starved_at_its_end() -> None:
    """A lane is starved only while it holds none of its promoted slots: on a CPU engine a
    long request runs longer than promote_after_s, and timed from its grant the next long
    one went first the moment it ended, every time (short requests behind one long
    prefill after another: 1.5-1.9x the engine floor on CPU engines at 120% load)."""
    clock = Clock()
    scheduler, _ = make(1, bulk={"promote_after_s": 0.05}, clock=clock)
    running = await scheduler.acquire("bulk")
    waiting = asyncio.create_task(scheduler.acquire("bulk"))
    await settle()
    clock.advance(1.0)  # the long one ran 1 s; the next one has waited as long
    short = asyncio.create_task(scheduler.acquire("interactive"))
    await settle()
    scheduler.release(running)
    await settle()
    assert short.done() and not waiting.done(), "a lane that just held its slot cut in"
    clock.advance(0.1)  # now bulk has held no slot for 0.1 s: starved, it goes first
    later = asyncio.create_task(scheduler.acquire("interactive"))
    await settle()
    scheduler.release(short.result())
    await settle()
    assert waiting.done() and not later.done()
    scheduler.release(waiting.result())
    scheduler.release(await asyncio.wait_for(later, 1))


async def test_not_yet_promoted_request_still_yields_to_higher_lane() -> None:
    scheduler, _ = make(1, bulk={"promote_after_s": 10})
    held = await scheduler.acquire("interactive")
    bulk = asyncio.create_task(scheduler.acquire("bulk"))
    await settle()
    short = asyncio.create_task(scheduler.acquire("interactive"))
    await settle()
    scheduler.release(held)
    await settle()
    assert short.done() and not bulk.done()
    scheduler.release(short.result())
    scheduler.release(await asyncio.wait_for(bulk, 1))


async def test_lane_never_holds_more_than_its_slot_limit() -> None:
    scheduler, source = make(4, limits={"interactive": 4, "bulk": 2})
    bulk = [await scheduler.acquire("bulk") for _ in range(2)]
    third = asyncio.create_task(scheduler.acquire("bulk"))
    await settle()
    assert not third.done(), "bulk took a third slot over its limit of 2"
    assert source.free == 2
    # The slots bulk may not take stay free for the interactive lane.
    shorts = [await asyncio.wait_for(scheduler.acquire("interactive"), 1) for _ in range(2)]
    assert source.free == 0
    scheduler.release(bulk[0])
    grant = await asyncio.wait_for(third, 1)
    assert scheduler.lane("bulk").in_flight == 2
    for g in [grant, bulk[1], *shorts]:
        scheduler.release(g)
    assert source.free == 4


async def test_full_queue_is_refused_at_once_with_retry_after() -> None:
    scheduler, _ = make(1, bulk={"max_queue_depth": 2})
    held = await scheduler.acquire("bulk")
    waiting = [asyncio.create_task(scheduler.acquire("bulk")) for _ in range(2)]
    await settle()
    with pytest.raises(Refusal) as refused:
        await scheduler.acquire("bulk")
    assert status_of(refused.value) == 429 and refused.value.code == "queue_full"
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s >= 1
    # The other lane's queue is its own.
    other = asyncio.create_task(scheduler.acquire("interactive"))
    await settle()
    assert not other.done()
    for task in [*waiting, other]:
        task.cancel()
    await asyncio.gather(*waiting, other, return_exceptions=True)
    scheduler.release(held)


async def test_queue_timeout_answers_503_and_leaves_the_queue() -> None:
    scheduler, _ = make(1, interactive={"queue_timeout_s": 0.1})
    held = await scheduler.acquire("interactive")
    started = asyncio.get_running_loop().time()
    with pytest.raises(Refusal) as timed_out:
        await scheduler.acquire("interactive")
    waited = asyncio.get_running_loop().time() - started
    assert status_of(timed_out.value) == 503 and timed_out.value.code == "queue_timeout"
    assert timed_out.value.outcome == "queue_timeout"
    assert timed_out.value.retry_after_s is not None
    assert 0.09 <= waited < 2
    assert len(scheduler.lane("interactive").queue) == 0
    scheduler.release(held)


async def test_cancelled_waiter_leaves_the_queue_at_once() -> None:
    scheduler, source = make(1)
    held = await scheduler.acquire("bulk")
    waiter = asyncio.create_task(scheduler.acquire("bulk"))
    await settle()
    assert len(scheduler.lane("bulk").queue) == 1
    waiter.cancel()
    await settle()
    assert len(scheduler.lane("bulk").queue) == 0
    scheduler.release(held)
    assert source.free == 1 and scheduler.lane("bulk").in_flight == 0


async def test_cancel_right_after_grant_gives_the_slot_back() -> None:
    scheduler, source = make(1)
    held = await scheduler.acquire("bulk")
    waiter = asyncio.create_task(scheduler.acquire("bulk"))
    await settle()
    scheduler.release(held)  # grants the waiter's future...
    waiter.cancel()  # ...but its task is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert source.free == 1 and scheduler.lane("bulk").in_flight == 0


async def test_predicted_wait_over_the_deadline_is_refused_at_once() -> None:
    clock = Clock()
    scheduler, _ = make(1, bulk={"queue_timeout_s": 0.5}, clock=clock)
    # Teach the scheduler that a bulk request holds its slot ~0.2 s.
    grant = await scheduler.acquire("bulk")
    clock.advance(0.2)
    scheduler.release(grant)
    held = await scheduler.acquire("bulk")
    queued = [asyncio.create_task(scheduler.acquire("bulk")) for _ in range(2)]
    await settle()
    # Two ahead plus this one at ~0.2 s each on one slot: ~0.6 s > 0.5 s.
    with pytest.raises(Refusal) as refused:
        await scheduler.acquire("bulk")
    assert status_of(refused.value) == 429 and refused.value.code == "wait_too_long"
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)
    scheduler.release(held)


async def test_release_is_idempotent() -> None:
    scheduler, source = make(1)
    grant: Grant = await scheduler.acquire("interactive")
    scheduler.release(grant)
    scheduler.release(grant)
    assert source.free == 1 and scheduler.lane("interactive").in_flight == 0


async def test_promotion_guarantees_progress_not_priority() -> None:
    """An aged lane that already runs its promoted_slots does not cut in front."""
    clock = Clock()
    scheduler, _ = make(2, bulk={"promote_after_s": 0.05, "promoted_slots": 1}, clock=clock)
    running_bulk = await scheduler.acquire("bulk")
    held = await scheduler.acquire("interactive")
    aged = asyncio.create_task(scheduler.acquire("bulk"))
    await settle()
    clock.advance(0.1)  # past promote_after_s, but bulk already runs one
    short = asyncio.create_task(scheduler.acquire("interactive"))
    await settle()
    scheduler.release(held)
    await settle()
    assert short.done() and not aged.done()
    scheduler.release(short.result())
    scheduler.release(await asyncio.wait_for(aged, 1))
    scheduler.release(running_bulk)


# -- the work-conserving split, deadlines, calibrated prediction -------------------------


async def test_a_lane_without_competition_uses_every_slot() -> None:
    scheduler, source = make(4)
    bulk = [await asyncio.wait_for(scheduler.acquire("bulk"), 1) for _ in range(4)]
    assert source.free == 0 and scheduler.lane("bulk").in_flight == 4
    for grant in bulk:
        scheduler.release(grant)


async def test_under_a_waiting_higher_lane_a_lower_one_gives_back_down_to_its_floor() -> None:
    scheduler, source = make(3, bulk={"min_slots": 1})
    bulk = [await scheduler.acquire("bulk") for _ in range(3)]
    shorts = [asyncio.create_task(scheduler.acquire("interactive")) for _ in range(3)]
    more_bulk = asyncio.create_task(scheduler.acquire("bulk"))
    await settle()
    scheduler.release(bulk[0])  # interactive waits: the slot is given back to it
    await settle()
    assert shorts[0].done() and not more_bulk.done()
    scheduler.release(bulk[1])
    await settle()
    assert shorts[1].done() and not more_bulk.done()
    scheduler.release(bulk[2])  # bulk would drop to 0 running: its floor keeps one
    await settle()
    assert more_bulk.done() and not shorts[2].done()
    assert scheduler.lane("bulk").in_flight == 1
    scheduler.release(more_bulk.result())
    for task in shorts:
        scheduler.release(await asyncio.wait_for(task, 1))
    assert source.free == 3


async def test_a_floor_of_zero_sheds_the_lower_lane_entirely() -> None:
    scheduler, _ = make(1, bulk={"min_slots": 0})
    held = await scheduler.acquire("bulk")
    short = asyncio.create_task(scheduler.acquire("interactive"))
    bulk = asyncio.create_task(scheduler.acquire("bulk"))
    await settle()
    scheduler.release(held)
    await settle()
    assert short.done() and not bulk.done()
    scheduler.release(short.result())
    scheduler.release(await asyncio.wait_for(bulk, 1))


async def test_the_client_deadline_applies_when_shorter_than_the_lane() -> None:
    scheduler, _ = make(1, interactive={"queue_timeout_s": 30})
    held = await scheduler.acquire("interactive")
    note = WaitNote()
    started = asyncio.get_running_loop().time()
    with pytest.raises(Refusal) as timed_out:
        await scheduler.acquire("interactive", client_deadline_s=0.1, note=note)
    assert timed_out.value.code == "queue_timeout"
    assert asyncio.get_running_loop().time() - started < 2
    assert note.deadline_s == 0.1
    # A client deadline longer than the lane's does not extend it.
    assert scheduler.deadline_for("interactive", 99.0) == 30
    scheduler.release(held)


async def test_a_fitted_lane_deadline_applies_to_new_arrivals() -> None:
    scheduler, _ = make(1, interactive={"queue_timeout_s": 0.05})
    scheduler.set_deadline("interactive", 5.0)
    held = await scheduler.acquire("interactive")
    waiter = asyncio.create_task(scheduler.acquire("interactive"))
    await asyncio.sleep(0.2)  # past the configured 0.05 s, within the fitted 5 s
    assert not waiter.done()
    scheduler.release(held)
    scheduler.release(await asyncio.wait_for(waiter, 1))


async def test_prediction_is_calibrated_by_measured_waits_per_place() -> None:
    clock = Clock()
    scheduler, _ = make(1, interactive={"queue_timeout_s": 100}, clock=clock)
    for _ in range(6):  # each request waits 2 s in first place in line
        held = await scheduler.acquire("interactive")
        note = WaitNote()
        waiter = asyncio.create_task(scheduler.acquire("interactive", note=note))
        await settle()
        clock.advance(2.0)
        scheduler.release(held)
        scheduler.release(await asyncio.wait_for(waiter, 1))
    assert scheduler.lane("interactive").wait_per_place.value == pytest.approx(2.0)
    held = await scheduler.acquire("interactive")
    queued = [asyncio.create_task(scheduler.acquire("interactive")) for _ in range(2)]
    await settle()
    # Two ahead: third place in line, 2 s a place.
    assert scheduler.predicted_wait_s("interactive") == pytest.approx(6.0)
    # Higher lanes' waiters count as ahead of a lower lane's arrival.
    assert scheduler._place_in_line(scheduler.lane("bulk")) == 3
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)
    scheduler.release(held)


async def test_refusal_names_the_client_deadline_and_retry_after_from_the_estimate() -> None:
    clock = Clock()
    scheduler, _ = make(1, interactive={"queue_timeout_s": 100}, clock=clock)
    lane = scheduler.lane("interactive")
    for _ in range(10):
        lane.wait_per_place.add(1.0)
    held = await scheduler.acquire("interactive")
    queued = [asyncio.create_task(scheduler.acquire("interactive")) for _ in range(3)]
    await settle()
    with pytest.raises(Refusal) as refused:
        await scheduler.acquire("interactive", client_deadline_s=2.0)
    assert refused.value.code == "wait_too_long" and "your" in refused.value.message
    assert refused.value.retry_after_s == 1  # 4 s predicted, the lane allows 80 s
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)
    scheduler.release(held)


async def test_a_lower_lane_is_shed_while_a_higher_one_waits_near_its_deadline() -> None:
    clock = Clock()
    scheduler, _ = make(
        1, interactive={"queue_timeout_s": 10}, bulk={"queue_timeout_s": 100}, clock=clock
    )
    interactive = scheduler.lane("interactive")
    for _ in range(PRESSURE_SAMPLES - 1):
        interactive.recent_waits.append(6.0)  # over half of its 10 s
    interactive.last_wait_at = clock.now
    assert scheduler.pressing_lane("bulk") is None  # not yet enough to call it sustained
    interactive.recent_waits.append(6.0)
    assert scheduler.pressing_lane("bulk") is interactive
    with pytest.raises(Refusal) as shed:
        await scheduler.acquire("bulk")
    assert shed.value.code == "wait_too_long" and "'interactive'" in shed.value.message
    # The short requests themselves are still admitted; as they go through at once,
    # the pressure is gone and the lower lane is served again.
    for _ in range(PRESSURE_SAMPLES // 2 + 1):
        scheduler.release(await scheduler.acquire("interactive"))
    assert scheduler.pressing_lane("bulk") is None
    scheduler.release(await scheduler.acquire("bulk"))


async def test_shedding_ends_with_its_cause_an_idle_gateway_sheds_nothing() -> None:
    """The pressure is the present's: once the higher lane has nobody waiting and its
    last wait is older than its deadline, the lower lane is admitted, though no short
    request came by to say so (an idle gateway refused every bulk request for minutes)."""
    clock = Clock()
    scheduler, _ = make(1, interactive={"queue_timeout_s": 5}, clock=clock)
    interactive = scheduler.lane("interactive")
    for _ in range(PRESSURE_SAMPLES):
        interactive.recent_waits.append(4.0)
    interactive.last_wait_at = clock.now
    assert scheduler.pressing_lane("bulk") is interactive
    clock.advance(4.0)
    assert scheduler.pressing_lane("bulk") is interactive  # within its deadline: recent
    clock.advance(2.0)
    assert scheduler.pressing_lane("bulk") is None
    scheduler.release(await scheduler.acquire("bulk"))


async def test_retry_after_is_the_predicted_wait_and_the_drain_counts_from_the_backlog() -> None:
    clock = Clock()
    scheduler, _ = make(1, bulk={"max_queue_depth": 4, "reject_predicted_wait": False}, clock=clock)
    held = await scheduler.acquire("bulk")
    assert scheduler.drain_rate("bulk") is None  # no backlog
    queued = [asyncio.create_task(scheduler.acquire("bulk")) for _ in range(4)]
    await settle()
    assert scheduler.drain_rate("bulk") is None  # a backlog too new to say
    clock.advance(2.0)
    scheduler.release(held)  # one request left the line in 2 s
    await settle()
    held = queued.pop(0).result()
    queued.append(asyncio.create_task(scheduler.acquire("bulk")))
    await settle()
    assert scheduler.drain_rate("bulk") == pytest.approx(0.5)
    with pytest.raises(Refusal) as refused:
        await scheduler.acquire("bulk")
    assert refused.value.code == "queue_full"
    # Five places in line (four queued and a retry) at 2 s each (the slot's hold).
    assert refused.value.retry_after_s == 10
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)
    scheduler.release(held)


async def test_a_burst_after_a_quiet_spell_gets_the_wait_it_will_have_not_a_minute() -> None:
    """Dispatches long before a burst (at the rate requests arrived then) do not make its
    drain rate: the refusals of a burst carry the predicted wait beyond what is allowed."""
    clock = Clock()
    scheduler, _ = make(1, interactive={"queue_timeout_s": 5}, clock=clock)
    lane = scheduler.lane("interactive")
    for _ in range(5):
        scheduler.release(await scheduler.acquire("interactive"))
        lane.wait_per_place.add(0.25)
        clock.advance(30.0)  # one request every 30 s: a "drain" of 1/30 per second
    held = await scheduler.acquire("interactive")
    burst = [asyncio.create_task(scheduler.acquire("interactive")) for _ in range(19)]
    await settle()
    with pytest.raises(Refusal) as refused:
        await scheduler.acquire("interactive")
    # 20 places at 0.25 s each: 5 s, of which 4 s may be waited.
    assert refused.value.code == "wait_too_long" and refused.value.retry_after_s == 1
    for task in burst:
        task.cancel()
    await asyncio.gather(*burst, return_exceptions=True)
    scheduler.release(held)


async def test_a_lanes_drain_rate_counts_the_higher_lanes_that_go_first() -> None:
    clock = Clock()
    scheduler, _ = make(1, clock=clock)
    held = await scheduler.acquire("interactive")
    shorts = [asyncio.create_task(scheduler.acquire("interactive")) for _ in range(3)]
    longs = [asyncio.create_task(scheduler.acquire("bulk")) for _ in range(2)]
    await settle()
    for _ in range(2):
        clock.advance(1.5)
        scheduler.release(held)
        await settle()
        held = next(t for t in shorts if t.done() and not t.result().released).result()
    # interactive: two dispatches in the 3 s of its backlog; bulk: none of its own,
    # but the line ahead of it is interactive's.
    assert scheduler.drain_rate("interactive") == pytest.approx(2 / 3)
    assert scheduler.drain_rate("bulk") == pytest.approx(2 / 3)
    scheduler.release(held)
    scheduler.release(await asyncio.wait_for(shorts[-1], 1))
    for task in longs:
        scheduler.release(await asyncio.wait_for(task, 1))


class DeferringSlots(CountingSlots):
    """Slots for anyone, but a request hinted "home" is deferred until it waited 50 ms."""

    def try_take(
        self,
        lane: str,
        prompt_tokens: int,
        output_tokens: int = 0,
        exclude: object = None,
        hint: object = None,
        waited_s: float | None = None,
        ahead: int = 0,
        keep_batch_tokens: int = 0,
    ) -> object | None:
        if self.free and hint == "home" and waited_s is not None and waited_s < 0.05:
            return Deferred(0.05 - waited_s)
        return super().try_take(lane, prompt_tokens, output_tokens, exclude, hint)


async def test_a_deferred_head_lets_the_requests_behind_it_go_and_is_served_after() -> None:
    source = DeferringSlots(1)
    scheduler = Scheduler([LaneSettings(name="only")], {"only": 4}, source)
    home = asyncio.ensure_future(scheduler.acquire("only", hint="home"))
    await asyncio.sleep(0)
    other = asyncio.ensure_future(scheduler.acquire("only"))
    granted = await asyncio.wait_for(other, 1)
    assert not home.done(), "the deferred head waits; the request behind it took the slot"
    scheduler.release(granted)
    # The slot is free again, but the head is still deferred: it gets it when its wait ends.
    await asyncio.sleep(0.01)
    assert not home.done()
    grant = await asyncio.wait_for(home, 1)
    assert grant.queued_s >= 0.05


# --- the floor on one and two slots (a lower lane never inverts the priority) ----------


async def test_on_one_slot_a_short_goes_before_queued_longs() -> None:
    """The issue's scenario: one slot, promotion off, the defaults' floor of 1. A long
    holds the slot, two more longs queue, then a short: the short goes next."""
    scheduler, _ = make(1, bulk={"min_slots": 1})
    held = await scheduler.acquire("bulk")
    order: list[str] = []

    async def request(lane: str, tag: str) -> None:
        grant = await scheduler.acquire(lane)
        order.append(tag)
        await asyncio.sleep(0)
        scheduler.release(grant)

    tasks = [asyncio.create_task(request("bulk", f"long-{i}")) for i in (1, 2)]
    await settle()
    tasks.append(asyncio.create_task(request("interactive", "short")))
    await settle()
    scheduler.release(held)
    await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert order == ["short", "long-1", "long-2"]


async def test_on_one_slot_promotion_still_keeps_the_lower_lane_from_starving() -> None:
    """Short requests keep coming: the starved long one goes after those that were
    waiting when it was starved, before all that came later."""
    clock = Clock()
    scheduler, _ = make(1, bulk={"min_slots": 1, "promote_after_s": 1.0}, clock=clock)
    held = await scheduler.acquire("interactive")
    long = asyncio.create_task(scheduler.acquire("bulk"))
    shorts = [asyncio.create_task(scheduler.acquire("interactive")) for _ in range(2)]
    await settle()
    clock.advance(2.0)  # the long waited past promote_after_s
    later = [asyncio.create_task(scheduler.acquire("interactive")) for _ in range(3)]
    await settle()
    scheduler.release(held)
    for task in shorts:
        scheduler.release(await asyncio.wait_for(task, 1))
    await settle()
    assert long.done() and not any(task.done() for task in later)
    scheduler.release(long.result())
    for task in later:
        scheduler.release(await asyncio.wait_for(task, 1))


async def test_on_two_slots_the_floor_keeps_one_slot_for_the_lower_lane() -> None:
    scheduler, _ = make(2, bulk={"min_slots": 1})
    longs = [await scheduler.acquire("bulk") for _ in range(2)]
    shorts = [asyncio.create_task(scheduler.acquire("interactive")) for _ in range(3)]
    more_long = asyncio.create_task(scheduler.acquire("bulk"))
    await settle()
    scheduler.release(longs[0])  # bulk keeps 1 running: the slot goes to a short
    await settle()
    assert shorts[0].done() and not more_long.done()
    scheduler.release(longs[1])  # bulk would drop to 0: its floor keeps this one
    await settle()
    assert more_long.done() and not shorts[1].done()
    scheduler.release(more_long.result())
    scheduler.release(shorts[0].result())
    scheduler.release(await asyncio.wait_for(shorts[1], 1))


# --- tenants: fair order, the full line, the per-tenant cap ------------------------------


async def test_a_light_tenant_goes_before_a_flooding_tenants_backlog() -> None:
    scheduler, _ = make(1)
    held = await scheduler.acquire("interactive", 50, tenant="flood")
    order: list[str] = []

    async def request(tenant: str) -> None:
        grant = await scheduler.acquire("interactive", 50, tenant=tenant)
        order.append(tenant)
        await asyncio.sleep(0)
        scheduler.release(grant, 50, 10)

    flood = [asyncio.create_task(request("flood")) for _ in range(5)]
    await settle()
    light = asyncio.create_task(request("light"))
    await settle()
    scheduler.release(held, 50, 10)
    await asyncio.wait_for(asyncio.gather(*flood, light), 1)
    assert order[0] == "light", order


async def test_a_light_tenants_predicted_wait_is_its_own_turn_not_the_line() -> None:
    clock = Clock()
    scheduler, _ = make(1, interactive={"queue_timeout_s": 5}, clock=clock)
    held = await scheduler.acquire("interactive", 50, tenant="flood")
    flood = [
        asyncio.create_task(scheduler.acquire("interactive", 50, tenant="flood")) for _ in range(20)
    ]
    await settle()
    scheduler.lane("interactive").hold_ewma_s = 1.0  # one slot, 1 s a request
    assert scheduler.predicted_wait_s("interactive") == pytest.approx(21.0)
    assert scheduler.predicted_wait_s("interactive", "flood") == pytest.approx(21.0)
    assert scheduler.predicted_wait_s("interactive", "light") == pytest.approx(1.0)
    note = WaitNote()
    light = asyncio.create_task(
        scheduler.acquire("interactive", 50, tenant="light", note=note)
    )  # admitted: the flood's line is not its line
    await settle()
    assert not light.done() and note.predicted_wait_s == pytest.approx(1.0)
    with pytest.raises(Refusal) as refused:
        await scheduler.acquire("interactive", 50, tenant="flood")
    assert refused.value.code == "wait_too_long"
    scheduler.release(held)
    scheduler.release(await asyncio.wait_for(light, 1))
    for task in flood:
        task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)


async def test_a_full_line_refuses_the_heaviest_tenants_newest_not_the_newcomer() -> None:
    scheduler, _ = make(1, interactive={"max_queue_depth": 4, "reject_predicted_wait": False})
    held = await scheduler.acquire("interactive", tenant="flood")
    flood = [
        asyncio.create_task(scheduler.acquire("interactive", tenant="flood")) for _ in range(4)
    ]
    await settle()
    light = asyncio.create_task(scheduler.acquire("interactive", tenant="light"))
    await settle()
    newest = flood[-1]
    assert newest.done() and not light.done()
    refused = newest.exception()
    assert isinstance(refused, Refusal) and refused.code == "queue_full"
    assert refused.retry_after_s is not None and refused.retry_after_s >= 1
    assert status_of(refused) == 429
    # The flood itself, at more than its share, is refused as before.
    with pytest.raises(Refusal) as again:
        await scheduler.acquire("interactive", tenant="flood")
    assert again.value.code == "queue_full"
    scheduler.release(held)
    scheduler.release(await asyncio.wait_for(light, 1))
    for task in flood[:-1]:
        scheduler.release(await asyncio.wait_for(task, 1))


async def test_the_per_tenant_cap_refuses_only_that_tenant() -> None:
    scheduler, _ = make(1, interactive={"max_queue_depth_per_tenant": 2})
    held = await scheduler.acquire("interactive", tenant="a")

    async def request(tenant: str) -> str:
        scheduler.release(await scheduler.acquire("interactive", tenant=tenant))
        return tenant

    queued = [asyncio.create_task(request("a")) for _ in range(2)]
    await settle()
    with pytest.raises(Refusal) as refused:
        await scheduler.acquire("interactive", tenant="a")
    assert refused.value.code == "queue_full" and "2 requests" in refused.value.message
    other = asyncio.create_task(request("b"))
    await settle()
    assert not other.done()  # queued, not refused
    scheduler.release(held)
    assert sorted(await asyncio.wait_for(asyncio.gather(*queued, other), 1)) == ["a", "a", "b"]


async def test_one_tenant_is_served_first_come_and_charged_what_it_cost() -> None:
    scheduler, _ = make(1)
    scheduler.cost.output_weight = 4.0
    held = await scheduler.acquire("interactive", 100, tenant="only")
    assert held.charged == 100
    order: list[int] = []

    async def request(index: int) -> None:
        grant = await scheduler.acquire("interactive", 10 * index, tenant="only")
        order.append(index)
        await asyncio.sleep(0)
        scheduler.release(grant)

    tasks = []
    for index in range(1, 6):
        tasks.append(asyncio.create_task(request(index)))
        await settle()
    scheduler.release(held, 60, 5)  # 40 of its 100 prompt tokens were cached
    assert held.cost == 60 + 4.0 * 5
    await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert order == [1, 2, 3, 4, 5]


class ModelSlots(CountingSlots):
    """Slots for requests hinted "beta"; those hinted "alpha" wait for their own backends,
    all full (a pool whose engines list different models)."""

    def try_take(
        self,
        lane: str,
        prompt_tokens: int,
        output_tokens: int = 0,
        exclude: object = None,
        hint: object = None,
        waited_s: float | None = None,
        ahead: int = 0,
        keep_batch_tokens: int = 0,
    ) -> object | None:
        if self.free and hint == "alpha":
            return Deferred(5.0, own_full=True)
        return super().try_take(lane, prompt_tokens, output_tokens, exclude, hint)


async def test_a_request_behind_many_waiting_for_their_own_full_backends_is_served() -> None:
    """40 requests wait for their model's full backends; another model's request behind
    them takes its free one at once (LOOKAHEAD alone, 16, held it until they drained)."""
    scheduler = Scheduler([LaneSettings(name="only")], {"only": 64}, ModelSlots(4))
    alphas = [asyncio.ensure_future(scheduler.acquire("only", hint="alpha")) for _ in range(40)]
    await settle()
    beta = await asyncio.wait_for(scheduler.acquire("only", hint="beta"), 1)
    assert beta.queued_s < 0.5 and not any(task.done() for task in alphas)
    scheduler.release(beta)
    for task in alphas:
        task.cancel()


async def test_a_lower_lanes_next_request_waits_once_past_its_fitted_deadline() -> None:
    """The head of a lower lane's line whose deadline the gateway fitted gets a promotion
    age and a slot hold more (its deadline while no hold is measured), once, for the
    promotion it is next for; the request behind it does not, nor the head a second time
    (a long request on a CPU llama.cpp timed out 7-43 s before that promotion, in a stream
    already begun)."""
    scheduler, _ = make(1, bulk={"queue_timeout_s": 0.1, "promote_after_s": 0.5})
    scheduler.set_deadline("bulk", 0.1, adapted=True)
    held = await scheduler.acquire("interactive")
    head_note, behind_note = WaitNote(), WaitNote()
    head = asyncio.create_task(scheduler.acquire("bulk", note=head_note))
    await settle()
    behind = asyncio.create_task(scheduler.acquire("bulk", note=behind_note))
    await asyncio.sleep(0.15)  # both past the fitted 0.1 s
    assert not head.done(), "the next request in line timed out at its fitted deadline"
    assert behind.done() and behind.exception().code == "queue_timeout"  # type: ignore[union-attr]
    assert behind_note.grace_s is None and behind_note.deadline_s == 0.1
    assert head_note.grace_s == pytest.approx(0.6) and head_note.deadline_s == pytest.approx(0.7)
    with pytest.raises(Refusal) as timed_out:  # one grace: at 0.7 s it times out
        await asyncio.wait_for(head, 2)
    assert timed_out.value.code == "queue_timeout"
    scheduler.release(held)


async def test_the_graced_head_is_served_when_its_promotion_comes() -> None:
    scheduler, _ = make(1, bulk={"queue_timeout_s": 0.1, "promote_after_s": 0.5})
    scheduler.set_deadline("bulk", 0.1, adapted=True)
    held = await scheduler.acquire("interactive")
    head = asyncio.create_task(scheduler.acquire("bulk"))
    await asyncio.sleep(0.15)  # past its fitted 0.1 s, still in line (graced to 0.7 s)
    assert not head.done()
    scheduler.release(held)
    scheduler.release(await asyncio.wait_for(head, 1))


async def test_no_grace_while_the_lower_lane_is_shed() -> None:
    """While the higher lane's requests wait over half their deadline the lower lane is
    shed: a request kept then takes a promotion no other would have taken."""
    clock = Clock()
    scheduler, _ = make(
        1,
        interactive={"queue_timeout_s": 10},
        bulk={"queue_timeout_s": 0.1, "promote_after_s": 0.05},
        clock=clock,
    )
    scheduler.set_deadline("bulk", 0.1, adapted=True)
    held = await scheduler.acquire("interactive")
    note = WaitNote()
    head = asyncio.create_task(scheduler.acquire("bulk", note=note))
    await settle()
    interactive = scheduler.lane("interactive")
    interactive.recent_waits.extend([6.0] * PRESSURE_SAMPLES)  # over half of its 10 s
    interactive.last_wait_at = clock.now
    with pytest.raises(Refusal) as timed_out:
        await asyncio.wait_for(head, 1)
    assert timed_out.value.code == "queue_timeout" and note.grace_s is None
    scheduler.release(held)


@pytest.mark.parametrize(
    ("adapted", "lane", "client_deadline_s", "timed_out_at"),
    [
        (False, "bulk", None, 0.1),  # written: exact
        (True, "interactive", None, 0.1),  # the highest lane: no promotion to wait for
        (True, "bulk", 0.1, 0.1),  # the client's own deadline: exact
        (True, "bulk", 0.15, 0.15),  # the grace stops at the client's deadline
    ],
)
async def test_no_grace_past_a_written_or_a_clients_deadline_nor_in_the_highest_lane(
    adapted: bool, lane: str, client_deadline_s: float | None, timed_out_at: float
) -> None:
    # A grace would be 0.5 + 0.1 s: far from every bound below, on a busy machine too.
    scheduler, _ = make(
        1,
        interactive={"queue_timeout_s": 0.1, "promote_after_s": 0.5},
        bulk={"queue_timeout_s": 0.1, "promote_after_s": 0.5},
    )
    scheduler.set_deadline(lane, 0.1, adapted=adapted)
    held = await scheduler.acquire("interactive")
    note = WaitNote()
    started = asyncio.get_running_loop().time()
    with pytest.raises(Refusal) as timed_out:
        await scheduler.acquire(lane, client_deadline_s=client_deadline_s, note=note)
    waited = asyncio.get_running_loop().time() - started
    assert timed_out.value.code == "queue_timeout"
    assert timed_out_at - 0.01 <= waited < timed_out_at + 0.3
    assert note.deadline_s == pytest.approx(timed_out_at)
    scheduler.release(held)
