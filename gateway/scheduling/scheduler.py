"""Lane queues and backend slots: who runs next, who waits, who is refused at once.

A free slot goes to the oldest request of the highest-priority lane that may
take one; a request queued longer than its lane's `promote_after_s` goes before
all of them (oldest promoted first) while its lane runs fewer than
`promoted_slots` requests, so long requests are never starved, yet a lane that
is already progressing does not take slots from short requests waiting. A lane
never holds more than its slot limit, so long requests can never fill every
slot. Requests that would wait too long are refused at the door (429) instead
of rotting in memory, and those that did wait too long get 503: a client with a
fast error can retry elsewhere, a client with a 60 s timeout cannot.

The scheduler knows nothing about HTTP or backends: a `SlotSource` hands out
the actual slot (a backend) and says when none is free for a lane.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.config import LaneSettings
from gateway.outcomes import QueueFull, QueueTimeout, Refusal, WaitTooLong

#: Weight of the newest slot-hold sample in the per-lane moving average.
HOLD_EWMA_ALPHA = 0.2
MAX_RETRY_AFTER_S = 60


class SlotSource(Protocol):
    """Where slots come from (the backend pool)."""

    def try_take(
        self, lane: str, prompt_tokens: int, output_tokens: int = 0, exclude: Any = None
    ) -> Any | None:
        """A slot for a request of `lane` (not on the backend of slot `exclude`), or None."""

    def prefill_done(self, slot: Any) -> None:
        """The request's prompt is no longer in prefill (its first byte came back)."""

    def give_back(self, slot: Any) -> None:
        """Return a slot taken with try_take."""


@dataclass(slots=True)
class Grant:
    """A held slot. Release it exactly once, through `Scheduler.release`."""

    lane: str
    slot: Any
    queued_s: float
    granted_at: float
    released: bool = False


@dataclass(slots=True)
class _Waiter:
    enqueued_at: float
    prompt_tokens: int
    output_tokens: int
    future: asyncio.Future[Grant]
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class LaneState:
    settings: LaneSettings
    slot_limit: int
    queue: deque[_Waiter] = field(default_factory=deque)
    in_flight: int = 0
    #: Moving average of how long a request of this lane holds its slot.
    hold_ewma_s: float | None = None

    @property
    def name(self) -> str:
        return self.settings.name


class Scheduler:
    """Per-lane FIFO queues in front of a shared pool of slots."""

    def __init__(
        self,
        lanes: Sequence[LaneSettings],
        slot_limits: dict[str, int],
        source: SlotSource,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._lanes = [LaneState(lane, slot_limits[lane.name]) for lane in lanes]
        self._by_name = {lane.name: lane for lane in self._lanes}
        self._source = source
        #: The one clock of every estimate (waits, hold times, promotion ages). Only the
        #: queue timeout is a loop timer: it must fire, not just be computed.
        self._now = clock

    @property
    def lanes(self) -> list[LaneState]:
        return self._lanes

    def lane(self, name: str) -> LaneState:
        return self._by_name[name]

    def predicted_wait_s(self, name: str) -> float | None:
        """A lower bound on the wait of a request arriving now: None when unknown.

        It counts only this lane's own queue against its own slots, ignoring
        higher lanes that may cut in, so it refuses only requests that surely
        cannot make their deadline.
        """
        lane = self._by_name[name]
        if not lane.queue and lane.in_flight < lane.slot_limit:
            return 0.0
        if lane.hold_ewma_s is None:
            return None
        return (len(lane.queue) + 1) * lane.hold_ewma_s / lane.slot_limit

    def _retry_after(self, lane: LaneState) -> int:
        wait = self.predicted_wait_s(lane.name)
        if wait is None:
            wait = lane.hold_ewma_s or 1.0
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(wait)))

    async def acquire(self, name: str, prompt_tokens: int = 0, output_tokens: int = 0) -> Grant:
        """Wait for a slot in lane `name`; a Refusal when refused or timed out.

        Cancelling the caller (client went away) leaves the queue at once.
        """
        lane = self._by_name[name]
        settings = lane.settings
        now = self._now()
        if len(lane.queue) >= settings.max_queue_depth and (
            lane.queue or lane.in_flight >= lane.slot_limit
        ):
            raise QueueFull(
                f"The '{name}' lane's queue is full ({settings.max_queue_depth} waiting). "
                "Retry after the delay in Retry-After.",
                retry_after_s=self._retry_after(lane),
            )
        if settings.reject_predicted_wait:
            predicted = self.predicted_wait_s(name)
            if predicted is not None and predicted > settings.queue_timeout_s:
                raise WaitTooLong(
                    f"The '{name}' lane would make this request wait about {predicted:.0f} s, "
                    f"over its {settings.queue_timeout_s:g} s limit.",
                    retry_after_s=self._retry_after(lane),
                )
        if lane.in_flight < lane.slot_limit and not any(other.queue for other in self._lanes):
            # Nobody waits anywhere: what dispatching would do, without queueing a future.
            slot = self._source.try_take(name, prompt_tokens, output_tokens)
            if slot is not None:
                lane.in_flight += 1
                return Grant(name, slot, 0.0, now)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(now, prompt_tokens, output_tokens, loop.create_future())
        lane.queue.append(waiter)
        self._dispatch()
        if waiter.future.done():
            return waiter.future.result()
        waiter.timer = loop.call_later(settings.queue_timeout_s, self._expire, lane, waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._abandon(lane, waiter)
            raise
        finally:
            waiter.timer.cancel()

    def _expire(self, lane: LaneState, waiter: _Waiter) -> None:
        if waiter.future.done():
            return
        self._remove(lane, waiter)
        waiter.future.set_exception(
            QueueTimeout(
                f"Waited {lane.settings.queue_timeout_s:g} s in the '{lane.name}' lane's queue "
                "without getting a backend slot.",
                retry_after_s=self._retry_after(lane),
            )
        )

    def _abandon(self, lane: LaneState, waiter: _Waiter) -> None:
        """The waiting client went away: leave the queue, or give back a slot just granted."""
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            self.release(future.result())
        else:
            self._remove(lane, waiter)

    def _remove(self, lane: LaneState, waiter: _Waiter) -> None:
        try:
            lane.queue.remove(waiter)
        except ValueError:
            pass

    def release(self, grant: Grant) -> None:
        """Give the slot back and hand it to the next request in line."""
        if grant.released:
            return
        grant.released = True
        lane = self._by_name[grant.lane]
        lane.in_flight -= 1
        held = self._now() - grant.granted_at
        if lane.hold_ewma_s is None:
            lane.hold_ewma_s = held
        else:
            lane.hold_ewma_s += HOLD_EWMA_ALPHA * (held - lane.hold_ewma_s)
        self._source.give_back(grant.slot)
        self._dispatch()

    def prefill_done(self, grant: Grant) -> None:
        """The backend started answering: its prefill budget may admit the next prompt."""
        if not grant.released:
            self._source.prefill_done(grant.slot)
            self._dispatch()

    def reassign(self, grant: Grant, prompt_tokens: int, output_tokens: int) -> bool:
        """Move a held grant to a slot on another backend at once (a retry); False if none."""
        slot = self._source.try_take(grant.lane, prompt_tokens, output_tokens, exclude=grant.slot)
        if slot is None:
            return False
        self._source.give_back(grant.slot)
        grant.slot = slot
        self._dispatch()
        return True

    def fail_waiting(self, error: Refusal) -> int:
        """Answer every queued request with `error` (shutdown); returns how many."""
        failed = 0
        for lane in self._lanes:
            while lane.queue:
                waiter = lane.queue.popleft()
                if not waiter.future.done():
                    waiter.future.set_exception(error)
                    failed += 1
        return failed

    def notify_capacity(self) -> None:
        """Slots appeared outside of `release` (a backend came back): serve the queues."""
        self._dispatch()

    def _dispatch(self) -> None:
        while self._grant_one():
            pass

    def _grant_one(self) -> bool:
        now = self._now()
        ready = []
        for lane in self._lanes:
            queue = lane.queue
            while queue and queue[0].future.done():  # cancelled, not yet cleaned up
                queue.popleft()
            if queue and lane.in_flight < lane.slot_limit:
                ready.append(lane)
        if not ready:
            return False
        promoted = sorted(
            (
                lane
                for lane in ready
                if lane.settings.promote_after_s is not None
                and lane.in_flight < lane.settings.promoted_slots
                and now - lane.queue[0].enqueued_at >= lane.settings.promote_after_s
            ),
            key=lambda lane: lane.queue[0].enqueued_at,
        )
        for lane in promoted + [lane for lane in ready if lane not in promoted]:
            head = lane.queue[0]
            slot = self._source.try_take(lane.name, head.prompt_tokens, head.output_tokens)
            if slot is None:
                continue
            waiter = lane.queue.popleft()
            lane.in_flight += 1
            waiter.future.set_result(Grant(lane.name, slot, now - waiter.enqueued_at, now))
            return True
        return False
