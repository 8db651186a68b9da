"""When a silent stream is a stalled backend: a time learned per backend, not one guess.

A frozen engine (process stopped, GPU gone, connections left open) sends
nothing and closes nothing; the idle timeout (60 s by default) would hold each
of its streams that long. But a fixed few seconds would take a slow CPU
engine, or a decode paused by a big prefill beside it, for a dead one. So each
backend keeps the longest silence of each of its recent streams (after their
first token: a long prefill before it is no stall), and a stream is stalled
once it is silent for `multiple` times the high percentile of those, or of its
own longest silence so far if that is longer, never less than `floor_s` and
never more than the idle timeout. The stall then counts as a failed backend:
the answer is resumed elsewhere and the backend is marked unhealthy until its
checks pass again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

#: Streams whose longest silence a backend remembers.
GAP_WINDOW = 64
#: The share of them a stall time must clear (a high percentile, not the maximum: one
#: odd pause must not set the time for all).
GAP_PERCENTILE = 0.95


@dataclass(slots=True, frozen=True)
class StallRule:
    """How long a silence after the first token is a stall (`[resume]`)."""

    floor_s: float
    multiple: float
    ceiling_s: float

    def stall_s(self, learned_gap_s: float, own_gap_s: float) -> float:
        gap = max(learned_gap_s, own_gap_s)
        return min(self.ceiling_s, max(self.floor_s, self.multiple * gap))


class StreamGaps:
    """One backend's recent streams' longest silences; `high` is their high percentile."""

    __slots__ = ("_gaps", "_high")

    def __init__(self) -> None:
        self._gaps: deque[float] = deque(maxlen=GAP_WINDOW)
        self._high: float | None = 0.0

    def add(self, gap_s: float) -> None:
        self._gaps.append(gap_s)
        self._high = None

    @property
    def high(self) -> float:
        """0 before any stream ended here (the stream's own silences then say)."""
        if self._high is None:
            ordered = sorted(self._gaps)
            self._high = ordered[min(len(ordered) - 1, int(GAP_PERCENTILE * len(ordered)))]
        return self._high
