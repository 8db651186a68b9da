"""Deadlines that fit the engine: what the slowest backend allows, in seconds.

A lane's deadline bounds a request's wait in the gateway's queue. With the
prefill budget, a short request may have to wait for one long prompt already
in prefill, and then prefill itself: that is the engine's floor, what no door
in front of one server can beat. On an H100 it is tens of milliseconds; on a
CPU running llama.cpp a 1500-token prompt alone takes seconds. A deadline
below the floor does not make anything faster, it only turns requests away
that the backend would have served a moment later; so a lane that allows it
(`fit_timeout_to_engine`) has its deadline raised to `DEADLINE_OVER_FLOOR`
times the floor, and the gateway says so.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

#: A fitted deadline leaves this much room over the floor (a slot wait, jitter).
DEADLINE_OVER_FLOOR = 1.5
#: A lane's headroom keeps the slots with which its P99 wait for one is within this
#: share of the floor: the product's promise is a short P99 within 1.3x the floor, and
#: a wait and a long prefill ahead are rarely both at their worst. On the matrix's CPU
#: vLLM, 0.3 refused 8-30% more long requests than 0.5 for short P99s within 0.04x of
#: its, and 1.0 left chat at 100-150% at 1.24-1.26x the floor.
WAIT_ALLOWANCE_OVER_FLOOR = 0.5
#: "A long prompt" is this quantile of recent prompts; "its own" this one of the lane's.
LONG_PROMPT_QUANTILE = 0.95
PROMPT_QUANTILE = 0.9
#: Prompts seen before their quantile replaces the prior of a long one.
PROMPTS_TO_TRUST = 32
#: Prompt sizes remembered per lane.
PROMPT_WINDOW = 512
#: Before any traffic: the long prompt that may be ahead, and a lane's own prompt (or
#: the lane's limit, when smaller).
PRIOR_LONG_PROMPT_TOKENS = 2048
PRIOR_OWN_PROMPT_TOKENS = 256


def quantile(values: Iterable[int], q: float) -> int | None:
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class PromptSizes:
    """Recent prompt sizes per lane: what "a long prompt" and "a lane's own" are."""

    def __init__(self, window: int = PROMPT_WINDOW) -> None:
        self._window = window
        self._by_lane: dict[str, deque[int]] = {}

    def add(self, lane: str, prompt_tokens: int) -> None:
        sizes = self._by_lane.get(lane)
        if sizes is None:
            sizes = self._by_lane[lane] = deque(maxlen=self._window)
        sizes.append(prompt_tokens)

    def own(self, lane: str, lane_max: int | None) -> int:
        """A typical large prompt of this lane (its quantile; before traffic, the prior)."""
        seen = quantile(self._by_lane.get(lane, ()), PROMPT_QUANTILE)
        if seen is not None:
            return seen
        return min(lane_max or PRIOR_OWN_PROMPT_TOKENS, PRIOR_OWN_PROMPT_TOKENS)

    def long(self) -> int:
        """A long prompt that may be in prefill ahead of anyone: a high quantile of all
        lanes' prompts; never below the prior until enough were seen (the first few
        requests being short says nothing about the long ones to come)."""
        every = [size for sizes in self._by_lane.values() for size in sizes]
        seen = quantile(every, LONG_PROMPT_QUANTILE)
        if seen is None:
            return PRIOR_LONG_PROMPT_TOKENS
        return seen if len(every) >= PROMPTS_TO_TRUST else max(seen, PRIOR_LONG_PROMPT_TOKENS)


def engine_floor_s(prefill_s: Callable[[int], float], long_tokens: int, own_tokens: int) -> float:
    """One long prefill ahead plus the request's own: the best a queue can promise."""
    return prefill_s(max(long_tokens, own_tokens)) + prefill_s(own_tokens)


def fitted_deadline_s(configured_s: float, floor_s: float, fit: bool) -> float:
    """The deadline in force: the configured one, raised to fit the floor when allowed."""
    if not fit:
        return configured_s
    return max(configured_s, DEADLINE_OVER_FLOOR * floor_s)
