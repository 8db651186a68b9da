"""The plain-text report of an analysis: verdicts first, then the numbers behind them.

It is what an on-call engineer reads in a terminal, so it fits 100 columns and
leads with the one line per lane that says which fix to reach for.
"""

from __future__ import annotations

import textwrap
from typing import Any

from gateway.tools.analyze.analyzer import QUEUE_BOUND_SHARE, VERDICT_RULE

MEASURE_TEXT = {"ttft_ms": "TTFT", "e2e_ms": "e2e (no first token)"}
MEASURE_LEGEND = (
    "TTFT splits into queue_ms + backend_ttft_ms + gateway; e2e (for requests without a first "
    "token) into queue_ms + dispatch → end + gateway"
)


def fmt_ms(value: float | None) -> str:
    """Milliseconds with precision that suits the size: 0.06, 12.7, 1503."""
    if value is None:
        return "-"
    if abs(value) < 10:
        return f"{value:.2f}"
    if abs(value) < 1000:
        return f"{value:.1f}"
    return f"{value:.0f}"


def fmt_share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def verdict_lines(lane: str, tail: dict[str, Any]) -> list[str]:
    """The headline for one lane and the numbers that justify it."""
    if not tail["size"]:
        return [f"{lane}: no verdict (no request with a TTFT or e2e time)"]
    mixed = len(tail["measures"]) > 1
    measures = ", ".join(
        MEASURE_TEXT[m] + (f" ×{n}" if mixed else "")
        for m, n in sorted(tail["measures"].items(), key=lambda item: -item[1])
    )
    lane = lane[:40]
    pct = f"{100 * tail['fraction']:g}%"
    lines = [
        f"{lane}: {tail['verdict_text']}",
        f"    slowest {pct} = {tail['size']} of {tail['ranked']} requests, measured by {measures}",
        f"    mean {fmt_ms(tail['mean_total_ms'])} ms = queue {fmt_ms(tail['mean_queue_ms'])} ms"
        f" ({fmt_share(tail['queue_share'])}) + backend {fmt_ms(tail['mean_backend_ms'])} ms"
        f" ({fmt_share(tail['backend_share'])}) + gateway {fmt_ms(tail['mean_gateway_ms'])} ms"
        f" ({fmt_share(tail['gateway_share'])})",
    ]
    if tail["verdict"] == "unknown":
        return lines
    spread = (
        f"; tail {fmt_ms(tail['cutoff_ms'])} to {fmt_ms(tail['max_ms'])} ms"
        if tail["size"] > 1
        else ""
    )
    lines.append(
        f"    queue share of queue + backend: {fmt_share(tail['queue_vs_backend'])}"
        f" (queueing-bound above {QUEUE_BOUND_SHARE:.0%}){spread}"
    )
    return lines


def format_report(analysis: dict[str, Any]) -> str:
    """The plain-text report (≤ 100 columns): verdicts first, then the numbers behind them."""
    lanes: dict[str, Any] = analysis["lanes"]
    out = [
        f"gateway analyze: {analysis['requests']} requests in {len(lanes)} lane(s), "
        f"{analysis['skipped_lines']} other line(s) skipped"
    ]
    window = analysis.get("window")
    if window:
        out.append(f"window: {window['start']} → {window['end']} ({window['seconds']:.1f} s)")
    if not lanes:
        out.append('no request lines (event == "request") found')
        return "\n".join(out) + "\n"

    out += ["", f"VERDICT, slowest {100 * analysis['tail_fraction']:g}% of each lane"]
    for lane, data in lanes.items():
        out += ["  " + line for line in verdict_lines(lane, data["tail"])]

    out += ["", "LATENCY (ms) per lane and outcome; n = requests with a value"]
    out.append(
        f"  {'lane / outcome':<30}{'requests':>8}  {'metric':<16}{'n':>6}"
        f"{'p50':>10}{'p95':>10}{'p99':>10}"
    )
    for lane, data in lanes.items():
        out.append(f"  {lane[:30]}")
        for outcome, stats in data["outcomes"].items():
            label = f"  {outcome}"[:30]
            rows = [(m, s) for m, s in stats["latency"].items() if s["count"]]
            if not rows:
                out.append(f"  {label:<30}{stats['count']:>8}  (no timings)")
            for i, (metric, s) in enumerate(rows):
                first = f"  {label:<30}{stats['count']:>8}" if i == 0 else " " * 40
                out.append(
                    f"{first}  {metric:<16}{s['count']:>6}{fmt_ms(s['p50']):>10}"
                    f"{fmt_ms(s['p95']):>10}{fmt_ms(s['p99']):>10}"
                )

    out += ["", "REJECTIONS, TIMEOUTS AND ERRORS per lane (% of the lane's requests)"]
    failures = [
        (lane, failure, data["requests"])
        for lane, data in lanes.items()
        for failure in data["failures"]
    ]
    if not failures:
        out.append("  none: every request ended ok")
    else:
        out.append(f"  {'lane':<24}{'reason':<32}{'count':>8}{'lane total':>12}{'% of lane':>12}")
        for lane, failure, total in failures:
            out.append(
                f"  {lane[:23]:<24}{failure['reason'][:31]:<32}{failure['count']:>8}"
                f"{total:>12}{failure['percent']:>11.1f}%"
            )
    predictor = analysis.get("predictor")
    if predictor:
        out += ["", *predictor_lines(predictor)]
    out += ["", "HOW TO READ"]
    out += textwrap.wrap(
        f"{VERDICT_RULE}. {MEASURE_LEGEND}. Gateway time is admission (token counting) and "
        "refusals. Percentiles interpolate linearly between ranks, as numpy does.",
        width=98,
        initial_indent="  ",
        subsequent_indent="  ",
    )
    return "\n".join(out) + "\n"


def predictor_lines(predictor: dict[str, Any]) -> list[str]:
    """The PREDICTOR section: was the wait predicted at arrival right, and were refusals?"""
    out = [
        "PREDICTOR per lane: predicted wait at arrival vs queue_ms; wait_too_long refusals",
        f"  {'lane':<24}{'n':>6}{'median |err|':>14}{'p90 |err|':>11}"
        f"{'refused':>9}{'judged':>8}{'would have made':>17}{'vs limit':>9}",
    ]
    for lane, data in predictor["lanes"].items():
        share = data["would_have_made_share"]
        made = f"{data['would_have_made']} ({fmt_share(share)})" if share is not None else "-"
        near = data.get("would_have_waited_share_p50")
        out.append(
            f"  {lane[:23]:<24}{data['admitted_with_prediction']:>6}"
            f"{_ms_or_dash(data['median_abs_error_ms']):>14}"
            f"{_ms_or_dash(data['p90_abs_error_ms']):>11}"
            f"{data['refused_wait_too_long']:>9}{data['refusals_judged']:>8}{made:>17}"
            f"{'-' if near is None else f'{near:.2f}x':>9}"
        )
    out += textwrap.wrap(
        predictor["rule"] + "; vs limit: the median of the waits the judged refusals would "
        "have had, over their deadline.",
        width=98,
        initial_indent="  ",
        subsequent_indent="  ",
    )
    return out


def _ms_or_dash(value: float | None) -> str:
    return "-" if value is None else f"{fmt_ms(value)} ms"
