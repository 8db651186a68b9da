"""What the engines allow, measured on the engine model itself in virtual time.

- **capacity**: requests a second the engines complete of a traffic's sizes when never
  idle (a closed loop straight to them, twice their slots in flight), so a load of 0.8
  is 80% of what they sustain of that very traffic, chunking and batching included;
- **the engine floor**: the first token of a short request that arrives just as one long
  prompt starts its prefill on an idle engine, sent straight to it (on one slot, the
  long request's whole answer is in the way). No door in front of the engine can
  promise better to a short request that meets a long one: the lanes' promise is a
  short request's P99 within a small factor of it. The long prompt is the traffic's
  95th percentile and the short one its first lane's 90th, the same quantiles the
  gateway fits its deadlines with (`scheduling/fitting.py`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

from gateway.scheduling.fitting import LONG_PROMPT_QUANTILE, PROMPT_QUANTILE, quantile
from gateway.tools.replay.answers import ModelledEngine
from gateway.tools.replay.runs import TokenWatch, start_engines
from gateway.tools.replay.sources import Arrival
from gateway.tools.replay.vclock import run_virtual

#: Closed-loop requests before the measured ones (the batch fills up meanwhile).
WARM_UP_SHARE = 0.2


def capacity_rps(engines: Sequence[ModelledEngine], requests: Sequence[Arrival]) -> float:
    """Requests a second the engines complete of these `requests`, kept full."""
    return run_virtual(_closed_loop(engines, requests))


async def _closed_loop(engines: Sequence[ModelledEngine], requests: Sequence[Arrival]) -> float:
    started = start_engines(len(engines), [m.config for m in engines])
    watch = TokenWatch(started)
    work = iter(requests)
    ends: list[float] = []
    turn = itertools.count()

    async def worker() -> None:
        for request in work:
            index = min(range(len(started)), key=lambda i: (started[i].in_flight, next(turn)))
            config = engines[index].config
            seq = started[index].submit(
                config.backend_tokens(request.prompt_tokens), request.max_tokens
            )
            _, end = watch.track(seq)
            ends.append(await end)

    workers = 2 * sum(m.config.max_batch for m in engines)
    await asyncio.gather(*(worker() for _ in range(workers)))
    for engine in started:
        await engine.stop()
    skip = int(len(ends) * WARM_UP_SHARE)
    measured = sorted(ends)[skip:]
    span = measured[-1] - measured[0] if len(measured) > 1 else 0.0
    return (len(measured) - 1) / span if span > 0 else float("inf")


def floor_prompts(arrivals: Sequence[Arrival], short: Sequence[Arrival]) -> tuple[int, int]:
    """(the long prompt, the short one) of the engine floor for this traffic."""
    long = quantile((a.prompt_tokens for a in arrivals), LONG_PROMPT_QUANTILE) or 1
    own = quantile((a.prompt_tokens for a in short), PROMPT_QUANTILE) or 1
    return max(long, own), own


def engine_floor_s(engine: ModelledEngine, long: Arrival, own_tokens: int) -> float:
    """The short request's first token behind one long prefill (seconds)."""
    return run_virtual(_floor(engine, long, own_tokens))


async def _floor(engine: ModelledEngine, long: Arrival, own_tokens: int) -> float:
    loop = asyncio.get_running_loop()
    (started,) = start_engines(1, [engine.config])
    watch = TokenWatch([started])
    config = engine.config
    watch.track(started.submit(config.backend_tokens(long.prompt_tokens), long.max_tokens))
    at = loop.time()
    first, _ = watch.track(started.submit(config.backend_tokens(own_tokens), 1))
    floor = await first - at
    await started.stop()
    return floor
