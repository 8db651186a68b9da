"""The `analyze --html` report: one self-contained file an SRE can open or attach at 2 a.m.

Self-contained because incident write-ups get mailed, archived and opened on
machines without network: CSS is inline and the plots are inline SVG, nothing
is fetched. matplotlib is an optional extra (`llm-tail-gateway[report]`), so it
is imported only inside `render`; the figures use matplotlib's object API
(`Figure` + SVG output), which never loads a GUI backend or touches pyplot's
global state, so it is as headless as Agg.
"""

from __future__ import annotations

import html
import io
import math
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from gateway.tools.analyze.analyzer import (
    METRICS,
    QUEUE_BOUND_SHARE,
    VERDICT_RULE,
    queue_depth_series,
)
from gateway.tools.analyze.engine import PART_TEXT, PARTS, SLOT_RULE
from gateway.tools.analyze.fields import (
    NO_LANE,
    Record,
    arrival_s,
    end_s,
    lane_of,
    number,
    outcome_of,
)
from gateway.tools.analyze.report_text import (
    GAP_VERDICT_TEXT,
    cost_source_text,
    fmt_ms,
    fmt_share,
)
from gateway.tools.analyze.tenants import NO_TENANT
from gateway.tools.stats import percentile

#: The parts of a request's wait, in the colours every plot and card use: the two
#: queues in oranges, the engine's work in blues, the gateway's own time grey.
QUEUE_COLOUR = "#e6550d"
ENGINE_QUEUE_COLOUR = "#a63603"
BACKEND_COLOUR = "#3182bd"
PREFILL_COLOUR = BACKEND_COLOUR
DECODE_COLOUR = "#6baed6"
BACKEND_OTHER_COLOUR = "#c6dbef"
GATEWAY_COLOUR = "#a8a8a8"
PART_COLOUR = {
    "queue_ms": QUEUE_COLOUR,
    "engine_queue_ms": ENGINE_QUEUE_COLOUR,
    "prefill_ms": PREFILL_COLOUR,
    "decode_ms": DECODE_COLOUR,
    "backend_other_ms": BACKEND_OTHER_COLOUR,
    "backend_ms": BACKEND_COLOUR,
    "gateway_ms": GATEWAY_COLOUR,
}
#: The parts a bar is stacked from: four where the log splits the backend's time, else two.
FOUR_PARTS = PARTS
TWO_PARTS = ("queue_ms", "backend_ms", "gateway_ms")
PART_LEGEND = {
    "queue_ms": "gateway queue",
    "backend_ms": "backend (dispatch → first token / end)",
    "gateway_ms": "gateway (admission, refusal)",
    **{part: PART_TEXT[part] for part in ("engine_queue_ms", "prefill_ms", "decode_ms")},
    "backend_other_ms": "backend, not split by the engine",
}
VERDICT_COLOUR = {
    "queueing": QUEUE_COLOUR,
    "engine_queue": ENGINE_QUEUE_COLOUR,
    "prefill": PREFILL_COLOUR,
    "decode": "#2171b5",
    "backend": BACKEND_COLOUR,
    "gateway": GATEWAY_COLOUR,
    "unknown": "#777777",
}
#: Retries in the retry panel, new requests beside them.
RETRY_COLOUR = "#c51b7d"
NEW_COLOUR = "#bdbdbd"
LANE_COLOURS = ("#1b9e77", "#7570b3", "#d95f02", "#e7298a", "#66a61e", "#e6ab02", "#a6761d")
#: Not-ok outcomes over time: away from the queue/backend orange and blue.
REFUSAL_COLOURS = ("#c51b7d", "#54278f", "#4d4d4d", "#8c510a", "#b2182b", "#35978f", "#dfc27d")
#: Most steps drawn per queue-depth line.
DEPTH_POINTS = 2000
#: Bars per lane in the "where did the time go" plot.
SLOWEST_PLOTTED = 20
#: Most points drawn per CDF line; the top of the distribution is always kept whole.
CDF_POINTS = 1500
#: Tenants in the per-tenant table and chart (most requests first); --json has all.
TENANTS_SHOWN = 40
#: The tenant chart's bars: weighted service (the engine's work) and P99 TTFT.
SERVICE_COLOUR = BACKEND_COLOUR
TTFT_COLOUR = "#636363"


def render(analysis: dict[str, Any], records: Sequence[Record], *, source: str = "") -> str:
    """The whole HTML document as a string."""
    import matplotlib

    lanes = list(analysis["lanes"])
    colours = {lane: LANE_COLOURS[i % len(LANE_COLOURS)] for i, lane in enumerate(lanes)}
    with matplotlib.rc_context(
        {
            "svg.fonttype": "none",  # real <text>: smaller files, crisp and searchable
            "svg.hashsalt": "gateway-report",  # stable ids from run to run
            "font.family": "sans-serif",
            "font.size": 10,
            "axes.spines.top": False,
            "axes.spines.right": False,
        }
    ):
        figures = [
            (
                "Where the slowest requests spent their time",
                f"Each bar is one request, slowest at the top (at most {SLOWEST_PLOTTED} per "
                "lane). Bars above a dashed line are the slowest "
                f"{100 * analysis['tail_fraction']:g}% that decide the verdict; without a line, "
                "every bar shown is. "
                "Time to first token when there was one, else end-to-end time (marked e2e).",
                _svg(_tail_figure(analysis, records), "tail"),
            ),
            (
                "Where the time went, per percentile band",
                "Each bar is the mean split of one lane's requests in a band of its ranking by "
                "the verdict's measure: below P50, P50 to P90, P90 to P99, and the slowest 1%. "
                + (
                    "Gateway queue and engine queue are waiting; prefill and decode the "
                    "engine's work (decode only in an e2e measure); backend, not split: what "
                    "the engine did not account for."
                    if analysis.get("engine_split")
                    else "This log has no engine split (engine_queue_ms, prefill_ms, "
                    "decode_ms): queue and backend only."
                ),
                _svg(_band_figure(analysis), "bands"),
            ),
            (
                "Latency distribution per lane",
                "Share of requests at or below each latency (log scale). TTFT: streamed "
                "requests that got a first token; e2e: every request not refused at the door.",
                _svg(_cdf_figure(lanes, records, colours), "cdf"),
            ),
            (
                "Queue depth and refusals over time",
                "Requests waiting in each lane's queue, rebuilt from each line's timestamp "
                "(end) − e2e_ms (arrival) and queue_ms; below, requests that did not end ok, "
                "by reason, at the time they ended.",
                _svg(_timeline_figure(lanes, records, colours), "time"),
            ),
        ]
        tenants = analysis.get("tenants") or {}
        tenant_svg = _svg(_tenant_figure(tenants), "tenants") if tenants.get("count", 0) > 1 else ""
        retries = analysis.get("retries") or {}
        retry_svg = _svg(_retry_figure(retries), "retries") if retries.get("retries") else ""
    return _page(analysis, figures, source, tenant_svg, retry_svg)


# ----------------------------------------------------------------------------- figures


def _parts_of(tail: dict[str, Any]) -> tuple[str, ...]:
    return FOUR_PARTS if tail.get("split") == "four" else TWO_PARTS


def _parts_legend(fig: Any, drawn: Sequence[str]) -> None:
    """One legend over the figure for the time parts its bars drew, in the parts' order."""
    from matplotlib.patches import Patch

    order = [part for part in (*FOUR_PARTS, "backend_ms") if part in drawn]
    fig.legend(
        handles=[Patch(color=PART_COLOUR[part], label=PART_LEGEND[part]) for part in order],
        loc="outside upper center",
        ncols=min(4, len(order)),
        frameon=False,
    )


def _tail_figure(analysis: dict[str, Any], records: Sequence[Record]) -> Any:
    from matplotlib.figure import Figure

    # A lane whose slowest requests were all refused at the door has nothing to split.
    lanes = [
        lane
        for lane, data in analysis["lanes"].items()
        if data["tail"]["size"] and data["tail"]["verdict"] != "unknown"
    ]
    bars_of = {lane: analysis["lanes"][lane]["tail"]["slowest"][:SLOWEST_PLOTTED] for lane in lanes}
    heights = [len(bars_of[lane]) for lane in lanes] or [1]
    fig = Figure(figsize=(10, 1.0 + sum(0.24 * h + 0.7 for h in heights)), layout="constrained")
    if not lanes:
        _empty(fig.add_subplot(), "no request queued or reached a backend")
        return fig
    axes = fig.subplots(len(lanes), 1, squeeze=False, height_ratios=heights)[:, 0]
    drawn: list[str] = []
    for ax, lane in zip(axes, lanes, strict=True):
        tail = analysis["lanes"][lane]["tail"]
        bars = bars_of[lane]
        ys = range(len(bars))
        left = [0.0] * len(bars)
        for part in _parts_of(tail):
            widths = [b[part] for b in bars]
            ax.barh(ys, widths, left=left, color=PART_COLOUR[part], height=0.72)
            left = [lo + w for lo, w in zip(left, widths, strict=True)]
            if part not in drawn:
                drawn.append(part)
        ax.set_yticks(list(ys), bar_labels(bars), fontsize=8, family="monospace")
        ax.invert_yaxis()
        ax.set_xlim(0, max(left) * 1.04 if max(left) > 0 else 1)
        ax.tick_params(axis="y", length=0)
        if tail["size"] < len(bars):
            ax.axhline(tail["size"] - 0.5, color="#333333", linestyle="--", linewidth=1)
        verdict = tail["verdict"] or "unknown"
        label = (tail["verdict_text"] or verdict).partition(" → ")[0]
        if tail.get("split") == "four":
            parts = tail["parts"]
            waiting = (parts["queue_ms"]["share"] or 0) + (parts["engine_queue_ms"]["share"] or 0)
            why = f"waiting {fmt_share(waiting)} of the time"
        else:
            why = f"queue {fmt_share(tail['queue_vs_backend'])} of queue + backend"
        ax.set_title(
            f"{lane}: {label}, {why} in the slowest {_plural(tail['size'], 'request')}",
            loc="left",
            fontsize=11,
            fontweight="bold",
            color=VERDICT_COLOUR[verdict],
        )
        ax.set_xlabel("ms")
    _parts_legend(fig, drawn)
    return fig


def bar_labels(items: Sequence[dict[str, Any]]) -> list[str]:
    """What tells the waterfall's bars apart: arrival time and the distinct part of each id.

    A gateway's own ids share a per-process prefix (and a client's often do), so
    their first characters read the same on every bar; what differs is the tail.
    """
    ids = [str(item.get("request_id") or "?") for item in items]
    short = max((len(i) for i in ids), default=0) <= ID_SHOWN_MAX  # shown whole
    common = len(_common_prefix(ids)) if len(ids) > 1 and not short else 0
    common = max(0, min(common, min((len(i) for i in ids), default=0) - ID_SHOWN_MIN))
    labels = []
    for item, rid in zip(items, ids, strict=True):
        distinct = rid[common:]
        distinct = distinct[:ID_SHOWN_MAX] + ("…" if len(distinct) > ID_SHOWN_MAX else "")
        at = item.get("arrival")
        notes = [at[11:23] if isinstance(at, str) else "?", ("…" if common else "") + distinct]
        if item["outcome"] != "ok":
            notes.append(item["outcome"])
        if item["measure"] == "e2e_ms":
            notes.append("e2e")
        labels.append(" ".join(notes))
    return labels


#: Characters of a request id a bar's label shows at least and at most.
ID_SHOWN_MIN = 6
ID_SHOWN_MAX = 12


def _common_prefix(values: Sequence[str]) -> str:
    first, last = min(values), max(values)
    size = 0
    while size < min(len(first), len(last)) and first[size] == last[size]:
        size += 1
    return first[:size]


def _band_figure(analysis: dict[str, Any]) -> Any:
    """Per lane, a stacked bar of the mean parts in each percentile band."""
    from matplotlib.figure import Figure

    lanes = [lane for lane, data in analysis["lanes"].items() if data["tail"].get("bands")]
    heights = [len(analysis["lanes"][lane]["tail"]["bands"]) for lane in lanes] or [1]
    fig = Figure(figsize=(10, 1.0 + sum(0.3 * h + 0.7 for h in heights)), layout="constrained")
    if not lanes:
        _empty(fig.add_subplot(), "no request with a TTFT or e2e time")
        return fig
    axes = fig.subplots(len(lanes), 1, squeeze=False, height_ratios=heights)[:, 0]
    drawn: list[str] = []
    for ax, lane in zip(axes, lanes, strict=True):
        tail = analysis["lanes"][lane]["tail"]
        bands = tail["bands"]
        ys = range(len(bands))
        left = [0.0] * len(bands)
        for part in _parts_of(tail):
            widths = [band[part] or 0.0 for band in bands]
            ax.barh(ys, widths, left=left, color=PART_COLOUR[part], height=0.66)
            left = [lo + w for lo, w in zip(left, widths, strict=True)]
            if part not in drawn:
                drawn.append(part)
        labels = [f"{band['band']}  n={band['requests']}" for band in bands]
        ax.set_yticks(list(ys), labels, fontsize=9, family="monospace")
        ax.invert_yaxis()
        ax.set_xlim(0, max(left) * 1.12 if max(left) > 0 else 1)
        for y, total in zip(ys, left, strict=True):
            ax.text(total, y, f" {fmt_ms(total)} ms", va="center", fontsize=8)
        ax.tick_params(axis="y", length=0)
        ax.set_title(lane, loc="left", fontsize=11, fontweight="bold")
        ax.set_xlabel("mean ms")
    _parts_legend(fig, drawn)
    return fig


def _retry_figure(retries: dict[str, Any]) -> Any:
    """Requests per window, retries stacked on new ones; below, the retries' share and the bar."""
    from matplotlib.figure import Figure

    windows = retries["windows"]
    fig = Figure(figsize=(10, 4.6), layout="constrained")
    count_ax, share_ax = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    width = retries["window_s"]
    xs = [k * width for k in range(len(windows))]
    new = [w["requests"] - w["retries"] for w in windows]
    again = [w["retries"] for w in windows]
    count_ax.bar(xs, new, width=width * 0.92, align="edge", color=NEW_COLOUR, label="new")
    count_ax.bar(
        xs, again, bottom=new, width=width * 0.92, align="edge", color=RETRY_COLOUR, label="retries"
    )
    count_ax.set_ylabel(f"requests per {width:g} s")
    count_ax.legend(loc="lower left", bbox_to_anchor=(0, 1), ncols=2, frameon=False, fontsize=8)
    shares = [100 * (w["share"] or 0.0) for w in windows]
    colours = [RETRY_COLOUR if w["storm"] else NEW_COLOUR for w in windows]
    share_ax.bar(xs, shares, width=width * 0.92, align="edge", color=colours)
    share_ax.axhline(100 * retries["threshold"], color="#333333", linestyle="--", linewidth=1)
    share_ax.text(
        0,
        100 * retries["threshold"],
        f" storm above {retries['threshold']:.0%}",
        va="bottom",
        fontsize=8,
    )
    share_ax.set_ylim(0, 100)
    share_ax.set_ylabel("retries, % of requests")
    share_ax.set_xlabel("seconds since the first arrival in the log")
    share_ax.set_xlim(0, max(width, len(windows) * width))
    return fig


def _cdf_figure(lanes: list[str], records: Sequence[Record], colours: dict[str, str]) -> Any:
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullFormatter

    by_lane = _by_lane(records)
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    panels = (
        ("ttft_ms", "time to first token (ms)", lambda r: True),
        ("e2e_ms", "end to end (ms)", lambda r: not outcome_of(r).startswith("rejected_")),
    )
    for ax, (metric, label, keep) in zip(axes, panels, strict=True):
        lows, highs = [], []
        for lane in lanes:
            values = sorted(
                v for r in by_lane[lane] if keep(r) and (v := number(r, metric)) is not None
            )
            if not values:
                continue
            xs, ys = _cdf_points(values)
            lows.append(ys[0])
            highs.append(ys[-1])
            p99 = percentile(values, 99)
            ax.plot(
                [max(x, 0.01) for x in xs],
                ys,
                color=colours[lane],
                linewidth=2,
                label=f"{lane}  n={len(values)}  P99≈{fmt_ms(p99)} ms",
            )
        ax.set_xlabel(label)
        if not lows:
            _empty(ax, f"no {metric} values")
            continue
        ax.set_xscale("log")
        ax.set_yscale("logit")
        # Half a plotting position of headroom so the slowest point is not on the frame.
        bottom, top = min(0.1, max(min(lows), 0.01)), 1 - (1 - max(highs)) / 2
        ax.set_ylim(bottom, top)
        ticks = [t for t in (0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 0.9999) if bottom <= t <= top]
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.set_yticklabels([f"P{100 * t:g}" for t in ticks])
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="major", color="#dddddd", linewidth=0.8)
        ax.legend(loc="upper left", fontsize=8, frameon=False)
    return fig


def _cdf_points(values: list[float]) -> tuple[list[float], list[float]]:
    """Points of the empirical CDF (Hazen positions, never 0 or 1 for the logit axis).

    Long logs are thinned evenly, but the top of the distribution (the tail this
    report is about) is kept point for point.
    """
    n = len(values)
    keep = set(range(max(0, n - CDF_POINTS // 2), n))
    step = max(1, n // (CDF_POINTS // 2))
    keep.update(range(0, n, step))
    index = sorted(keep)
    return [values[i] for i in index], [(i + 0.5) / n for i in index]


def _timeline_figure(lanes: list[str], records: Sequence[Record], colours: dict[str, str]) -> Any:
    from matplotlib.figure import Figure

    by_lane = _by_lane(records)
    starts = [t for t in map(arrival_s, records) if t is not None]
    starts += [t for t in map(end_s, records) if t is not None]
    fig = Figure(figsize=(10, 5.2), layout="constrained")
    depth_ax, refused_ax = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    if not starts:
        _empty(depth_ax, "no timestamps in the log")
        return fig
    origin = min(starts)
    span = max(starts) - origin or 1.0
    for lane in lanes:
        series = queue_depth_series(by_lane[lane])
        if not series:
            continue
        xs, ys = _peaks([t - origin for t, _ in series], [d for _, d in series], span)
        depth_ax.step([0.0, *xs], [0, *ys], where="post", color=colours[lane], label=lane)
    depth_ax.set_ylabel("requests queued")
    depth_ax.set_ylim(bottom=0)
    depth_ax.grid(True, axis="y", color="#eeeeee")
    if depth_ax.get_lines():
        depth_ax.legend(
            loc="lower left", bbox_to_anchor=(0, 1), ncols=len(lanes), frameon=False, fontsize=8
        )

    ends: dict[str, list[float]] = defaultdict(list)
    for record in records:
        moment = end_s(record)
        if moment is not None and outcome_of(record) != "ok":
            label = outcome_of(record)
            if lane_of(record) != NO_LANE and len(lanes) > 1:
                label = f"{lane_of(record)}: {label}"
            ends[label].append(moment - origin)
    bins = 60 if span > 60 else max(10, int(span * 2))
    edges = [span * i / bins for i in range(bins + 1)]
    if ends:
        labels = sorted(ends, key=lambda k: -len(ends[k]))
        refused_ax.hist(
            [ends[k] for k in labels],
            bins=edges,
            stacked=True,
            label=labels,
            color=[REFUSAL_COLOURS[i % len(REFUSAL_COLOURS)] for i in range(len(labels))],
        )
        refused_ax.legend(
            loc="lower left", bbox_to_anchor=(0, 1), ncols=3, frameon=False, fontsize=8
        )
    else:
        _empty(refused_ax, "no rejections, timeouts or errors")
    refused_ax.set_ylabel(f"not ok per {span / bins:.2g} s")
    refused_ax.set_xlabel("seconds since the first arrival in the log")
    refused_ax.set_xlim(0, span)
    return fig


def _peaks(xs: list[float], ys: list[int], span: float) -> tuple[list[float], list[int]]:
    """At most ~DEPTH_POINTS steps: the deepest queue in each time slice, so no peak is lost.

    A busy day has a queue change per request; drawn one by one they make a
    megabyte of SVG that looks the same.
    """
    if len(xs) <= DEPTH_POINTS:
        return xs, ys
    width = span / (DEPTH_POINTS // 2)
    out_x: list[float] = []
    out_y: list[int] = []
    for x, y in zip(xs, ys, strict=True):
        start = math.floor(x / width) * width
        if out_x and out_x[-1] == start:
            out_y[-1] = max(out_y[-1], y)
        else:
            out_x.append(start)
            out_y.append(y)
    return out_x, out_y


def _tenant_figure(tenants: dict[str, Any]) -> Any:
    """Weighted service and P99 TTFT per tenant, side by side, most requests at the top."""
    from matplotlib.figure import Figure

    rows = list(tenants["table"].items())[:TENANTS_SHOWN]
    fig = Figure(figsize=(10, 1.2 + 0.3 * len(rows)), layout="constrained")
    service_ax, ttft_ax = fig.subplots(1, 2, sharey=True)
    names = [name[:24] for name, _ in rows]
    ys = list(range(len(rows)))
    panels = (
        (
            service_ax,
            [row["weighted_service"] for _, row in rows],
            SERVICE_COLOUR,
            "weighted service (cost / weight, tokens)",
        ),
        (ttft_ax, [row["ttft_ms"]["p99"] for _, row in rows], TTFT_COLOUR, "P99 TTFT (ms)"),
    )
    for ax, values, colour, label in panels:
        widths = [value or 0.0 for value in values]
        bars = ax.barh(ys, widths, color=colour, height=0.7)
        ax.bar_label(
            bars,
            labels=["-" if value is None else fmt_ms(value) for value in values],
            padding=3,
            fontsize=8,
        )
        ax.set_xlim(0, max(widths) * 1.18 if max(widths, default=0) > 0 else 1)
        ax.set_xlabel(label)
        ax.tick_params(axis="y", length=0)
    service_ax.set_yticks(ys, names, fontsize=8, family="monospace")
    service_ax.invert_yaxis()
    return fig


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#777777")
    ax.set_xticks([])
    ax.set_yticks([])


def _by_lane(records: Sequence[Record]) -> dict[str, list[Record]]:
    out: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        out[lane_of(record)].append(record)
    return out


def _svg(fig: Any, scope: str) -> str:
    """The figure as an inline <svg> that scales with the page and cannot clash with others.

    matplotlib names clip paths and glyphs by id; several inline SVGs in one page
    share one id space, so every id gets the figure's prefix.
    """
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None})
    text = buffer.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)
    text = re.sub(
        r'<svg([^>]*?)\swidth="[^"]*"\sheight="[^"]*"',
        rf'<svg\1 width="100%" role="img" class="plot" id="{scope}"',
        text,
        count=1,
    )
    text = re.sub(r'\bid="([^"]+)"', lambda m: _scoped_id(m, scope), text)
    text = re.sub(r"url\(#([^)]+)\)", rf"url(#{scope}-\1)", text)
    return re.sub(r'href="#([^"]+)"', rf'href="#{scope}-\1"', text)


def _scoped_id(match: re.Match[str], scope: str) -> str:
    name = match.group(1)
    return f'id="{name}"' if name == scope else f'id="{scope}-{name}"'


# ----------------------------------------------------------------------------- page


CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
       margin: 0 auto; max-width: 1100px; padding: 24px; color: #222; background: #fff; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 19px; margin: 36px 0 6px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.meta, .note { color: #555; font-size: 13px; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(330px, 1fr)); gap: 14px;
         margin-top: 18px; }
.card { border: 1px solid #ddd; border-left: 10px solid var(--c); border-radius: 6px;
        padding: 12px 16px; }
.card .lane { font-size: 14px; color: #555; text-transform: uppercase; letter-spacing: .04em; }
.card .verdict { font-size: 21px; font-weight: 700; color: var(--c); margin: 2px 0; }
.card .action { font-size: 16px; font-weight: 600; margin-bottom: 8px; }
.card .split { display: flex; height: 16px; border-radius: 3px; overflow: hidden;
               margin: 6px 0 8px; background: #eee; }
.card .why { font-size: 13.5px; }
.card .why b { font-variant-numeric: tabular-nums; }
.legend span { display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 10px; }
table { border-collapse: collapse; font-size: 13px; font-variant-numeric: tabular-nums;
        margin-top: 8px; }
th, td { padding: 3px 10px; border-bottom: 1px solid #eee; text-align: right; }
th.group { text-align: center; border-left: 1px solid #ddd; }
td.first, th.first { border-left: 1px solid #ddd; }
th:first-child, td:first-child, td.text, th.text { text-align: left; }
th { background: #f6f6f6; }
tr.lane td { font-weight: 700; background: #fafafa; }
svg.plot { height: auto; display: block; margin-top: 8px; }
"""


def _page(
    analysis: dict[str, Any],
    figures: list[tuple[str, str, str]],
    source: str,
    tenant_svg: str = "",
    retry_svg: str = "",
) -> str:
    e = html.escape
    window = analysis.get("window")
    when = f"{window['start']} → {window['end']} ({window['seconds']:.1f} s)" if window else ""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>Gateway tail latency: {e(source)}</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>Is P99 slow because of queueing or because of the model?</h1>",
        f'<div class="meta">{e(source)} · {analysis["requests"]} requests · '
        f"{analysis['skipped_lines']} other lines skipped · {e(when)}</div>",
        '<div class="cards">',
        *(_card(lane, data, analysis["tail_fraction"]) for lane, data in analysis["lanes"].items()),
        _storm_card(analysis.get("retries") or {}),
        "</div>",
        f'<p class="note">Verdict from the slowest {100 * analysis["tail_fraction"]:g}% of '
        f"each lane. {e(VERDICT_RULE)}. Queue time is queue_ms; backend time is "
        "backend_ttft_ms (dispatch → first token), or dispatch → end for requests without a "
        "first token; gateway time is the rest (admission, refusals). "
        + (
            f"Engine slots: {e(SLOT_RULE)}.</p>"
            if analysis.get("engine_split")
            else "This log has no engine split (engine_queue_ms, prefill_ms, decode_ms): the "
            "verdicts are the two-part ones, queue vs backend.</p>"
        ),
    ]
    if not analysis["lanes"]:
        parts.append('<p class="note">No request lines (event == "request") in the input.</p>')
    for title, note, svg in figures:
        parts += [f"<h2>{e(title)}</h2>", f'<p class="note">{e(note)}</p>', svg]
        if title.startswith("Where the time went") and analysis.get("backends"):
            parts += ['<h3 id="engine-slots">Engine slots</h3>', _slots_table(analysis["backends"])]
    parts += [
        "<h2>Latency per lane and outcome (ms)</h2>",
        _latency_table(analysis),
        "<h2>Rejections, timeouts and errors</h2>",
        _failure_table(analysis),
    ]
    if analysis.get("models"):
        parts += ['<h2 id="models-panel">Per model</h2>', _model_table(analysis["models"])]
    if analysis.get("tenants"):
        parts += [
            '<h2 id="tenants-panel">Tenants</h2>',
            _tenant_panel(analysis["tenants"], tenant_svg),
        ]
    if analysis.get("retries"):
        parts += [
            '<h2 id="retries-panel">Retries</h2>',
            _retry_panel(analysis["retries"], retry_svg),
        ]
    if analysis.get("predictor"):
        parts += ["<h2>Predictor: predicted wait vs measured, refusals</h2>"]
        parts += [_predictor_table(analysis["predictor"])]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _card(lane: str, data: dict[str, Any], fraction: float) -> str:
    e = html.escape
    tail = data["tail"]
    kind = tail["verdict"] or "unknown"
    label, _, action = (tail["verdict_text"] or "no verdict").partition(" → ")
    ok = data["outcomes"].get("ok", {}).get("latency", {})
    p99_ttft = ok.get("ttft_ms", {}).get("p99")
    p99_e2e = ok.get("e2e_ms", {}).get("p99")
    failed = sum(f["count"] for f in data["failures"])
    if not tail["size"] or kind == "unknown":
        split = why = ""
    else:
        four = tail.get("split") == "four"
        shares = (
            [(p, tail["parts"][p]["share"]) for p in FOUR_PARTS]
            if four
            else [(p, tail[p.replace("_ms", "_share")]) for p in TWO_PARTS]
        )
        split = '<div class="split">' + "".join(
            f'<div style="width:{100 * (share or 0):.1f}%;background:{PART_COLOUR[part]}"></div>'
            for part, share in shares
        )
        split += "</div>"
        measures = ", ".join(
            f"{n}× {'TTFT' if m == 'ttft_ms' else 'e2e'}" for m, n in tail["measures"].items()
        )
        why = (
            f"Slowest {100 * fraction:g}% = {tail['size']} of {_plural(tail['ranked'], 'request')} "
            f"({e(measures)}), mean <b>{fmt_ms(tail['mean_total_ms'])} ms</b>: "
        )
        if four:
            why += ", ".join(
                f'<span style="color:{VERDICT_COLOUR.get(part[:-3], PART_COLOUR[part])}">'
                f"{PART_TEXT[part]} <b>{fmt_ms(tail['parts'][part]['mean_ms'])} ms</b> "
                f"({fmt_share(tail['parts'][part]['share'])})</span>"
                for part in FOUR_PARTS
                if tail["parts"][part]["mean_ms"]
            )
            timings = ", ".join(f"{s} {n}" for s, n in tail["timing_sources"].items())
            why += f". Timings: {e(timings)}.<br>"
            for advice in tail.get("engine_queue_advice", []):
                why += f"{e(_advice_html(advice))}<br>"
        else:
            why += (
                f'<span style="color:{QUEUE_COLOUR}">queue <b>{fmt_ms(tail["mean_queue_ms"])} ms'
                f"</b> ({fmt_share(tail['queue_share'])})</span>, "
                f'<span style="color:{BACKEND_COLOUR}">backend <b>'
                f"{fmt_ms(tail['mean_backend_ms'])} ms</b> ({fmt_share(tail['backend_share'])})"
                f"</span>, gateway {fmt_ms(tail['mean_gateway_ms'])} ms. Queue holds "
                f"<b>{fmt_share(tail['queue_vs_backend'])}</b> of queue + backend "
                f"(threshold {QUEUE_BOUND_SHARE:.0%}).<br>"
            )
    why += (
        f"{_plural(data['requests'], 'request')} · ok P99 TTFT {_bold_ms(p99_ttft)} · "
        f"ok P99 e2e {_bold_ms(p99_e2e)} · not ok <b>{failed}</b> "
        f"({100 * failed / data['requests']:.1f}%)"
    )
    return (
        f'<div class="card" style="--c:{VERDICT_COLOUR[kind]}">'
        f'<div class="lane">lane {e(lane)}</div>'
        f'<div class="verdict">{e(label)}</div>'
        f'<div class="action">→ {e(action) if action else "look at the tables below"}</div>'
        f'{split}<div class="why">{why}</div></div>'
    )


def _advice_html(advice: dict[str, Any]) -> str:
    head = f"{advice['backend']}: up to {advice['max_in_flight']} in flight"
    if advice["advised_max_concurrency"] is None:
        text = f"{head}; no figure for max_concurrency: {advice['note']}."
    else:
        text = f"{head}; {advice['basis']}: max_concurrency = {advice['advised_max_concurrency']}."
    if advice.get("engine_setting"):
        text += (
            f" Its engine ({advice['engine']}): {advice['engine_setting']} "
            f"({advice['engine_setting_measured']})."
        )
    return text


def _slots_table(backends: dict[str, Any]) -> str:
    """Per backend: requests queued in the engine / sent, by how many were in flight."""
    e = html.escape
    body = ""
    for name, data in backends.items():
        counts = ", ".join(
            f"{n}: {row['queued']}/{row['requests']}" for n, row in data["by_in_flight"].items()
        )
        advised = data["advised_max_concurrency"]
        body += (
            f"<tr><td>{e(name)}</td><td>{data['requests']}</td><td>{data['max_in_flight']}</td>"
            f"<td>{data['first_queued_in_flight'] or '-'}</td>"
            f"<td><b>{advised if advised is not None else '-'}</b></td>"
            f"<td class=text>{e(counts)}</td><td class=text>{e(data['note'] or '')}</td></tr>"
        )
    return (
        '<table><thead><tr><th class="text">backend</th><th>requests</th>'
        "<th>most in flight</th><th>queued in the engine from</th>"
        "<th>advised max_concurrency</th>"
        '<th class="text">in flight when sent: queued in the engine / sent</th>'
        '<th class="text">note</th></tr></thead>'
        f"<tbody>{body}</tbody></table>"
        f'<p class="note">{e(SLOT_RULE)}.</p>'
    )


def _storm_card(retries: dict[str, Any]) -> str:
    """A card of its own for a retry storm: it is a verdict, with its own fix."""
    if retries.get("verdict") != "storm":
        return ""
    e = html.escape
    label, _, action = retries["verdict_text"].partition(" → ")
    faster = ", ".join(f"{name} {n}" for name, n in retries["clients_faster_than_told"].items())
    queue, refusals = retries["queue_ms"], retries["refusals"]
    return (
        f'<div class="card" style="--c:{RETRY_COLOUR}">'
        '<div class="lane">all lanes</div>'
        f'<div class="verdict">{e(label)}</div>'
        f'<div class="action">→ {e(action)}</div>'
        f'<div class="why">Retries were <b>{fmt_share(retries["share"])}</b> of '
        f"{_plural(retries['requests'], 'request')}, over {retries['threshold']:.0%} in "
        f"<b>{retries['storm_windows']}</b> of {len(retries['windows'])} windows; they held "
        f"<b>{fmt_share(queue['share'])}</b> of the queue wait and "
        f"<b>{fmt_share(refusals['share'])}</b> of the refusals. Faster than told: "
        f"{e(faster) if faster else 'none'}.</div></div>"
    )


def _retry_panel(retries: dict[str, Any], svg: str) -> str:
    """The retry section: its figures, the chart over time, and the clients that retried."""
    e = html.escape
    if not retries["tagged"]:
        return (
            '<p class="note">This log has no retry_of field (a gateway from before retries '
            "were marked): retries cannot be told from new requests.</p>"
        )
    if not retries["retries"]:
        return f'<p class="note">None of {retries["requests"]} requests was a retry.</p>'
    queue, refusals = retries["queue_ms"], retries["refusals"]
    retried = ", ".join(f"{code} {n}" for code, n in retries["retried_outcomes"].items())
    head = (
        f'<p class="note"><b>{e(retries["verdict_text"])}</b>. {retries["retries"]} of '
        f"{retries['requests']} requests ({fmt_share(retries['share'])}) were retries; "
        f"{retries['storm_windows']} of {len(retries['windows'])} windows of "
        f"{retries['window_s']:g} s had more than {retries['threshold']:.0%}. The retries held "
        f"{fmt_share(queue['share'])} of the queue wait ({fmt_ms(queue['retries'])} of "
        f"{fmt_ms(queue['total'])} ms) and {fmt_share(refusals['share'])} of the refusals "
        f"({refusals['retries']} of {refusals['total']}); the requests retried had got: "
        f"{e(retried)}; {retries['over_max_retries']} went beyond the seed's two retries; "
        f"{retries.get('damped', 0)} were refused at once by the gateway for coming before "
        "their Retry-After.</p>"
    )
    body = "".join(
        f"<tr><td>{e(name)}</td><td>{row['requests']}</td><td>{row['retries']}</td>"
        f"<td>{fmt_share(row['share'])}</td><td>{row['told']}</td>"
        f"<td>{row['faster_than_told']}</td><td>{fmt_ms(row['median_gap_ms'])}</td>"
        f"<td>{row['longest_chain']}</td><td>{row['refused']}</td></tr>"
        for name, row in list(retries["clients"].items())[:TENANTS_SHOWN]
        if row["retries"]
    )
    table = (
        '<table><thead><tr><th class="text">client</th><th>requests</th><th>retries</th>'
        "<th>share</th><th>told (Retry-After)</th><th>faster than told</th>"
        "<th>median gap ms</th><th>longest chain</th><th>refused</th></tr></thead>"
        f"<tbody>{body}</tbody></table>"
    )
    return "\n".join(
        [
            head,
            '<p class="note">Above: requests per window, retries on top; below: the '
            "retries' share, the storm windows in colour.</p>",
            svg,
            table,
            f'<p class="note">{e(retries["rule"])}.</p>',
        ]
    )


def _bold_ms(value: float | None) -> str:
    return "-" if value is None else f"<b>{fmt_ms(value)} ms</b>"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _latency_table(analysis: dict[str, Any]) -> str:
    e = html.escape
    head = "".join(f'<th class="group" colspan="3">{m}</th>' for m in METRICS)
    sub = "".join('<th class="first">p50</th><th>p95</th><th>p99</th>' for _ in METRICS)
    rows = [
        "<table><thead>",
        f'<tr><th class="text" rowspan="2">lane / outcome</th><th rowspan="2">n</th>{head}</tr>',
        f"<tr>{sub}</tr></thead><tbody>",
    ]
    for lane, data in analysis["lanes"].items():
        rows.append(f'<tr class="lane"><td colspan="{2 + 3 * len(METRICS)}">{e(lane)}</td></tr>')
        for outcome, stats in data["outcomes"].items():
            cells = "".join(
                f"<td{' class=first' if q == 'p50' else ''}>{fmt_ms(stats['latency'][m][q])}</td>"
                for m in METRICS
                for q in ("p50", "p95", "p99")
            )
            rows.append(
                f"<tr><td>&nbsp;&nbsp;{e(outcome)}</td><td>{stats['count']}</td>{cells}</tr>"
            )
    rows.append("</tbody></table>")
    return "\n".join(rows)


def _model_table(models: dict[str, Any]) -> str:
    """Each model's lanes: its own pool and queue, so its own verdict."""
    e = html.escape
    rows = []
    for model, data in models.items():
        pools = ", ".join(p for p in data["pools"] if p != model)
        for lane, summary in data["lanes"].items():
            ok = summary["outcomes"].get("ok") or {"count": 0, "latency": {}}
            ttft = ok["latency"].get("ttft_ms") or {}
            queue = ok["latency"].get("queue_ms") or {}
            rows.append(
                f"<tr><td class='text'>{e(model)}</td><td class='text'>{e(pools)}</td>"
                f"<td class='text'>{e(lane)}</td><td>{summary['requests']}</td>"
                f"<td>{ok['count']}</td><td>{fmt_ms(ttft.get('p50'))}</td>"
                f"<td>{fmt_ms(ttft.get('p99'))}</td><td>{fmt_ms(queue.get('p99'))}</td>"
                f"<td class='text'>{e(summary['tail'].get('verdict') or '-')}</td></tr>"
            )
    return (
        '<table><thead><tr><th class="text">model</th><th class="text">pool (when another)</th>'
        '<th class="text">lane</th><th>requests</th><th>ok</th><th>TTFT p50</th>'
        '<th>TTFT p99</th><th>queue p99</th><th class="text">verdict</th></tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _failure_table(analysis: dict[str, Any]) -> str:
    e = html.escape
    rows = [
        (lane, failure, data["requests"])
        for lane, data in analysis["lanes"].items()
        for failure in data["failures"]
    ]
    if not rows:
        return '<p class="note">None: every request ended ok.</p>'
    body = "".join(
        f"<tr><td>{e(lane)}</td><td class='text'>{e(f['reason'])}</td><td>{f['count']}</td>"
        f"<td>{total}</td><td>{f['percent']:.1f}%</td></tr>"
        for lane, f, total in rows
    )
    return (
        '<table><thead><tr><th class="text">lane</th><th class="text">reason</th>'
        "<th>count</th><th>lane requests</th><th>% of lane</th></tr></thead>"
        f"<tbody>{body}</tbody></table>"
    )


def _predictor_table(predictor: dict[str, Any]) -> str:
    e = html.escape
    body = ""
    for lane, data in predictor["lanes"].items():
        share = data["would_have_made_share"]
        made = "-" if share is None else f"{data['would_have_made']} ({fmt_share(share)})"
        near = data.get("would_have_waited_share_p50")
        body += (
            f"<tr><td>{e(lane)}</td><td>{data['admitted_with_prediction']}</td>"
            f"<td>{fmt_ms(data['median_abs_error_ms'])}</td>"
            f"<td>{fmt_ms(data['p90_abs_error_ms'])}</td>"
            f"<td>{data['refused_wait_too_long']}</td><td>{data['refusals_judged']}</td>"
            f"<td>{made}</td><td>{'-' if near is None else f'{near:.2f}x'}</td></tr>"
        )
    return (
        '<table><thead><tr><th class="text">lane</th><th>served with a prediction</th>'
        "<th>median |error| ms</th><th>p90 |error| ms</th><th>refused wait_too_long</th>"
        "<th>judged</th><th>would have made the deadline</th>"
        "<th>would have waited (of the deadline, median)</th></tr></thead>"
        f"<tbody>{body}</tbody></table>"
        f'<p class="note">{e(predictor["rule"])}.</p>'
    )


def _tenant_panel(tenants: dict[str, Any], svg: str) -> str:
    """The per-tenant table, the chart, and the fair share per lane against VTC's bound."""
    e = html.escape
    table: dict[str, Any] = tenants["table"]
    if tenants["count"] <= 1:
        name = next(iter(table), NO_TENANT)
        why = " (this log has no tenant field)" if not tenants["tagged"] else ""
        head = f'<p class="note">One tenant, “{e(name)}”{why}: nothing to compare.</p>'
    else:
        head = (
            f'<p class="note">{tenants["count"]} tenants, most requests first. Tokens served: '
            "prompt + completion of served requests; cost: what the tenant's fair-share "
            "counter was charged; weighted service: cost / weight; wait: queue_ms.</p>"
        )
    rows = list(table.items())[:TENANTS_SHOWN]
    body = ""
    for name, row in rows:
        weight = "-" if row["weight"] is None else f"{row['weight']:g}"
        refusals = ", ".join(f"{code} {n}" for code, n in row["refusals"].items()) or "-"
        body += (
            f"<tr><td>{e(name)}</td><td>{weight}</td><td>{row['requests']}</td>"
            f"<td>{row['served']}</td><td>{row['tokens_served']}</td>"
            f"<td>{fmt_ms(row['cost_tokens'])}</td><td>{fmt_ms(row['weighted_service'])}</td>"
            f"<td class=first>{fmt_ms(row['ttft_ms']['p50'])}</td>"
            f"<td>{fmt_ms(row['ttft_ms']['p99'])}</td>"
            f"<td class=first>{fmt_ms(row['queue_ms']['p50'])}</td>"
            f"<td>{fmt_ms(row['queue_ms']['p99'])}</td>"
            f"<td class='text first'>{e(refusals)}</td></tr>"
        )
    more = (
        f'<p class="note">… and {len(table) - len(rows)} more tenants (all in --json).</p>'
        if len(table) > len(rows)
        else ""
    )
    parts = [
        head,
        '<table><thead><tr><th class="text">tenant</th><th>weight</th><th>requests</th>'
        "<th>served</th><th>tokens served</th><th>cost</th><th>weighted service</th>"
        '<th class="first">TTFT p50 ms</th><th>TTFT p99 ms</th>'
        '<th class="first">wait p50 ms</th><th>wait p99 ms</th>'
        '<th class="text first">refusals by code</th></tr></thead>'
        f"<tbody>{body}</tbody></table>",
        more,
    ]
    if tenants["count"] <= 1:
        return "\n".join(parts)
    parts += [
        '<p class="note">Left: each tenant\'s weighted service over the whole log (equal bars '
        "mean served by weight only where the tenants were all backlogged all along: the "
        "fair share below says where they were); right: its P99 TTFT.</p>",
        svg,
        _fairness_table(tenants),
    ]
    return "\n".join(parts)


def _fairness_table(tenants: dict[str, Any]) -> str:
    e = html.escape
    fairness = tenants["fairness"]
    title = (
        f"<h3>Fair share per lane: Jain's index over {fairness['window_s']:g} s windows, "
        "largest gap against VTC's bound</h3>"
    )
    if not fairness["lanes"]:
        return title + '<p class="note">No lane had requests of two tenants queued.</p>'
    body = ""
    for lane, data in fairness["lanes"].items():
        gap = data["gap"] or {}

        def tokens(key: str, gap: dict[str, Any] = gap) -> str:
            return "-" if gap.get(key) is None else fmt_ms(gap[key])

        body += (
            f"<tr><td>{e(lane)}</td><td>{data['tenants']}</td><td>{data['windows']}</td>"
            f"<td>{data['windows_one_tenant']}</td><td>{_jain(data['min_jain'])}</td>"
            f"<td>{_jain(data['median_jain'])}</td><td class=first>{tokens('max_gap')}</td>"
            f"<td>{tokens('bound')}</td><td>{tokens('in_flight_max')}</td>"
            f"<td class=text>{e(' vs '.join(gap.get('pair', [])) or '-')}</td>"
            f"<td class=text>{e(GAP_VERDICT_TEXT[gap['verdict']]) if gap else '-'}</td></tr>"
        )
    overall = (
        f"All lanes: {fairness['windows']} windows, min J {_jain(fairness['min_jain'])}, "
        f"median J {_jain(fairness['median_jain'])} (1.0 = served exactly by weight). "
        if fairness["windows"]
        else "No window had two tenants backlogged and served. "
    )
    return (
        title + '<table><thead><tr><th class="text">lane</th><th>tenants</th><th>windows</th>'
        "<th>windows with one tenant</th><th>min J</th><th>median J</th>"
        '<th class="first">max gap</th><th>bound 2·U</th><th>in flight</th>'
        '<th class="text">pair</th><th class="text">gap</th></tr></thead>'
        f"<tbody>{body}</tbody></table>"
        f'<p class="note">{e(overall)}{e(cost_source_text(tenants["cost_source"]))}. '
        f"{e(fairness['rule'])}. {e(fairness['gap_rule'])}.</p>"
    )


def _jain(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
