"""Lane queues and backend slots: who runs next, who waits, who is refused at once.

A free slot goes to the oldest request of the highest-priority lane that may
take one; a request queued longer than its lane's `promote_after_s` goes before
the requests that came since (those already waiting then go first) while its
lane runs fewer than `promoted_slots` requests, so long requests are never
starved, yet a lane that is already progressing does not take slots from short
requests waiting.

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
queueing really cost, promotions, floors and prefill budgets included. Beside
it, the wait the work in sight makes at least (`known_wait.py`: the prefills in
flight ahead of it) refuses at once a request that cannot make its deadline
whatever happens next; and a lower lane's arrival is judged by how fast its own
line has moved since its backlog began (`own_line_wait_s`): the higher lanes'
requests that arrive meanwhile go first, which its place in line cannot show,
so a request admitted there would otherwise time out in the queue. Admitted
means served. A request's deadline is its lane's (exactly as written,
or fitted to a slow engine where the operator left it unset) or the client's
own, whichever is shorter.

A request of the highest lane that would wait, for a slot or behind a lower lane's
prompt in prefill on its engine, may preempt such a prompt (`preemption.py`, off unless
`max_preemptions` is set): the caller says when a request is sent and how to cancel it
(`sent`), and a preempted one comes back through `requeue`.

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
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.config import LaneSettings
from gateway.outcomes import QueueFull, QueueTimeout, Refusal, WaitTooLong
from gateway.scheduling.fairness import FairQueue, TokenCost
from gateway.scheduling.headroom import WAIT_PROBABILITY, ArrivalRate, headroom_slots
from gateway.scheduling.known_wait import MAX_AHEAD
from gateway.scheduling.learning import WindowedMedian
from gateway.scheduling.preemption import InPrefill, LaneRule, victims

#: Weight of the newest slot-hold sample in the per-lane moving average.
HOLD_EWMA_ALPHA = 0.2
#: ... and of the tokens one of its requests holds of a token-bounded batch.
COST_EWMA_ALPHA = 0.1
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
#: How far past requests waiting for their own backends (`Deferred.own_full`: their
#: model's, all full) a lane is looked at: another model's request behind a queue of a
#: full model's gets its free backend (at 16, 40 queued requests of one model held
#: another's idle one for 30 s). A lane's default queue depth (256) at most.
OWN_FULL_LOOKAHEAD = 256
#: The tenant of a request that names none (and of every request without tenants).
DEFAULT_TENANT = "default"
#: Recent dispatches per lane from which its drain rate (requests leaving the line per
#: second) is measured, for Retry-After.
DRAIN_SAMPLES = 32
#: A backlog younger than this, with fewer than two dispatches, has no drain rate yet.
MIN_DRAIN_SPAN_S = 1.0


@dataclass(slots=True, frozen=True)
class Deferred:
    """What a slot source answers when it has a slot, but this request had better wait a
    little for another one (the backend that has its prompt cached, now full): requests
    behind it in line may take the free slot; it is asked again within `retry_in_s`."""

    retry_in_s: float
    #: It waits for its own backends (its model's), all full: the requests behind it that
    #: can go elsewhere are looked at past LOOKAHEAD (`OWN_FULL_LOOKAHEAD`).
    own_full: bool = False


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
        keep_batch_tokens: int = 0,
    ) -> Any | None:
        """A slot for a request of `lane` (not on the backend of slot `exclude`), None when
        there is none, or `Deferred` when this request should wait for a better one.

        `hint` is the request's routing hint, passed through untouched; `waited_s` how
        long it has waited in line (None: it may not wait, a retry), `ahead` how many
        requests go before it (its lane's and the higher lanes'); `keep_batch_tokens`
        what an engine that bounds its batch by tokens keeps for the lanes above."""

    def has_free_slot(self, lane: str) -> bool:
        """Some backend of `lane` has a free slot now (with [redis], counting the slots the
        other replicas hold)."""

    def known_wait_s(self, lane: str, ahead: Sequence[tuple[int, Any]]) -> float:
        """The least wait of a request of `lane` that has `ahead` of it in line (each a
        prompt's tokens and its routing hint), from the work known now: what is left of
        the prefills in flight on the lane's backends (`scheduling/known_wait.py`)."""

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
    tenant: str = DEFAULT_TENANT
    #: What its tenant was charged at dispatch (its prompt), settled at release...
    charged: float = 0.0
    #: ... to what it cost (uncached prompt + weighted output; None until released).
    cost: float | None = None
    #: Times its request was preempted before this grant (`requeue`), and when it was
    #: first sent to an engine (None: not yet).
    preemptions: int = 0
    first_sent_at: float | None = None
    #: While sent and before its first token: what may preempt it (`Scheduler.sent`).
    prefill: InPrefill | None = None

    @property
    def enqueued_at(self) -> float:
        return self.granted_at - self.queued_s


@dataclass(slots=True)
class WaitNote:
    """What admission to the queue decided for one request, for its log line."""

    #: The wait predicted at arrival: the measured one, or the wait the work in sight
    #: makes at least (`known_wait.py`), whichever is longer (None: never queued).
    predicted_wait_s: float | None = None
    #: The queue deadline in force: the lane's, or the client's when shorter; with
    #: `grace_s` in it when the request waited past it at the head of its line.
    deadline_s: float | None = None
    #: Seconds added to a lower lane's fitted deadline (`Scheduler._grace_s`; None: none).
    grace_s: float | None = None


@dataclass(slots=True, eq=False)
class _Waiter:
    enqueued_at: float
    prompt_tokens: int
    output_tokens: int
    future: asyncio.Future[Grant]
    tenant: str = DEFAULT_TENANT
    #: Its place in line at arrival: requests ahead of it plus one.
    position: int = 1
    timer: asyncio.TimerHandle | None = None
    #: What the slot source may route it by (its prompt's prefix, its session).
    hint: Any = None
    #: Times it was preempted (it is back in line after that), and when it was first
    #: sent to an engine.
    preemptions: int = 0
    first_sent_at: float | None = None
    #: Back in line after it had a slot (`requeue`): its next grant is not a new
    #: dispatch, and its wait (counted from its arrival) no sample of the queue's.
    again: bool = False
    #: The client's own queue deadline (None: none): no grace goes past it.
    client_deadline_s: float | None = None
    #: Its log line's note, told of a grace; whether it had its one grace.
    note: WaitNote | None = None
    graced: bool = False


@dataclass(slots=True, eq=False)
class LaneState:
    settings: LaneSettings
    slot_limit: int
    #: Its waiting requests, in the order they are served (fair between tenants).
    queue: FairQueue[_Waiter] = field(default_factory=FairQueue)
    in_flight: int = 0
    #: Slots of the backends it may use (what its floor may keep is fewer than these).
    capacity: int = 0
    #: Moving average of how long a request of this lane holds its slot.
    hold_ewma_s: float | None = None
    #: The queue deadline in force for this lane (queue_timeout_s, or raised to fit a
    #: slow engine by the app), and whether it is the gateway's (fitted, the operator
    #: left it unset or opted in) rather than written: only then may a request wait
    #: past it (`Scheduler._grace_s`).
    deadline_s: float = 0.0
    deadline_adapted: bool = False
    #: Measured seconds of waiting per place in line (median of recent requests).
    wait_per_place: WindowedMedian = field(
        default_factory=lambda: WindowedMedian(0.0, min_samples=WAIT_SAMPLES_NEEDED)
    )
    #: Lanes that go before this one and share some of its backends, and those after.
    higher: list[LaneState] = field(default_factory=list)
    lower: list[LaneState] = field(default_factory=list)
    #: Its latest requests' queue waits (seconds; a timed-out one counts its deadline),
    #: and when the latest of them ended.
    recent_waits: deque[float] = field(default_factory=lambda: deque(maxlen=PRESSURE_SAMPLES))
    last_wait_at: float = 0.0
    #: Since when its queue has had requests waiting without a break (None: empty now).
    backlog_since: float | None = None
    #: When its latest requests got their slots (the drain rate's samples).
    dispatched_at: deque[float] = field(default_factory=lambda: deque(maxlen=DRAIN_SAMPLES))
    #: The latest moment it was progressing: it got a slot, or it still held its
    #: `promoted_slots` (its promotion clock starts here, not at its latest grant: a lane
    #: whose one long request ran for 17 s was not starving meanwhile).
    progressed_at: float | None = None
    #: Its queue had requests at the last look (for `Scheduler.on_waiting`).
    had_waiters: bool = False
    #: Gets no new slot while set (with [redis]: a higher lane has requests waiting in
    #: another replica of the fleet).
    held_back: bool = False
    #: Its recent arrivals (admitted or not: its demand).
    arrivals: ArrivalRate = field(default_factory=ArrivalRate)
    #: Its demand in slots (arrival rate x slot hold), and the slots that demand needs
    #: (`headroom.headroom_slots`), as of its latest arrival or release.
    demand_slots: float = 0.0
    headroom: int = 0
    #: How long its requests may wait for a slot beyond the engine floor, for its
    #: headroom's tail (`set_wait_allowance`; None: not known, the probability alone).
    wait_allowance_s: float | None = None
    #: The slots its tail needs (None: no allowance applies), and whether they are its
    #: headroom: only where they leave the lanes below room (`_note_demand`).
    tail_slots: int | None = None
    tail_in_force: bool = False
    #: Moving average of the tokens one request of this lane holds of an engine's batch
    #: tokens (its prompt and output budget): what its headroom is worth there.
    cost_ewma_tokens: float | None = None
    #: When an arrival of it was last refused (None: never).
    refused_at: float | None = None

    @property
    def name(self) -> str:
        return self.settings.name

    def __post_init__(self) -> None:
        if not self.deadline_s:
            self.deadline_s = self.settings.queue_timeout_s
        if not self.capacity:
            self.capacity = self.slot_limit


class Scheduler:
    """Per-lane FIFO queues in front of a shared pool of slots."""

    def __init__(
        self,
        lanes: Sequence[LaneSettings],
        slot_limits: dict[str, int],
        source: SlotSource,
        clock: Callable[[], float] = time.perf_counter,
        competes: Callable[[str, str], bool] | None = None,
        *,
        fair_share: bool = True,
        capacities: dict[str, int] | None = None,
    ) -> None:
        self._lanes = [
            LaneState(
                lane,
                slot_limits[lane.name],
                queue=FairQueue(fair_share),
                capacity=(capacities or {}).get(lane.name, 0),
            )
            for lane in lanes
        ]
        self._by_name = {lane.name: lane for lane in self._lanes}
        self._link(competes)
        self._source = source
        #: The one clock of every estimate (waits, hold times, promotion ages). Only the
        #: queue timeout and the end of a deferral are loop timers: they must fire.
        self._now = clock
        #: The pending look at the queues and when it is due (kept here: uvloop answers a
        #: call_at under a millisecond with a plain Handle, which has no `when()`).
        self._deferral_timer: asyncio.Handle | None = None
        self._deferral_at = 0.0
        #: Told when a lane's queue fills (True) or empties (False): with [redis], the
        #: other replicas hold their lower lanes back meanwhile.
        self.on_waiting: Callable[[str, bool], None] | None = None
        #: What a request costs its tenant (the output weight is learned by the sizer).
        self.cost = TokenCost()
        #: Most times one request may be preempted (`preemption.py`); 0: never.
        self.max_preemptions = 0
        #: The requests sent and not yet past their prefill (`sent`), and those preempted
        #: whose slot has not come back yet (`requeue`, `release`).
        self._in_prefill: set[InPrefill] = set()
        self._preempting: set[InPrefill] = set()

    def _link(self, competes: Callable[[str, str], bool] | None) -> None:
        """Each lane's higher lanes (those before it that share a backend) and lower ones."""
        for lane in self._lanes:
            lane.higher, lane.lower = [], []
        for index, lane in enumerate(self._lanes):
            lane.higher = [
                other
                for other in self._lanes[:index]
                if competes is None or competes(lane.name, other.name)
            ]
            for other in lane.higher:
                other.lower.append(lane)

    def reconfigure(
        self,
        lanes: Sequence[LaneSettings],
        competes: Callable[[str, str], bool] | None = None,
    ) -> None:
        """A reload: the same lanes, in the same order, with new settings, for the
        requests that arrive from now on (queue depths, timeouts, promotion; the slot
        limits and deadlines are the sizer's `refit`). What is queued stays in line; what
        was learned (waits, holds, demand) stays. The lanes' names and order cannot
        change here: their queues hold requests."""
        assert [lane.name for lane in lanes] == [lane.name for lane in self._lanes]
        for state, settings in zip(self._lanes, lanes, strict=True):
            state.settings = settings
        self._link(competes)
        self._dispatch()

    @property
    def lanes(self) -> list[LaneState]:
        return self._lanes

    def lane(self, name: str) -> LaneState:
        return self._by_name[name]

    def set_slot_limit(self, name: str, slots: int, capacity: int | None = None) -> None:
        """The lane's backends changed size (learned from the engine): serve the queues.

        `slots`: the most the lane may hold; `capacity`: all slots of its backends."""
        lane = self._by_name[name]
        lane.slot_limit = max(1, slots)
        if capacity is not None:
            lane.capacity = max(1, capacity)
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
            lane.backlog_since = self._now() if waiting else None
            if self.on_waiting is not None:
                self.on_waiting(lane.name, waiting)

    def set_deadline(self, name: str, deadline_s: float, *, adapted: bool = False) -> None:
        """The lane's queue deadline in force from now on (new arrivals); `adapted`: the
        gateway's own (fitted to the engine), not the operator's written one."""
        lane = self._by_name[name]
        lane.deadline_s, lane.deadline_adapted = deadline_s, adapted

    # -- prediction ------------------------------------------------------------------

    def _place_in_line(
        self, lane: LaneState, tenant: str | None = None, weight: float = 1.0, cost: float = 0.0
    ) -> int:
        """Requests that go before one arriving now in `lane`, plus one: of its own lane's,
        those of its tenant's fair turn (None: the whole line), and all of the higher
        lanes' that go first."""
        higher = sum(len(other.queue) for other in lane.higher)
        if tenant is None:
            return len(lane.queue) + higher + 1
        return lane.queue.place_for(tenant, weight, cost) + higher

    def _starts_now(self, lane: LaneState) -> bool:
        return (
            not lane.queue
            and lane.in_flight < self._limit(lane, self._now())
            and not any(other.queue for other in lane.higher)
            and self._source.has_free_slot(lane.name)
        )

    def predicted_wait_s(
        self, name: str, tenant: str | None = None, weight: float = 1.0, cost: float = 0.0
    ) -> float | None:
        """The wait of a request arriving now in lane `name`; None when unknown.

        Its place in line (in its tenant's fair turn; None: at the end of the line)
        times the lane's measured wait per place; before enough requests have waited,
        the lane's slot hold time over its slots per place.
        """
        lane = self._by_name[name]
        if self._starts_now(lane):
            return 0.0
        return self._measured_wait_s(lane, tenant, weight, cost)

    def _measured_wait_s(
        self, lane: LaneState, tenant: str | None, weight: float, cost: float
    ) -> float | None:
        """`predicted_wait_s` for a request that does not start at once."""
        place = self._place_in_line(lane, tenant, weight, cost)
        hold = lane.hold_ewma_s
        if not lane.wait_per_place.learned:
            return None if hold is None else place * hold / lane.slot_limit
        measured = place * lane.wait_per_place.value
        yielding = self._yielding_slots(lane)
        if hold is None or yielding is None:
            return measured
        # A lane below is giving its slots back (it is shed, or over what this lane's
        # headroom leaves it): the wait is the one this lane's requests alone make,
        # on the slots it will have, not the line as the lower lane's slots make it now.
        return min(measured, place * hold / yielding)

    def known_wait_s(
        self, name: str, tenant: str | None = None, weight: float = 1.0, cost: float = 0.0
    ) -> float:
        """The least wait of a request arriving now in lane `name` from the work in sight
        (`known_wait.py`): the prefills in flight on its backends, and the requests that
        go before it (the higher lanes' queues, then its own lane's up to its place in
        its tenant's fair turn), each holding a slot at least for its own prefill."""
        lane = self._by_name[name]
        ahead: list[tuple[int, Any]] = []
        for other in lane.higher:
            ahead += [(w.prompt_tokens, w.hint) for w in other.queue.order(MAX_AHEAD)]
        own = self._place_in_line(lane, tenant, weight, cost) - 1 - len(ahead)
        if own > 0 and len(ahead) < MAX_AHEAD:
            own = min(own, MAX_AHEAD - len(ahead))
            ahead += [(w.prompt_tokens, w.hint) for w in lane.queue.order(own)]
        return self._source.known_wait_s(name, ahead[:MAX_AHEAD])

    def own_line_wait_s(self, name: str) -> float | None:
        """For a lane below others: the wait of a request joining the back of its own
        line, at the rate its line has been served since its backlog began (None: not a
        lower lane, no backlog, or one too new to say).

        Its place in line counts only the requests there now, but the higher lanes'
        requests that arrive while it waits go first too: under their pressure a lower
        lane is served one promotion at a time (a long answer, then `promote_after_s`),
        and a request admitted behind two others waits for three of those. The rate its
        own line moves at already says so; with nothing served in the backlog's time,
        each place ahead costs at least that time."""
        lane = self._by_name[name]
        since = lane.backlog_since
        if not lane.higher or since is None:
            return None
        now = self._now()
        span = now - since
        if span < MIN_DRAIN_SPAN_S:
            return None
        served = sum(1 for moment in lane.dispatched_at if moment > since)
        if served == DRAIN_SAMPLES:  # a long backlog: the rate of the latest dispatches
            span = now - lane.dispatched_at[0]
        places = len(lane.queue) + 1
        return places * span / max(1, served)

    def _yielding_slots(self, lane: LaneState) -> int | None:
        """The slots `lane` will have once the lanes below it that are giving slots back
        are down to their floors (None: none of them is)."""
        now = self._now()
        lower = lane.lower
        if not lower or not any(
            other.in_flight > self._floor(other, [lane])
            and (
                self.pressing_lane(other.name) is not None
                or other.in_flight > self._limit(other, now)
            )
            for other in lower
        ):
            return None
        floors = self._floors_below(lane)
        return max(1, min(lane.slot_limit, lane.capacity - floors))

    def pressing_lane(self, name: str) -> LaneState | None:
        """A higher lane sharing backends with `name` whose recent requests waited (the
        median of the last few) over `SHED_LOWER_AT` of their deadline: while it is,
        `name` is shed. Sustained pressure, not one arrival's bad moment: a single long
        prefill in progress must not turn lower-lane requests away."""
        now = self._now()
        for other in self._by_name[name].higher:
            waits = other.recent_waits
            if (
                len(waits) >= PRESSURE_SAMPLES
                and statistics.median(waits) > SHED_LOWER_AT * other.deadline_s
                and (other.queue or now - other.last_wait_at <= other.deadline_s)
            ):
                return other
        return None

    def drain_rate(self, name: str) -> float | None:
        """Requests per second leaving the line of lane `name` (its own dispatches and
        those of the higher lanes that go first, each since its current backlog began);
        it falls while nothing is dispatched. None while there is no backlog, or one too
        new to say (under `MIN_DRAIN_SPAN_S` and fewer than two dispatches): what left
        the line before a burst, at the rate requests arrived then, says nothing of how
        fast the burst drains (a minute's Retry-After for a backlog gone in 1.5 s)."""
        now = self._now()
        lane = self._by_name[name]
        backlogged = [m for m in (lane, *lane.higher) if m.backlog_since is not None]
        if not backlogged:
            return None
        since = min(m.backlog_since for m in backlogged if m.backlog_since is not None)
        left = sum(
            sum(1 for t in m.dispatched_at if t > (m.backlog_since or now)) for m in backlogged
        )
        span = now - since
        if span < MIN_DRAIN_SPAN_S and left < 2:
            return None
        return left / span if span > 0 else None

    def _retry_after(
        self, lane: LaneState, beyond_s: float = 0.0, tenant: str | None = None, weight: float = 1.0
    ) -> int:
        """Seconds until a retry may fit: the wait a request arriving now would have (of
        `tenant`'s next request, in its fair turn), less `beyond_s` (the wait a request
        may have): the figure the refusal was decided by. Before there is one, the line
        ahead over its drain rate since its backlog began. (The drain rate first read a
        minute on a CPU engine whose short requests wait out one long prefill, a few
        seconds, and after a quiet spell the rate requests had arrived at.)"""
        predicted = self.predicted_wait_s(lane.name, tenant, weight)
        rate = self.drain_rate(lane.name)
        if predicted is not None:
            wait = predicted
        elif rate:
            wait = self._place_in_line(lane, tenant, weight) / rate
        else:
            wait = lane.hold_ewma_s or 1.0
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
        tenant: str = DEFAULT_TENANT,
        weight: float = 1.0,
    ) -> Grant:
        """Wait for a slot in lane `name`; a Refusal when refused or timed out.

        `client_deadline_s`: how long the client lets this request wait in the queue
        (from its own deadline); the lane's deadline applies when it is shorter.
        `tenant` and `weight`: whose request it is, for the lane's fair share.
        Cancelling the caller (client went away) leaves the queue at once.
        """
        lane = self._by_name[name]
        settings = lane.settings
        now = self._now()
        lane.arrivals.add(now)
        tokens = prompt_tokens + output_tokens
        lane.cost_ewma_tokens = (
            tokens
            if lane.cost_ewma_tokens is None
            else lane.cost_ewma_tokens + COST_EWMA_ALPHA * (tokens - lane.cost_ewma_tokens)
        )
        self._note_demand(lane, now)
        deadline = self.deadline_for(name, client_deadline_s)
        cost = self.cost.of(prompt_tokens, output_tokens)
        # A measured wait of 0 (a lane whose requests started at once lately) says
        # nothing of the prefill in flight now: only starting now skips the other two.
        starts_now = self._starts_now(lane)
        predicted = 0.0 if starts_now else self._measured_wait_s(lane, tenant, weight, cost)
        known = 0.0 if starts_now else self.known_wait_s(name, tenant, weight, cost)
        own_line = None if starts_now else self.own_line_wait_s(name)
        if note is not None:
            note.predicted_wait_s = max(predicted or 0.0, known, own_line or 0.0)
            note.deadline_s = deadline
        try:
            self._check_queue_room(lane, tenant, weight)
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
                    retry_after_s=self._retry_after(
                        lane, REFUSE_AT_DEADLINE_SHARE * lane.deadline_s, tenant, weight
                    ),
                )
            if settings.reject_predicted_wait and own_line is not None and own_line > deadline:
                raise WaitTooLong(
                    f"The '{name}' lane's line has moved at about {own_line:.1f} s for this "
                    f"request's place while the lanes above it are busy, over the "
                    f"{deadline:.3g} s limit.",
                    retry_after_s=max(1, min(MAX_RETRY_AFTER_S, math.ceil(own_line - deadline))),
                )
            if settings.reject_predicted_wait and known > deadline:
                whose = "your" if deadline < lane.deadline_s else f"the '{name}' lane's"
                raise WaitTooLong(
                    f"The '{name}' lane cannot give this request a slot for at least {known:.1f} "
                    f"s (the prompts in prefill ahead of it), over {whose} {deadline:.3g} s limit.",
                    retry_after_s=max(1, min(MAX_RETRY_AFTER_S, math.ceil(known - deadline))),
                )
        except Refusal:
            lane.refused_at = now  # (its lane sheds: no engine time of its to spare)
            raise
        if (
            lane.in_flight < self._limit(lane, now)
            and not lane.held_back
            and not any(other.queue for other in self._lanes)
        ):
            # Nobody waits anywhere: what dispatching would do, without queueing a future.
            slot = self._source.try_take(
                name,
                prompt_tokens,
                output_tokens,
                hint=hint,
                waited_s=0.0,
                keep_batch_tokens=self._kept_batch_tokens(lane, now),
            )
            if slot is not None and not isinstance(slot, Deferred):
                charged = lane.queue.started(tenant, prompt_tokens, weight)
                lane.in_flight += 1
                lane.recent_waits.append(0.0)
                lane.last_wait_at = now
                lane.dispatched_at.append(now)
                lane.progressed_at = now
                return Grant(name, slot, 0.0, now, tenant=tenant, charged=charged)
        waiter = _Waiter(
            now,
            prompt_tokens,
            output_tokens,
            asyncio.get_running_loop().create_future(),
            tenant,
            position=self._place_in_line(lane, tenant, weight, cost),
            hint=hint,
            client_deadline_s=client_deadline_s,
            note=note,
        )
        lane.queue.push(waiter, weight)
        self._note_queue(lane)
        return await self._wait(lane, waiter, deadline, deadline)

    def _check_queue_room(self, lane: LaneState, tenant: str, weight: float) -> None:
        """QueueFull for an arrival of `tenant` when its lane's line has no room for it:
        over the tenant's own cap, or the line is full and the arrival's tenant holds at
        least its share of it (else the newest request of the tenant holding the most is
        refused instead, and the arrival takes its place)."""
        settings, queue = lane.settings, lane.queue
        cap = settings.max_queue_depth_per_tenant
        if cap and queue.queued_of(tenant) >= cap:
            raise QueueFull(
                f"You have {cap} requests waiting in the '{lane.name}' lane already, the most "
                "one tenant may. Retry after the delay in Retry-After.",
                retry_after_s=self._retry_after(lane, tenant=tenant, weight=weight),
            )
        depth = settings.max_queue_depth
        if len(queue) < depth or not (queue or lane.in_flight >= lane.slot_limit):
            return
        victim = queue.displaced_by(tenant, weight, depth) if depth else None
        if victim is None:
            raise QueueFull(
                f"The '{lane.name}' lane's queue is full ({depth} waiting). "
                "Retry after the delay in Retry-After.",
                retry_after_s=self._retry_after(lane, tenant=tenant, weight=weight),
            )
        self._remove(lane, victim)
        victim.future.set_exception(
            QueueFull(
                f"The '{lane.name}' lane's queue is full ({depth} waiting) and you hold more "
                "of it than your share: your newest request made room for another tenant's. "
                "Retry after the delay in Retry-After.",
                retry_after_s=self._retry_after(lane, tenant=victim.tenant),
            )
        )

    async def requeue(
        self,
        grant: Grant,
        prompt_tokens: int,
        output_tokens: int,
        *,
        deadline_s: float,
        hint: Any = None,
        preempted: bool = False,
    ) -> Grant:
        """The slot of `grant` turned out unusable (with [redis]: the other replicas hold
        that backend's slots), or its request was `preempted`: give it back and wait again
        at the front of the line, with the time waited so far counted against
        `deadline_s`, the request's queue deadline. No arrival refusal applies: the
        request was admitted already."""
        lane = self._by_name[grant.lane]
        self._forget_prefill(grant)
        grant.released = True
        lane.in_flight -= 1
        lane.queue.refund(grant.tenant, grant.charged)
        self._source.give_back(grant.slot)
        enqueued_at = grant.granted_at - grant.queued_s
        left = deadline_s - (self._now() - enqueued_at)
        waiter = _Waiter(
            enqueued_at,
            prompt_tokens,
            output_tokens,
            asyncio.get_running_loop().create_future(),
            grant.tenant,
            hint=hint,
            preemptions=grant.preemptions + preempted,
            first_sent_at=grant.first_sent_at,
            again=True,
            # (its deadline was granted already, grace or not: it gets no more)
            graced=True,
        )
        lane.queue.push_front(waiter)
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
        grace = self._grace_s(lane, waiter, deadline)
        if grace > 0:
            waiter.graced = True
            if waiter.note is not None:
                waiter.note.deadline_s, waiter.note.grace_s = deadline + grace, grace
            waiter.timer = asyncio.get_running_loop().call_later(
                grace, self._expire, lane, waiter, deadline + grace
            )
            return
        self._remove(lane, waiter)
        # It would have waited at least this long: a (low) sample all the same.
        lane.wait_per_place.add(deadline / waiter.position)
        lane.recent_waits.append(deadline)
        lane.last_wait_at = self._now()
        waiter.future.set_exception(
            QueueTimeout(
                f"Waited {deadline:.3g} s in the '{lane.name}' lane's queue "
                "without getting a backend slot.",
                retry_after_s=self._retry_after(lane),
            )
        )

    def _grace_s(self, lane: LaneState, waiter: _Waiter, deadline: float) -> float:
        """Seconds more for `waiter`, whose deadline came (0: none): once, for the next
        request in line of a lower lane whose deadline is the gateway's (fitted; never a
        written one, never past the client's own), a promotion age and one of its lane's
        slot holds (its deadline before one was measured); not while its lane is shed.

        Under the higher lanes' pressure a lower lane is served one promotion at a time:
        its running request ends, then `promote_after_s` passes. On a CPU engine that
        pace (25-50 s on a 4-slot llama.cpp) is known only once it has been seen, and a
        long request admitted at the head of an empty line timed out after waiting the
        whole fitted deadline, 7-43 s before the promotion it was next for, in a stream
        whose 200 keep-alive comments had begun. Timing it out then wastes the wait and
        breaks the stream; the request behind it gets no slot sooner for it. While the
        lane is shed (`pressing_lane`) the higher lane needs the engine: a request kept
        then took a promotion no other would have, and on the matrix's CPU engines in
        conversation 1% more short requests were refused for it."""
        after = lane.settings.promote_after_s
        if waiter.graced or not lane.deadline_adapted or not lane.higher or after is None:
            return 0.0
        if next(iter(lane.queue.order(1)), None) is not waiter:
            return 0.0
        if self.pressing_lane(lane.name) is not None:
            return 0.0
        grace = after + (deadline if lane.hold_ewma_s is None else lane.hold_ewma_s)
        if waiter.client_deadline_s is not None:
            grace = min(grace, waiter.client_deadline_s - deadline)
        return max(0.0, grace)

    def _abandon(self, lane: LaneState, waiter: _Waiter) -> None:
        """The waiting client went away: leave the queue, or give back a slot just granted."""
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            self.release(future.result())
        else:
            self._remove(lane, waiter)

    def _remove(self, lane: LaneState, waiter: _Waiter) -> None:
        lane.queue.remove(waiter)
        self._note_queue(lane)

    def release(
        self, grant: Grant, served_prompt_tokens: int | None = None, output_tokens: int = 0
    ) -> None:
        """Give the slot back and hand it to the next request in line.

        `served_prompt_tokens` (the prompt's uncached part) and `output_tokens`: what the
        engine really did for it, its tenant's charge (None: the prompt as charged, no
        output)."""
        if grant.released:
            return
        self._forget_prefill(grant)
        grant.released = True
        lane = self._by_name[grant.lane]
        now = self._now()
        if lane.in_flight >= lane.settings.promoted_slots:
            lane.progressed_at = now
        lane.in_flight -= 1
        prompt = grant.charged if served_prompt_tokens is None else served_prompt_tokens
        grant.cost = self.cost.of(int(prompt), output_tokens)
        lane.queue.settle(grant.tenant, grant.charged, grant.cost)
        held = now - grant.granted_at
        if lane.hold_ewma_s is None:
            lane.hold_ewma_s = held
        else:
            lane.hold_ewma_s += HOLD_EWMA_ALPHA * (held - lane.hold_ewma_s)
        self._note_demand(lane, now)
        self._source.give_back(grant.slot)
        self._dispatch(released=lane)

    def prefill_done(self, grant: Grant) -> None:
        """The backend started answering: its prefill budget may admit the next prompt."""
        if not grant.released:
            self._forget_prefill(grant)
            self._source.prefill_done(grant.slot)
            self._dispatch()

    # -- preemption ------------------------------------------------------------------------

    def sent(
        self, grant: Grant, engine: Hashable, cancel: Callable[[], None] | None = None
    ) -> None:
        """`grant`'s request was sent to `engine` (a key: the backend) and has no first
        token yet. A request of the highest lane preempts the lower lanes' prompts in
        prefill there (they would delay its own); another may be preempted until its
        first token (`prefill_done`) by calling `cancel` (None: it may not be)."""
        if grant.released:
            return
        self._forget_prefill(grant)  # sent again (a retry on another backend)
        now = self._now()
        if grant.first_sent_at is None:
            grant.first_sent_at = now
        lane = self._by_name[grant.lane]
        if not lane.higher and lane.lower and self.max_preemptions:
            for victim in self._victims(lane, engine):
                self._preempt(victim)
        if lane.higher and cancel is not None:
            grant.prefill = InPrefill(
                grant.lane,
                engine,
                grant.enqueued_at,
                grant.first_sent_at,
                now,
                grant.preemptions,
                cancel,
            )
            self._in_prefill.add(grant.prefill)

    def _victims(self, lane: LaneState, engine: Hashable | None = None) -> list[InPrefill]:
        """What a waiting request of `lane` may preempt (`preemption.victims`), best first."""
        if not self._in_prefill:
            return []
        rules = {
            other.name: LaneRule(
                index,
                other.deadline_s,
                other.settings.promote_after_s,
                None if other.refused_at is None else self._now() - other.refused_at,
            )
            for index, other in enumerate(self._lanes)
        }
        return victims(
            self._in_prefill,
            rules,
            above_rank=self._lanes.index(lane),
            now=self._now(),
            max_per_request=self.max_preemptions,
            engine=engine,
        )

    def _preempt(self, victim: InPrefill) -> None:
        """Cancel `victim` at its engine; its slot comes back through `requeue`."""
        self._in_prefill.discard(victim)
        self._preempting.add(victim)
        cancel, victim.cancel = victim.cancel, None
        assert cancel is not None
        cancel()

    def _preempt_for_waiting(self, lane: LaneState) -> None:
        """The highest lane has requests no slot was found for: preempt one prompt in
        prefill of a lower lane for each of them not yet covered by a preemption under
        way (its slot is on its way back)."""
        if lane.higher or not lane.lower or not self.max_preemptions:
            return
        wanted = len(lane.queue) - len(self._preempting)
        for victim in self._victims(lane)[: max(0, wanted)]:
            self._preempt(victim)

    def _forget_prefill(self, grant: Grant) -> None:
        if grant.prefill is not None:
            self._in_prefill.discard(grant.prefill)
            self._preempting.discard(grant.prefill)
            grant.prefill = None

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
            for waiter in lane.queue.pop_all():
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
            if not lane.queue or lane.held_back or lane.in_flight >= lane.slot_limit:
                continue
            if lane.in_flight < self._limit(lane, now) or self._promoted(lane, now):
                ready.append(lane)
            else:
                self._serve_again_in(self._headroom_changes_in(lane, now))
        if not ready:
            return False
        # Work-conserving split: under a waiting higher lane, a lower one gets no new slot;
        # the slot it just gave back it keeps only to stay at its floor (nothing starves).
        pressed = {
            lane: pressing
            for lane in ready
            if (pressing := [other for other in lane.higher if other in ready])
        }
        kept = [
            lane
            for lane, pressing in pressed.items()
            if lane is keeping and lane.in_flight < self._floor(lane, pressing)
        ]
        starved = {
            lane: at
            for lane in ready
            if (at := self._promoted_at(lane, now)) is not None
            and not self._waited_before(lane.higher, at, ready)
        }
        promoted = sorted(starved, key=starved.__getitem__)
        order = promoted + [lane for lane in kept if lane not in promoted]
        order += [lane for lane in ready if lane not in pressed and lane not in order]
        for lane in order:
            waiter, slot = self._first_served(lane, now)
            if waiter is None:
                continue
            charged = lane.queue.dispatched(waiter)
            self._note_queue(lane)
            lane.in_flight += 1
            waited = now - waiter.enqueued_at
            if not waiter.again:  # (a request back in line: its wait is no queue's sample)
                lane.wait_per_place.add(waited / waiter.position)
                lane.recent_waits.append(waited)
                lane.last_wait_at = now
                lane.dispatched_at.append(now)
            lane.progressed_at = now
            waiter.future.set_result(
                Grant(
                    lane.name,
                    slot,
                    waited,
                    now,
                    tenant=waiter.tenant,
                    charged=charged,
                    preemptions=waiter.preemptions,
                    first_sent_at=waiter.first_sent_at,
                )
            )
            return True
        return False

    # -- headroom ----------------------------------------------------------------------

    def _note_demand(self, lane: LaneState, now: float) -> None:
        """The lane's demand in slots and the headroom it needs, after an arrival or a
        release (its rate, its hold time or both changed)."""
        hold = lane.hold_ewma_s
        lane.demand_slots = 0.0 if hold is None else lane.arrivals.per_s(now) * hold
        most = min(lane.slot_limit, lane.capacity)
        probability = self._wait_probability(lane)
        lane.headroom = headroom_slots(lane.demand_slots, most, probability)
        allowance = self._allowance_holds(lane)
        if allowance is None:
            lane.tail_slots, lane.tail_in_force = None, False
            return
        # The tail decides where it leaves the lanes below a slot beyond their floors.
        # Where it would take them all, they would run by promotion alone (a CPU vLLM of
        # 8 places at 115%: 34 long requests of 101 served instead of 59, 6 admitted ones
        # timed out instead of 3, for a short P99 still over the target): the
        # probability decides there, and the app says that only more slots hold the tail.
        lane.tail_slots = headroom_slots(lane.demand_slots, most, probability, allowance)
        lane.tail_in_force = not lane.lower or lane.tail_slots < most - self._floors_below(lane)
        if lane.tail_in_force:
            lane.headroom = max(lane.headroom, lane.tail_slots)

    def _floors_below(self, lane: LaneState) -> int:
        """The slots the lanes below `lane` keep whatever its headroom (their floors)."""
        return sum(self._floor(other, [lane]) for other in lane.lower)

    @staticmethod
    def _wait_probability(lane: LaneState) -> float:
        written = lane.settings.headroom_wait_probability
        return WAIT_PROBABILITY if written is None else written

    @staticmethod
    def _allowance_holds(lane: LaneState) -> float | None:
        """The lane's allowed wait over its slot hold, for its headroom's tail; None where
        the operator wrote `headroom_wait_probability` (that alone is then its headroom)
        or nothing is known yet."""
        hold, allowance = lane.hold_ewma_s, lane.wait_allowance_s
        if lane.settings.headroom_wait_probability is not None or not hold or allowance is None:
            return None
        return allowance / hold

    def set_wait_allowance(self, name: str, seconds: float | None) -> None:
        """How long lane `name`'s requests may wait for a slot (its share of the engine
        floor, from the app's sizing): its headroom keeps the slots with which an arrival
        waits longer at most `TAIL_PROBABILITY` of the time."""
        lane = self._by_name[name]
        lane.wait_allowance_s = seconds
        self._note_demand(lane, self._now())

    def headroom_figures(self, name: str) -> dict[str, Any]:
        """What lane `name`'s headroom is made of, and what it leaves the lanes below
        (for /debug/backends, metrics and the sizer's warning)."""
        lane = self._by_name[name]
        now = self._now()
        quiet = lane.arrivals.quiet(now)
        return {
            "arrivals_per_s": round(lane.arrivals.per_s(now), 3),
            "hold_s": round(lane.hold_ewma_s or 0.0, 3),
            "demand_slots": 0.0 if quiet else round(lane.demand_slots, 3),
            "headroom_slots": 0 if quiet else lane.headroom,
            "wait_probability": self._wait_probability(lane),
            "wait_allowance_s": (
                None
                if self._allowance_holds(lane) is None or lane.wait_allowance_s is None
                else round(lane.wait_allowance_s, 3)
            ),
            "tail_slots": None if quiet else lane.tail_slots,
            "tail_in_force": lane.tail_in_force,
            "reserved_by_higher": self.reserved_slots(name),
            "may_hold": self._limit(lane, now),
            "floors_below": self._floors_below(lane),
        }

    def reserved_slots(self, name: str) -> int:
        """Slots the active lanes above lane `name` keep for their own demand."""
        now = self._now()
        return sum(
            other.headroom for other in self._by_name[name].higher if not other.arrivals.quiet(now)
        )

    def _limit(self, lane: LaneState, now: float) -> int:
        """The slots `lane` may hold now: its slot limit, less the headroom of the active
        lanes above it, but never below its floor (on one slot: no headroom, strict
        priority)."""
        if not lane.higher or lane.capacity < 2:
            return lane.slot_limit
        reserved = sum(other.headroom for other in lane.higher if not other.arrivals.quiet(now))
        if not reserved:
            return lane.slot_limit
        floor = self._floor(lane, lane.higher)
        return min(lane.slot_limit, max(floor, lane.capacity - reserved))

    def _kept_batch_tokens(self, lane: LaneState, now: float) -> int:
        """What `lane` leaves of an engine's batch tokens (TGI's) for the active lanes above
        it: their headroom, in their requests' tokens. Slots alone keep nothing on such an
        engine (it reports 128 and holds far fewer), and a short request that finds its
        tokens taken waits for a long answer to end. A starved lane (promoted) keeps
        nothing back: long requests are never starved."""
        if not lane.higher or lane.capacity < 2:
            return 0
        kept = sum(
            other.headroom * (other.cost_ewma_tokens or 0.0)
            for other in lane.higher
            if other.headroom and not other.arrivals.quiet(now)
        )
        return 0 if not kept or self._promoted(lane, now) else round(kept)

    def _headroom_changes_in(self, lane: LaneState, now: float) -> float:
        """Seconds until `lane`, held below its slot limit by headroom with a request
        waiting, should be looked at again without any release: when the lanes above go
        quiet, or its oldest request is promoted."""
        moments = [
            quiet for other in lane.higher if (quiet := other.arrivals.quiet_at()) is not None
        ]
        oldest = lane.queue.oldest_enqueued_at()
        after = lane.settings.promote_after_s
        if after is not None and oldest is not None:
            last = lane.progressed_at if lane.progressed_at is not None else oldest
            moments.append(max(oldest, last) + after)
        return max(0.001, min(moments, default=now + 1.0) - now)

    @staticmethod
    def _floor(lane: LaneState, pressing: Sequence[LaneState]) -> int:
        """The slots `lane` keeps while the `pressing` lanes wait: its `min_slots`, but
        never all the slots it shares with one of them (on one slot that floor would be
        the whole backend, and long requests would go before short ones): there the
        lanes are strict priority, and promotion keeps the lower one from starving."""
        shared = min(min(lane.capacity, other.capacity) for other in pressing)
        return min(lane.settings.min_slots, shared - 1)

    @staticmethod
    def _promoted(lane: LaneState, now: float) -> bool:
        """Its oldest request waited past `promote_after_s`, and for that long the lane
        has neither got a slot nor held its `promoted_slots`: it is starved, so it goes
        before the higher lanes' requests that came since (`_waited_before`). A lane
        that got a slot meanwhile, or whose requests were running, is progressing: its
        requests wait their turn (on one slot, each promotion would hold every short
        request behind a whole long answer, though the long ones were not starved; on a
        CPU engine, a long request's prefill and answer outlast the promotion age, and
        timed from its grant the next long one was promoted the moment it ended, every
        short request's decode frozen again for the next long prefill)."""
        return Scheduler._promoted_at(lane, now) is not None

    @staticmethod
    def _promoted_at(lane: LaneState, now: float) -> float | None:
        """When `lane` was starved (see `_promoted`); None: it is not."""
        settings = lane.settings
        after = settings.promote_after_s
        oldest = lane.queue.oldest_enqueued_at()
        if after is None or oldest is None or lane.in_flight >= settings.promoted_slots:
            return None
        last = oldest if lane.progressed_at is None else max(oldest, lane.progressed_at)
        return last + after if now >= last + after else None

    @staticmethod
    def _waited_before(lanes: Sequence[LaneState], moment: float, ready: list[LaneState]) -> bool:
        """One of `lanes` that may take a slot now has a request waiting from before
        `moment`.

        A starved lane goes first only once those are served: it takes its place in line
        as of the moment it was starved. Going before them too, on an engine whose long
        prefill freezes every decode beside it (llama.cpp's), froze the short requests
        it passed, and left no slot for those that came during the prefill (a 4-slot CPU
        engine at 150%: short P99 1.8x the floor, 1.3x in line)."""
        return any(
            lane in ready and (lane.queue.oldest_enqueued_at() or moment) < moment for lane in lanes
        )

    def _first_served(self, lane: LaneState, now: float) -> tuple[_Waiter | None, Any]:
        """The lane's first request in line that gets a slot now, and the slot.

        The first in the lane's fair order, unless the source defers it (it waits for
        the backend holding its prompt's cache): then the requests after it, up to
        LOOKAHEAD of them, may take the free slot, and the queues are served again when
        the first deferral ends. Requests waiting for their own backends (another
        model's, in a pool whose engines list different models) are not counted: past
        them the lane is looked at up to OWN_FULL_LOOKAHEAD.
        """
        retry_in: float | None = None
        higher = sum(len(other.queue) for other in lane.higher)
        kept_tokens = self._kept_batch_tokens(lane, now)
        looked = 0  # requests looked at, but those waiting for their own full backends
        for index, waiter in enumerate(lane.queue.order(OWN_FULL_LOOKAHEAD)):
            if looked == LOOKAHEAD:
                break
            looked += 1
            if waiter.future.done():  # cancelled, not yet cleaned up
                continue
            slot = self._source.try_take(
                lane.name,
                waiter.prompt_tokens,
                waiter.output_tokens,
                hint=waiter.hint,
                waited_s=now - waiter.enqueued_at,
                ahead=higher + index,
                keep_batch_tokens=kept_tokens,
            )
            if slot is None:
                self._preempt_for_waiting(lane)
                break  # no slot for this lane at all
            if not isinstance(slot, Deferred):
                return waiter, slot
            if slot.own_full:
                looked -= 1
            retry_in = slot.retry_in_s if retry_in is None else min(retry_in, slot.retry_in_s)
        if retry_in is not None:
            self._serve_again_in(retry_in)
        return None, None

    def _serve_again_in(self, seconds: float) -> None:
        """Serve the queues once more in `seconds` (the earliest deferral's end)."""
        loop = asyncio.get_running_loop()
        when = loop.time() + max(0.001, seconds)
        timer = self._deferral_timer
        if timer is not None and not timer.cancelled() and self._deferral_at <= when:
            return
        if timer is not None:
            timer.cancel()
        self._deferral_timer, self._deferral_at = loop.call_at(when, self._deferral_ended), when

    def _deferral_ended(self) -> None:
        self._deferral_timer = None
        self._dispatch()
