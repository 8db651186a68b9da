"""The ideal two-lane scheduler: what a door in front of these engines could do at best.

The measure the gateway's own run is held to, on the same schedule and the same engines.
It knows what no gateway can: which prompt is still in prefill, to the step, and every
request's class at once. With that it keeps the order the product promises and nothing
else: short (first-lane) requests strictly first, first come first served; a long request
only on an engine where no prompt is in prefill (so at most one long prefill at a time,
never beside a short one, which a whole-prompt engine would make wait for all of it);
one slot of every engine of two or more kept for short requests; nobody sent past an
engine's batch tokens (TGI's), where it would wait inside the engine; no deadline, no
refusal, nothing learned. Requests no lane admits go as long ones (direct, they are sent
anyway).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.tools.replay.answers import ModelledEngine
from gateway.tools.replay.runs import Result, Run, TokenWatch, feed, start_engines
from gateway.tools.replay.sources import Arrival
from gateway.tools.replay.vclock import run_virtual
from gateway.tools.simulator.config import SimulatorConfig
from gateway.tools.simulator.engine import Engine


@dataclass(eq=False)
class _Place:
    """One engine and what the ideal scheduler has running on it."""

    engine: Engine
    config: SimulatorConfig
    held_tokens: int = 0
    running: int = 0
    #: Prompt tokens of its requests still in prefill, by class.
    short_prefill: int = 0
    long_prefill: int = 0

    @property
    def slots(self) -> int:
        return self.config.max_batch

    @property
    def batch_tokens(self) -> int | None:
        """Its batch's token bound (prompt and max_tokens reserved at admission, TGI's
        `max_batch_total_tokens`); None: none. Past it a request would wait inside it."""
        return self.config.max_batch_tokens or None

    @property
    def in_prefill(self) -> bool:
        return bool(self.short_prefill or self.long_prefill)


@dataclass(eq=False)
class _Waiting:
    arrival: Arrival
    short: bool
    #: What it holds of its engine's token-bounded batch, once placed.
    held_tokens: int = 0
    placed: asyncio.Future[_Place] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


def _cost(place: _Place, waiting: _Waiting) -> int:
    """What a request holds of the place's batch tokens: its prompt in the engine's own
    tokens and its whole output."""
    arrival = waiting.arrival
    return place.config.backend_tokens(arrival.prompt_tokens) + arrival.max_tokens


def _fits(place: _Place, waiting: _Waiting) -> bool:
    """Room in the place's batch tokens (one bigger than all of them goes alone)."""
    return (
        place.batch_tokens is None
        or not place.running
        or place.held_tokens + _cost(place, waiting) <= place.batch_tokens
    )


class IdealScheduler:
    """Strict two-lane priority with perfect knowledge of the engines' prefill."""

    def __init__(self, places: list[_Place]) -> None:
        self.places = places
        self.short: deque[_Waiting] = deque()
        self.long: deque[_Waiting] = deque()

    def kick(self) -> None:
        """Place every waiting request that may start now."""
        while self.short:
            place = self._for_short(self.short[0])
            if place is None:
                break
            self._start(self.short.popleft(), place)
        while self.long and not self.short:
            place = self._for_long(self.long[0])
            if place is None:
                break
            self._start(self.long.popleft(), place)

    def _for_short(self, waiting: _Waiting) -> _Place | None:
        free = [p for p in self.places if p.running < p.slots and _fits(p, waiting)]
        # The engine that reaches this prompt soonest: the least prefill ahead of it.
        return min(free, key=lambda p: (p.long_prefill + p.short_prefill, p.running), default=None)

    def _for_long(self, waiting: _Waiting) -> _Place | None:
        free = [
            p
            for p in self.places
            if p.running < (p.slots - 1 if p.slots > 1 else 1)
            and not p.in_prefill
            and _fits(p, waiting)
        ]
        return min(free, key=lambda p: p.running, default=None)

    def _start(self, waiting: _Waiting, place: _Place) -> None:
        place.running += 1
        if place.batch_tokens is not None:
            waiting.held_tokens = _cost(place, waiting)
            place.held_tokens += waiting.held_tokens
        if waiting.short:
            place.short_prefill += waiting.arrival.prompt_tokens
        else:
            place.long_prefill += waiting.arrival.prompt_tokens
        waiting.placed.set_result(place)


async def _ideal(arrivals: Sequence[Arrival], classes: Sequence[str], short_class: str,
                 engines: Sequence[ModelledEngine]) -> Run:  # fmt: skip
    started = start_engines(len(engines), [m.config for m in engines])
    watch = TokenWatch(started)
    scheduler = IdealScheduler(
        [_Place(engine, m.config) for engine, m in zip(started, engines, strict=True)]
    )
    by_engine = {id(p.engine): m for p, m in zip(scheduler.places, engines, strict=True)}
    run = Run()

    async def one(_: int, arrival: Arrival, cls: str) -> None:
        result = Result(cls, asyncio.get_running_loop().time())
        run.results.append(result)
        waiting = _Waiting(arrival, cls == short_class)
        (scheduler.short if waiting.short else scheduler.long).append(waiting)
        scheduler.kick()
        place = await waiting.placed
        config = by_engine[id(place.engine)].config
        seq = place.engine.submit(config.backend_tokens(arrival.prompt_tokens), arrival.max_tokens)
        first, end = watch.track(seq)
        result.first_token = await first
        if waiting.short:
            place.short_prefill -= arrival.prompt_tokens
        else:
            place.long_prefill -= arrival.prompt_tokens
        scheduler.kick()
        result.end = await end
        place.running -= 1
        place.held_tokens -= waiting.held_tokens
        scheduler.kick()

    await feed(arrivals, classes, one)
    run.virtual_s = asyncio.get_running_loop().time()
    for engine in started:
        await engine.stop()
    return run


def run_ideal(
    arrivals: Sequence[Arrival],
    classes: Sequence[str],
    short_class: str,
    engines: Sequence[ModelledEngine],
) -> Run:
    """The ideal scheduler's run; `short_class`: the class that goes first (the first lane)."""
    return run_virtual(_ideal(arrivals, classes, short_class, engines))
