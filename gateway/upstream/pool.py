"""The backends, their slots and their health; the scheduler's `SlotSource`.

Each backend has `max_concurrency` slots: the most requests the gateway lets
run on it at once. Keeping that number near the engine's batch size keeps the
queue in the gateway, where lanes can order it, rather than in the engine,
which serves first-come-first-served.

Each backend also has a prefill budget in seconds (`prefill_budget_s`): the
predicted prefill time of the prompts it may be prefilling at once, counted
from dispatch to the first byte of the answer, predicted from the backend's
learned prefill rate (`scheduling/learning.py`). Engines prefill waiting
prompts in arrival order, so a short request dispatched behind two long
prompts waits for both; with the budget a short one waits for at most one
long prefill, and the gateway, not the engine, decides what goes next when
it ends. Engine prefill is serial anyway, so holding a long prompt back costs
it almost nothing. A prompt bigger than the budget still goes, alone. In
seconds, not tokens, so the same default lets an H100 prefill several long
prompts at once and a CPU one. (`max_prefill_tokens` is an optional hard cap
in tokens on top.)

Engines that report a queue of their own (`/metrics`: requests waiting inside
the engine, invisible to the lanes) get no more requests than they actually
run until the queue is gone: a request waiting there could not be reordered.

Balancing: among the available backends a lane may use that have a free slot
(and prefill room), the one that would give the soonest first token wins: its
predicted prefill in flight plus this prompt's, at its learned rate, so a
backend four times slower gets a request only when the fast one is busy
enough to be slower still. Between equally soon ones, the fewest outstanding
tokens per unit of weight (prompt + max_tokens of its in-flight requests):
token counts, not request counts, are what fill an engine. Then the fewest
in-flight. An unlearned backend looks fast (the prior), so it is tried soon
and learned within a few requests.

Cache and session (`[routing]`): engines cache the KV of prompts they served,
so a prompt whose prefix (system prompt, conversation history) was sent to a
backend lately starts sooner there: its predicted first token counts only the
uncached part (`prefix_index.py`), and so does its share of the prefill budget;
the backend with the most of the prompt cached wins (a turn that left its
history behind would make every later turn prefill it again).
A backend busier than the least loaded one by more than `cache_load_margin` (a
share of its slots in flight: 0.5, so 6 of 8 against 2 of 8) is judged without
its cache, so a hot prefix spreads instead of piling up. Between backends
holding as much of the prompt, the session's backend (rendezvous hashing,
`affinity.py`) wins while it is within the margin, so a conversation's first
turn lands where its later turns, through any replica, will look for it; then
the soonest first token. A request may wait in line for a busy backend that would
still start it sooner (`_defer`), counting the prefill that starting elsewhere would
repeat; the slots and prefill room that backend frees are kept for its waiters, in
the order they began to wait, while another backend has room. Picking and reserving
a slot is one synchronous step: two requests cannot race for the same "least loaded"
backend.

Models (`served.py`): a request goes only to the backends of its pool that serve its
`model` (`served.serving`: those that list it, else those that answer any name; over
the whole pool, then the lane's backends): in the catch-all pool,
backends whose engines list different models share the queues, and each request waits
for a backend of its own model (`Deferred` when those are full, so the requests behind
it for other models go).

LoRA adapters (`[routing] adapter_affinity`): a request whose `model` is an adapter
some backend of the lane lists goes only to backends that list it, and among them to
one that runs it now, else one with room for another adapter (`adapters.py`); when
all that list it are full it waits (`Deferred`), letting the requests behind it go.

Health: a backend is available while its last active check passed and it is
not ejected. Consecutive failures (connect errors, 5xx, first-byte timeouts)
eject it for a cooldown that doubles on each repeat; it comes back by itself.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

from gateway.admission.prefix import PromptPrefix
from gateway.config import (
    DEFAULT_MAX_CONCURRENCY,
    BackendSettings,
    HealthSettings,
    RoutingSettings,
)
from gateway.outcomes import NoBackend, Outcome
from gateway.scheduling.fitting import PRIOR_LONG_PROMPT_TOKENS
from gateway.scheduling.known_wait import known_wait_s
from gateway.scheduling.learning import BackendModel
from gateway.scheduling.scheduler import Deferred
from gateway.upstream.adapters import AdapterCandidate, BackendAdapters, preferred_backends
from gateway.upstream.affinity import rendezvous_weight
from gateway.upstream.engine_timings import WindowSplit
from gateway.upstream.prefix_index import PrefixIndex
from gateway.upstream.served import ServedModels, serving
from gateway.upstream.stall import StreamGaps

#: Why a backend was chosen (the routing metric's label).
BY_PREFIX, BY_SESSION, BY_LOAD = "prefix", "session", "load"
#: The automatic prefill budget's ceiling: the fixed budget of earlier releases, which
#: holds on CPU engines, where one long prompt alone is over it.
MAX_AUTO_PREFILL_BUDGET_S = 0.5
#: The automatic prefill budget's floor in prompt tokens: every engine we know prefills at
#: least this many in one step (vLLM's, SGLang's and TGI's step budgets are 2048-8192
#: tokens, llama.cpp's micro-batch 512), so prompts under it together cost about one
#: step. Without it, traffic of short prompts only made "one long prompt" one of them,
#: and one prompt prefilled at a time: 64 requests arriving together waited in the
#: gateway for each other's first byte (the overhead benchmark's waves: TTFT p99 4x the
#: passthrough's, 2x the fixed budget's).
MIN_AUTO_PREFILL_BUDGET_TOKENS = 512
#: A prompt whose own prefill (its tokens at the learned rate, without the first token's
#: fixed cost) is at most this share of the budget rides along with the prefill in
#: flight, as long as such small prompts together stay within one budget: one holds
#: nobody up, and held back it only waits in the gateway instead of in the engine. (With
#: the budget one long prompt's prefill, counting a short prompt's fixed cost against it
#: held every short request behind every long prefill; with no bound on the small ones
#: together, an overloaded H100 prefilled a queue of them at once, 3x slower.)
RIDE_ALONG = 0.25
#: The most of an engine's batch tokens that lower lanes leave for the lanes above (the
#: rest is theirs whatever the headroom says: a long request fits beside the kept room).
MAX_KEPT_BATCH_SHARE = 0.25


@dataclass(slots=True, frozen=True)
class Wait:
    """A request waiting in line for one backend: until when, and the prefill it will add."""

    until: float
    prefill_tokens: int
    prefill_s: float


@dataclass(slots=True, frozen=True)
class Kept:
    """What a backend keeps for the requests waiting in line for it: theirs when it frees."""

    slots: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0


NOTHING_KEPT = Kept()


@dataclass(slots=True, frozen=True)
class Choice:
    """A backend that could take the request now, with its ranking key."""

    key: tuple[int, bool, int, float, int]
    backend: Backend
    cached: int
    matched: int
    ttft: float


def _kept_for_others(backend: Backend, hint: RouteHint | None, now: float) -> Kept:
    """What `backend` keeps for the requests waiting in line for it ahead of `hint` (all
    of them, when `hint` waits for none): what it frees is theirs, in the order they
    began to wait."""
    if not backend.waiters:
        return NOTHING_KEPT
    slots = prefill_tokens = 0
    prefill_s = 0.0
    for other, wait in backend.waiters.items():
        if other is hint:
            break
        if wait.until > now:
            slots += 1
            prefill_tokens += wait.prefill_tokens
            prefill_s += wait.prefill_s
    return Kept(slots, prefill_tokens, prefill_s)


def _busy(backend: Backend) -> float:
    """How busy a backend is, for the cache margin: its share of slots in flight (this
    replica's and, with [redis], the other replicas')."""
    return (backend.in_flight + backend.others_in_flight) / backend.max_concurrency


@dataclass(slots=True, frozen=True, eq=False, weakref_slot=True)
class RouteHint:
    """What routing may use besides load: the prompt's blocks and the session's key.

    One per request, compared by identity: a backend remembers the requests waiting
    for it by their hint, weakly, so one that went away leaves nothing behind."""

    prefix: PromptPrefix | None = None
    session: str | None = None
    #: Longest it may wait in line for a better backend than a free one (half its queue
    #: deadline: the rest is for the wait it cannot avoid).
    wait_budget_s: float = math.inf
    #: The request's `model`: a LoRA adapter goes where it runs (`adapters.py`).
    model: str | None = None


@dataclass(slots=True, eq=False)
class Backend:
    """One model server and what the gateway has running on it."""

    name: str
    url: str
    max_concurrency: int
    #: 0: no prefill budget in tokens.
    max_prefill_tokens: int = 0
    #: Predicted prefill seconds the backend may have in flight; 0: no such budget.
    prefill_budget_s: float = 0.0
    #: The budget is one long prompt's prefill at this backend's learned rate (at most
    #: `MAX_AUTO_PREFILL_BUDGET_S`), refitted by the sizer as both change.
    prefill_budget_auto: bool = False
    #: The long prompt the automatic budget was last fitted to (the sizer's, each round).
    budget_long_tokens: int = PRIOR_LONG_PROMPT_TOKENS
    weight: float = 1.0
    api_key: str | None = None
    priority_field: bool = False
    #: max_concurrency came from the config (else from the engine, or the default).
    concurrency_configured: bool = True
    #: What engine it is ("vllm", "sglang", "llama.cpp", "tgi", "simulator"): how an
    #: answer is continued there (`resume.py`); None: unknown, never resumed on.
    engine: str | None = None
    engine_configured: bool = False
    #: The longest silences of its recent streams: when one of them is stalled (`stall.py`).
    gaps: StreamGaps = field(default_factory=StreamGaps)
    #: Drained (`drain`): no new request; its streams end where they are, or are carried
    #: over at the drain deadline. It ends by `undrain`, or when the backend comes back
    #: from a failed health check (a restarted engine: the rollout's new version).
    draining: bool = False
    #: A reload or DNS dropped it (`membership.py`): drained for good, never undrained by
    #: its health checks, forgotten once idle.
    leaving: bool = False
    #: The relays streaming from it now, each able to hand its stream over (`Watchdog`).
    streams: set[Any] = field(default_factory=set)
    in_flight: int = 0
    #: Requests ever sent here (so a probe can tell it had the backend to itself).
    dispatches: int = 0
    #: Prompt tokens of requests sent here that have not answered their first byte.
    prefilling_tokens: int = 0
    #: Predicted prefill seconds of those requests.
    prefilling_s: float = 0.0
    #: Prompt + max_tokens of the requests in flight here.
    outstanding_tokens: int = 0
    #: The tokens the engine's batch holds at most, a request's prompt and max_tokens
    #: reserved as it joins (TGI's `max_batch_total_tokens`); None: it did not say. Past
    #: them a request waits inside the engine, first come first served, behind long
    #: answers, where no lane can put a short one first: it waits in its lane instead.
    batch_tokens: int | None = None
    #: What the requests in flight here hold of `batch_tokens`, in the engine's tokens.
    batch_tokens_held: int = 0
    #: The last active health check passed (optimistic until the first one).
    healthy: bool = True
    #: Loop time until which the backend is ejected.
    ejected_until: float = 0.0
    consecutive_failures: int = 0
    ejections: int = 0
    #: Its learned service rates.
    model: BackendModel = field(default_factory=BackendModel)
    #: Requests the engine itself reports waiting in its queue (None: not reported).
    engine_waiting: float | None = None
    engine_running: float | None = None
    engine_kv_usage: float | None = None
    #: While the engine reports a queue: the most requests it actually runs of ours.
    engine_limit: int | None = None
    #: The most requests its engine was seen to run while others waited inside it: its
    #: batch, where the slots it reports are a router's limit (TGI's 128; `sizing`), kept
    #: across a restart with the learned figures. None: not seen.
    engine_batch: int | None = None
    #: The mean split of the requests that ended in its engine's latest histogram window
    #: (vLLM, SGLang), and the mean prompt tokens it prefilled of those the gateway saw
    #: end in it (`engine_timings.prefill_scale`); None: no such window.
    engine_window: WindowSplit | None = None
    engine_window_tokens: float | None = None
    #: Prompt tokens prefilled by the requests that ended here since the last scrape.
    ended_tokens: int = 0
    ended_requests: int = 0
    #: The context window the engine reports (tokens), when it does.
    engine_context_tokens: int | None = None
    #: The prompt prefixes sent here lately: what its engine probably has cached.
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)
    #: With [redis]: slots and predicted prefill seconds the other replicas hold here (as
    #: last heard from Redis; while Redis is down, the slots beyond this replica's share).
    others_in_flight: int = 0
    others_prefilling_s: float = 0.0
    #: Moving average of how long a request holds a slot here (None: none ended yet):
    #: how soon a slot frees, for a request deciding whether to wait for this backend.
    hold_s: float | None = None
    #: Requests deferred to wait for room here, in the order they began to wait.
    waiters: WeakKeyDictionary[RouteHint, Wait] = field(default_factory=WeakKeyDictionary)
    #: Its LoRA adapters: listed, running in its engine, and sent there by this gateway.
    lora: BackendAdapters = field(default_factory=BackendAdapters)
    #: The model names it serves: the config's `models`, else what its engine lists.
    served: ServedModels = field(default_factory=ServedModels)
    _prefilling: set[Slot] = field(default_factory=set)
    #: Prompt tokens in prefill of the slots that rode along (`rides_along` at dispatch):
    #: kept as a count, not summed over the slots at each dispatch (a burst of 64 short
    #: requests summed 2000 slots).
    riding_tokens: int = 0

    @classmethod
    def from_settings(cls, settings: BackendSettings) -> Backend:
        backend = cls(
            name=settings.name,
            url=settings.url.rstrip("/"),
            max_concurrency=settings.max_concurrency or DEFAULT_MAX_CONCURRENCY,
            max_prefill_tokens=settings.max_prefill_tokens,
            prefill_budget_s=settings.prefill_budget_s or 0.0,
            prefill_budget_auto=settings.prefill_budget_s is None,
            weight=settings.weight,
            api_key=settings.api_key,
            priority_field=settings.priority_field,
            concurrency_configured=settings.max_concurrency is not None,
            engine=settings.engine,
            engine_configured=settings.engine is not None,
            served=ServedModels.configured(settings.models, settings.serves),
        )
        backend.fit_prefill_budget(PRIOR_LONG_PROMPT_TOKENS)
        return backend

    def fit_prefill_budget(self, long_prompt_tokens: int) -> None:
        """With the automatic budget: one long prompt's predicted prefill, at most
        `MAX_AUTO_PREFILL_BUDGET_S`. A fixed 0.5 s let an H100 prefill eight long prompts
        at once, and a short request waited behind all of them inside the engine (the
        matrix: 3-4x the floor at 80% load); on a CPU one long prompt is over it and
        goes alone, as before. Never under `MIN_AUTO_PREFILL_BUDGET_TOKENS`' prefill."""
        if self.prefill_budget_auto:
            self.budget_long_tokens = long_prompt_tokens
            own = self.model.prefill_s(max(long_prompt_tokens, MIN_AUTO_PREFILL_BUDGET_TOKENS))
            self.prefill_budget_s = min(MAX_AUTO_PREFILL_BUDGET_S, own)

    def refit_prefill_budget(self) -> None:
        """The automatic budget again at once after a request taught the prefill rate,
        not at the next health round: an H100 learned in its first second kept the
        prior's 0.5 s for five, and prefilled six long prompts beside each short one."""
        self.fit_prefill_budget(self.budget_long_tokens)

    @property
    def auth_headers(self) -> dict[str, str] | None:
        """`Authorization` for the gateway's own calls to this backend (checks, probes)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None

    @property
    def slot_limit(self) -> int:
        """Slots usable now: max_concurrency, or fewer while the engine reports a queue."""
        if self.engine_limit is None:
            return self.max_concurrency
        return min(self.max_concurrency, self.engine_limit)

    @property
    def free_slots(self) -> int:
        return self.slot_limit - self.in_flight - self.others_in_flight

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.ejected_until and not self.draining

    def batch_cost(self, prompt_tokens: int, output_tokens: int) -> int:
        """What a request holds of the engine's batch tokens: its prompt in the engine's
        own tokens and its whole output budget."""
        return round(prompt_tokens * self.model.token_ratio) + output_tokens

    def fits_batch(self, prompt_tokens: int, output_tokens: int, keep: int = 0) -> bool:
        """Room in the engine's batch tokens, beside the `keep` of them left for higher
        lanes, at most `MAX_KEPT_BATCH_SHARE` of them (a request bigger than all of them
        goes alone, as the engine takes it)."""
        if self.batch_tokens is None or not self.in_flight:
            return True
        cost = self.batch_cost(prompt_tokens, output_tokens)
        keep = min(keep, int(self.batch_tokens * MAX_KEPT_BATCH_SHARE))
        return self.batch_tokens_held + cost + keep <= self.batch_tokens

    def can_prefill(self, prompt_tokens: int, kept: Kept = NOTHING_KEPT) -> bool:
        """Room in the prefill budget, less what is `kept` for requests waiting in line;
        a prompt over it goes when nothing else prefills."""
        if not self.prefilling_tokens and not self.others_prefilling_s and not kept.prefill_s:
            return True
        if self.max_prefill_tokens and (
            self.prefilling_tokens + kept.prefill_tokens + prompt_tokens > self.max_prefill_tokens
        ):
            return False
        if self.prefill_budget_s:
            if self.rides_along(prompt_tokens):
                # Small prompts together stay within one budget beside the long one, as
                # one prompt of their tokens: the first token's fixed cost is paid once per
                # engine step, not once per prompt (counted per prompt, a 20 ms prior let
                # four 10-token prompts prefill at once).
                riding = self.riding_tokens + prompt_tokens
                return self.model.prefill_s(riding) <= self.prefill_budget_s
            in_prefill = self.prefilling_s + self.others_prefilling_s + kept.prefill_s
            return in_prefill + self.model.prefill_s(prompt_tokens) <= self.prefill_budget_s
        return True

    def rides_along(self, prompt_tokens: int) -> bool:
        """A prompt small enough against the budget to prefill beside the one in flight
        (`RIDE_ALONG`)."""
        own_s = prompt_tokens / self.model.prefill_tokens_per_s
        return own_s <= RIDE_ALONG * self.prefill_budget_s

    def prefill_ahead_tokens(self, now: float) -> int:
        """Prompt tokens predicted still to prefill for requests dispatched here before."""
        rate = self.model.prefill_tokens_per_s
        return sum(
            max(0, slot.prefill_tokens - int((now - slot.dispatched_at) * rate))
            for slot in self._prefilling
        )

    def note_ended(self, prefilled_tokens: int) -> None:
        """A request ended here, having prefilled `prefilled_tokens` (the gateway's count)."""
        self.ended_tokens += prefilled_tokens
        self.ended_requests += 1

    def take_ended(self) -> float | None:
        """The mean tokens prefilled by the requests noted since the last call (None: no
        request), and start again."""
        mean = self.ended_tokens / self.ended_requests if self.ended_requests else None
        self.ended_tokens, self.ended_requests = 0, 0
        return mean

    def note_engine_load(
        self,
        waiting: float | None,
        running: float | None,
        kv_usage: float | None,
        *,
        hold: bool = True,
    ) -> None:
        """What the engine's own metrics say: hold dispatch while it has a queue (and
        `hold`: the caller has seen it long enough to trust it)."""
        self.engine_waiting, self.engine_running, self.engine_kv_usage = waiting, running, kv_usage
        if hold and waiting is not None and waiting >= 1:
            # No more than now, and no more than it runs: the rest would only queue inside.
            ours_running = self.in_flight - int(waiting) if running is None else int(running)
            self.engine_limit = max(1, min(self.in_flight, ours_running))
        else:
            self.engine_limit = None


@dataclass(slots=True, eq=False)
class Slot:
    """One request's place on a backend."""

    backend: Backend
    prompt_tokens: int
    output_tokens: int
    dispatched_at: float = 0.0
    #: Predicted seconds of its prefill (what it holds of the prefill budget).
    prefill_s: float = 0.0
    #: Prompt tokens predicted still in prefill ahead of it when it was dispatched.
    ahead_tokens: int = 0
    #: The engine was reporting a queue of its own (its TTFT is not a clean sample).
    engine_queued: bool = False
    prefilling: bool = True
    #: Prompt tokens the backend probably has cached (routing's guess: the prefix sent
    #: there times the share of such guesses it really served from cache), and the rest:
    #: what it has to prefill.
    cached_tokens: int = 0
    prefill_tokens: int = 0
    #: The prefix sent there before, in tokens (the guess before that share).
    matched_tokens: int = 0
    #: Why this backend: BY_PREFIX, BY_SESSION or BY_LOAD.
    reason: str = BY_LOAD
    #: Its lease in Redis ([redis]); None: none (no Redis, or Redis down at dispatch).
    lease: str | None = None
    #: The LoRA adapter it was routed for (None: not routed as one).
    adapter: str | None = None
    #: The model it was routed for (an answer carried over goes where that is served).
    model: str | None = None
    #: Its prompt rode along beside the prefill in flight (`Backend.rides_along`).
    riding: bool = False
    #: What it holds of its backend's batch tokens (`Backend.batch_cost`).
    batch_tokens: int = 0


class BackendPool:
    """Hands out slots on the least loaded available backend of a lane."""

    def __init__(
        self,
        backends: list[Backend],
        *,
        lane_backends: Mapping[str, Collection[str] | None] | None = None,
        health: HealthSettings | None = None,
        routing: RoutingSettings | None = None,
        clock: Callable[[], float],
    ) -> None:
        self.backends: list[Backend] = []
        self.health = health or HealthSettings()
        self.routing = routing or RoutingSettings()
        self.clock = clock
        self._lane_backends: dict[str, list[Backend]] = {}
        self.set_members(backends, lane_backends or {})
        #: Called when a backend may have become available again (the scheduler's dispatch).
        self.on_available: Callable[[], None] = lambda: None
        #: Called when a slot's prompt leaves prefill, and when a slot is given back (the
        #: slot leases shared with other replicas follow them).
        self.on_prefill_done: Callable[[Slot], None] | None = None
        self.on_give_back: Callable[[Slot], None] | None = None
        #: Each LoRA adapter's last backend, so its requests stay together.
        self._adapter_home: dict[str, str] = {}
        #: Where a backend's ejection, failed check and return are said (None: nowhere):
        #: on call, the moment a backend leaves or rejoins is what the timeline needs,
        #: not only the `gateway_backend_available` gauge.
        self.events: Any = None

    def set_members(
        self, backends: list[Backend], lane_backends: Mapping[str, Collection[str] | None]
    ) -> None:
        """Its backends, and which of them each lane may use (by name; a lane not named
        may use all). At start, and when a reload or DNS changes them (`live/`): a backend
        that left is no longer chosen; its requests in flight still give their slots back
        to it, the object they hold."""
        for backend in backends:
            if backend not in self.backends:
                backend.prefixes.capacity_tokens = self.routing.prefix_memory_tokens
        self.backends = list(backends)
        by_name = {b.name: b for b in backends}
        self._lane_backends = {
            lane: self.backends if names is None else [by_name[n] for n in names if n in by_name]
            for lane, names in lane_backends.items()
        }

    def backends_of(self, lane: str) -> list[Backend]:
        return self._lane_backends.get(lane, self.backends)

    def slots_of(self, lane: str) -> int:
        """Slots of the backends a lane may use (their max_concurrency)."""
        return sum(b.max_concurrency for b in self.backends_of(lane))

    def shares_backends(self, lane: str, other: str) -> bool:
        """The two lanes compete for slots: some backend serves both."""
        mine = self.backends_of(lane)
        return any(b in mine for b in self.backends_of(other))

    def has_available(self, lane: str | None = None) -> bool:
        now = self.clock()
        candidates = self.backends if lane is None else self.backends_of(lane)
        return any(b.available(now) for b in candidates)

    def has_free_slot(self, lane: str) -> bool:
        """A backend of `lane` is available with a free slot (others' leases counted)."""
        now = self.clock()
        return any(b.free_slots > 0 and b.available(now) for b in self.backends_of(lane))

    def require_available(self, lane: str, model: str | None = None) -> None:
        """NoBackend (retry after the next health check) when nothing serves `lane` now
        (or no backend of it that serves `model`)."""
        if not self.has_available(lane):
            raise NoBackend(
                f"No healthy backend serves the '{lane}' lane right now.",
                retry_after_s=self.health.interval_s,
            )
        if model is not None:
            now = self.clock()
            if not any(b.available(now) for b in self._serving(lane, model, self.backends)):
                raise NoBackend(
                    f"No healthy backend serves {model!r} in the '{lane}' lane right now.",
                    retry_after_s=self.health.interval_s,
                )

    def token_ratio(self, lane: str | None = None) -> float:
        """The backends' tokens per gateway token (of a lane's, or all): the largest, so a
        cap holds on every backend; 1.0 when unknown."""
        backends = self.backends if lane is None else self.backends_of(lane)
        ratios = [b.model.token_ratio for b in backends]
        return max(ratios) if ratios else 1.0

    def known_wait_s(self, lane: str, ahead: Sequence[tuple[int, Any]]) -> float:
        """The least wait of a request of `lane` with `ahead` of it in line (each a prompt's
        tokens and its routing hint; `scheduling/known_wait.py`). A slot whose prompt is in
        prefill frees no sooner than what is left of it: the prompts dispatched before it
        there, then its own, at its backend's learned rate. A request ahead holds a slot at
        least for its prompt's uncached part at the fastest learned rate. A backend whose
        rate is still the prior's counts all its slots free: no refusal rests on a guess."""
        now = self.clock()
        idle, busy = 0, []
        fastest = 0.0
        for backend in self.backends_of(lane):
            if not backend.available(now):
                continue
            model = backend.model
            if not model.prefill_learned:
                idle += backend.slot_limit
                continue
            fastest = max(fastest, model.prefill_tokens_per_s)
            left = [
                remaining
                for slot in backend._prefilling
                if (
                    remaining := model.prefill_s(slot.ahead_tokens + slot.prefill_tokens)
                    - (now - slot.dispatched_at)
                )
                > 0
            ]
            busy += left
            idle += max(0, backend.slot_limit - len(left))
        holds = []
        if fastest:
            for prompt_tokens, hint in ahead:
                prefix = hint.prefix if isinstance(hint, RouteHint) else None
                uncached = prompt_tokens - self.expected_cached_tokens(prefix)
                holds.append(max(0, uncached) / fastest)
        return known_wait_s(idle, busy, holds)

    def prefill_s(self, lane: str, prompt_tokens: int) -> float:
        """Predicted prefill of a prompt on the slowest backend of a lane."""
        return max((b.model.prefill_s(prompt_tokens) for b in self.backends_of(lane)), default=0.0)

    def try_take(
        self,
        lane: str,
        prompt_tokens: int,
        output_tokens: int = 0,
        exclude: Slot | None = None,
        hint: RouteHint | None = None,
        waited_s: float | None = None,
        ahead: int = 0,
        keep_batch_tokens: int = 0,
    ) -> Slot | Deferred | None:
        """A slot on the best backend for this request; not on `exclude`'s backend.

        Among the backends within the load margin: the most of the prompt cached (in
        sixteenths of it), then the session's backend, then the soonest first token.
        The cache comes first because a turn that leaves its history behind costs more
        than its own wait: every later turn of the conversation prefills it again.

        A request that has waited `waited_s` in line (behind `ahead` others) may instead
        be `Deferred` for a busy backend that would still give it a sooner first token
        after the wait for a slot there (its prompt cached there, or a faster engine):
        see `_defer`. An engine that bounds its batch by tokens (TGI's) takes it only
        with `keep_batch_tokens` of them left beside it for the lanes above.
        """
        now = self.clock()
        avoid = exclude.backend if exclude is not None else None
        candidates = [
            backend
            for backend in self.backends_of(lane)
            if backend is not avoid
            and backend.free_slots > 0
            and backend.available(now)
            and backend.fits_batch(prompt_tokens, output_tokens, keep_batch_tokens)
        ]
        if not candidates:
            return None
        model = hint.model if hint is not None else None
        if model is not None:
            candidates = self._serving(lane, model, candidates)
            if not candidates:  # those that serve it are full: let the ones behind go
                return Deferred(self.health.interval_s, own_full=True)
        adapter = self._adapter_of(lane, hint)
        adapter_reason = None
        if adapter is not None:
            # It may wait for a full backend that runs it, as long as for a sooner one.
            may_wait = waited_s is not None and waited_s < min(
                self.routing.max_wait_for_sooner_s,
                hint.wait_budget_s if hint is not None else math.inf,
            )
            candidates, adapter_reason = self._adapter_candidates(
                lane, adapter, candidates, may_wait, now
            )
            if not candidates:  # those that serve it are full: let the ones behind go
                return Deferred(self.health.interval_s)
        routing = self.routing
        prefix = hint.prefix if hint is not None and routing.prefix_affinity else None
        session = hint.session if hint is not None and routing.session_affinity else None
        affine = None
        if session is not None and len(candidates) > 1:
            affine = self._session_backend(lane, session, now)
        # Only backends within the margin of the least loaded may win by cache or session.
        within = min(_busy(backend) for backend in candidates) + routing.cache_load_margin
        # The room a backend keeps for the requests in line waiting for it is theirs while
        # another backend has room: taken by whoever is served first, it would send the
        # waiter, after its wait, to prefill its whole history on a cold engine.
        best: Choice | None = None
        best_free: Choice | None = None
        roomy, roomy_free = [], []
        for backend in candidates:
            cached = matched = 0
            favoured = _busy(backend) <= within
            if prefix is not None and favoured:
                matched = min(prompt_tokens, backend.prefixes.matched_tokens(prefix))
                cached = int(matched * backend.model.cache_hit_share)
            uncached = prompt_tokens - cached
            if not backend.can_prefill(uncached):
                continue
            ttft = (
                backend.prefilling_s
                + backend.others_prefilling_s
                + backend.model.prefill_s(uncached)
            )
            key = (
                -(cached * 16 // max(1, prompt_tokens)),
                not (favoured and backend is affine),
                # The soonest first token in 10 ms steps (so equal backends tie), then the
                # fewest outstanding tokens per unit of weight.
                int(ttft * 100),
                backend.outstanding_tokens / backend.weight,
                backend.in_flight,
            )
            roomy.append(backend)
            choice = None
            if best is None or key < best.key:
                best = choice = Choice(key, backend, cached, matched, ttft)
            kept = _kept_for_others(backend, hint, now)
            if backend.free_slots > kept.slots and backend.can_prefill(uncached, kept):
                roomy_free.append(backend)
                if best_free is None or key < best_free.key:
                    best_free = choice or Choice(key, backend, cached, matched, ttft)
        if best_free is not None:  # else the first in line takes what is kept
            best, roomy = best_free, roomy_free
        if best is None:
            return None
        if hint is not None and waited_s is not None and routing.max_wait_for_sooner_s:
            deferred = self._defer(lane, prompt_tokens, hint, best, roomy, waited_s, ahead, now)
            if deferred is not None:
                return deferred
            for backend in self.backends_of(lane):  # it waits for none of them any more
                if backend.waiters:
                    backend.waiters.pop(hint, None)
        if best.cached:
            reason = BY_PREFIX
        elif adapter_reason is not None:
            reason = adapter_reason
        else:
            reason = BY_SESSION if best.backend is affine and not best.key[1] else BY_LOAD
        slot = self._reserve(
            best.backend, prompt_tokens, output_tokens, best.cached, reason, prefix, now
        )
        slot.matched_tokens = best.matched
        slot.model = model
        if adapter is not None:
            slot.adapter = adapter
            best.backend.lora.dispatched(adapter)
            self._adapter_home[adapter] = best.backend.name
        return slot

    def take_over(self, lane: str, slot: Slot) -> Slot | None:
        """A slot for an answer carried over mid-stream (`resume.py`) when no backend of the
        lane has a free one: on the available backend other than `slot`'s with the most
        room, over its limit. Half an answer already sent is worth more than holding one
        engine's batch at its size for the seconds the rest takes. None: no such backend."""
        now = self.clock()
        candidates = [
            backend
            for backend in self.backends_of(lane)
            if backend is not slot.backend and backend.available(now)
        ]
        if slot.model is not None:
            candidates = self._serving(lane, slot.model, candidates)
        if not candidates:
            return None
        backend = max(
            candidates, key=lambda b: (b.free_slots / b.max_concurrency, -b.outstanding_tokens)
        )
        taken = self._reserve(
            backend, slot.prompt_tokens, slot.output_tokens, 0, BY_LOAD, None, now
        )
        taken.model = slot.model
        return taken

    def _serving(self, lane: str, model: str, candidates: list[Backend]) -> list[Backend]:
        """The candidates of `lane` that serve `model` (`served.serving`, over the whole
        pool: a lane kept off the backends that list a model must not send it to one that
        answers any name instead). One backend: the router sent it what it serves."""
        if len(self.backends) < 2:
            return candidates
        allowed = serving(model, self.backends)
        if len(allowed) == len(self.backends):
            return candidates
        mine = self.backends_of(lane)
        return [b for b in candidates if b in allowed and b in mine]

    def _adapter_of(self, lane: str, hint: RouteHint | None) -> str | None:
        """The request's model when it is a LoRA adapter a backend of the lane lists."""
        model = hint.model if hint is not None else None
        if model is None or not self.routing.adapter_affinity:
            return None
        return model if any(model in b.lora.listed for b in self.backends_of(lane)) else None

    def _adapter_candidates(
        self, lane: str, adapter: str, candidates: list[Backend], may_wait: bool, now: float
    ) -> tuple[list[Backend], str | None]:
        """The candidates an adapter's request should choose among (`adapters.py`); none
        while it had better wait for a full backend that runs it."""
        runs_elsewhere = may_wait and any(
            b not in candidates and b.available(now) and adapter in b.lora.active()
            for b in self.backends_of(lane)
        )
        names, reason = preferred_backends(
            adapter,
            [
                AdapterCandidate(
                    b.name,
                    adapter in b.lora.listed,
                    b.lora.active(),
                    b.lora.max_lora,
                    b.lora.loaded(),
                )
                for b in candidates
            ],
            self._adapter_home.get(adapter),
            runs_elsewhere,
        )
        return [b for b in candidates if b.name in names], reason

    def _defer(
        self,
        lane: str,
        prompt_tokens: int,
        hint: RouteHint,
        best: Choice,
        roomy: list[Backend],
        waited_s: float,
        ahead: int,
        now: float,
    ) -> Deferred | None:
        """Deferred while a busy backend would give a sooner first token than the best
        free one (`best`) even after this request's wait for a slot there.

        Sooner because its engine has more of the prompt cached, or is faster. Starting
        on the free one where less is cached also costs others: its engine prefills
        again what the busy one holds, and every request behind it there waits as long,
        so that prefill counts against the free one twice. The wait for a slot is
        predicted from how often its slots free: the requests ahead in line and those
        already waiting for it go first, one release each (and their prefill before its
        own), so a hot prefix or a fast engine draws only the waiters it can serve in
        time and the rest go elsewhere at once. It waits at most the gain, within its
        budget (`max_wait_for_sooner_s`, at most half its queue deadline), once: when
        that wait is over it takes the best free backend. Requests behind it in line
        are served meanwhile, but not with what the backend it waits for frees.
        """
        budget = min(self.routing.max_wait_for_sooner_s, hint.wait_budget_s) - waited_s
        for backend in self.backends_of(lane):
            wait = backend.waiters.get(hint)
            if wait is not None:  # waiting for it: until it has room or patience runs out
                if wait.until > now and budget > 0 and backend.available(now):
                    if backend not in roomy:
                        return Deferred(wait.until - now)
                del backend.waiters[hint]
                return None  # it has room now (it is the best free one) or the wait is over
        if budget <= 0:
            return None
        prefix = hint.prefix if self.routing.prefix_affinity else None
        target, net_gain, gross_gain, target_uncached = None, 0.0, 0.0, 0
        for backend in self.backends_of(lane):
            if backend in roomy or backend.hold_s is None or not backend.available(now):
                continue
            cached = 0
            if prefix is not None:
                matched = min(prompt_tokens, backend.prefixes.matched_tokens(prefix))
                cached = int(matched * backend.model.cache_hit_share)
            # It is on no list yet (see above): every waiter there goes first.
            kept = _kept_for_others(backend, hint, now)
            slot_wait = 0.0
            if backend.free_slots <= kept.slots:
                slot_wait = (ahead + kept.slots + 1) * backend.hold_s / backend.max_concurrency
            # The prefill in flight there, then the waiters', goes on while the request
            # waits for the slot.
            ahead_s = backend.prefilling_s + backend.others_prefilling_s + kept.prefill_s
            ttft = max(0.0, ahead_s - slot_wait) + backend.model.prefill_s(prompt_tokens - cached)
            # Starting where less is cached also prefills, there, what this backend has
            # cached: time every request behind it on that engine waits too.
            lost_s = max(0, cached - best.cached) / best.backend.model.prefill_tokens_per_s
            gain = best.ttft + lost_s - ttft
            if gain - slot_wait > net_gain:
                target, net_gain, gross_gain = backend, gain - slot_wait, gain
                target_uncached = prompt_tokens - cached
        if target is None:
            return None
        patience = min(budget, gross_gain)
        for other, wait in list(target.waiters.items()):
            if wait.until <= now:
                del target.waiters[other]
        target.waiters[hint] = Wait(
            now + patience, target_uncached, target.model.prefill_s(target_uncached)
        )
        return Deferred(patience)

    def _session_backend(self, lane: str, session: str, now: float) -> Backend | None:
        """The session's backend: the highest rendezvous weight among the lane's available
        ones (full or not: a busy session backend is skipped, not replaced)."""
        available = [b for b in self.backends_of(lane) if b.available(now)]
        return max(available, key=lambda b: rendezvous_weight(session, b.name), default=None)

    def _reserve(
        self,
        backend: Backend,
        prompt_tokens: int,
        output_tokens: int,
        cached: int,
        reason: str,
        prefix: PromptPrefix | None,
        now: float,
    ) -> Slot:
        """Take the slot on `backend` (in the same step as choosing it: no race)."""
        uncached = prompt_tokens - cached
        slot = Slot(
            backend,
            prompt_tokens,
            output_tokens,
            dispatched_at=now,
            prefill_s=backend.model.prefill_s(uncached),
            ahead_tokens=backend.prefill_ahead_tokens(now) if backend.prefilling_tokens else 0,
            engine_queued=backend.engine_limit is not None,
            cached_tokens=cached,
            prefill_tokens=uncached,
            reason=reason,
        )
        if backend.batch_tokens is not None:
            slot.batch_tokens = backend.batch_cost(prompt_tokens, output_tokens)
            backend.batch_tokens_held += slot.batch_tokens
        backend.in_flight += 1
        backend.dispatches += 1
        backend.prefilling_tokens += uncached
        backend.prefilling_s += slot.prefill_s
        backend.outstanding_tokens += prompt_tokens + output_tokens
        backend._prefilling.add(slot)
        if backend.prefill_budget_s and backend.rides_along(prompt_tokens):
            slot.riding = True
            backend.riding_tokens += uncached
        if prefix is not None:
            backend.prefixes.add(prefix)
        return slot

    def expected_cached_tokens(self, prefix: PromptPrefix | None) -> int:
        """The most prompt tokens any backend probably has cached (for the lane choice by
        the uncached part, made before the lane and so its backends are known)."""
        if prefix is None or not self.routing.prefix_affinity:
            return 0
        return max((b.prefixes.matched_tokens(prefix) for b in self.backends), default=0)

    def prefill_done(self, slot: Slot) -> None:
        """The backend answered its first byte: the prompt is no longer in prefill."""
        if slot.prefilling:
            slot.prefilling = False
            backend = slot.backend
            backend.prefilling_tokens -= slot.prefill_tokens
            if slot.riding:
                backend.riding_tokens -= slot.prefill_tokens
            backend._prefilling.discard(slot)
            # Summed floats drift: recompute the total from what is left.
            backend.prefilling_s = (
                sum(s.prefill_s for s in backend._prefilling) if backend._prefilling else 0.0
            )
            if self.on_prefill_done is not None:
                self.on_prefill_done(slot)

    def give_back(self, slot: Slot) -> None:
        self.prefill_done(slot)
        backend = slot.backend
        held = self.clock() - slot.dispatched_at
        backend.hold_s = (
            held if backend.hold_s is None else backend.hold_s + 0.2 * (held - backend.hold_s)
        )
        backend.in_flight -= 1
        backend.outstanding_tokens -= slot.prompt_tokens + slot.output_tokens
        backend.batch_tokens_held -= slot.batch_tokens
        if slot.adapter is not None:
            backend.lora.ended(slot.adapter, self.clock())
        if self.on_give_back is not None:
            self.on_give_back(slot)

    def any_backend(self) -> Backend | None:
        """An available backend for requests that need no slot (model listing)."""
        now = self.clock()
        return next((b for b in self.backends if b.available(now)), None)

    # -- health ------------------------------------------------------------------------

    def record_result(self, backend: Backend, outcome: Outcome) -> None:
        """Passive health: what one request's outcome says about its backend."""
        if outcome.counts_against_backend:
            self.report_failure(backend)
        elif outcome.counts_for_backend:
            backend.consecutive_failures = 0

    def report_failure(self, backend: Backend) -> bool:
        """Count a failure; eject the backend at the threshold. True when it was ejected."""
        backend.consecutive_failures += 1
        if backend.consecutive_failures < self.health.failures_to_eject:
            return False
        self.eject(backend)
        return True

    def eject(self, backend: Backend) -> None:
        cooldown = min(self.health.eject_max_s, self.health.eject_base_s * 2**backend.ejections)
        backend.ejections += 1
        backend.consecutive_failures = 0
        backend.ejected_until = self.clock() + cooldown
        # Failing: it may be restarting, and a restarted engine has lost its cache.
        backend.prefixes.clear()
        if self.events is not None:
            self.events.warning(
                "backend_ejected",
                backend=backend.name,
                failures=self.health.failures_to_eject,
                cooldown_s=cooldown,
                ejections=backend.ejections,
            )

        def cooled_down() -> None:
            if self.events is not None and backend.available(self.clock()):
                self.events.info("backend_back", backend=backend.name, after="ejection")
            self.on_available()  # serve the queues again (a no-op if still unhealthy)

        asyncio.get_running_loop().call_later(cooldown, cooled_down)

    def drain(self, backend: Backend, deadline_s: float) -> asyncio.TimerHandle:
        """No new request for `backend`; at `deadline_s` its streams still running are
        handed over (each carried over to another backend when it can be, else cut)."""
        backend.draining = True

        def hand_over() -> None:
            if backend.draining:
                for stream in list(backend.streams):
                    stream.drain()

        return asyncio.get_running_loop().call_later(deadline_s, hand_over)

    def undrain(self, backend: Backend) -> None:
        if backend.draining:
            backend.draining = False
            self.on_available()

    def set_health(self, backend: Backend, healthy: bool) -> None:
        """The result of an active check. A drained backend that failed its check and
        passes again was restarted (the new version of a rollout): it serves again."""
        came_back = healthy and not backend.healthy
        if came_back and not backend.leaving:
            backend.draining = False
        if not healthy:
            backend.prefixes.clear()  # down (maybe restarting): its cache is gone
        if self.events is not None and healthy != backend.healthy:
            if healthy:
                self.events.info("backend_back", backend=backend.name, after="health_check")
            else:
                self.events.warning(
                    "backend_unhealthy", backend=backend.name, check=self.health.path
                )
        backend.healthy = healthy
        if came_back:
            self.on_available()
