"""`--html FILE`: the side-by-side table as one self-contained page (no matplotlib needed)."""

from __future__ import annotations

from html import escape
from typing import Any


def render_html(result: dict[str, Any], engine: str, traffic: str) -> str:
    rows = []
    classes = sorted({c for run in ("direct", "gateway") for c in result[run]["classes"]})
    for cls in classes:
        for run in ("direct", "gateway"):
            fig = result[run]["classes"].get(cls)
            if fig is None:
                continue
            t = fig["ttft_ms"]
            cells = [run, cls, *(_ms(t[p]) for p in ("p50", "p95", "p99"))]
            cells += [str(fig["completed"]), str(fig["refused"]), str(fig["goodput_rps"])]
            rows.append("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>")
    sweep = result.get("sweep")
    sweep_line = (
        ""
        if sweep is None
        else f"<p>Smallest fleet meeting {escape(sweep['class'])} P99 TTFT &le; "
        f"{sweep['target_s']:g} s through the gateway: {sweep['backends'] or 'none found'}</p>"
    )
    head = "".join(
        f"<th>{h}</th>"
        for h in ("run", "class", "P50 TTFT ms", "P95", "P99", "done", "refused", "goodput/s")
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>gateway replay</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:4px 10px;"
        "text-align:right;border-bottom:1px solid #ddd}td:nth-child(-n+2){text-align:left}"
        "</style></head><body><h1>What would the gateway change?</h1>"
        f"<p>{escape(engine)}</p><p>{escape(traffic)}</p>"
        f"<table><tr>{head}</tr>{''.join(rows)}</table>{sweep_line}</body></html>\n"
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
