"""The matrix as a table for the terminal, as a Markdown page for the docs site, and its summary."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.scheduling.fitting import DEADLINE_OVER_FLOOR
from gateway.tools.matrix.cells import MAX_SHORT_REFUSED


def _s(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _ratio(value: float | None, of: float | None) -> str:
    if value is None or not of:
        return "-"
    return f"{value / of:.2f}x"


def _refused(cell: dict[str, Any]) -> str:
    run = cell["runs"]["gateway"]
    shorts = run["shorts"] or 1
    text = f"{run['short_refused']}/{run['shorts']} ({100.0 * run['short_refused'] / shorts:.0f}%)"
    late = cell.get("ideal_shorts_late")
    if late is not None and late > MAX_SHORT_REFUSED:
        text += f" †{100.0 * late:.0f}%"
    return text


def row(cell: dict[str, Any]) -> list[str]:
    runs = cell["runs"]
    direct, gateway, ideal = runs["direct"], runs["gateway"], runs["ideal"]
    failed = [c["check"] for c in cell["checks"] if not c["passed"]]
    return [
        cell["engine"],
        cell["mix"],
        f"{cell['load']:.0%}",
        _s(cell["floor_s"]),
        _s(direct["short_p99_s"]),
        _s(gateway["short_p99_s"]),
        _ratio(gateway["short_p99_s"], cell["floor_s"])
        + ("" if cell.get("floor_reachable", True) else "*"),
        _s(ideal["short_p99_s"]),
        _refused(cell),
        _s(direct["long_p99_s"]),
        _s(gateway["long_p99_s"]),
        _s(ideal["long_p99_s"]),
        f"{gateway['long_refused']}/{gateway['longs']}",
        str(gateway.get("admitted_timed_out", "-")),
        str(gateway.get("preempted", "-")),
        "-" if gateway.get("prefill_work") is None else f"{gateway['prefill_work']:.2f}",
        "ok" if not failed else "MISS: " + "; ".join(failed),
    ]


HEADER = [
    "engine",
    "mix",
    "load",
    "floor s",
    "short P99 direct",
    "gateway",
    "x floor",
    "ideal",
    "shorts refused",
    "long P99 direct",
    "gateway",
    "ideal",
    "longs refused",
    "admitted, then timed out",
    "preempted",
    "prefill work",
    "promises",
]


def table(cells: Sequence[dict[str, Any]]) -> str:
    rows = [HEADER] + [row(cell) for cell in cells]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER) - 1)]
    lines = []
    for r in rows:
        lines.append(
            "  ".join(
                v.rjust(w) if i > 2 else v.ljust(w)
                for i, (v, w) in enumerate(zip(r, widths, strict=False))
            )
            + "  "
            + r[-1]  # fmt: skip
        )
        if r is HEADER:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


FOOTNOTE = (
    "`*`: the ideal scheduler itself is over 1.3x the floor in this cell (the short "
    "requests' own demand queues them), so the cell is held to 1.1x the ideal's. "
    "`†N%`: the ideal scheduler gives N% of the short requests their first token later "
    "than the lane's deadline (the gateway's own fit: "
    f"{DEADLINE_OVER_FLOOR:g}x the floor, at least the configured one), so the cell may "
    'refuse up to that share. "admitted, then timed out": requests (short or long) '
    "the gateway queued that then got 503 queue_timeout, counted in the refusals too. "
    '"preempted": long prompts the gateway took off the engine in prefill for a short '
    'request ([preemption], off by default); "prefill work": the engine\'s prompt tokens '
    "prefilled per prompt token of the requests it answered (1.00: each prompt once; over "
    "it: prompts prefilled again after a preemption, beyond what the prefix cache kept)."
)


def markdown(cells: Sequence[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row(cell)) + " |" for cell in cells]
    return "\n".join(lines) + "\n\n" + FOOTNOTE


def markdown_page(cells: Sequence[dict[str, Any]]) -> str:
    """The table as the docs site's `docs/matrix.md`: a page needs a title of its own,
    or the site's strict build refuses it (a page without one cannot be in the navigation)."""
    intro = (
        "# Engine matrix\n\n"
        "`python -m gateway matrix` replays the same seeded traffic, in virtual time, straight\n"
        "to each kind of engine, through the gateway freshly started with its defaults, and\n"
        "through an ideal two-lane scheduler, against the engine's floor (a short request's\n"
        "time to first token behind one long prefill), and checks the promises. Times are\n"
        "seconds; this page is the command's `--markdown` output.\n\n"
    )
    return intro + markdown(cells)


def summary(cells: Sequence[dict[str, Any]]) -> dict[str, Any]:
    checked = [c for cell in cells for c in cell["checks"]]
    missed = [
        {"cell": f"{cell['engine']} / {cell['mix']} / {cell['load']:.0%}", **c}
        for cell in cells
        for c in cell["checks"]
        if not c["passed"]
    ]
    return {"cells": len(cells), "checks": len(checked), "missed": missed}
