"""What each other server's log says about the tail, and what it cannot say.

The rule for TGI is the analyzer's own: the slowest `TAIL_FRACTION` of requests
(by total time) are queue-bound when more than `QUEUE_BOUND_SHARE` of their
queue + inference time was queue_time. vLLM's periodic lines say when the engine
queued and how full it was; nginx's say time to first byte against total.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from gateway.tools.analyze.analyzer import PERCENTILES, QUEUE_BOUND_SHARE, TAIL_FRACTION
from gateway.tools.analyze.sources.vllm import clock_s
from gateway.tools.stats import summarize

#: How many of the longest waits the TGI verdict lists.
LONGEST_LISTED = 5

CANNOT = {
    "tgi": "TGI's line does not split inference into prefill and decode, and has no TTFT; "
    "time before the router (a proxy, the network) is not in it.",
    "vllm": "vLLM's periodic lines have no per-request TTFT or queue time; its access "
    "lines have a status but no duration: which requests waited is not in this log.",
    "nginx": "nginx cannot split queue from prefill: upstream_header_time (TTFB) is "
    "both; it also does not know tokens.",
}


def _pcts(values: Sequence[float | None]) -> dict[str, float | None]:
    out = summarize(values, PERCENTILES)
    return {k: (round(v, 3) if v is not None else None) for k, v in out.items()}


def tgi_verdict(
    entries: Sequence[dict[str, Any]], fraction: float = TAIL_FRACTION
) -> dict[str, Any]:
    ranked = sorted(entries, key=lambda e: e["total_ms"], reverse=True)
    tail = ranked[: max(1, round(len(ranked) * fraction))] if ranked else []
    queue = sum(e.get("queue_ms", 0.0) for e in tail)
    inference = sum(e.get("inference_ms", 0.0) for e in tail)
    share = queue / (queue + inference) if queue + inference > 0 else None
    # The verdict vocabulary of our own log's tail (`analyzer.verdict`): a JSON consumer
    # reads one set of words whatever the source.
    kind = None if share is None else ("queueing" if share > QUEUE_BOUND_SHARE else "backend")
    waited = sorted(entries, key=lambda e: e["queue_ms"], reverse=True)[:LONGEST_LISTED]
    return {
        "requests": len(entries),
        "total_ms": _pcts([e["total_ms"] for e in entries]),
        "queue_ms": _pcts([e.get("queue_ms") for e in entries]),
        "inference_ms": _pcts([e.get("inference_ms") for e in entries]),
        "tail_requests": len(tail),
        "tail_queue_share": round(share, 4) if share is not None else None,
        "verdict": kind,
        "longest_waits": [
            {k: e.get(k) for k in ("time", "span", "queue_ms", "inference_ms", "total_ms")}
            for e in waited
        ],
        "cannot_tell": CANNOT["tgi"],
    }


def vllm_verdict(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    stats = sorted(
        (e for e in entries if e["kind"] == "stats"), key=lambda e: clock_s(e["time"]) or 0
    )
    access = [e for e in entries if e["kind"] == "access"]
    windows: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for e in stats:
        if e["waiting"] > 0:
            if current is None:
                current = {"start": e["time"], "end": e["time"], "max_waiting": 0, "lines": 0}
                windows.append(current)
            current["end"] = e["time"]
            current["max_waiting"] = max(current["max_waiting"], int(e["waiting"]))
            current["lines"] += 1
        else:
            current = None
    for w in windows:
        start, end = clock_s(w["start"]), clock_s(w["end"])
        w["seconds"] = end - start if start is not None and end is not None else None

    def peak(key: str) -> float | None:
        values = [e[key] for e in stats if key in e]
        return max(values) if values else None

    def mean(key: str) -> float | None:
        values = [e[key] for e in stats if key in e]
        return round(sum(values) / len(values), 3) if values else None

    return {
        "stats_lines": len(stats),
        "queued_lines": sum(1 for e in stats if e["waiting"] > 0),
        "queued_windows": windows,
        "max_running": peak("running"),
        "max_waiting": peak("waiting"),
        "kv_usage_peak_pct": peak("kv_usage_pct"),
        "prompt_tps_mean": mean("prompt_tps"),
        "generation_tps_mean": mean("generation_tps"),
        "generation_tps_peak": peak("generation_tps"),
        "requests": len(access),
        "statuses": dict(sorted(Counter(str(e["status"]) for e in access).items())),
        "verdict": ("engine queued" if windows else "engine never queued") if stats else None,
        "cannot_tell": CANNOT["vllm"],
    }


def nginx_verdict(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ttfb = _pcts([e["ttfb_ms"] for e in entries])
    total = _pcts([e["request_ms"] for e in entries])
    p99_ttfb, p99_total = ttfb.get("p99"), total.get("p99")
    share = p99_ttfb / p99_total if p99_ttfb is not None and p99_total else None
    kind = None if share is None else ("first byte" if share > QUEUE_BOUND_SHARE else "streaming")
    return {
        "requests": len(entries),
        "ttfb_ms": ttfb,
        "request_ms": total,
        "p99_ttfb_share": round(share, 4) if share is not None else None,
        "verdict": kind,
        "statuses": dict(sorted(Counter(str(e["status"]) for e in entries).items())),
        "cannot_tell": CANNOT["nginx"],
    }


def source_analysis(found: dict[str, list[dict[str, Any]]], unknown: int) -> dict[str, Any]:
    """The `sources` key of `analyze --json`: one verdict per source present."""
    out: dict[str, Any] = {"unreadable_lines": unknown}
    if found.get("tgi"):
        out["tgi"] = tgi_verdict(found["tgi"])
    if found.get("vllm"):
        out["vllm"] = vllm_verdict(found["vllm"])
    if found.get("nginx"):
        out["nginx"] = nginx_verdict(found["nginx"])
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _row(name: str, p: dict[str, float | None]) -> str:
    return f"  {name:<14} P50 {_ms(p.get('p50')):>9}  P95 {_ms(p.get('p95')):>9}  P99 {_ms(p.get('p99')):>9} ms"


def format_sources(analysis: dict[str, Any]) -> str:
    lines: list[str] = []
    tgi = analysis.get("tgi")
    if tgi:
        lines.append(f"TGI log: {tgi['requests']} requests")
        for key in ("total_ms", "queue_ms", "inference_ms"):
            lines.append(_row(key.removesuffix("_ms"), tgi[key]))
        share = tgi["tail_queue_share"]
        if tgi["verdict"] is not None:
            lines.append(
                f"  verdict: the slowest {tgi['tail_requests']} request(s) are "
                f"{tgi['verdict']}-bound ({share:.0%} of queue + inference in TGI's queue)"
            )
        lines.append("  longest waits in TGI's queue:")
        for e in tgi["longest_waits"]:
            lines.append(
                f"    {e['time'] or '-'}  {e['span'] or '-'}  queue {_ms(e['queue_ms'])} ms  "
                f"inference {_ms(e['inference_ms'])} ms  total {_ms(e['total_ms'])} ms"
            )
        lines.append(f"  cannot tell: {tgi['cannot_tell']}")
    vl = analysis.get("vllm")
    if vl:
        lines.append(f"vLLM log: {vl['stats_lines']} stats lines, {vl['requests']} access lines")
        lines.append(
            f"  max running {_num(vl['max_running'])}, max waiting {_num(vl['max_waiting'])}, "
            f"GPU KV cache peak {_num(vl['kv_usage_peak_pct'])}%, generation "
            f"{_num(vl['generation_tps_mean'])} tokens/s mean ({_num(vl['generation_tps_peak'])} peak)"
        )
        if vl["verdict"] is not None:
            lines.append(
                f"  verdict: {vl['verdict']} ({vl['queued_lines']} of {vl['stats_lines']} "
                f"stats lines had Waiting > 0)"
            )
        for w in vl["queued_windows"]:
            secs = "" if w["seconds"] is None else f" ({w['seconds']:g} s)"
            lines.append(
                f"    queued {w['start']} .. {w['end']}{secs}, up to {w['max_waiting']} waiting"
            )
        if vl["statuses"]:
            lines.append("  statuses: " + ", ".join(f"{k}: {v}" for k, v in vl["statuses"].items()))
        lines.append(f"  cannot tell: {vl['cannot_tell']}")
    ng = analysis.get("nginx")
    if ng:
        lines.append(f"nginx log: {ng['requests']} requests")
        lines.append(_row("ttfb", ng["ttfb_ms"]))
        lines.append(_row("total", ng["request_ms"]))
        if ng["verdict"] is not None:
            lines.append(
                f"  verdict: P99 is {ng['verdict']}-bound (P99 TTFB is "
                f"{ng['p99_ttfb_share']:.0%} of P99 total)"
            )
        lines.append("  statuses: " + ", ".join(f"{k}: {v}" for k, v in ng["statuses"].items()))
        lines.append(f"  cannot tell: {ng['cannot_tell']}")
    if lines:
        lines.append(f"lines no reader knew: {analysis.get('unreadable_lines', 0)}")
    return "\n".join(lines) + ("\n" if lines else "")


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:g}"
