"""The two runs on one virtual clock: straight to the engines, and through the gateway's code.

The gateway run makes the calls `gateway/http/proxy.py` makes around a request, in its
order: `admit` (caps, lane choice) → `pool.require_available` → `scheduler.acquire`
(queue, predicted-wait refusals, queue timeout) → dispatch to the slot's backend → on the
first token `scheduler.prefill_done` → at the end `split_time`/`learn_from` (the pool's
learned prefill and TPOT) → `scheduler.release` (the slot back, the next one granted).
The engines are the simulator's, unchanged, stepped by the virtual loop.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.admission.admit import RequestShape, admit
from gateway.config import Settings
from gateway.observability.record import RequestRecord
from gateway.outcomes import Outcome, Refusal
from gateway.scheduling.scheduler import Scheduler, WaitNote
from gateway.tools.replay.sources import Arrival
from gateway.tools.replay.vclock import run_virtual
from gateway.tools.simulator.config import SimulatorConfig
from gateway.tools.simulator.engine import Engine, TokenEvent
from gateway.tools.simulator.engine import Sequence as EngineSequence
from gateway.upstream.learn import learn_from, split_time
from gateway.upstream.pool import Backend, BackendPool

#: The class of a request no lane admits (the gateway refuses it; direct, it is sent anyway).
UNADMITTED = "unadmitted"


@dataclass(slots=True)
class Result:
    """One request's fate in one run: seconds on the run's clock."""

    cls: str
    arrival: float
    first_token: float | None = None
    end: float | None = None
    refused: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass(slots=True)
class Run:
    results: list[Result] = field(default_factory=list)
    virtual_s: float = 0.0


class _Watch:
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

    def _token(self, seq: EngineSequence, event: TokenEvent) -> None:
        first = self._first.pop(id(seq), None)
        if first is not None and seq.first_token is not None:
            first.set_result(seq.first_token)
        if event.finish_reason is not None:
            end = self._end.pop(id(seq))
            end.set_result(seq.end if seq.end is not None else seq.first_token or 0.0)


def classify(arrival: Arrival, settings: Settings) -> str:
    """The lane the gateway's rules give this request (its class in both runs)."""
    if arrival.lane is not None and arrival.lane in {lane.name for lane in settings.lanes}:
        return arrival.lane
    try:
        return admit(shape_of(arrival), settings).lane.name
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


async def _feed(
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


def _start_engines(n: int, config: SimulatorConfig) -> list[Engine]:
    engines = [Engine(config) for _ in range(n)]
    for engine in engines:
        engine.start()
    return engines


async def _direct(arrivals: Sequence[Arrival], classes: Sequence[str], n: int,
                  config: SimulatorConfig) -> Run:  # fmt: skip
    engines = _start_engines(n, config)
    watch = _Watch(engines)
    turn = itertools.count()
    run = Run()

    async def one(_: int, arrival: Arrival, cls: str) -> None:
        result = Result(cls, asyncio.get_running_loop().time())
        run.results.append(result)
        # A plain client: the engine holding the fewest, ties round-robin.
        start = next(turn) % n
        engine = min((engines[(start + i) % n] for i in range(n)), key=lambda e: e.in_flight)
        seq = engine.submit(arrival.prompt_tokens, arrival.max_tokens)
        first, end = watch.track(seq)
        result.first_token = await first
        result.end = await end

    await _feed(arrivals, classes, one)
    run.virtual_s = asyncio.get_running_loop().time()
    for engine in engines:
        await engine.stop()
    return run


async def _gateway(arrivals: Sequence[Arrival], classes: Sequence[str], settings: Settings,
                   config: SimulatorConfig) -> Run:  # fmt: skip
    loop = asyncio.get_running_loop()
    pool = BackendPool(
        [Backend.from_settings(b) for b in settings.backends],
        lane_backends={lane.name: lane.backends for lane in settings.lanes},
        health=settings.health,
        routing=settings.routing,
        clock=loop.time,
    )
    scheduler = Scheduler(
        settings.lanes,
        {lane.name: settings.lane_slot_limit(lane) for lane in settings.lanes},
        pool,
        clock=loop.time,
        competes=pool.shares_backends,
        fair_share=settings.tenants.fair_share,
        capacities={lane.name: pool.slots_of(lane.name) for lane in settings.lanes},
    )
    pool.on_available = scheduler.notify_capacity
    engines = _start_engines(len(settings.backends), config)
    by_backend = {b.name: e for b, e in zip(pool.backends, engines, strict=True)}
    watch = _Watch(engines)
    run = Run()

    async def one(index: int, arrival: Arrival, cls: str) -> None:
        now = loop.time()
        result = Result(cls, now)
        run.results.append(result)
        record = RequestRecord(f"replay-{index}", "/v1/chat/completions", now)
        record.stream, record.prompt_tokens = True, arrival.prompt_tokens
        grant = None
        try:
            admission = admit(shape_of(arrival), settings, token_ratio=pool.token_ratio(None))
            lane, budget = admission.lane.name, admission.budget
            record.lane, record.max_tokens = lane, budget.max_tokens
            pool.require_available(lane)
            record.enqueued = loop.time()
            grant = await scheduler.acquire(
                lane, arrival.prompt_tokens, budget.total, note=WaitNote()
            )
            record.dispatched = loop.time()
            record.attempts = 1
            record.backend = grant.slot.backend.name
            engine = by_backend[grant.slot.backend.name]
            seq = engine.submit(arrival.prompt_tokens, budget.max_tokens)
            first, end = watch.track(seq)
            result.first_token = record.first_byte = record.first_token = await first
            scheduler.prefill_done(grant)
            result.end = record.end = await end
            record.completion_tokens = seq.generated
            record.outcome, record.status = Outcome.OK, 200
        except Refusal as refusal:
            result.refused = refusal.code
            record.outcome = refusal.outcome
        finally:
            if grant is not None:
                record.timings = split_time(record, grant.slot)
                learn_from(record, grant.slot)
                scheduler.release(grant, arrival.prompt_tokens, record.completion_tokens or 0)

    await _feed(arrivals, classes, one)
    run.virtual_s = loop.time()
    for engine in engines:
        await engine.stop()
    return run


def run_direct(arrivals: Sequence[Arrival], classes: Sequence[str], backends: int,
               config: SimulatorConfig) -> Run:  # fmt: skip
    return run_virtual(_direct(arrivals, classes, backends, config))


def run_gateway(arrivals: Sequence[Arrival], classes: Sequence[str], settings: Settings,
                config: SimulatorConfig) -> Run:  # fmt: skip
    return run_virtual(_gateway(arrivals, classes, settings, config))
