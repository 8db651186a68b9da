"""Headroom for a higher lane, sized from its measured demand (pure, an injected clock)."""

from __future__ import annotations

import asyncio
import math

import pytest

from gateway.scheduling.headroom import (
    LOAD_STEP,
    QUIET_S,
    TAIL_PROBABILITY,
    ArrivalRate,
    _slots_needed_in_steps,
    erlang_c,
    headroom_slots,
    slots_needed,
)
from gateway.scheduling.scheduler import Grant, Scheduler
from tests.scheduling.test_scheduler import Clock, make, settle


def test_erlang_c_known_values() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: an arrival waits rho of the time
    assert erlang_c(4, 2.1) == pytest.approx(0.199, abs=0.002)
    assert erlang_c(2, 2.0) == 1.0 and erlang_c(3, 0.0) == 0.0


def test_slots_needed_grows_with_the_load_and_is_capped() -> None:
    assert slots_needed(0.0, 8) == 0
    assert slots_needed(0.05, 8) == 1
    needed = [slots_needed(load, 64) for load in (0.5, 1.0, 2.0, 4.0, 8.0)]
    assert needed == sorted(needed) and needed[0] < needed[-1]
    assert erlang_c(slots_needed(4.0, 64), 4.0) <= 0.1 < erlang_c(slots_needed(4.0, 64) - 1, 4.0)
    assert slots_needed(20.0, 8) == 8


def test_headroom_slots_from_the_cache_are_never_fewer_than_the_exact_answer() -> None:
    for step in range(0, 64 * 40, 7):
        load = step * LOAD_STEP + 0.3 * LOAD_STEP  # between two steps
        exact = slots_needed(load, 64)
        assert exact <= headroom_slots(load, 64) <= slots_needed(load + LOAD_STEP, 64)
        assert headroom_slots(step * LOAD_STEP, 64) == slots_needed(step * LOAD_STEP, 64)


def test_a_load_over_every_slot_needs_them_all_without_a_pass_or_a_cache_entry() -> None:
    """A burst measures thousands of Erlangs: the answer is every slot, as the pass over
    them would end, and those loads leave the lane's usual ones in the cache."""
    for load, most in ((5000.0, 2048), (64.0, 64), (8.5, 8)):
        assert headroom_slots(load, most) == slots_needed(load, most) == most
    _slots_needed_in_steps.cache_clear()
    for tenth in range(20_480, 40_000):
        headroom_slots(tenth / 10, 2048)
    assert _slots_needed_in_steps.cache_info().currsize == 0
    assert headroom_slots(0.0, 8) == headroom_slots(3.0, 0) == 0
    assert headroom_slots(9.0, 8, wait_probability=1.0) == slots_needed(9.0, 8, 1.0) == 0


def waits_past(slots: int, load: float, allowance_holds: float) -> float:
    """Erlang C's chance that an arrival waits longer than the allowance."""
    return erlang_c(slots, load) * math.exp(-(slots - load) * allowance_holds)


def test_a_short_allowance_against_a_long_hold_keeps_the_slots_of_its_tail() -> None:
    """3 Erlangs on 8 slots: 6 slots keep waiting to 10% of arrivals, but those wait
    ln(10) x hold / 3 at P99 (1.8 s for a 2.3 s hold: the CPU vLLM's short answers). With
    an allowance of a tenth of the hold, the tail needs 8; a generous one changes nothing."""
    assert slots_needed(3.0, 8) == 6
    tight = slots_needed(3.0, 16, allowance_holds=0.1)
    assert waits_past(tight, 3.0, 0.1) <= TAIL_PROBABILITY < waits_past(tight - 1, 3.0, 0.1)
    assert tight == 8 and slots_needed(3.0, 8, allowance_holds=0.1) == 8
    assert slots_needed(3.0, 8, allowance_holds=5.0) == 6
    # Each criterion alone is met; the looser probability leaves the tail to decide.
    assert slots_needed(3.0, 16, wait_probability=0.5, allowance_holds=0.1) == tight
    # The cache rounds the allowance down: never fewer slots than the exact answer.
    for tenths in range(1, 40):
        allowance = tenths / 10 + LOAD_STEP / 3
        assert headroom_slots(3.0, 16, 0.1, allowance) >= slots_needed(3.0, 16, 0.1, allowance)


def test_an_arrival_rate_falls_while_nothing_arrives_and_is_zero_when_quiet() -> None:
    rate = ArrivalRate()
    for second in range(10):
        rate.add(float(second))
    assert rate.per_s(9.0) == pytest.approx(1.0)
    assert rate.per_s(18.0) == pytest.approx(0.5)
    assert rate.per_s(9.0 + QUIET_S + 0.1) == 0.0 and rate.quiet(9.0 + QUIET_S + 0.1)


async def arrive(
    scheduler: Scheduler, clock: Clock, lane: str, count: int, every_s: float, hold_s: float
) -> None:
    """`count` requests of `lane`, one every `every_s`, each holding its slot `hold_s`
    (overlapping, on a backend with room for them all)."""
    running: list[tuple[float, Grant]] = []
    for _ in range(count):
        running.append((clock.now + hold_s, await scheduler.acquire(lane)))
        clock.advance(every_s)
        for ends, grant in [r for r in running if r[0] <= clock.now]:
            scheduler.release(grant)
            running.remove((ends, grant))
    for ends, grant in running:
        clock.now = max(clock.now, ends)
        scheduler.release(grant)


async def test_headroom_follows_the_higher_lanes_arrival_rate() -> None:
    clock = Clock()
    scheduler, _ = make(8, clock=clock)
    interactive = scheduler.lane("interactive")
    await arrive(scheduler, clock, "interactive", 10, every_s=1.0, hold_s=1.0)  # 1 Erlang
    low = interactive.headroom
    await arrive(scheduler, clock, "interactive", 32, every_s=0.25, hold_s=1.0)  # 4 Erlangs
    high = interactive.headroom
    assert 1 <= low < high <= 8
    assert interactive.demand_slots == pytest.approx(4.0, rel=0.15)
    assert scheduler.reserved_slots("bulk") == high
    # The lower lane may hold what the headroom leaves, and no more.
    bulk = [await scheduler.acquire("bulk") for _ in range(8 - high)]
    extra = asyncio.create_task(scheduler.acquire("bulk"))
    await settle()
    assert not extra.done()
    scheduler.release(bulk.pop())
    await settle()
    assert extra.done()  # it took the slot a bulk request gave back, not the headroom
    for grant in [*bulk, extra.result()]:
        scheduler.release(grant)


async def test_a_higher_tolerated_wait_keeps_fewer_slots_and_one_keeps_none() -> None:
    """The same demand (2 Erlangs on 8 slots), three tolerances: the headroom shrinks as
    the higher lane's arrivals may find it busy more often, and 1 leaves the lower lane
    every slot."""
    kept = []
    for probability in (0.1, 0.5, 1.0):
        clock = Clock()
        scheduler, source = make(
            8, interactive={"headroom_wait_probability": probability}, clock=clock
        )
        await arrive(scheduler, clock, "interactive", 32, every_s=0.5, hold_s=1.0)
        kept.append(scheduler.reserved_slots("bulk"))
        bulk = [await asyncio.wait_for(scheduler.acquire("bulk"), 1) for _ in range(8 - kept[-1])]
        extra = asyncio.create_task(scheduler.acquire("bulk"))
        await settle()
        assert not extra.done() and source.free == kept[-1]  # those slots: the headroom
        extra.cancel()
        for grant in bulk:
            scheduler.release(grant)
    assert kept[0] > kept[1] > kept[2] == 0, kept
    assert erlang_c(kept[1], 2.0) <= 0.5 < erlang_c(kept[1] - 1, 2.0)


@pytest.mark.parametrize("written", [None, 0.1])
async def test_a_wait_allowance_keeps_the_tail_unless_the_probability_is_written(
    written: float | None,
) -> None:
    """3 Erlangs of 2.4 s holds on 16 slots: with an allowance of a tenth of the hold (the
    app's share of the engine floor), the higher lane keeps the 8-9 its tail needs; a
    probability the operator wrote is the headroom exactly (as without an allowance)."""
    clock = Clock()
    overrides = {} if written is None else {"headroom_wait_probability": written}
    scheduler, _ = make(16, interactive=overrides, clock=clock)
    await arrive(scheduler, clock, "interactive", 32, every_s=0.8, hold_s=2.4)
    before = scheduler.reserved_slots("bulk")
    scheduler.set_wait_allowance("interactive", 0.24)
    figures = scheduler.headroom_figures("interactive")
    assert before < 8 and figures["demand_slots"] == pytest.approx(3.0, rel=0.2)
    if written is None:
        assert scheduler.reserved_slots("bulk") == figures["tail_slots"] >= 8
        assert figures["wait_allowance_s"] == 0.24
    else:
        assert scheduler.reserved_slots("bulk") == before
        assert figures["wait_allowance_s"] is None and figures["tail_slots"] is None
    assert figures["wait_probability"] == 0.1


async def test_a_tail_that_would_take_every_slot_leaves_the_probability_in_force() -> None:
    """The same demand on 8 slots: the tail needs all 8, which would leave the long
    requests promotion alone; the headroom keeps to the probability, and says the tail."""
    clock = Clock()
    scheduler, _ = make(8, clock=clock)
    await arrive(scheduler, clock, "interactive", 32, every_s=0.8, hold_s=2.4)
    before = scheduler.reserved_slots("bulk")
    scheduler.set_wait_allowance("interactive", 0.24)
    figures = scheduler.headroom_figures("interactive")
    assert before < 8 and figures["tail_slots"] == 8
    assert scheduler.reserved_slots("bulk") == figures["headroom_slots"] == before


async def test_a_quiet_higher_lane_keeps_no_headroom_and_the_waiter_is_served() -> None:
    clock = Clock()
    scheduler, source = make(4, clock=clock)
    await arrive(scheduler, clock, "interactive", 20, every_s=0.3, hold_s=1.0)
    assert scheduler.reserved_slots("bulk") == 4  # ~3 Erlangs: all four slots
    bulk = [await scheduler.acquire("bulk")]  # its floor, whatever the headroom
    waiting = asyncio.create_task(scheduler.acquire("bulk"))
    await settle()
    assert not waiting.done() and source.free > 0  # a free slot, kept for interactive
    clock.advance(QUIET_S + 1)  # interactive goes quiet: the headroom is gone
    assert scheduler.reserved_slots("bulk") == 0
    # The scheduler's own timer looks again when the higher lane turns quiet, on the
    # loop's time; with the clock moved by hand, look now.
    scheduler.notify_capacity()
    grant = await asyncio.wait_for(waiting, 1)
    for held in [*bulk, grant]:
        scheduler.release(held)


async def test_headroom_never_takes_the_lower_lanes_floor_on_two_or_more_slots() -> None:
    for slots in (2, 3, 8):
        clock = Clock()
        # Room for all of interactive's 20 Erlangs; bulk's backends have `slots`.
        scheduler, _ = make(
            64, bulk={"min_slots": 1}, limits={"interactive": 64, "bulk": slots}, clock=clock
        )
        await arrive(scheduler, clock, "interactive", 32, every_s=0.05, hold_s=1.0)
        assert scheduler.reserved_slots("bulk") >= slots
        grant = await asyncio.wait_for(scheduler.acquire("bulk"), 1)  # its floor of one
        second = asyncio.create_task(scheduler.acquire("bulk"))
        await settle()
        assert not second.done()
        scheduler.release(grant)
        scheduler.release(await asyncio.wait_for(second, 1))


async def test_on_one_slot_there_is_no_headroom_only_priority() -> None:
    clock = Clock()
    scheduler, _ = make(1, clock=clock)
    await arrive(scheduler, clock, "interactive", 20, every_s=0.5, hold_s=0.4)
    scheduler.release(await asyncio.wait_for(scheduler.acquire("bulk"), 1))


async def test_while_the_lower_lane_yields_a_short_is_predicted_on_the_slots_it_will_have() -> None:
    """Shed the right lane first: longs hold three of four slots and are being shed; the
    measured wait per place says a short waits long, but once the longs are down to their
    floor the shorts have three slots: that is the wait predicted, so it is admitted."""
    clock = Clock()
    scheduler, _ = make(4, interactive={"queue_timeout_s": 5}, bulk={"min_slots": 1}, clock=clock)
    longs = [await scheduler.acquire("bulk") for _ in range(3)]
    held = await scheduler.acquire("interactive")
    interactive = scheduler.lane("interactive")
    interactive.hold_ewma_s = 1.0
    for _ in range(10):
        interactive.wait_per_place.add(3.0)  # measured while the longs held the slots
        interactive.recent_waits.append(4.0)  # over half its deadline: bulk is shed
    queued = [asyncio.create_task(scheduler.acquire("interactive")) for _ in range(2)]
    await settle()
    assert scheduler.pressing_lane("bulk") is interactive
    # Three places at 3 s measured would be 9 s (refused); on 3 slots at 1 s: 1 s.
    assert scheduler.predicted_wait_s("interactive") == pytest.approx(1.0)
    with pytest.raises(Exception) as shed:
        await scheduler.acquire("bulk")
    assert getattr(shed.value, "code", None) == "wait_too_long"
    for grant in longs[1:]:  # the longs end; only the floor's one remains
        scheduler.release(grant)
    await settle()
    assert all(task.done() for task in queued)
    # Nothing is yielding any more: the measured figure applies again.
    assert scheduler.predicted_wait_s("interactive") == pytest.approx(3.0)
    for grant in [longs[0], held, *(task.result() for task in queued)]:
        scheduler.release(grant)
