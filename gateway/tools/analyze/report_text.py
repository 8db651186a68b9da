"""The plain-text report of an analysis: verdicts first, then the numbers behind them.

It is what an on-call engineer reads in a terminal, so it fits 100 columns and
leads with the one line per lane that says which fix to reach for. Names (lanes,
outcomes, backends, tenants, clients) are never cut to fit: a cut name is another
name (`rejected_max_tokens_too_larg`). A table's name column is as wide as its
longest name, as far as the row still fits; a longer name gets a line of its own.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable
from typing import Any

from gateway.tools.analyze.analyzer import QUEUE_BOUND_SHARE, VERDICT_RULE
from gateway.tools.analyze.engine import PART_TEXT, PARTS, SLOT_RULE
from gateway.tools.analyze.retries import MAX_RETRIES
from gateway.tools.analyze.tenants import COST_FALLBACK, COST_LOGGED, NO_TENANT

#: The report's width in columns: a terminal's, less a margin.
WIDTH = 100
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
    pct = f"{100 * tail['fraction']:g}%"
    lines = _wrapped(f"{lane}: {tail['verdict_text']}", indent="", more="      ")
    lines.append(
        f"    slowest {pct} = {tail['size']} of {tail['ranked']} requests, measured by {measures}"
    )
    lines += _stall_lines(tail)
    if tail.get("split") == "four":
        return lines + _four_part_lines(tail)
    lines.append(
        f"    mean {fmt_ms(tail['mean_total_ms'])} ms = queue {fmt_ms(tail['mean_queue_ms'])} ms"
        f" ({fmt_share(tail['queue_share'])}) + backend {fmt_ms(tail['mean_backend_ms'])} ms"
        f" ({fmt_share(tail['backend_share'])}) + gateway {fmt_ms(tail['mean_gateway_ms'])} ms"
        f" ({fmt_share(tail['gateway_share'])})"
    )
    if tail["verdict"] == "unknown":
        return lines
    lines.append(
        f"    queue share of queue + backend: {fmt_share(tail['queue_vs_backend'])}"
        f" (queueing-bound above {QUEUE_BOUND_SHARE:.0%}){_spread(tail)}"
    )
    if tail.get("split_note") and tail["split_note"] != TWO_PART_LOG_NOTE:
        lines += _wrapped(tail["split_note"])
    return lines


#: Said once under VERDICT rather than under every lane of an older log.
TWO_PART_LOG_NOTE = (
    "two-part verdict: this log has no engine_queue_ms / prefill_ms / decode_ms "
    "(a gateway from before the engine split)"
)


def _four_part_lines(tail: dict[str, Any]) -> list[str]:
    parts = tail["parts"]
    split = ", ".join(
        f"{PART_TEXT[part]} {fmt_ms(parts[part]['mean_ms'])} ({fmt_share(parts[part]['share'])})"
        for part in PARTS
    )
    lines = _wrapped(f"mean {fmt_ms(tail['mean_total_ms'])} ms: {split}")
    if tail["verdict"] == "unknown":
        return lines
    waiting = sum(parts[p]["mean_ms"] or 0.0 for p in ("queue_ms", "engine_queue_ms"))
    both = (tail["mean_queue_ms"] or 0.0) + (tail["mean_backend_ms"] or 0.0)
    lines += _wrapped(
        f"waiting (gateway + engine queue) {fmt_share(waiting / both if both else None)} of "
        f"queue + backend (a queue names the verdict above {QUEUE_BOUND_SHARE:.0%}){_spread(tail)}"
    )
    timings = ", ".join(f"{source} {n}" for source, n in tail["timing_sources"].items())
    lines.append(f"    timings of the slowest: {timings}")
    for advice in tail.get("engine_queue_advice", []):
        lines += _wrapped(_advice_text(advice))
    return lines


def _stall_lines(tail: dict[str, Any]) -> list[str]:
    """Under a queueing verdict: the slots were held long because decode stalled."""
    stall = tail.get("decode_stall")
    if tail.get("verdict") != "queueing" or not stall or not stall["stalled"]:
        return []
    return _wrapped(
        f"decode stalled: TPOT P95 {fmt_ms(stall['tpot_p95_ms'])} ms is "
        f"{stall['tpot_p95_over_p50']:.1f}x its P50 ({fmt_ms(stall['tpot_p50_ms'])} ms), so "
        f"the requests ahead held their slots {fmt_ms(stall['slot_hold_p90_ms'])} ms at P90 "
        f"(P50 {fmt_ms(stall['slot_hold_p50_ms'])}): other prompts prefilled in the same "
        "engine steps. Ordering alone does not shorten that; fewer long prompts at once "
        "do, and on vLLM a cap on a long prompt's share of a step "
        "(--long-prefill-token-threshold; llama.cpp's smaller --ubatch-size measured no "
        "better, see docs/benchmarks.md)"
    )


def _advice_text(advice: dict[str, Any]) -> str:
    """What the in-flight counts of one backend say about its max_concurrency."""
    head = f"{advice['backend']}: up to {advice['max_in_flight']} in flight when requests were sent"
    if advice["advised_max_concurrency"] is None:
        text = f"{head}; no figure: {advice['note']}"
    else:
        text = f"{head}; {advice['basis']}: set its max_concurrency to {advice['advised_max_concurrency']}"
    if advice.get("engine_setting"):
        text += (
            f". Its engine ({advice['engine']}) can do what the door cannot: "
            f"{advice['engine_setting']} ({advice['engine_setting_measured']})"
        )
    return text


def _spread(tail: dict[str, Any]) -> str:
    if tail["size"] <= 1:
        return ""
    return f"; tail {fmt_ms(tail['cutoff_ms'])} to {fmt_ms(tail['max_ms'])} ms"


def _wrapped(text: str, indent: str = "    ", more: str = "      ") -> list[str]:
    """Prose wrapped to the report's width, the words whole: a name longer than a line
    overhangs it rather than being split (or split at its hyphens)."""
    return textwrap.wrap(
        text,
        width=WIDTH - 2,
        initial_indent=indent,
        subsequent_indent=more,
        break_long_words=False,
        break_on_hyphens=False,
    )


def _column(values: Iterable[str], least: int, rest: int) -> int:
    """A name column's width: its longest value and a space, at least `least` (the header's
    layout), as far as the row still fits WIDTH (`rest`: the indent and the columns after
    it). A value too long for that goes on a line of its own (`_cell`) and does not widen
    the column: the room is left to the columns after it."""
    fitting = [len(value) + 1 for value in values if len(value) + 1 <= WIDTH - rest]
    return max([least, *fitting])


def _cell(value: str, width: int, lead: str) -> tuple[list[str], str]:
    """`value` padded to its column, and the lines to write before its row: none when it
    fits; when it does not, itself whole after `lead` (the row up to this column; from
    the table's indent when even that is too wide), and the row goes on below with this
    cell blank, so the figures stay under their headers."""
    if len(value) < width:
        return [], f"{value:<{width}}"
    line = lead + value if len(lead) + len(value) <= WIDTH else f"  {value}"
    return [line], " " * width


#: The figures a sizing warning is repeated with, in this order, where it has them.
SAID_FIGURES = (
    "slots",
    "usable_slots",
    "tail_slots",
    "headroom_slots",
    "demand_slots",
    "hold_s",
    "wait_allowance_s",
    "deadline_s",
    "engine_floor_s",
)


def said_lines(said: list[dict[str, Any]]) -> list[str]:
    """The gateway's latest sizing warning of each kind per lane, with its figures and
    hint (what no order of the queue fixes)."""
    out = ["THE GATEWAY SAID (its latest sizing warning of each kind, per lane)"]
    for line in said:
        figures = ", ".join(f"{key} {line[key]}" for key in SAID_FIGURES if key in line)
        out += _wrapped(f"{line.get('lane')}: {line['event']} ({figures})", indent="  ")
        if line.get("hint"):
            out += _wrapped(str(line["hint"]), indent="    ", more="    ")
    return out


def slot_lines(backends: dict[str, Any]) -> list[str]:
    """ENGINE SLOTS: per backend, who queued in the engine by how many were in flight."""
    out = [
        "ENGINE SLOTS per backend: requests in flight when one was sent: queued in the "
        "engine / sent"
    ]
    if not backends:
        out.append("  no request was sent to a backend")
    for name, data in backends.items():
        counts = ", ".join(
            f"{n}: {row['queued']}/{row['requests']}" for n, row in data["by_in_flight"].items()
        )
        if data["advised_max_concurrency"] is not None:
            said = (
                f"→ it batches {data['advised_max_concurrency']}: max_concurrency "
                f"{data['advised_max_concurrency']} ({data['basis']})"
            )
        else:
            said = f"→ no figure: {data['note']}"
        out += _wrapped(f"{name}: {counts} {said}", indent="  ", more="    ")
    return out


BAND_HEADERS = ("total", "gw queue", "eng queue", "prefill", "decode", "other", "gateway")


def band_lines(lanes: dict[str, Any]) -> list[str]:
    """TIME SPLIT: per lane and percentile band, the mean of each part (the HTML's bars)."""
    out = _wrapped(
        "TIME SPLIT per lane and percentile band of the verdict's measure (mean ms; other: "
        "backend time the engine did not account for)",
        indent="",
        more="  ",
    )
    out += [
        f"  {'lane / band':<20}{'n':>6}" + "".join(f"{h:>10}" for h in BAND_HEADERS),
    ]
    for lane, data in lanes.items():
        bands = data["tail"].get("bands") or []
        if not bands:
            continue
        timings = ", ".join(f"{s} {n}" for s, n in data.get("timing_sources", {}).items())
        out += _wrapped(lane + (f" (timings: {timings})" if timings else ""), "  ", "      ")
        for band in bands:
            cells = [band["mean_total_ms"], *(band[part] for part in PARTS)]
            out.append(
                f"    {band['band']:<18}{band['requests']:>6}"
                + "".join(f"{fmt_ms(c):>10}" for c in cells)
            )
    return out


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
    if not analysis.get("engine_split"):
        out += _wrapped(f"({TWO_PART_LOG_NOTE})", indent="  ", more="   ")
    for lane, data in lanes.items():
        out += ["  " + line for line in verdict_lines(lane, data["tail"])]
    retries = analysis.get("retries") or {}
    if retries.get("verdict") == "storm":
        out += ["  " + line for line in _wrapped(f"retries: {retries['verdict_text']}", "")]
    if analysis.get("gateway_said"):
        out += ["", *said_lines(analysis["gateway_said"])]
    if analysis.get("engine_split"):
        out += ["", *band_lines(lanes)]
        out += ["", *slot_lines(analysis.get("backends") or {})]

    out += ["", "LATENCY (ms) per lane and outcome; n = requests with a value"]
    head = f"{'requests':>8}  {'metric':<16}{'n':>6}{'p50':>10}{'p95':>10}{'p99':>10}"
    labels = [f"  {outcome}" for data in lanes.values() for outcome in data["outcomes"]]
    width = _column(labels, 30, 2 + len(head))
    out.append(f"  {'lane / outcome':<{width}}{head}")
    for lane, data in lanes.items():
        out.append(f"  {lane}")
        for outcome, stats in data["outcomes"].items():
            before, label = _cell(f"  {outcome}", width, "  ")
            out += before
            rows = [(m, s) for m, s in stats["latency"].items() if s["count"]]
            if not rows:
                out.append(f"  {label}{stats['count']:>8}  (no timings)")
            for i, (metric, s) in enumerate(rows):
                first = f"  {label}{stats['count']:>8}" if i == 0 else " " * (width + 10)
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
        head = f"{'count':>8}{'lane total':>12}{'% of lane':>12}"
        lane_w = _column((lane for lane, _, _ in failures), 24, 2 + 32 + len(head))
        reason_w = _column((f["reason"] for _, f, _ in failures), 32, 2 + lane_w + len(head))
        out.append(f"  {'lane':<{lane_w}}{'reason':<{reason_w}}{head}")
        for i, (lane, failure, total) in enumerate(failures):
            named = i == 0 or failures[i - 1][0] != lane  # a lane's name once, on its first row
            before, name = _cell(lane if named else "", lane_w, "  ")
            more, reason = _cell(failure["reason"], reason_w, f"  {name}")
            out += before + more
            out.append(
                f"  {name}{reason}{failure['count']:>8}{total:>12}{failure['percent']:>11.1f}%"
            )
    models = analysis.get("models")
    if models:
        out += ["", *model_lines(models)]
    predictor = analysis.get("predictor")
    if predictor:
        out += ["", *predictor_lines(predictor)]
    tenants = analysis.get("tenants")
    if tenants:
        out += ["", *tenant_lines(tenants)]
    if retries:
        out += ["", *retry_lines(retries)]
    resumes = analysis.get("resumes")
    if resumes:
        out += ["", *resume_lines(resumes)]
    slots = f" Engine slots: {SLOT_RULE}." if analysis.get("engine_split") else ""
    out += ["", "HOW TO READ"]
    out += _wrapped(
        f"{VERDICT_RULE}. {MEASURE_LEGEND}. Gateway time is admission (token counting) and "
        f"refusals.{slots} Percentiles interpolate linearly between ranks, as numpy does.",
        "  ",
        "  ",
    )
    return "\n".join(out) + "\n"


def model_lines(models: dict[str, Any]) -> list[str]:
    """One row per model and lane: what each model's clients got, and its own verdict."""
    head = f"{'requests':>9}{'ok %':>7}{'ttft p50':>10}{'ttft p99':>10}{'queue p99':>10}  "
    labels: dict[str, str] = {}
    for model, data in models.items():
        pools = ", ".join(p for p in data["pools"] if p != model)
        labels[model] = f"{model} → {pools}" if pools else model
    rows = [(model, lane, s) for model, d in models.items() for lane, s in d["lanes"].items()]
    verdict_w = max(len(s["tail"].get("verdict") or "-") for _, _, s in rows)
    rest = 2 + len(head) + verdict_w
    label_w = _column(labels.values(), 28, rest + 14)
    lane_w = _column((lane for _, lane, _ in rows), 14, rest + label_w)
    out = [
        f"PER MODEL ({len(models)} models; each has its own pool, queue and slots)",
        f"  {'model → pool':<{label_w}}{'lane':<{lane_w}}{head}verdict",
    ]
    for model, data in models.items():
        for i, (lane, summary) in enumerate(data["lanes"].items()):
            ok = summary["outcomes"].get("ok")
            share = 100.0 * ok["count"] / summary["requests"] if ok else 0.0
            latency = ok["latency"] if ok else {}
            ttft = latency.get("ttft_ms") or {}
            queue = latency.get("queue_ms") or {}
            verdict = summary["tail"].get("verdict") or "-"
            before, name = _cell(labels[model] if i == 0 else "", label_w, "  ")
            more, lane_cell = _cell(lane, lane_w, f"  {name}")
            out += before + more
            out.append(
                f"  {name}{lane_cell}{summary['requests']:>9}{share:>7.1f}"
                f"{fmt_ms(ttft.get('p50')):>10}{fmt_ms(ttft.get('p99')):>10}"
                f"{fmt_ms(queue.get('p99')):>10}  {verdict}"
            )
    return out


def predictor_lines(predictor: dict[str, Any]) -> list[str]:
    """The PREDICTOR section: was the wait predicted at arrival right, and were refusals?"""
    head = (
        f"{'n':>6}{'median |err|':>14}{'p90 |err|':>11}"
        f"{'refused':>9}{'judged':>8}{'would have made':>17}{'vs limit':>9}"
    )
    width = _column(predictor["lanes"], 24, 2 + len(head))
    out = [
        "PREDICTOR per lane: predicted wait at arrival vs queue_ms; wait_too_long refusals",
        f"  {'lane':<{width}}{head}",
    ]
    for lane, data in predictor["lanes"].items():
        share = data["would_have_made_share"]
        made = f"{data['would_have_made']} ({fmt_share(share)})" if share is not None else "-"
        near = data.get("would_have_waited_share_p50")
        before, name = _cell(lane, width, "  ")
        out += before
        out.append(
            f"  {name}{data['admitted_with_prediction']:>6}"
            f"{_ms_or_dash(data['median_abs_error_ms']):>14}"
            f"{_ms_or_dash(data['p90_abs_error_ms']):>11}"
            f"{data['refused_wait_too_long']:>9}{data['refusals_judged']:>8}{made:>17}"
            f"{'-' if near is None else f'{near:.2f}x':>9}"
        )
    out += _wrapped(
        predictor["rule"] + "; vs limit: the median of the waits the judged refusals would "
        "have had, over their deadline.",
        "  ",
        "  ",
    )
    return out


def _ms_or_dash(value: float | None) -> str:
    return "-" if value is None else f"{fmt_ms(value)} ms"


#: Tenants listed one by one in the text report (most requests first); --json has all.
TENANTS_LISTED = 20
GAP_VERDICT_TEXT = {
    "within_bound": "within VTC's bound",
    "within_bound_plus_in_flight": "over 2·U by less than the pair's requests in flight",
    "over_bound": "over the bound, in-flight requests included",
}


def tenant_lines(tenants: dict[str, Any]) -> list[str]:
    """The TENANTS section: what each tenant got, then per lane whether that was fair."""
    table: dict[str, Any] = tenants["table"]
    if tenants["count"] <= 1:
        name = next(iter(table), NO_TENANT)
        why = " (this log has no tenant field)" if not tenants["tagged"] else ""
        out = [f'TENANTS: one tenant, "{name}"{why}: nothing to compare']
    else:
        out = [
            f"TENANTS: {tenants['count']}; tokens = prompt + completion of served requests, "
            "wait = queue_ms"
        ]
    head = (
        f"{'weight':>7}{'requests':>9}{'served':>8}{'tokens':>11}"
        f"{'TTFT p50':>9}{'TTFT p99':>9}{'wait p50':>9}{'wait p99':>9}{'refused':>8}"
    )
    listed = list(table.items())[:TENANTS_LISTED]
    width = _column((name for name, _ in listed), 18, 2 + len(head))
    out.append(f"  {'tenant':<{width}}{head}")
    for name, row in listed:
        weight = "-" if row["weight"] is None else f"{row['weight']:.4g}"
        before, cell = _cell(name, width, "  ")
        out += before
        out.append(
            f"  {cell}{weight:>7}{row['requests']:>9}{row['served']:>8}"
            f"{row['tokens_served']:>11}{fmt_ms(row['ttft_ms']['p50']):>9}"
            f"{fmt_ms(row['ttft_ms']['p99']):>9}{fmt_ms(row['queue_ms']['p50']):>9}"
            f"{fmt_ms(row['queue_ms']['p99']):>9}{sum(row['refusals'].values()):>8}"
        )
    if len(table) > len(listed):
        out.append(f"  ... and {len(table) - len(listed)} more tenant(s) (all of them in --json)")
    refused = "; ".join(
        f"{name} " + ", ".join(f"{code} {count}" for code, count in row["refusals"].items())
        for name, row in listed
        if row["refusals"]
    )
    if refused:
        out += _wrapped("refused by code: " + refused, "  ", "    ")
    if tenants["count"] <= 1:
        return out
    return out + ["", *fairness_lines(tenants)]


def fairness_lines(tenants: dict[str, Any]) -> list[str]:
    """FAIR SHARE per lane: Jain's index over contended windows, and the gap against 2·U."""
    fairness = tenants["fairness"]
    out = [
        f"FAIR SHARE per lane: Jain's J over {fairness['window_s']:g} s windows with ≥ 2 tenants "
        f"backlogged ≥ {fairness['backlog_share']:.0%} and served"
    ]
    if not fairness["lanes"]:
        out.append("  no lane had requests of two tenants queued: nothing to compare")
        return out
    head = (
        f"{'tenants':>8}{'windows':>8}{'one':>9}{'min J':>8}{'median J':>9}"
        f"{'max gap':>11}{'bound 2U':>11}{'in flight':>11}"
    )
    width = _column(fairness["lanes"], 18, 2 + len(head))
    out.append(f"  {'lane':<{width}}{head}")
    for lane, data in fairness["lanes"].items():
        gap = data["gap"] or {}
        before, cell = _cell(lane, width, "  ")
        out += before
        out.append(
            f"  {cell}{data['tenants']:>8}{data['windows']:>8}"
            f"{data['windows_one_tenant']:>9}{_index(data['min_jain']):>8}"
            f"{_index(data['median_jain']):>9}{_tokens(gap.get('max_gap')):>11}"
            f"{_tokens(gap.get('bound')):>11}{_tokens(gap.get('in_flight_max')):>11}"
        )
        if gap:
            pair = " vs ".join(gap["pair"])
            out += _wrapped(
                f"largest gap {pair}, {gap['start'][11:23]} → {gap['end'][11:23]}: "
                f"{GAP_VERDICT_TEXT[gap['verdict']]}; {gap['intervals_over_bound']} of "
                f"{gap['pair_intervals']} co-backlogged interval(s) over 2·U"
            )
        worst = data["worst_window"]
        if worst and worst["jain"] < 1:
            shares = sorted(worst["weighted_service"].items(), key=lambda item: -item[1])
            listed = ", ".join(f"{name} {_tokens(x)}" for name, x in shares[:6])
            more = f" and {len(shares) - 6} more" if len(shares) > 6 else ""
            out += _wrapped(
                f"least fair window from {worst['start'][11:23]}: J {_index(worst['jain'])}, "
                f"weighted service {listed}{more}"
            )
        if data["backlogged_unserved"]:
            out.append(
                f"    {data['backlogged_unserved']} time(s) a tenant backlogged "
                f"≥ {fairness['backlog_share']:.0%} of a window got nothing while another was served"
            )
    if fairness["windows"]:
        out.append(
            f"  all lanes: {fairness['windows']} window(s), min J {_index(fairness['min_jain'])}, "
            f"median J {_index(fairness['median_jain'])} (1.0 = served exactly by weight)"
        )
    out += _wrapped(cost_source_text(tenants["cost_source"]), indent="  ", more="    ")
    out += _wrapped(
        "windows: those counted; one: those with a single tenant backlogged and served (not "
        "counted); gap, bound and in flight are in weighted tokens. "
        f"{fairness['rule']}. {fairness['gap_rule']}.",
        "  ",
        "  ",
    )
    return out


def cost_source_text(sources: dict[str, int]) -> str:
    """Which figure the weighted service was counted from: the gateway's charge or a stand-in."""
    logged, fallback = sources[COST_LOGGED], sources[COST_FALLBACK]
    if not fallback:
        return f"service counted from cost_tokens (what the gateway charged), {logged} request(s)"
    stand_in = (
        "uncached prompt + completion tokens (lines without cost_tokens; output weight taken as 1)"
    )
    if not logged:
        return f"service counted from {stand_in}, {fallback} request(s)"
    return (
        f"service counted from cost_tokens for {logged} request(s), from {stand_in} for {fallback}"
    )


def _index(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _tokens(value: float | None) -> str:
    """Weighted tokens: whole numbers once they are large, one decimal below 1000."""
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.1f}"


#: Storm windows and clients listed one by one in the text report; --json has all.
STORM_WINDOWS_LISTED = 8
RETRY_CLIENTS_LISTED = 15


def retry_lines(retries: dict[str, Any]) -> list[str]:
    """The RETRIES section: how much was retries, when, whose, and what it cost."""
    if not retries["tagged"]:
        return _wrapped(
            "RETRIES: this log has no retry_of field (a gateway from before retries were "
            "marked): retries cannot be told from new requests",
            indent="",
            more="  ",
        )
    if not retries["retries"]:
        return [f"RETRIES: none of {retries['requests']} requests was a retry"]
    windows = retries["windows"]
    out = _wrapped(
        f"RETRIES: {retries['retries']} of {retries['requests']} requests "
        f"({fmt_share(retries['share'])}) were retries; {retries['storm_windows']} of "
        f"{len(windows)} window(s) of {retries['window_s']:g} s had more than "
        f"{retries['threshold']:.0%} retries",
        indent="",
        more="  ",
    )
    out += _wrapped(f"verdict: {retries['verdict_text']}", indent="  ")
    storms = [w for w in windows if w["storm"]]
    if storms:
        listed = "; ".join(
            f"{w['start'][11:23]} {w['retries']}/{w['requests']} ({fmt_share(w['share'])})"
            for w in storms[:STORM_WINDOWS_LISTED]
        )
        more = f"; and {len(storms) - STORM_WINDOWS_LISTED} more" if len(storms) > 8 else ""
        out += _wrapped(f"storm windows (start, retries/requests): {listed}{more}", "  ")
        whose = ", ".join(f"{name} {n}" for name, n in list(retries["storm_clients"].items())[:8])
        out += _wrapped(f"retries in storm windows by client: {whose}", "  ")
    queue, refusals = retries["queue_ms"], retries["refusals"]
    out += _wrapped(
        f"cost: {fmt_share(queue['share'])} of the queue wait ({fmt_ms(queue['retries'])} of "
        f"{fmt_ms(queue['total'])} ms queue_ms), {fmt_share(refusals['share'])} of the "
        f"refusals ({refusals['retries']} of {refusals['total']})",
        "  ",
    )
    retried = ", ".join(f"{code} {n}" for code, n in retries["retried_outcomes"].items())
    out += _wrapped(f"what the retried requests got: {retried}", "  ")
    faster = retries["clients_faster_than_told"]
    clients = retries["clients"]
    if faster:
        named = ", ".join(
            f"{name} {n} of {clients[name]['told']}" for name, n in list(faster.items())[:10]
        )
        out += _wrapped(f"faster than told (before their Retry-After): {named}", "  ")
    else:
        out.append(
            f"  faster than told: none of the {retries['judged_against_retry_after']} retries "
            "of a refusal with a Retry-After"
        )
    if retries.get("damped"):
        out.append(
            f"  damped by the gateway (refused at once, before their Retry-After): "
            f"{retries['damped']}"
        )
    if retries["over_max_retries"]:
        out.append(
            f"  beyond the seed's {MAX_RETRIES} retries of one request: "
            f"{retries['over_max_retries']}"
        )
    head = (
        f"{'requests':>9}{'retries':>8}{'share':>7}{'told':>6}{'faster':>7}"
        f"{'median gap':>11}{'chain':>6}{'refused':>8}"
    )
    rows = [(n, row) for n, row in clients.items() if row["retries"]][:RETRY_CLIENTS_LISTED]
    width = _column((name for name, _ in rows), 24, 2 + len(head))
    out.append(f"  {'client':<{width}}{head}")
    for name, row in rows:
        before, cell = _cell(name, width, "  ")
        out += before
        out.append(
            f"  {cell}{row['requests']:>9}{row['retries']:>8}"
            f"{fmt_share(row['share']):>7}{row['told']:>6}{row['faster_than_told']:>7}"
            f"{_ms_or_dash(row['median_gap_ms']):>11}{row['longest_chain']:>6}"
            f"{row['refused']:>8}"
        )
    rest = sum(1 for row in clients.values() if row["retries"]) - len(rows)
    if rest > 0:
        out.append(f"  ... and {rest} more client(s) that retried (all of them in --json)")
    out += _wrapped(
        "told: retries of a refusal that carried a Retry-After; chain: the most retries of one "
        f"request. {retries['rule']}.",
        "  ",
        "  ",
    )
    return out


def resume_lines(resumes: dict[str, Any]) -> list[str]:
    """The RESUMES section of the text report."""
    if not resumes["tagged"]:
        return ["RESUMES: this log has no resumes field (a gateway from before resumes)"]
    if not resumes["resumed"] and not resumes["not_resumed"]:
        return [f"RESUMES: no stream of {resumes['requests']} requests broke mid-answer"]
    reasons = ", ".join(f"{why} {n}" for why, n in resumes["reasons"].items()) or "none"
    out = [
        f"RESUMES: {resumes['resumed']} answers carried over mid-stream "
        f"({resumes['carry_overs']} carry-overs; {resumes['resumed_ok']} ended ok); "
        f"why: {reasons}"
    ]
    if resumes["broke_streams"]:
        named = ", ".join(f"{b} {n}" for b, n in resumes["broke_streams"].items())
        out.append(f"  backends that broke or stalled streams: {named}")
    if resumes["drained_from"]:
        named = ", ".join(f"{b} {n}" for b, n in resumes["drained_from"].items())
        out.append(f"  drained from: {named}")
    if resumes["not_resumed"]:
        why = ", ".join(f"{w} {n}" for w, n in resumes["not_resumed_why"].items())
        out.append(
            f"  not carried over (ended with an error event): {resumes['not_resumed']} ({why})"
        )
    return out
