"""Percentiles and summaries shared by the load generator, the analyzer and the benchmarks."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between ranks; None if empty.

    Same definition as numpy's default ("linear"), so figures match what users
    compute in a notebook.
    """
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high:
        return float(ordered[low])
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(
    values: Iterable[float | None], qs: Sequence[float] = (50, 95, 99)
) -> dict[str, float | None]:
    """count, mean and the given percentiles of the non-None values."""
    present = sorted(v for v in values if v is not None)
    out: dict[str, float | None] = {"count": float(len(present))}
    out["mean"] = sum(present) / len(present) if present else None
    for q in qs:
        out[f"p{q:g}"] = percentile(present, q)
    return out
