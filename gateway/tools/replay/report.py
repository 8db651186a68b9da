"""Per-class figures of a run, the side-by-side table, and the smallest fleet that meets a P99."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.tools.replay.runs import Run
from gateway.tools.stats import percentile


def summary(run: Run) -> dict[str, Any]:
    """RUN = {"classes": {NAME: {"ttft_ms": {p50,p95,p99}, completed, refused, goodput_rps}}}."""
    classes: dict[str, dict[str, Any]] = {}
    for cls in sorted({r.cls for r in run.results}):
        mine = [r for r in run.results if r.cls == cls]
        ttfts = [r.ttft_s * 1000.0 for r in mine if r.ttft_s is not None and r.end is not None]
        classes[cls] = {
            "ttft_ms": {f"p{q}": _ms(percentile(ttfts, q)) for q in (50, 95, 99)},
            "completed": len(ttfts),
            "refused": sum(1 for r in mine if r.refused is not None),
            "goodput_rps": round(len(ttfts) / run.virtual_s, 3) if run.virtual_s > 0 else None,
        }
    return {"classes": classes, "virtual_s": round(run.virtual_s, 3)}


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def table(runs: dict[str, dict[str, Any]]) -> str:
    lines = [
        f"{'run':<8} {'class':<12} {'p50 ms':>9} {'p95 ms':>9} {'p99 ms':>9} "
        f"{'done':>6} {'refused':>7} {'goodput/s':>9}"
    ]
    for name, run in runs.items():
        for cls, fig in run["classes"].items():
            t = fig["ttft_ms"]
            lines.append(
                f"{name:<8} {cls:<12} {_cell(t['p50'])} {_cell(t['p95'])} {_cell(t['p99'])} "
                f"{fig['completed']:>6} {fig['refused']:>7} {fig['goodput_rps'] or 0:>9.2f}"
            )
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return f"{'-':>9}" if value is None else f"{value:>9.0f}"


def meets(run: dict[str, Any], cls: str, target_ms: float) -> bool:
    fig = run["classes"].get(cls)
    p99 = None if fig is None else fig["ttft_ms"]["p99"]
    return p99 is not None and p99 <= target_ms


def smallest_fleet(meets_with: Callable[[int], bool], low: int = 1, high: int = 64) -> int | None:
    """The fewest backends for which `meets_with(n)` holds (assumed monotone); None: not
    even `high`. Doubles up from `low`, then bisects."""
    bad, n = low - 1, low
    while not meets_with(n):
        if n >= high:
            return None
        bad, n = n, min(high, n * 2)
    good = n
    while good - bad > 1:
        mid = (good + bad) // 2
        if meets_with(mid):
            good = mid
        else:
            bad = mid
    return good
