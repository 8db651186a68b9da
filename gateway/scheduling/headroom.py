"""Headroom for a higher lane: the slots its own demand needs, kept from the lanes below.

The work-conserving split lets a lower lane use every slot while nothing above it
waits, and takes slots back only as its requests end. A long request holds its
slot for its whole life (seconds on a GPU, many seconds on a CPU), so a burst of
short requests arriving while long ones hold most slots queues behind them for
seconds: the slots come back too late. So while a higher lane is active, the lanes
below it may hold only the slots its demand leaves:

- its demand is its recent arrival rate times how long its requests hold a slot
  (both measured), in slots: the Erlangs of queueing theory;
- the slots it needs are the fewest with which an arrival would find all of them
  busy at most `WAIT_PROBABILITY` of the time (Erlang C: Poisson arrivals, which a
  lane's many independent clients are), so a burst finds a free slot;
- and, where the lane's allowed wait is known (its share of the engine floor:
  `scheduler.set_wait_allowance`), enough that an arrival waits longer than that at
  most `TAIL_PROBABILITY` of the time, since the lane's promise is a P99. Under Erlang C
  a wait past t has the chance C x exp(-(slots - load) x t / hold): with 10% of arrivals
  waiting, the P99 wait is ln(10) x hold / (slots - load), which is seconds where a
  short answer holds its slot for seconds (a CPU vLLM's 32 tokens at 68 ms: 1.6 s of
  queue at P99 on a floor of 0.7 s, measured). Where the tail would take every slot of
  the lanes below, the probability alone decides (`Scheduler._note_demand`);
- a lane with no arrival for `QUIET_S` needs nothing: the lower lanes may use every
  slot again.

A lower lane keeps its floor (`min_slots`) whatever the headroom, so nothing below
starves; the higher lane may still use the lower lanes' unused slots.

Pure arithmetic over timestamps the caller passes in.
"""

from __future__ import annotations

import functools
import math
from collections import deque

#: An arrival finds every slot of its lane's headroom busy at most this often (the lane's
#: `headroom_wait_probability`, this by default).
WAIT_PROBABILITY = 0.1
#: ... and waits past its allowance at most this often (unless the operator wrote the
#: probability above: then that alone is the lane's headroom).
TAIL_PROBABILITY = 0.01
#: A lane with no arrival for this long is quiet: it needs no headroom.
QUIET_S = 10.0
#: Recent arrivals per lane from which its rate is measured...
ARRIVAL_SAMPLES = 32
#: ... once there are this many (two arrivals in a row say little about a rate).
MIN_ARRIVALS = 4


def erlang_c(servers: int, load: float) -> float:
    """The chance that an arrival waits, with `servers` slots offered `load` Erlangs."""
    if load <= 0:
        return 0.0
    if servers <= load:
        return 1.0
    blocked = 1.0  # Erlang B, by its recursion over the number of servers
    for k in range(1, servers + 1):
        blocked = load * blocked / (k + load * blocked)
    return servers * blocked / (servers - load * (1.0 - blocked))


def slots_needed(
    load: float,
    most: int,
    wait_probability: float = WAIT_PROBABILITY,
    allowance_holds: float | None = None,
) -> int:
    """The fewest slots (at most `most`) with which `load` Erlangs wait at most that often,
    and (`allowance_holds`: the allowed wait over the slot hold) wait past that allowance
    at most `TAIL_PROBABILITY` of the time.

    One pass of Erlang B's recursion over the number of slots: O(slots). A probability
    of 1 (every arrival may wait) needs none."""
    if load <= 0 or most <= 0 or wait_probability >= 1:
        return 0
    if load >= most:  # no count up to `most` exceeds the load: the pass would end at `most`
        return most
    blocked = 1.0
    for slots in range(1, most + 1):
        blocked = load * blocked / (slots + load * blocked)
        if slots <= load:
            continue
        waits = slots * blocked / (slots - load * (1.0 - blocked))
        if waits > wait_probability:
            continue
        if (
            allowance_holds is None
            or waits * math.exp(-(slots - load) * allowance_holds) <= TAIL_PROBABILITY
        ):
            return slots
    return most


#: A lane's demand is rounded up to this fraction of an Erlang for `headroom_slots`'
#: cache: it changes at every arrival and release, and each exact answer is a pass over
#: the slots (rounded up, the answer is never fewer slots than the exact one). The
#: allowance is rounded down to it, for the same reason.
LOAD_STEP = 1 / 64


def headroom_slots(
    load: float,
    most: int,
    wait_probability: float = WAIT_PROBABILITY,
    allowance_holds: float | None = None,
) -> int:
    """`slots_needed` for `load` rounded up to `LOAD_STEP`, from a cache.

    A load over every slot needs them all, at once and outside the cache: a burst of
    arrivals (32 in 2 ms) measures thousands of Erlangs, each a new key, which cost a
    pass over every slot (2048 on a big engine) on every arrival and release, and
    pushed the lane's usual loads out of the cache."""
    if load >= most:
        return 0 if most <= 0 or wait_probability >= 1 else most
    allowance = None if allowance_holds is None else math.floor(allowance_holds / LOAD_STEP)
    return _slots_needed_in_steps(math.ceil(load / LOAD_STEP), most, wait_probability, allowance)


@functools.lru_cache(maxsize=4096)
def _slots_needed_in_steps(
    steps: int, most: int, wait_probability: float, allowance_steps: int | None
) -> int:
    allowance = None if allowance_steps is None else allowance_steps * LOAD_STEP
    return slots_needed(steps * LOAD_STEP, most, wait_probability, allowance)


class ArrivalRate:
    """Arrivals per second of a lane, over its recent arrivals; it falls while none come."""

    __slots__ = ("_times",)

    def __init__(self, samples: int = ARRIVAL_SAMPLES) -> None:
        self._times: deque[float] = deque(maxlen=samples)

    def add(self, now: float) -> None:
        self._times.append(now)

    def quiet(self, now: float) -> bool:
        """No arrival for QUIET_S (or none ever)."""
        return not self._times or now - self._times[-1] > QUIET_S

    def quiet_at(self) -> float | None:
        """When the lane turns quiet if nothing more arrives (None: no arrival yet)."""
        return self._times[-1] + QUIET_S if self._times else None

    def per_s(self, now: float) -> float:
        """0 before MIN_ARRIVALS, and once the lane has been quiet for QUIET_S."""
        times = self._times
        if len(times) < MIN_ARRIVALS or now - times[-1] > QUIET_S or now <= times[0]:
            return 0.0
        return (len(times) - 1) / (now - times[0])
