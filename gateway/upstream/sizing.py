"""The gateway sizes itself to its backends: slots, context, deadlines, engine queues.

Every health-check round (and once at start) it

- asks each backend what it is (`telemetry.probe_facts`: llama.cpp `/props`,
  TGI `/info`, vLLM `/v1/models`): its slots become `max_concurrency` unless
  the config sets it, its context window and input limit the gateway's caps
  unless the config sets them, so a request the backend would reject for
  length is refused at the door, with the same clarity;
- reads each engine's own load (`telemetry.fetch_load`, its `/metrics`): while
  an engine reports requests waiting inside it, the pool sends it no more
  than it runs (`Backend.note_engine_load`); its request time histograms, against
  the last scrape's, give the mean split of the requests that ended in between
  (`Backend.engine_window`), with the mean prompt the gateway saw end there
  meanwhile, to set the engine's prefill against the gateway's estimates;
- with LoRA on (the backend lists adapters, or its engine reports them), reads its
  adapters every round (`/v1/models`: an adapter loaded at run time is routed to
  after the next check) and the ones at work (`vllm:lora_requests_info`) into
  `Backend.lora`, which `adapters.py` routes by;
- refits the lanes: slot limits from the backends' slots, and deadlines to the
  engine floor the backends' learned prefill rates imply (`fitting`), with a
  warning naming the numbers when a configured deadline is below it;
- logs the learned figures when they change a lot.

What it decides it writes into the pool and the scheduler; the requests read
it from there. A backend that answers none of this is simply not sized by it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from gateway.config import LaneSettings, LimitsSettings, Settings, slot_limit
from gateway.scheduling.fairness import DEFAULT_OUTPUT_WEIGHT, learned_output_weight
from gateway.scheduling.fitting import (
    WAIT_ALLOWANCE_OVER_FLOOR,
    PromptSizes,
    engine_floor_s,
    fitted_deadline_s,
)
from gateway.scheduling.learning import MIN_PREFILL_SAMPLE_TOKENS, changed_a_lot
from gateway.scheduling.scheduler import LaneState, Scheduler
from gateway.upstream.engine_timings import window_split
from gateway.upstream.learned_state import LearnedState
from gateway.upstream.pool import Backend, BackendPool
from gateway.upstream.probe import measure_prefill
from gateway.upstream.questions import BackendQuestions, asked
from gateway.upstream.telemetry import BackendFacts, EngineLoad

#: Ask a backend what it is every this many health rounds (it rarely changes).
FACTS_EVERY_ROUNDS = 12
#: Scrapes in a row that must show a queue inside the engine before dispatch is held.
QUEUED_SCRAPES_TO_HOLD = 2
#: A lane's queue deadline while its backends' prefill is not learned yet (at least the
#: configured one): long enough for one long prefill on a CPU four times slower than a
#: laptop's, so no refusal rests on figures not learned.
UNLEARNED_DEADLINE_S = 60.0
#: Why a lane's deadline is what it is (`BackendSizer.deadline_in_force`).
CONFIGURED, DEFAULT, FITTED, UNLEARNED = "configured", "default", "fitted", "unlearned"
#: An engine whose KV cache is this full queues for want of memory, not between steps.
KV_FULL = 0.9
#: A backend whose /metrics said nothing this many times is scraped this much less often.
SILENT_METRICS_BACKOFF = 10
#: Before a lower lane's slot hold is measured: the output of a long request ahead.
PRIOR_LONG_OUTPUT_TOKENS = 256
#: Scrapes in a row of an engine running all the slots its learned batch allows, with
#: none waiting, before more are tried (it may batch more than it was seen to): an
#: eighth more, at least one.
BATCH_PROBE_SCRAPES = 3


@dataclass(slots=True)
class _Known:
    """What the sizer remembers of one backend between rounds."""

    facts: BackendFacts | None = None
    load: EngineLoad | None = None
    silent_scrapes: int = 0
    queued_scrapes: int = 0
    #: The engine's running requests at the last scrape.
    queued_running: float | None = None
    logged_prefill_rate: float = 0.0
    logged_token_ratio: float = 1.0
    #: The most requests it was ever seen to run (a queue below that is not for want of
    #: room in its batch).
    peak_running: int = 0
    #: Scrapes in a row it ran all of its learned batch with none waiting
    #: (`BATCH_PROBE_SCRAPES`).
    batch_full_scrapes: int = 0
    #: Its facts were asked for once (a backend that joined since is asked at once).
    asked: bool = False


def _queued_scrapes(known: _Known, load: EngineLoad) -> int:
    """Scrapes in a row that saw the engine full with requests waiting inside it.

    A request between two engine steps is "waiting" too: on a fast engine at a third of
    its batch a scrape finds one or two most of the time (vLLM on an H100 in the matrix:
    the hold clamped 64 slots to the 30 in use, and short requests queued in the gateway
    at 4x the floor). A real queue has the engine full: its running requests the same as
    at the last scrape (at its batch limit) or its KV cache nearly full."""
    if load.waiting is None or load.waiting < 1:
        return 0
    if not known.queued_scrapes:
        return 1
    # At its peak too: a whole-prompt engine also queues behind one long prefill, its
    # running unchanged meanwhile (TGI at 50% load: 4 waiting beside 3 running, of the 16
    # it had run; held at 3, every lane stood still until the next scrape, 5 s).
    at_limit = (
        load.running is not None
        and load.running == known.queued_running
        and load.running >= known.peak_running
    )
    kv_full = load.kv_usage is not None and load.kv_usage >= KV_FULL
    return known.queued_scrapes + 1 if at_limit or kv_full else 1


class BackendSizer:
    def __init__(
        self,
        settings: Settings,
        pool: BackendPool,
        scheduler: Scheduler,
        events: Any,
        prompt_sizes: PromptSizes,
        pool_name: str = "",
    ) -> None:
        self.settings = settings
        #: The model pool it sizes (its lines name it; "*" for the catch-all pool).
        self.pool_name = pool_name
        self.pool = pool
        self.scheduler = scheduler
        self.events = events
        self.prompt_sizes = prompt_sizes
        #: The caps in force: the config's, tightened by what the backends accept.
        self.limits_in_force = settings.limits
        #: The same for the caps of models with their own (`[[models]] limits`).
        self._in_force: dict[LimitsSettings, LimitsSettings] = {}
        #: By backend name; one that joins later (a reload, DNS) gets its entry then.
        self._known: defaultdict[str, _Known] = defaultdict(_Known)
        self._rounds = 0
        #: The floor behind each lane's deadline, in seconds (for /debug and warnings).
        self.floors: dict[str, float] = {}
        self._warned: dict[str, float] = {}
        #: What `lane_in_force` last said of each lane: deadline, why, slot limit.
        self._said: dict[str, tuple[float, str, int]] = {}
        #: Where the learned figures are kept across a restart (None: nowhere).
        self.learned_state: LearnedState | None = None
        #: A prompt the prior cannot time was sent (one long enough to teach a prefill
        #: rate): from then until the rate is learned, the deadlines are provisional.
        self._sent_unpredictable = False
        self.refit(quiet=True)

    def reconfigure(self, settings: Settings) -> None:
        """A reload: the caps, lanes and routing in force from now on (`refit` follows)."""
        self.settings = settings
        self.limits_in_force = self.limits()
        self._in_force.clear()

    def note_prompt(self, lane: str, prompt_tokens: int) -> None:
        """A request of `lane` with this prompt is about to queue: its size is a sample of
        what a long prompt is, and the first long one sent to engines not learned yet
        makes the deadlines provisional at once (`learned`), before it holds anyone up."""
        self.prompt_sizes.add(lane, prompt_tokens)
        if not self._sent_unpredictable and prompt_tokens >= MIN_PREFILL_SAMPLE_TOKENS:
            self._sent_unpredictable = True
            if not all(b.model.prefill_learned for b in self.pool.backends):
                self.refit()

    async def round(self, through: aiohttp.ClientSession | BackendQuestions) -> None:
        """One sizing round: facts now and then, engine loads, then refit the lanes.

        `through`: the health checks' session (HTTP), or the questions answered by an
        engine model (replay). A failure here is a warning, never the end of the checks.
        """
        try:
            await self._round(asked(through))
        except Exception as error:  # noqa: BLE001 - sizing must not stop health checks
            self.events.warning("sizing_failed", error=repr(error)[:200])

    async def _round(self, questions: BackendQuestions) -> None:
        facts_round = self._rounds % FACTS_EVERY_ROUNDS == 0
        for backend in list(self.pool.backends):
            known = self._known[backend.name]
            if facts_round or not known.asked:
                known.asked = True
                self.apply_facts(backend, await questions.facts(backend))
        for backend in list(self.pool.backends):
            known = self._known[backend.name]
            if not facts_round and self._serves_lora(known):
                listed = await questions.adapters(backend)
                if listed is not None:
                    backend.lora.note_listed(listed)
            if known.silent_scrapes >= 3 and self._rounds % SILENT_METRICS_BACKOFF:
                continue
            # The scrape's time is taken before it: a request of ours that ends meanwhile
            # counts as ended after what the scrape saw.
            scraped_at = self.pool.clock()
            load = await questions.load(backend)
            self.apply_load(backend, load)
            self._apply_lora(backend, load, scraped_at)
        self._rounds += 1
        self.refit()

    async def warm_up(self, through: aiohttp.ClientSession | BackendQuestions) -> None:
        """At start: what each backend is, then its prefill measured; then refit, so a
        deadline below the engine floor is fitted (or warned about) before any traffic."""
        questions = asked(through)
        try:
            for backend in self.pool.backends:
                facts = self._known[backend.name].facts
                if facts is None:  # the first health round may have asked already
                    facts = await questions.facts(backend)
                    self.apply_facts(backend, facts)
                if not backend.model.prefill_learned:
                    await measure_prefill(questions, backend, facts.model if facts else None)
            self.refit()
        except Exception as error:  # noqa: BLE001 - a failed warm-up leaves the priors
            self.events.warning("warm_up_failed", error=repr(error)[:200])

    # -- what the backends say --------------------------------------------------------

    @staticmethod
    def _serves_lora(known: _Known) -> bool:
        """LoRA is on there: it listed adapters, or its engine reports them."""
        return (known.facts is not None and known.facts.adapters is not None) or (
            known.load is not None and known.load.lora is not None
        )

    @staticmethod
    def _apply_lora(backend: Backend, load: EngineLoad | None, scraped_at: float) -> None:
        lora = load.lora if load is not None else None
        if lora is None:
            backend.lora.note_scrape((), (), None, scraped_at)
        else:
            backend.lora.note_scrape(lora.running, lora.waiting, lora.max_lora, scraped_at)

    def forget(self, name: str) -> None:
        """A backend left the pool for good (a reload dropped it, DNS no longer lists it)."""
        self._known.pop(name, None)

    def facts_of(self, backend: Backend) -> BackendFacts | None:
        return self._known[backend.name].facts

    def apply_facts(self, backend: Backend, facts: BackendFacts | None) -> None:
        known = self._known[backend.name]
        if facts is None or facts == known.facts:
            return
        known.facts = facts
        if self.learned_state is not None:
            self.learned_state.check_facts(backend, facts)
        backend.lora.note_listed(facts.adapters or ())
        if facts.slots and not backend.concurrency_configured:
            backend.max_concurrency = min(facts.slots, backend.engine_batch or facts.slots)
        backend.engine_context_tokens = facts.context_tokens
        backend.batch_tokens = facts.batch_tokens
        if not backend.engine_configured:
            backend.engine = facts.engine
        if facts.engine == "llama.cpp" and facts.slots and facts.context_tokens:
            # Its slots' contexts hold its prompts: remember no more prefixes than that.
            # (Recent builds also keep evicted prompts in host memory, `--cache-ram`, whose
            # size /props does not say: what this forgets, the engine may still have.)
            backend.prefixes.capacity_tokens = min(
                self.settings.routing.prefix_memory_tokens, facts.slots * facts.context_tokens
            )
        self.events.info(
            "backend_described",
            backend=backend.name,
            engine=facts.engine,
            slots=backend.max_concurrency,
            slots_from="config" if backend.concurrency_configured else "engine",
            context_tokens=facts.context_tokens,
            max_input_tokens=facts.max_input_tokens,
            batch_tokens=facts.batch_tokens,
        )
        self.limits_in_force = self.limits()
        self._in_force.clear()
        configured, in_force = self.settings.limits, self.limits_in_force
        if in_force.max_prompt_tokens < configured.max_prompt_tokens:
            self.events.warning(
                "limit_tightened_to_backend",
                key="limits.max_prompt_tokens",
                configured=configured.max_prompt_tokens,
                in_force=in_force.max_prompt_tokens,
                backend=backend.name,
                hint="a backend accepts no longer prompt: longer ones get 413 at the door "
                "instead of the backend's 400",
            )

    def in_force(self, configured: LimitsSettings) -> LimitsSettings:
        """A model's configured caps tightened by what this pool's backends accept
        (remembered until the backends' facts change: one lookup per request)."""
        if configured is self.settings.limits:
            return self.limits_in_force
        known = self._in_force.get(configured)
        if known is None:
            known = self._in_force[configured] = self.limits(configured)
        return known

    def limits(self, configured: LimitsSettings | None = None) -> LimitsSettings:
        """The caps in force: the config's (`[limits]`, or one model's), tightened by
        what the backends accept: their context window where the config sets none, and
        their input limit where it is lower."""
        limits = self.settings.limits if configured is None else configured
        facts = [k.facts for k in self._known.values() if k.facts is not None]
        contexts = [f.context_tokens for f in facts if f.context_tokens]
        inputs = [f.max_input_tokens for f in facts if f.max_input_tokens]
        changes: dict[str, int] = {}
        if not limits.context_window and contexts:
            changes["context_window"] = min(contexts)
        if inputs and min(inputs) < limits.max_prompt_tokens:
            changes["max_prompt_tokens"] = min(inputs)
        return msgspec.structs.replace(limits, **changes) if changes else limits

    def apply_load(self, backend: Backend, load: EngineLoad | None) -> None:
        known = self._known[backend.name]
        if load is None:
            known.silent_scrapes += 1
            if known.load is not None:
                backend.note_engine_load(None, None, None)
                backend.engine_window = backend.engine_window_tokens = None
                known.load = None
            return
        known.silent_scrapes = 0
        self._apply_window(backend, known, load)
        if load.kv_capacity_tokens:
            # Remember no more prefixes than its KV cache can hold.
            backend.prefixes.capacity_tokens = min(
                self.settings.routing.prefix_memory_tokens, load.kv_capacity_tokens
            )
        was_queued = backend.engine_limit is not None
        known.queued_scrapes = _queued_scrapes(known, load)
        known.queued_running = load.running
        if load.running is not None:
            known.peak_running = max(known.peak_running, int(load.running))
        self._learn_batch(backend, known, load)
        # A queue seen once may be a request between two engine steps: hold on the second.
        backend.note_engine_load(
            load.waiting,
            load.running,
            load.kv_usage,
            hold=known.queued_scrapes >= QUEUED_SCRAPES_TO_HOLD,
        )
        if (backend.engine_limit is not None) != was_queued:
            self.events.warning(
                "engine_queue" if not was_queued else "engine_queue_gone",
                backend=backend.name,
                engine=load.engine,
                waiting=load.waiting,
                running=load.running,
                holding_at=backend.engine_limit,
            )
        known.load = load

    def _learn_batch(self, backend: Backend, known: _Known, load: EngineLoad) -> None:
        """The engine's own batch, where the config does not set the slots: what it runs
        when it is full (a queue inside it, two scrapes at its peak running count, or its
        KV cache full: `_queued_scrapes`).

        TGI's /info reports its router's limit (128) while its batch is bounded by KV
        tokens (32 sequences of a chat mix on an A10G): sent 128, the requests past its
        batch wait inside it for a whole answer to end, where no lane can put a short one
        first (the matrix: 2.1-2.5x the floor at 80% load). Learned, the batch becomes the
        slots the lanes share. It is probed upward, an eighth at a time, while the engine
        runs all of it with none waiting, since a batch bounded by tokens grows when the
        requests are smaller."""
        if backend.concurrency_configured or load.running is None:
            return
        running = int(load.running)
        full = known.queued_scrapes >= QUEUED_SCRAPES_TO_HOLD
        if full and 0 < running < backend.max_concurrency:
            backend.engine_batch = backend.max_concurrency = running
            known.batch_full_scrapes = 0
            self.events.info("engine_batch_learned", backend=backend.name, slots=running)
            return
        batch = backend.engine_batch
        if batch is None or running < batch or (load.waiting or 0) >= 1:
            known.batch_full_scrapes = 0
            return
        known.batch_full_scrapes += 1
        reported = known.facts.slots if known.facts is not None else None
        if known.batch_full_scrapes >= BATCH_PROBE_SCRAPES and (reported or 0) > batch:
            more = batch + max(1, batch // 8)
            backend.engine_batch = backend.max_concurrency = min(reported or more, more)
            known.batch_full_scrapes = 0

    def _apply_window(self, backend: Backend, known: _Known, load: EngineLoad) -> None:
        """The engine's histograms against the last scrape's: the window's mean split, and
        the mean prompt of the requests the gateway saw end meanwhile. A window in which
        nothing ended (for the engine or for this gateway) keeps the one before: what it
        says is the engine's speed, which idling does not change."""
        tokens = backend.take_ended()
        if load.times is None:  # it stopped telling
            backend.engine_window = backend.engine_window_tokens = None
            return
        before = known.load.times if known.load is not None else None
        window = None if before is None else window_split(before, load.times)
        if window is not None and tokens is not None:
            backend.engine_window, backend.engine_window_tokens = window, tokens

    # -- refitting the lanes ----------------------------------------------------------

    def refit(self, *, quiet: bool = False) -> None:
        """Slot limits, prefill budgets and deadlines from what the backends said and
        taught; `quiet`: without the lifecycle lines (at construction, before `serve`
        could say anything else: a start that fails says only why)."""
        long = self.prompt_sizes.long()
        for backend in self.pool.backends:
            backend.fit_prefill_budget(long)
        for lane in self.settings.lanes:
            slots = self.pool.slots_of(lane.name)
            self.scheduler.set_slot_limit(lane.name, slot_limit(lane, slots), slots)
            floor = self.floor_s(lane.name, lane.max_prompt_tokens)
            self.floors[lane.name] = floor
            self.scheduler.set_wait_allowance(lane.name, WAIT_ALLOWANCE_OVER_FLOOR * floor)
            deadline, why = self.deadline_in_force(lane, floor)
            self.scheduler.set_deadline(lane.name, deadline, adapted=why != CONFIGURED)
            if quiet:
                continue
            self._say_in_force(lane, deadline, why, floor)
            if not lane.fit_timeout_to_engine and floor > lane.queue_timeout_s:
                self._warn_short_deadline(lane.name, lane.queue_timeout_s, floor)
        self.scheduler.cost.output_weight = self.output_token_weight()
        if quiet:
            return
        for state in self.scheduler.lanes:
            self._warn_demand_over_capacity(state.name, state.capacity)
            self._warn_tail_needs_every_slot(state)
        for backend in self.pool.backends:
            self._log_learned(backend)

    def deadline_in_force(self, lane: LaneSettings, floor_s: float) -> tuple[float, str]:
        """A lane's queue deadline and why it is that: `configured` (written, or the
        default where fitting is off: exact), `default` (fitting is on and the engine
        floor fits in it), `fitted` (raised to `DEADLINE_OVER_FLOOR` x the floor) or
        `unlearned` (`UNLEARNED_DEADLINE_S` until the engine's prefill is measured)."""
        configured = lane.queue_timeout_s
        if not lane.fit_timeout_to_engine:
            return configured, CONFIGURED
        if not self.learned(lane.name) and configured < UNLEARNED_DEADLINE_S:
            return UNLEARNED_DEADLINE_S, UNLEARNED
        fitted = fitted_deadline_s(configured, floor_s, fit=True)
        return (fitted, FITTED) if fitted > configured else (configured, DEFAULT)

    def _say_in_force(self, lane: LaneSettings, deadline: float, why: str, floor: float) -> None:
        """One line per lane with what is in force and why, at start and whenever the
        reason, the slot limit or the deadline (by a fifth) changes."""
        state = self.scheduler.lane(lane.name)
        said = self._said.get(lane.name)
        if (
            said is not None
            and said[1] == why
            and said[2] == state.slot_limit
            and not changed_a_lot(said[0], deadline, 1.2)
        ):
            return
        self._said[lane.name] = (deadline, why, state.slot_limit)
        self.events.info(
            "lane_in_force",
            lane=lane.name,
            pool=self.pool_name,
            deadline_s=round(deadline, 3),
            deadline_from=why,
            configured_s=lane.queue_timeout_s,
            fit_timeout_to_engine=lane.fit_timeout_to_engine,
            engine_floor_s=round(floor, 3),
            floor_learned=self.learned(lane.name),
            slot_limit=state.slot_limit,
            max_queue_depth=lane.max_queue_depth,
            promote_after_s=lane.promote_after_s,
            reject_predicted_wait=lane.reject_predicted_wait,
        )

    def _warn_demand_over_capacity(self, lane: str, capacity: int) -> None:
        """Say why a lane's requests wait or are refused when its own demand is more than
        the backends can give it (all their slots, less the floors of the lanes below):
        no order of the queue helps then, only capacity or less traffic."""
        figures = self.scheduler.headroom_figures(lane)
        demand, floors = float(figures["demand_slots"]), int(figures["floors_below"])
        usable = max(1, capacity - floors)
        if demand <= usable:
            self._warned.pop(f"demand:{lane}", None)
            return
        if not changed_a_lot(self._warned.get(f"demand:{lane}", 0.0), demand, 1.2):
            return
        self._warned[f"demand:{lane}"] = demand
        self.events.warning(
            "lane_demand_over_capacity",
            lane=lane,
            arrivals_per_s=figures["arrivals_per_s"],
            hold_s=figures["hold_s"],
            demand_slots=demand,
            usable_slots=usable,
            hint="this lane's own requests need more slots than its backends have beside "
            "the lower lanes' floors: its requests wait or are refused whatever the order; "
            "add backends or slots, or lower its traffic",
        )

    def _warn_tail_needs_every_slot(self, state: LaneState) -> None:
        """Say when a lane's P99 wait could be held within its allowance only by taking
        every slot the lanes below have beyond their floors: its headroom then keeps to
        its wait probability (the lanes below would run by promotion alone), and its
        tail is over the promise. Its demand fits (else `lane_demand_over_capacity`
        says it), but its requests hold their slots long against its allowed wait (a
        CPU vLLM's 32-token answers: 2.4 s against 0.4 s): only more slots serve both."""
        figures = self.scheduler.headroom_figures(state.name)
        key = f"tail:{state.name}"
        tail, demand = figures["tail_slots"], float(figures["demand_slots"] or 0.0)
        # Said again only for a demand a fifth over the highest said: a demand that
        # hovers at the edge (a 4-slot llama.cpp at 115%) said it 22 times in 5 minutes.
        highest = self._warned.get(key, 0.0)
        if tail is None or figures["tail_in_force"] or not demand or demand < 1.2 * highest:
            return
        self._warned[key] = demand
        self.events.warning(
            "lane_tail_needs_every_slot",
            lane=state.name,
            slots=state.capacity,
            tail_slots=tail,
            headroom_slots=figures["headroom_slots"],
            demand_slots=demand,
            hold_s=figures["hold_s"],
            wait_allowance_s=figures["wait_allowance_s"],
            hint="this lane's P99 wait fits its allowance only with every slot kept from "
            "the lanes below, so its headroom keeps to headroom_wait_probability and its "
            "slowest requests wait longer: give the engine more slots (vLLM "
            "--max-num-seqs, SGLang --max-running-requests, llama.cpp --parallel) and "
            "max_concurrency with them, or add a backend",
        )

    def learned(self, lane: str) -> bool:
        """Every backend of `lane` has taught its prefill rate (its own traffic, the
        start-up probe, or the state a restart kept), or no prompt long enough to need it
        was sent yet. Otherwise the floor is the prior's (a GPU's): a deadline fitted to
        it would refuse requests the engine serves a moment later (a slow CPU: every
        short request behind the first long prefill), so the lane's deadline is
        `UNLEARNED_DEADLINE_S` meanwhile. Short prompts alone wait for nothing the
        configured deadline did not allow for: it stays in force."""
        if not self._sent_unpredictable:
            return True
        return all(b.model.prefill_learned for b in self.pool.backends_of(lane))

    def output_token_weight(self) -> float:
        """One output token's cost against a prompt token, for the tenants' fair share:
        configured, or what the learned backends prefill while one output token holds
        a slot (the median over them; the default before any is learned)."""
        configured = self.settings.tenants.output_token_weight
        if configured:
            return configured
        learned = sorted(
            learned_output_weight(b.model.prefill_tokens_per_s, b.model.tpot_s(b.max_concurrency))
            for b in self.pool.backends
            if b.model.prefill_learned
        )
        return learned[len(learned) // 2] if learned else DEFAULT_OUTPUT_WEIGHT

    def floor_s(self, lane: str, lane_max_prompt: int | None) -> float:
        """The engine floor of a lane: one long prefill plus its own, on its slowest backend;
        for a lower lane, at least the promotion its line's head waits for under the
        higher lanes' pressure (`_promotion_floor_s`).

        On a backend of one slot no slot can be kept for the lane: a request of it may
        arrive just after a long one took the slot, and waits for that one's whole answer,
        not only its prefill (llama.cpp's `--parallel 1` on a laptop)."""
        own = self.prompt_sizes.own(lane, lane_max_prompt)
        long = self.prompt_sizes.long()
        floors = []
        for backend in self.pool.backends_of(lane):
            floor = engine_floor_s(backend.model.prefill_s, long, own)
            if backend.slot_limit <= 1:
                floor += self._long_hold_s(lane, backend, long) - backend.model.prefill_s(long)
            floors.append(floor)
        return max(max(floors, default=0.0), self._promotion_floor_s(lane))

    def _promotion_floor_s(self, lane: str) -> float:
        """What the head of a lower lane's line waits under the higher lanes' sustained
        pressure: it gets a slot by promotion only, once the request of its lane running
        ends (the lane's measured slot hold) and `promote_after_s` more have passed. A
        deadline under it, on an engine where a long answer holds its slot for seconds
        (a CPU's), turns long requests away after they waited most of it (0: not a lower
        lane, no promotion, or no hold measured yet)."""
        state = self.scheduler.lane(lane)
        after = state.settings.promote_after_s
        if not state.higher or after is None or state.hold_ewma_s is None:
            return 0.0
        return after + state.hold_ewma_s

    def _long_hold_s(self, lane: str, backend: Backend, long_tokens: int) -> float:
        """How long a request of a lower lane holds its slot: learned (the longest of the
        lanes' moving averages below `lane`), else a long prefill and its prior answer."""
        state = self.scheduler.lane(lane)
        holds = [other.hold_ewma_s for other in state.lower if other.hold_ewma_s is not None]
        if holds:
            return max(max(holds), backend.model.prefill_s(long_tokens))
        answer = backend.model.tpot_s(1) * PRIOR_LONG_OUTPUT_TOKENS
        return backend.model.prefill_s(long_tokens) + answer

    def _warn_short_deadline(self, lane: str, deadline: float, floor: float) -> None:
        """A written deadline under the engine floor is kept, and said once with the
        figures (again when the floor moves by a fifth). Only a learned floor is worth
        a warning: the prior's is a GPU's guess."""
        if not self.learned(lane) or not changed_a_lot(self._warned.get(lane, 0.0), floor, 1.2):
            return
        self._warned[lane] = floor
        self.events.warning(
            "lane_deadline_below_engine_floor",
            lane=lane,
            pool=self.pool_name,
            deadline_s=deadline,
            engine_floor_s=round(floor, 2),
            hint="kept as written: a request of this lane that arrives behind one long "
            "prefill gets 429 or 503 though the engine would serve it a moment later; "
            "raise queue_timeout_s, or set fit_timeout_to_engine = true to have it fitted",
        )

    def _log_learned(self, backend: Backend) -> None:
        known = self._known[backend.name]
        model = backend.model
        if not model.prefill_learned:
            return
        rate, ratio = model.prefill_tokens_per_s, model.token_ratio
        if changed_a_lot(known.logged_prefill_rate, rate) or changed_a_lot(
            known.logged_token_ratio, ratio, 1.1
        ):
            known.logged_prefill_rate, known.logged_token_ratio = rate, ratio
            self.events.info("backend_learned", backend=backend.name, **model.figures().to_json())

    # -- what it knows, for /debug/backends and check-config --probe -----------------

    def describe(self) -> list[dict[str, Any]]:
        result = []
        for backend in self.pool.backends:
            known = self._known[backend.name]
            facts = known.facts
            load = known.load
            result.append(
                {
                    "name": backend.name,
                    "url": backend.url,
                    "slots": backend.max_concurrency,
                    "slots_from": "config"
                    if backend.concurrency_configured
                    else ("engine" if facts and facts.slots else "default"),
                    "in_flight": backend.in_flight,
                    "draining": backend.draining,
                    "leaving": backend.leaving,
                    "prefilling_s": round(backend.prefilling_s, 3),
                    "engine": None if facts is None else facts.engine,
                    "context_tokens": None if facts is None else facts.context_tokens,
                    "max_input_tokens": None if facts is None else facts.max_input_tokens,
                    "batch_tokens": backend.batch_tokens,
                    "batch_tokens_held": backend.batch_tokens_held,
                    "engine_load": None
                    if load is None
                    else {
                        "engine": load.engine,
                        "waiting": load.waiting,
                        "running": load.running,
                        "kv_usage": load.kv_usage,
                    },
                    "holding_at": backend.engine_limit,
                    "engine_window": _window(backend),
                    "learned": backend.model.figures(max(1, backend.in_flight)).to_json(),
                    "serves": backend.served.describe(),
                }
            )
        return result

    def describe_lanes(self) -> list[dict[str, Any]]:
        return [
            {
                "lane": lane.name,
                "configured_timeout_s": lane.settings.queue_timeout_s,
                "fit_timeout_to_engine": lane.settings.fit_timeout_to_engine,
                "deadline_s": round(lane.deadline_s, 3),
                "deadline_from": self.deadline_in_force(
                    lane.settings, self.floors.get(lane.name, 0.0)
                )[1],
                "engine_floor_s": _rounded(self.floors.get(lane.name)),
                "slot_limit": lane.slot_limit,
                "predicted_wait_s": self.scheduler.predicted_wait_s(lane.name),
                "headroom": self.scheduler.headroom_figures(lane.name),
                "tenants": _tenant_shares(lane),
            }
            for lane in self.scheduler.lanes
        ]


#: Tenants listed per lane in /debug/backends (those waiting or running first).
DESCRIBED_TENANTS = 20


def _tenant_shares(lane: LaneState) -> list[dict[str, Any]]:
    """The lane's fair share as it stands: each tenant's counter (weighted tokens served),
    weight, queued and running requests; the busiest first."""
    shares = sorted(lane.queue.tenants(), key=lambda s: (-(len(s.queue) + s.in_flight), s.counter))
    return [
        {
            "tenant": share.name or "(all: fair_share off)",
            "weight": share.weight,
            "served_tokens_per_weight": round(share.counter, 1),
            "queued": len(share.queue),
            "in_flight": share.in_flight,
        }
        for share in shares[:DESCRIBED_TENANTS]
    ]


def _window(backend: Backend) -> dict[str, float] | None:
    """The engine's latest histogram window, as /debug/backends shows it (ms)."""
    window, tokens = backend.engine_window, backend.engine_window_tokens
    if window is None or tokens is None:
        return None
    return {
        "requests": window.requests,
        "queue_ms": round(window.queue_s * 1000.0, 3),
        "prefill_ms": round(window.prefill_s * 1000.0, 3),
        "decode_ms": round(window.decode_s * 1000.0, 3),
        "mean_prefilled_tokens": round(tokens, 1),
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
