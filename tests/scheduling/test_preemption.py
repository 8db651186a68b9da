"""Preemption of a lower lane's request in prefill (issue #53): who may be preempted, and
the scheduler's part: the victim's cancel called, its slot back through `requeue`, its
request at the head of its line with its count, and the bounds that keep it from being
preempted forever."""

from __future__ import annotations

import asyncio

import pytest

from gateway.outcomes import Refusal
from gateway.scheduling.preemption import InPrefill, LaneRule, may_preempt, victims
from tests.scheduling.test_scheduler import Clock, make, settle

RULES = {
    "interactive": LaneRule(0, deadline_s=5.0, promote_after_s=None),
    "standard": LaneRule(1, deadline_s=30.0, promote_after_s=10.0),
    "bulk": LaneRule(2, deadline_s=30.0, promote_after_s=10.0),
}


def in_prefill(lane: str = "bulk", *, engine: str = "a", enqueued: float = 0.0,
               first_sent: float = 0.0, sent: float = 0.0, preemptions: int = 0) -> InPrefill:  # fmt: skip
    return InPrefill(lane, engine, enqueued, first_sent, sent, preemptions, lambda: None)


def test_a_request_is_preempted_within_its_count_age_deadline_and_while_its_lane_is_quiet() -> None:
    rule = RULES["bulk"]
    assert may_preempt(in_prefill(), rule, now=1.0, max_per_request=2)
    assert not may_preempt(in_prefill(preemptions=2), rule, now=1.0, max_per_request=2)
    # Held back by preemptions for its lane's promotion age (from its first send): never more.
    assert not may_preempt(in_prefill(first_sent=0.0), rule, now=10.0, max_per_request=2)
    assert may_preempt(in_prefill(enqueued=0.0, first_sent=9.0), rule, now=10.0, max_per_request=2)
    # Four fifths of its queue deadline spent since its arrival: back in line it would
    # risk the rest.
    assert may_preempt(in_prefill(first_sent=23.0), rule, now=23.5, max_per_request=2)
    assert not may_preempt(in_prefill(first_sent=23.0), rule, now=24.5, max_per_request=2)
    # Its lane refused an arrival within one of its deadlines: no engine time to spare.
    shedding = LaneRule(2, deadline_s=30.0, promote_after_s=10.0, refused_ago_s=29.0)
    assert not may_preempt(in_prefill(), shedding, now=1.0, max_per_request=2)
    quiet_again = LaneRule(2, deadline_s=30.0, promote_after_s=10.0, refused_ago_s=31.0)
    assert may_preempt(in_prefill(), quiet_again, now=1.0, max_per_request=2)
    unpreemptible = in_prefill()
    unpreemptible.cancel = None
    assert not may_preempt(unpreemptible, rule, now=1.0, max_per_request=2)


def test_victims_are_of_lower_lanes_on_the_engine_lowest_lane_and_latest_sent_first() -> None:
    older = in_prefill("bulk", sent=1.0)
    newer = in_prefill("bulk", sent=2.0)
    middle = in_prefill("standard", sent=3.0)
    elsewhere = in_prefill("bulk", engine="b", sent=2.5)
    short = in_prefill("interactive", sent=2.0)
    found = victims([older, newer, middle, elsewhere, short], RULES, above_rank=0, now=4.0,
                    max_per_request=2, engine="a")  # fmt: skip
    assert found == [newer, older, middle]
    # A request of the middle lane preempts only the lane below it; any engine when unsaid.
    found = victims([older, middle, elsewhere], RULES, above_rank=1, now=4.0, max_per_request=2)
    assert found == [elsewhere, older]


async def test_a_short_request_sent_to_an_engine_preempts_the_long_prompt_in_prefill_there() -> (
    None
):
    clock = Clock()
    scheduler, source = make(2, clock=clock)
    scheduler.max_preemptions = 2
    long_grant = await scheduler.acquire("bulk", 3000, 100)
    cancelled: list[str] = []
    scheduler.sent(long_grant, "engine-a", lambda: cancelled.append("long"))
    clock.advance(0.5)
    short_grant = await scheduler.acquire("interactive", 50, 10)
    scheduler.sent(short_grant, "engine-b")  # another engine: the long one delays nothing there
    assert cancelled == []
    scheduler.sent(short_grant, "engine-a")
    assert cancelled == ["long"]
    # The preempted request goes back to the head of its line; its slot is free meanwhile.
    again = asyncio.create_task(
        scheduler.requeue(long_grant, 3000, 100, deadline_s=30.0, preempted=True)
    )
    await settle()
    assert again.done()  # a free slot: it is sent again at once, behind the short one
    regrant = again.result()
    assert regrant.preemptions == 1 and regrant.first_sent_at == long_grant.first_sent_at
    assert source.free == 0
    # Its first token: it is past its prefill and may no longer be preempted.
    scheduler.sent(regrant, "engine-a", lambda: cancelled.append("again"))
    scheduler.prefill_done(regrant)
    scheduler.sent(short_grant, "engine-a")
    assert cancelled == ["long"]


async def test_a_waiting_short_request_preempts_one_long_prompt_for_its_slot() -> None:
    clock = Clock()
    scheduler, source = make(2, clock=clock)
    scheduler.max_preemptions = 2
    longs = [await scheduler.acquire("bulk", 3000, 100) for _ in range(2)]
    cancelled: list[int] = []
    for index, grant in enumerate(longs):
        scheduler.sent(grant, "engine-a", lambda index=index: cancelled.append(index))
        clock.advance(0.1)
    waiting = asyncio.create_task(scheduler.acquire("interactive", 50, 10))
    await settle()
    assert cancelled == [1]  # one slot wanted: the latest sent, not both
    requeued = asyncio.create_task(
        scheduler.requeue(longs[1], 3000, 100, deadline_s=30.0, preempted=True)
    )
    await settle()
    assert waiting.done() and not requeued.done()  # the freed slot went to the short one
    scheduler.release(waiting.result())
    await settle()
    assert requeued.done() and requeued.result().preemptions == 1
    assert source.free == 0


async def test_a_steady_stream_of_shorts_preempts_the_same_long_request_at_most_its_count() -> None:
    clock = Clock()
    scheduler, _ = make(4, clock=clock)
    scheduler.max_preemptions = 2
    grant = await scheduler.acquire("bulk", 3000, 100)
    preempted = 0
    for _ in range(10):
        fired: list[bool] = []
        scheduler.sent(grant, "engine-a", lambda fired=fired: fired.append(True))
        short = await scheduler.acquire("interactive", 50, 10)
        scheduler.sent(short, "engine-a")
        scheduler.release(short)
        clock.advance(0.2)
        if not fired:
            break
        preempted += 1
        grant = await scheduler.requeue(grant, 3000, 100, deadline_s=30.0, preempted=True)
    assert preempted == 2
    scheduler.release(grant)


async def test_without_max_preemptions_nothing_is_preempted() -> None:
    scheduler, _ = make(2)
    long_grant = await scheduler.acquire("bulk", 3000, 100)
    cancelled: list[bool] = []
    scheduler.sent(long_grant, "engine-a", lambda: cancelled.append(True))
    short = await scheduler.acquire("interactive", 50, 10)
    scheduler.sent(short, "engine-a")
    assert cancelled == []


async def test_a_preempted_request_keeps_its_queue_deadline_from_its_arrival() -> None:
    clock = Clock()
    scheduler, _ = make(1, clock=clock)
    held = await scheduler.acquire("interactive", 50, 10)  # the one slot, taken
    grant = asyncio.create_task(scheduler.acquire("bulk", 3000, 100))
    clock.advance(1.0)
    scheduler.release(held)
    await settle()
    long_grant = grant.result()
    clock.advance(5.0)  # the lane's deadline (5 s) has passed since its arrival
    with pytest.raises(Refusal) as refused:
        await scheduler.requeue(long_grant, 3000, 100, deadline_s=5.0, preempted=True)
    assert refused.value.code == "queue_timeout"


async def test_a_lane_whose_arrivals_are_refused_is_not_preempted() -> None:
    """Its requests are refused for want of engine time: none to give away."""
    clock = Clock()
    scheduler, _ = make(2, bulk={"max_queue_depth": 1}, clock=clock)
    scheduler.max_preemptions = 4
    long_grant = await scheduler.acquire("bulk", 3000, 100)
    cancelled: list[bool] = []
    scheduler.sent(long_grant, "engine-a", lambda: cancelled.append(True))
    other = await scheduler.acquire("bulk", 3000, 100)
    queued = asyncio.create_task(scheduler.acquire("bulk", 3000, 100))
    await settle()
    with pytest.raises(Refusal):  # the line is full: refused at arrival
        await scheduler.acquire("bulk", 3000, 100)
    short = asyncio.create_task(scheduler.acquire("interactive", 50, 10))
    await settle()
    assert cancelled == []  # neither for a slot ...
    scheduler.release(other)
    await settle()
    scheduler.sent(short.result(), "engine-a")
    assert cancelled == []  # ... nor behind its prefill
    queued.cancel()
