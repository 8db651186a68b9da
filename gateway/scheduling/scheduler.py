"""Lane queues and backend slots: who runs next, who waits, who is refused at once.

A free slot goes to the oldest request of the highest-priority lane that may
take one; a request queued longer than its lane's `promote_after_s` goes before
all of them (oldest promoted first) while its lane runs fewer than
`promoted_slots` requests, so long requests are never starved, yet a lane that
is already progressing does not take slots from short requests waiting.

The split of slots is work-conserving: a lane with no competition may use every
slot (up to its own `max_slot_share`), but while a higher lane that shares its
backends has requests waiting, a lower lane gets no new slot; a slot it just
released it keeps only to stay at its `min_slots` floor. So it gives slots back
as its requests end, and nothing starves.

Requests that would wait too long are refused at the door (429) instead of
rotting in memory, and those that did wait too long get 503: a client with a
fast error can retry elsewhere, a client with a 60 s timeout cannot. While a
higher lane's recent requests waited over half their deadline, the lanes
below it are refused at arrival: their work is what overloads the
backends, so the lowest lane is shed first and a short request is refused
only when short requests alone exceed what the backends serve. The wait is
predicted from the request's place in line (its own lane's queue and those of
the higher lanes that go first) times the lane's measured wait per place, a
median over recent requests, so the prediction is calibrated against what
queueing really cost, promotions, floors and prefill budgets included. A
request's deadline is its lane's (which the app may raise to fit a slow
engine) or the client's own, whichever is shorter.

The scheduler knows nothing about HTTP or backends: a `SlotSource` hands out
the actual slot (a backend) and says when none is free for a lane. It reads
one clock, passed in, and keeps no other state than its queues and figures.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.config import LaneSettings
from gateway.outcomes import QueueFull, QueueTimeout, Refusal, WaitTooLong
from gateway.scheduling.learning import WindowedMedian

#: Weight of the newest slot-hold sample in the per-lane moving average.
HOLD_EWMA_ALPHA = 0.2
MAX_RETRY_AFTER_S = 60
#: A request is refused at arrival when its predicted wait is over this share of its
#: deadline: the prediction is a median, and a request admitted at the edge of its
#: deadline would as likely time out after waiting as make it.
REFUSE_AT_DEADLINE_SHARE = 0.8
#: A lower lane is refused while a higher lane's arrivals are predicted to wait over
#: this share of their deadline: the lowest lane is shed first, before any request of
#: the higher lane is refused (at REFUSE_AT_DEADLINE_SHARE).
SHED_LOWER_AT = 0.5
#: Recent waits per lane that tell whether it is under pressure (their median).
PRESSURE_SAMPLES = 8
#: Samples of the wait per place in line before they replace the structural guess.
WAIT_SAMPLES_NEEDED = 5
#: Requests of a lane looked at past a deferred head (each costs the source one try).
LOOKAHEAD = 16
#: Recent dispatches per lane from which its drain rate (requests leaving the line per
#: second) is measured, for Retry-After.
DRAIN_SAMPLES = 32


@dataclass(slots=True, frozen=True)
class Deferred:
    """What a slot source answers when it has a slot, but this request had better wait a
    little for another one (the backend that has its prompt cached, now full): requests
    behind it in line may take the free slot; it is asked again within `retry_in_s`."""

    retry_in_s: float


class SlotSource(Protocol):
    """Where slots come from (the backend pool)."""

    def try_take(
        self,
        lane: str,
        prompt_tokens: int,
        output_tokens: int = 0,
        exclude: Any = None,
        hint: Any = None,
        waited_s: float | None = None,
        ahead: int = 0,
    ) -> Any | None:
        """A slot for a request of `lane` (not on the backend of slot `exclude`), None when
        there is none, or `Deferred` when this request should wait for a better one.

        `hint` is the request's routing hint, passed through untouched; `waited_s` how
        long it has waited in line (None: it may not wait, a retry), `ahead` how many
        requests go before it (its lane's and the higher lanes')."""

    def has_free_slot(self, lane: str) -> bool:
        """Some backend of `lane` has a free slot now (with [redis], counting the slots the
        other replicas hold)."""

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
class WaitNote:
    """What admission to the queue decided for one request, for its log line."""

    #: The wait predicted at arrival (None: nothing to go on yet).
    predicted_wait_s: float | None = None
    #: The queue deadline in force: the lane's, or the client's when shorter.
    deadline_s: float | None = None


@dataclass(slots=True)
class _Waiter:
    enqueued_at: float
    prompt_tokens: int
    output_tokens: int
    future: asyncio.Future[Grant]
    #: Its place in line at arrival: requests ahead of it plus one.
    position: int = 1
    timer: asyncio.TimerHandle | None = None
    #: What the slot source may route it by (its prompt's prefix, its session).
    hint: Any = None


@dataclass(slots=True)
class LaneState:
    settings: LaneSettings
    slot_limit: int
    queue: deque[_Waiter] = field(default_factory=deque)
    in_flight: int = 0
    #: Moving average of how long a request of this lane holds its slot.
    hold_ewma_s: float | None = None
    #: The queue deadline in force for this lane (queue_timeout_s, or raised to fit a
    #: slow engine by the app).
    deadline_s: float = 0.0
    #: Measured seconds of waiting per place in line (median of recent requests).
    wait_per_place: WindowedMedian = field(
        default_factory=lambda: WindowedMedian(0.0, min_samples=WAIT_SAMPLES_NEEDED)
    )
    #: Lanes that go before this one and share some of its backends.
    higher: list[LaneState] = field(default_factory=list)
    #: Its latest requests' queue waits (seconds; a timed-out one counts its deadline).
    recent_waits: deque[float] = field(default_factory=lambda: deque(maxlen=PRESSURE_SAMPLES))
    #: When its latest requests got their slots (the drain rate's samples).
    dispatched_at: deque[float] = field(default_factory=lambda: deque(maxlen=DRAIN_SAMPLES))
    #: Its queue had requests at the last look (for `Scheduler.on_waiting`).
    had_waiters: bool = False
    #: Gets no new slot while set (with [redis]: a higher lane has requests waiting in
    #: another replica of the fleet).
    held_back: bool = False

    @property
    def name(self) -> str:
        return self.settings.name

    def __post_init__(self) -> None:
        if not self.deadline_s:
            self.deadline_s = self.settings.queue_timeout_s


class Scheduler:
    """Per-lane FIFO queues in front of a shared pool of slots."""

    def __init__(
        self,
        lanes: Sequence[LaneSettings],
        slot_limits: dict[str, int],
        source: SlotSource,
        clock: Callable[[], float] = time.perf_counter,
        competes: Callable[[str, str], bool] | None = None,
    ) -> None:
        self._lanes = [LaneState(lane, slot_limits[lane.name]) for lane in lanes]
        self._by_name = {lane.name: lane for lane in self._lanes}
        for index, lane in enumerate(self._lanes):
            lane.higher = [
                other
                for other in self._lanes[:index]
                if competes is None or competes(lane.name, other.name)
            ]
        self._source = source
        #: The one clock of every estimate (waits, hold times, promotion ages). Only the
        #: queue timeout and the end of a deferral are loop timers: they must fire.
        self._now = clock
        self._deferral_timer: asyncio.TimerHandle | None = None
        #: Told when a lane's queue fills (True) or empties (False): with [redis], the
        #: other replicas hold their lower lanes back meanwhile.
        self.on_waiting: Callable[[str, bool], None] | None = None

    @property
    def lanes(self) -> list[LaneState]:
        return self._lanes

    def lane(self, name: str) -> LaneState:
        return self._by_name[name]

    def set_slot_limit(self, name: str, slots: int) -> None:
        """The lane's backends changed size (learned from the engine): serve the queues."""
        self._by_name[name].slot_limit = max(1, slots)
        self._dispatch()

    def hold_back(self, names: set[str]) -> None:
        """Lanes that get no new slot from now on (the others again may, at once)."""
        released = False
        for lane in self._lanes:
            held = lane.name in names
            released |= lane.held_back and not held
            lane.held_back = held
        if released:
            self._dispatch()

    def _note_queue(self, lane: LaneState) -> None:
        """Tell `on_waiting` when the lane's queue went from empty to not, or back."""
        waiting = bool(lane.queue)
        if waiting != lane.had_waiters:
            lane.had_waiters = waiting
            if self.on_waiting is not None:
                self.on_waiting(lane.name, waiting)

    def set_deadline(self, name: str, deadline_s: float) -> None:
        """The lane's queue deadline in force from now on (new arrivals)."""
        self._by_name[name].deadline_s = deadline_s

    # -- prediction ------------------------------------------------------------------

    def _place_in_line(self, lane: LaneState) -> int:
        """Requests that go before one arriving now in `lane`, plus one."""
        return len(lane.queue) + sum(len(other.queue) for other in lane.higher) + 1

    def _starts_now(self, lane: LaneState) -> bool:
        return (
            not lane.queue
            and lane.in_flight < lane.slot_limit
            and not any(other.queue for other in lane.higher)
            and self._source.has_free_slot(lane.name)
        )

    def predicted_wait_s(self, name: str) -> float | None:
        """The wait of a request arriving now in lane `name`; None when unknown.

        Its place in line times the lane's measured wait per place; before enough
        requests have waited, the lane's slot hold time over its slots per place.
        """
        lane = self._by_name[name]
        if self._starts_now(lane):
            return 0.0
        place = self._place_in_line(lane)
        if lane.wait_per_place.learned:
            return place * lane.wait_per_place.value
        if lane.hold_ewma_s is None:
            return None
        return place * lane.hold_ewma_s / lane.slot_limit

    def pressing_lane(self, name: str) -> LaneState | None:
        """A higher lane sharing backends with `name` whose recent requests waited (the
        median of the last few) over `SHED_LOWER_AT` of their deadline: while it is,
        `name` is shed. Sustained pressure, not one arrival's bad moment: a single long
        prefill in progress must not turn lower-lane requests away."""
        for other in self._by_name[name].higher:
            waits = other.recent_waits
            if len(waits) >= PRESSURE_SAMPLES and (
                statistics.median(waits) > SHED_LOWER_AT * other.deadline_s
            ):
                return other
        return None

    def drain_rate(self, name: str) -> float | None:
        """Requests per second leaving the line of lane `name` (its own dispatches and
        those of the higher lanes that go first), over their recent dispatches; it falls
        while nothing is dispatched. None before two dispatches."""
        now = self._now()
        rate, measured = 0.0, False
        lane = self._by_name[name]
        for member in (lane, *lane.higher):
            times = member.dispatched_at
            if len(times) >= 2 and now > times[0]:
                rate += (len(times) - 1) / (now - times[0])
                measured = True
        return rate if measured else None

    def _retry_after(self, lane: LaneState, beyond_s: float = 0.0) -> int:
        """Seconds until a retry may fit: the time the line ahead takes to drain at its
        measured rate, less `beyond_s` (the wait a request may have); before a rate is
        measured, the predicted wait."""
        rate = self.drain_rate(lane.name)
        if rate:
            wait = self._place_in_line(lane) / rate
        else:
            wait = self.predicted_wait_s(lane.name) or lane.hold_ewma_s or 1.0
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(wait - beyond_s)))

    def deadline_for(self, name: str, client_deadline_s: float | None = None) -> float:
        """The queue deadline of a request of lane `name`: the lane's or the client's."""
        lane_deadline = self._by_name[name].deadline_s
        if client_deadline_s is None:
            return lane_deadline
        return max(0.0, min(lane_deadline, client_deadline_s))

    # -- the queue -------------------------------------------------------------------

    async def acquire(
        self,
        name: str,
        prompt_tokens: int = 0,
        output_tokens: int = 0,
        *,
        client_deadline_s: float | None = None,
        note: WaitNote | None = None,
        hint: Any = None,
    ) -> Grant:
        """Wait for a slot in lane `name`; a Refusal when refused or timed out.

        `client_deadline_s`: how long the client lets this request wait in the queue
        (from its own deadline); the lane's deadline applies when it is shorter.
        Cancelling the caller (client went away) leaves the queue at once.
        """
        lane = self._by_name[name]
        settings = lane.settings
        now = self._now()
        deadline = self.deadline_for(name, client_deadline_s)
        predicted = self.predicted_wait_s(name)
        if note is not None:
            note.predicted_wait_s, note.deadline_s = predicted, deadline
        if len(lane.queue) >= settings.max_queue_depth and (
            lane.queue or lane.in_flight >= lane.slot_limit
        ):
            raise QueueFull(
                f"The '{name}' lane's queue is full ({settings.max_queue_depth} waiting). "
                "Retry after the delay in Retry-After.",
                retry_after_s=self._retry_after(lane),
            )
        pressing = self.pressing_lane(name) if settings.reject_predicted_wait else None
        if pressing is not None:
            raise WaitTooLong(
                f"The '{name}' lane is shed while the '{pressing.name}' lane's requests wait "
                "close to their deadline (the backends are full with higher-priority work).",
                retry_after_s=self._retry_after(pressing),
            )
        if (
            settings.reject_predicted_wait
            and predicted is not None
            and predicted > REFUSE_AT_DEADLINE_SHARE * deadline
        ):
            whose = "your" if deadline < lane.deadline_s else f"the '{name}' lane's"
            raise WaitTooLong(
                f"The '{name}' lane would make this request wait about {predicted:.1f} s, "
                f"too close to {whose} {deadline:.3g} s limit.",
                retry_after_s=self._retry_after(lane, REFUSE_AT_DEADLINE_SHARE * lane.deadline_s),
            )
        if (
            lane.in_flight < lane.slot_limit
            and not lane.held_back
            and not any(other.queue for other in self._lanes)
        ):
            # Nobody waits anywhere: what dispatching would do, without queueing a future.
            slot = self._source.try_take(
                name, prompt_tokens, output_tokens, hint=hint, waited_s=0.0
            )
            if slot is not None and not isinstance(slot, Deferred):
                lane.in_flight += 1
                lane.recent_waits.append(0.0)
                lane.dispatched_at.append(now)
                return Grant(name, slot, 0.0, now)
        waiter = _Waiter(
            now,
            prompt_tokens,
            output_tokens,
            asyncio.get_running_loop().create_future(),
            position=self._place_in_line(lane),
            hint=hint,
        )
        lane.queue.append(waiter)
        self._note_queue(lane)
        return await self._wait(lane, waiter, deadline, deadline)

    async def requeue(
        self,
        grant: Grant,
        prompt_tokens: int,
        output_tokens: int,
        *,
        deadline_s: float,
        hint: Any = None,
    ) -> Grant:
        """The slot of `grant` turned out unusable (with [redis]: the other replicas hold
        that backend's slots): give it back and wait again at the front of the line, with
        the time waited so far counted against `deadline_s`, the request's queue deadline.
        No arrival refusal applies: the request was admitted already."""
        lane = self._by_name[grant.lane]
        grant.released = True
        lane.in_flight -= 1
        self._source.give_back(grant.slot)
        enqueued_at = grant.granted_at - grant.queued_s
        left = deadline_s - (self._now() - enqueued_at)
        waiter = _Waiter(
            enqueued_at,
            prompt_tokens,
            output_tokens,
            asyncio.get_running_loop().create_future(),
            hint=hint,
        )
        lane.queue.appendleft(waiter)
        self._note_queue(lane)
        if left <= 0:
            self._expire(lane, waiter, deadline_s)
            return waiter.future.result()  # raises the QueueTimeout
        return await self._wait(lane, waiter, left, deadline_s)

    async def _wait(
        self, lane: LaneState, waiter: _Waiter, timeout_s: float, deadline_s: float
    ) -> Grant:
        """Serve the queues; wait for `waiter`'s slot at most `timeout_s` (QueueTimeout)."""
        self._dispatch()
        if waiter.future.done():
            return waiter.future.result()
        loop = asyncio.get_running_loop()
        waiter.timer = loop.call_later(timeout_s, self._expire, lane, waiter, deadline_s)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._abandon(lane, waiter)
            raise
        finally:
            waiter.timer.cancel()

    def _expire(self, lane: LaneState, waiter: _Waiter, deadline: float) -> None:
        if waiter.future.done():
            return
        self._remove(lane, waiter)
        # It would have waited at least this long: a (low) sample all the same.
        lane.wait_per_place.add(deadline / waiter.position)
        lane.recent_waits.append(deadline)
        waiter.future.set_exception(
            QueueTimeout(
                f"Waited {deadline:.3g} s in the '{lane.name}' lane's queue "
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
        self._note_queue(lane)

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
        self._dispatch(released=lane)

    def prefill_done(self, grant: Grant) -> None:
        """The backend started answering: its prefill budget may admit the next prompt."""
        if not grant.released:
            self._source.prefill_done(grant.slot)
            self._dispatch()

    def reassign(
        self, grant: Grant, prompt_tokens: int, output_tokens: int, hint: Any = None
    ) -> bool:
        """Move a held grant to a slot on another backend at once (a retry); False if none."""
        slot = self._source.try_take(
            grant.lane, prompt_tokens, output_tokens, exclude=grant.slot, hint=hint
        )
        if slot is None or isinstance(slot, Deferred):
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
            self._note_queue(lane)
        return failed

    def notify_capacity(self) -> None:
        """Slots appeared outside of `release` (a backend came back): serve the queues."""
        self._dispatch()

    def _dispatch(self, released: LaneState | None = None) -> None:
        if released is not None and not self._grant_one(keeping=released):
            return
        while self._grant_one():
            pass

    def _grant_one(self, keeping: LaneState | None = None) -> bool:
        """Grant one slot; `keeping`: the lane that just released one (it may keep it)."""
        now = self._now()
        ready = []
        for lane in self._lanes:
            queue = lane.queue
            while queue and queue[0].future.done():  # cancelled, not yet cleaned up
                queue.popleft()
                self._note_queue(lane)
            if queue and lane.in_flight < lane.slot_limit and not lane.held_back:
                ready.append(lane)
        if not ready:
            return False
        # Work-conserving split: under a waiting higher lane, a lower one gets no new slot;
        # the slot it just gave back it keeps only to stay at its floor (nothing starves).
        pressed = [lane for lane in ready if any(other in ready for other in lane.higher)]
        kept = [
            lane for lane in pressed if lane is keeping and lane.in_flight < lane.settings.min_slots
        ]
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
        order = promoted + [lane for lane in kept if lane not in promoted]
        order += [lane for lane in ready if lane not in pressed and lane not in order]
        for lane in order:
            waiter, slot = self._first_served(lane, now)
            if waiter is None:
                continue
            lane.queue.remove(waiter)
            self._note_queue(lane)
            lane.in_flight += 1
            waited = now - waiter.enqueued_at
            lane.wait_per_place.add(waited / waiter.position)
            lane.recent_waits.append(waited)
            lane.dispatched_at.append(now)
            waiter.future.set_result(Grant(lane.name, slot, waited, now))
            return True
        return False

    def _first_served(self, lane: LaneState, now: float) -> tuple[_Waiter | None, Any]:
        """The lane's first request in line that gets a slot now, and the slot.

        The head, unless the source defers it (it waits for the backend holding its
        prompt's cache): then the requests behind it, up to LOOKAHEAD of them, may take
        the free slot, and the queues are served again when the first deferral ends.
        """
        retry_in: float | None = None
        higher = sum(len(other.queue) for other in lane.higher)
        for index, waiter in enumerate(lane.queue):
            if index == LOOKAHEAD:
                break
            if waiter.future.done():  # cancelled, not yet cleaned up
                continue
            slot = self._source.try_take(
                lane.name,
                waiter.prompt_tokens,
                waiter.output_tokens,
                hint=waiter.hint,
                waited_s=now - waiter.enqueued_at,
                ahead=higher + index,
            )
            if slot is None:
                break  # no slot for this lane at all
            if not isinstance(slot, Deferred):
                return waiter, slot
            retry_in = slot.retry_in_s if retry_in is None else min(retry_in, slot.retry_in_s)
        if retry_in is not None:
            self._serve_again_in(retry_in)
        return None, None

    def _serve_again_in(self, seconds: float) -> None:
        """Serve the queues once more in `seconds` (the earliest deferral's end)."""
        loop = asyncio.get_running_loop()
        when = loop.time() + max(0.001, seconds)
        timer = self._deferral_timer
        if timer is not None and not timer.cancelled() and timer.when() <= when:
            return
        if timer is not None:
            timer.cancel()
        self._deferral_timer = loop.call_at(when, self._deferral_ended)

    def _deferral_ended(self) -> None:
        self._deferral_timer = None
        self._dispatch()
