"""The two runs on one virtual clock: straight to the engines, and through the gateway's code.

The gateway run is wired as `serve` wires it (`app.build_pools`: a pool per model, its
scheduler, its sizer learning the engines) and makes the calls `gateway/http/proxy.py`
makes around a request, in its order: the model's pool → `admit` (caps, lane choice) →
`pool.require_available` → the lane's prompt sizes → `scheduler.acquire` (queue,
predicted-wait refusals, queue timeout) → dispatch to the slot's backend → on the first
token `scheduler.prefill_done` → at the end `split_time`/`learn_from` (the pool's learned
prefill and TPOT) → `scheduler.release` (the slot back, the next one granted). The
sizer's rounds and the start-up probe run on the same clock. The engines are the
simulator's, unchanged, stepped by the virtual loop.
"""

from __future__ import annotations

import asyncio
import io
import itertools
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

from gateway.admission.admit import RequestShape, admit
from gateway.app import build_pools
from gateway.config import Settings
from gateway.http.proxy import WAIT_FOR_SOONER_SHARE
from gateway.observability.logs import make_logger, render_request_line
from gateway.observability.record import RequestRecord
from gateway.outcomes import Outcome, Refusal
from gateway.scheduling.scheduler import WaitNote
from gateway.tools.replay.answers import EngineAnswers, ModelledEngine, modelled_engines
from gateway.tools.replay.sources import Arrival
from gateway.tools.replay.vclock import run_virtual
from gateway.tools.simulator.config import SimulatorConfig
from gateway.tools.simulator.engine import Engine, TokenEvent
from gateway.tools.simulator.engine import Sequence as EngineSequence
from gateway.tools.simulator.prefix_cache import PromptBlocks, prompt_blocks
from gateway.upstream.learn import learn_from, split_time
from gateway.upstream.pool import RouteHint
from gateway.upstream.sizing import BackendSizer

#: The class of a request no lane admits (the gateway refuses it; direct, it is sent anyway).
UNADMITTED = "unadmitted"
#: The wall-clock time of virtual second 0 in a replay's request log.
VIRTUAL_EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass(slots=True)
class Result:
    """One request's fate in one run: seconds on the run's clock."""

    cls: str
    arrival: float
    first_token: float | None = None
    end: float | None = None
    refused: str | None = None
    #: The Retry-After its refusal carried (seconds).
    retry_after_s: float | None = None
    #: Times it was preempted in prefill and sent again (the gateway run).
    preempted: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass(slots=True)
class Run:
    results: list[Result] = field(default_factory=list)
    virtual_s: float = 0.0
    #: Prompt tokens the engines prefilled, and the prompt tokens of the requests they
    #: answered: their ratio is the prefill work per answered prompt (over 1: prompts
    #: prefilled again, after a preemption, beyond what their cache kept).
    engine_prompt_tokens: int = 0
    answered_prompt_tokens: int = 0


class TokenWatch:
    """Futures for a sequence's first and last token, fed by the engine's `on_token`."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        self._first: dict[int, asyncio.Future[float]] = {}
        self._end: dict[int, asyncio.Future[float]] = {}
        for engine in engines:
            engine.on_token = self._token

    def track(self, seq: EngineSequence) -> tuple[asyncio.Future[float], asyncio.Future[float]]:
        loop = asyncio.get_running_loop()
        first, end = loop.create_future(), loop.create_future()
        self._first[id(seq)], self._end[id(seq)] = first, end
        return first, end

    def forget(self, seq: EngineSequence) -> None:
        """An aborted sequence: its futures will never be set."""
        self._first.pop(id(seq), None)
        self._end.pop(id(seq), None)

    def _token(self, seq: EngineSequence, event: TokenEvent) -> None:
        first = self._first.pop(id(seq), None)
        if first is not None and seq.first_token is not None:
            first.set_result(seq.first_token)
        if event.finish_reason is not None:
            end = self._end.pop(id(seq))
            end.set_result(seq.end if seq.end is not None else seq.first_token or 0.0)


def _setter(future: asyncio.Future[None]) -> Callable[[], None]:
    def set_it() -> None:
        if not future.done():
            future.set_result(None)

    return set_it


def own_blocks(index: int, config: SimulatorConfig, prompt_tokens: int) -> PromptBlocks | None:
    """Request `index`'s prompt as blocks of its own, for the engine's prefix cache: sent
    again after a preemption, it finds what its first attempt left there (nothing else
    shares them; nothing at all where the engine keeps nothing of a prefill cut short,
    `keep_aborted_prefill`). None without a prefix cache."""
    if not config.prefix_cache:
        return None
    tokens = config.backend_tokens(prompt_tokens)
    return prompt_blocks(range(index << 24, (index << 24) + tokens), config.block_tokens)


def classify(arrival: Arrival, settings: Settings, token_ratio: float = 1.0) -> str:
    """The lane the gateway's rules give this request (its class in every run).

    `token_ratio`: the engine's tokens per gateway token. Lanes are sized in the engine's
    tokens (`admit`): once the gateway has learned the ratio it puts a request by the
    engine's count, so that is the request's class, direct and ideal alike."""
    if arrival.lane is not None and arrival.lane in {lane.name for lane in settings.lanes}:
        return arrival.lane
    try:
        return admit(shape_of(arrival), settings, token_ratio=token_ratio).lane.name
    except Refusal:
        return UNADMITTED


def shape_of(arrival: Arrival) -> RequestShape:
    return RequestShape(
        body={},
        prompt_param="messages",
        model=None,
        stream=True,
        prompt_tokens=arrival.prompt_tokens,
        longest_prompt_tokens=arrival.prompt_tokens,
        requested_max_tokens=arrival.max_tokens,
        max_tokens_fields=("max_tokens",),
        n=1,
        prompt_count=1,
        client_wants_usage=False,
    )


async def feed(
    arrivals: Sequence[Arrival],
    classes: Sequence[str],
    one: Callable[[int, Arrival, str], Coroutine[Any, Any, None]],
) -> None:
    """Start each request at its arrival time: one sleeper, not one timer per request (a
    heap of 19k timers made every step's timer cost a dozen comparisons more)."""
    loop = asyncio.get_running_loop()
    tasks = []
    for index, (arrival, cls) in enumerate(zip(arrivals, classes, strict=True)):
        delay = arrival.at_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(loop.create_task(one(index, arrival, cls)))
    await asyncio.gather(*tasks)


def start_engines(n: int, config: SimulatorConfig | Sequence[SimulatorConfig]) -> list[Engine]:
    configs = [config] * n if isinstance(config, SimulatorConfig) else list(config)
    engines = [Engine(each) for each in configs]
    for engine in engines:
        engine.start()
    return engines


async def _direct(arrivals: Sequence[Arrival], classes: Sequence[str], n: int,
                  config: SimulatorConfig | Sequence[ModelledEngine]) -> Run:  # fmt: skip
    modelled = modelled_engines(config, n)
    engines = start_engines(n, [m.config for m in modelled])
    watch = TokenWatch(engines)
    turn = itertools.count()
    run = Run()

    async def one(_: int, arrival: Arrival, cls: str) -> None:
        result = Result(cls, asyncio.get_running_loop().time())
        run.results.append(result)
        # A plain client: the engine holding the fewest, ties round-robin.
        start = next(turn) % n
        index = min(((start + i) % n for i in range(n)), key=lambda i: engines[i].in_flight)
        prompt = modelled[index].config.backend_tokens(arrival.prompt_tokens)
        seq = engines[index].submit(prompt, arrival.max_tokens)
        first, end = watch.track(seq)
        result.first_token = await first
        run.answered_prompt_tokens += seq.prompt_tokens
        result.end = await end

    await feed(arrivals, classes, one)
    run.virtual_s = asyncio.get_running_loop().time()
    run.engine_prompt_tokens = sum(each.prefilled_tokens for each in engines)
    for engine in engines:
        await engine.stop()
    return run


async def _gateway(arrivals: Sequence[Arrival], classes: Sequence[str], settings: Settings,
                   config: SimulatorConfig | Sequence[ModelledEngine],
                   log: TextIO | None = None) -> Run:  # fmt: skip
    """Through the gateway as `serve` wires it (`app.build_pools`: a pool per model, each
    with its scheduler and sizer), on the virtual clock: the sizer's rounds every health
    interval and the start-up probe ask the engines as `HttpQuestions` would ask real ones
    (`answers.py`), and each request takes the calls `http/proxy.py` makes, in its order."""
    loop = asyncio.get_running_loop()
    modelled = modelled_engines(config, len(settings.backends))
    router = build_pools(settings, _quiet_events(), clock_of=loop.time)
    backends = [backend for each in router.pools for backend in each.pool.backends]
    by_name = {b.name: b for b in settings.backends}
    engines = {
        backend.name: modelled[settings.backends.index(by_name[backend.name])]
        for backend in backends
    }
    started = start_engines(len(engines), [m.config for m in engines.values()])
    running = dict(zip(engines, started, strict=True))
    watch = TokenWatch(started)
    answers = EngineAnswers({n: (engines[n], running[n]) for n in engines}, watch)
    housekeeping = [
        loop.create_task(_health_rounds(each.sizer, answers, settings.health.interval_s))
        for each in router.pools
    ]
    if settings.health.probe_on_start:
        housekeeping += [loop.create_task(each.sizer.warm_up(answers)) for each in router.pools]
    run = Run()

    async def one(index: int, arrival: Arrival, cls: str) -> None:
        now = loop.time()
        result = Result(cls, now)
        run.results.append(result)
        record = RequestRecord(f"replay-{index}", "/v1/chat/completions", now)
        record.stream, record.prompt_tokens = True, arrival.prompt_tokens
        record.model = arrival.model
        grant = None
        scheduler = router.default.scheduler
        try:
            route = router.resolve(arrival.model)
            pool, scheduler, sizer = route.pool.pool, route.pool.scheduler, route.pool.sizer
            record.pool = route.pool.name
            limits = sizer.in_force(route.limits)
            admission = admit(
                shape_of(arrival), settings, limits=limits, token_ratio=pool.token_ratio(None)
            )
            lane, budget = admission.lane.name, admission.budget
            record.lane, record.max_tokens = lane, budget.max_tokens
            pool.require_available(lane)
            sizer.note_prompt(lane, arrival.prompt_tokens)
            record.enqueued = loop.time()
            note = WaitNote()
            hint = RouteHint(
                wait_budget_s=WAIT_FOR_SOONER_SHARE * scheduler.deadline_for(lane),
                model=arrival.model,
            )
            try:
                grant = await scheduler.acquire(
                    lane, arrival.prompt_tokens, budget.total, note=note, hint=hint
                )
            finally:
                record.predicted_wait_s, record.deadline_s = note.predicted_wait_s, note.deadline_s
                record.deadline_grace_s = note.grace_s
            blocks = None
            while True:
                record.dispatched = loop.time()
                record.attempts += 1
                backend = grant.slot.backend
                record.backend, record.engine = backend.name, backend.engine
                engine = engines[record.backend]
                preemptible = settings.preemption.applies_to(backend.engine)
                if preemptible and blocks is None:
                    blocks = own_blocks(index, engine.config, arrival.prompt_tokens)
                seq = running[record.backend].submit(
                    engine.config.backend_tokens(arrival.prompt_tokens),
                    budget.max_tokens,
                    blocks=blocks,
                )
                first, end = watch.track(seq)
                if not preemptible:
                    scheduler.sent(grant, backend.name)
                    await first
                    break
                preempted: asyncio.Future[None] = loop.create_future()
                scheduler.sent(grant, backend.name, _setter(preempted))
                await asyncio.wait((first, preempted), return_when=asyncio.FIRST_COMPLETED)
                if first.done():
                    break
                running[record.backend].abort(seq)  # the engine connection closed
                watch.forget(seq)
                record.preempted += 1
                record.preempted_s += loop.time() - record.dispatched
                grant, held = None, grant
                grant = await scheduler.requeue(
                    held,
                    arrival.prompt_tokens,
                    budget.total,
                    deadline_s=record.deadline_s or scheduler.deadline_for(lane),
                    hint=hint,
                    preempted=True,
                )
            result.first_token = record.first_byte = record.first_token = first.result()
            result.preempted = record.preempted
            run.answered_prompt_tokens += seq.prompt_tokens
            scheduler.prefill_done(grant)
            result.end = record.end = await end
            record.completion_tokens = seq.generated
            record.backend_prompt_tokens = seq.prompt_tokens
            record.outcome, record.status = Outcome.OK, 200
        except Refusal as refusal:
            result.refused = refusal.code
            result.retry_after_s = refusal.retry_after_s
            record.outcome, record.error_code = refusal.outcome, refusal.code
            record.status, record.retry_after_s = 429, refusal.retry_after_s
        finally:
            if record.end is None:
                record.end = loop.time()
            if grant is not None:
                record.timings = split_time(record, grant.slot)
                learn_from(record, grant.slot)
                scheduler.release(grant, arrival.prompt_tokens, record.completion_tokens or 0)
            if log is not None:
                at = VIRTUAL_EPOCH + timedelta(seconds=loop.time())
                log.write(render_request_line(record, at))

    await feed(arrivals, classes, one)
    run.virtual_s = loop.time()
    run.engine_prompt_tokens = sum(each.prefilled_tokens for each in started)
    for task in housekeeping:
        task.cancel()
    await asyncio.gather(*housekeeping, return_exceptions=True)
    for each in started:
        await each.stop()
    return run


async def _health_rounds(sizer: BackendSizer, answers: EngineAnswers, interval_s: float) -> None:
    """The health monitor's rounds: one at start, then every interval (`HealthMonitor`)."""
    while True:
        await sizer.round(answers)
        await asyncio.sleep(interval_s)


def _quiet_events() -> Any:
    """The lifecycle logger, silent (a replay prints its own table)."""
    return make_logger(io.StringIO(), "error")


def run_direct(arrivals: Sequence[Arrival], classes: Sequence[str], backends: int,
               config: SimulatorConfig | Sequence[ModelledEngine]) -> Run:  # fmt: skip
    return run_virtual(_direct(arrivals, classes, backends, config))


def run_gateway(arrivals: Sequence[Arrival], classes: Sequence[str], settings: Settings,
                config: SimulatorConfig | Sequence[ModelledEngine],
                log: TextIO | None = None) -> Run:  # fmt: skip
    """`config`: one engine model for every backend, or one `ModelledEngine` per backend
    (in the order of `settings.backends`); `log`: where the request lines go."""
    return run_virtual(_gateway(arrivals, classes, settings, config, log))
