"""The least wait the work in sight makes (`scheduling/known_wait.py`), and the scheduler's
refusal at arrival when it outlasts the deadline."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import LaneSettings
from gateway.outcomes import WaitTooLong
from gateway.scheduling.known_wait import known_wait_s
from gateway.scheduling.scheduler import Scheduler, WaitNote
from tests.scheduling.test_scheduler import Clock, CountingSlots


def test_a_free_slot_for_each_request_ahead_and_this_one_means_no_wait() -> None:
    assert known_wait_s(2, [9.0], [1.0]) == 0.0


def test_the_request_takes_the_first_slot_to_free_after_those_ahead_took_theirs() -> None:
    # One slot prefilling for 6 s more: the request waits for it.
    assert known_wait_s(0, [6.0], []) == 6.0
    # Two requests ahead, each holding a slot at least 1 s: the first takes the slot
    # free at 2 s (until 3 s), the second the one free at 3 s (until 4 s); this one
    # takes the first again, at 3 s.
    assert known_wait_s(0, [2.0, 3.0], [1.0, 1.0]) == 3.0
    # Three ahead: the third takes the first slot at 3 s (until 4 s); this one 4 s.
    assert known_wait_s(0, [2.0, 3.0], [1.0, 1.0, 1.0]) == 4.0
    # An idle slot goes to the first request ahead; this one waits for the next to free.
    assert known_wait_s(1, [5.0], [2.0]) == 2.0


def test_with_nothing_known_the_wait_is_none_at_all() -> None:
    assert known_wait_s(0, [], []) == 0.0


class PrefillingSlots(CountingSlots):
    """One slot, taken, whose prompt is in prefill for `left_s` more seconds."""

    def __init__(self, left_s: float) -> None:
        super().__init__(0)
        self.left_s = left_s

    def known_wait_s(self, lane: str, ahead: object) -> float:
        return self.left_s


async def arrive(scheduler: Scheduler, deadline_s: float | None = None) -> WaitNote:
    note = WaitNote()
    task = asyncio.create_task(
        scheduler.acquire("only", 10, 10, note=note, client_deadline_s=deadline_s)
    )
    await asyncio.sleep(0)
    if task.done():
        task.result()  # raises the refusal
    task.cancel()
    return note


async def test_a_wait_the_prefill_ahead_makes_longer_than_the_deadline_is_refused_at_once() -> None:
    lane = LaneSettings(name="only", queue_timeout_s=2.0)
    scheduler = Scheduler([lane], {"only": 1}, PrefillingSlots(left_s=7.5), clock=Clock())
    with pytest.raises(WaitTooLong) as refused:
        await arrive(scheduler)
    assert "at least 7.5 s" in refused.value.message
    # Retry-After: when what is left of it would fit in the deadline.
    assert refused.value.retry_after_s == 6


async def test_one_that_fits_waits_and_its_line_says_the_wait_predicted() -> None:
    lane = LaneSettings(name="only", queue_timeout_s=10.0)
    scheduler = Scheduler([lane], {"only": 1}, PrefillingSlots(left_s=7.5), clock=Clock())
    note = await arrive(scheduler)
    assert note.predicted_wait_s == 7.5 and note.deadline_s == 10.0


async def test_a_client_deadline_shorter_than_the_known_wait_is_refused() -> None:
    lane = LaneSettings(name="only", queue_timeout_s=30.0)
    scheduler = Scheduler([lane], {"only": 1}, PrefillingSlots(left_s=4.0), clock=Clock())
    with pytest.raises(WaitTooLong) as refused:
        await arrive(scheduler, deadline_s=1.0)
    assert "your 1 s limit" in refused.value.message


async def test_with_refusal_at_arrival_off_it_waits_its_deadline() -> None:
    lane = LaneSettings(name="only", queue_timeout_s=2.0, reject_predicted_wait=False)
    scheduler = Scheduler([lane], {"only": 1}, PrefillingSlots(left_s=7.5), clock=Clock())
    note = await arrive(scheduler)
    assert note.predicted_wait_s == 7.5


async def test_a_lower_lane_line_that_moved_too_slowly_refuses_the_next_arrival() -> None:
    """Admitted means served: a bulk request joining a line that, under the higher lane's
    pressure, has been served one request in 20 s is refused at arrival, not admitted to
    time out; the top lane is never judged so."""
    from tests.scheduling.test_scheduler import make

    clock = Clock()
    scheduler, _ = make(1, bulk={"queue_timeout_s": 30}, clock=clock)
    held = await scheduler.acquire("interactive")
    waiting = [asyncio.create_task(scheduler.acquire("bulk")) for _ in range(2)]
    await asyncio.sleep(0)
    clock.advance(20.0)
    assert scheduler.own_line_wait_s("interactive") is None
    # Two in line, none served in 20 s: a third waits for at least three of those spans.
    assert scheduler.own_line_wait_s("bulk") == pytest.approx(3 * 20.0)
    with pytest.raises(WaitTooLong) as refused:
        await scheduler.acquire("bulk")
    assert "line has moved" in refused.value.message
    assert refused.value.retry_after_s == 60 - 30  # when it would fit in its 30 s
    scheduler.release(held)
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_a_lane_whose_requests_started_at_once_lately_still_sees_the_prefill_ahead() -> None:
    """Its measured wait per place is 0 (every recent request started at once): that says
    nothing of the 7.5 s prefill holding the one slot now."""
    lane = LaneSettings(name="only", queue_timeout_s=2.0)
    scheduler = Scheduler([lane], {"only": 1}, PrefillingSlots(left_s=7.5), clock=Clock())
    for _ in range(10):
        scheduler.lane("only").wait_per_place.add(0.0)
    assert scheduler.predicted_wait_s("only") == 0.0
    with pytest.raises(WaitTooLong):
        await arrive(scheduler)
