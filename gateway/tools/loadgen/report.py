"""Summaries, tables and JSON of load generator runs.

Latency percentiles are over successful requests only: a gateway that fails
fast turns slow requests into quick 429s, and counting those as fast answers
would flatter it. So failures are shown next to the percentiles (counts by
status/code, time to rejection) and goodput counts only tokens that arrived in
a successful answer.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.tools.loadgen.client import RequestResult, RunResult
from gateway.tools.stats import summarize

ALL = "all"


def error_key(result: RequestResult) -> str:
    """`status/code`, `-` for a missing part (no HTTP answer, or no code in the body)."""
    status = "-" if result.status is None else str(result.status)
    return f"{status}/{result.error_code or '-'}"


def _summarize_group(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    tokens = sum(r.tokens for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in reported)
    prompted = sum(r.prompt_tokens for r in reported)
    lags = [r.sent_ms - r.scheduled_ms for r in results if r.sent_ms is not None]
    return {
        "count": len(results),
        "ok": len(ok),
        "failed": len(failed),
        "errors": dict(sorted(Counter(error_key(r) for r in failed).items())),
        "ttft_ms": summarize(r.ttft_ms for r in ok),
        "e2e_ms": summarize(r.e2e_ms for r in ok),
        "tpot_ms": summarize(r.tpot_ms for r in ok),
        "queue_ms": summarize(r.queue_ms for r in results),
        "reject_ms": summarize(r.reject_ms for r in failed),
        "send_lag_ms": summarize(lags),
        "completion_tokens": tokens,
        "goodput_tok_s": tokens / wall_s if wall_s > 0 else None,
        "ok_per_s": len(ok) / wall_s if wall_s > 0 else None,
        #: Over the answers whose usage said (None when none did): the prefix cache's share.
        "cached_tokens": cached if reported else None,
        "cache_hit_ratio": cached / prompted if prompted else None,
        "retried": sum(r.attempts > 1 for r in results),
        "attempts": sum(r.attempts for r in results),
        "wall_s": wall_s,
    }


def summarize_run(run: RunResult) -> dict[str, dict[str, Any]]:
    """Per class (smallest prompts first) and `all`."""
    by_class: dict[str, list[RequestResult]] = {}
    for result in run.results:
        by_class.setdefault(result.cls, []).append(result)
    order = sorted(
        by_class, key=lambda c: sum(r.prompt_tokens for r in by_class[c]) / len(by_class[c])
    )
    out = {name: _summarize_group(by_class[name], run.wall_s) for name in order}
    out[ALL] = _summarize_group(run.results, run.wall_s)
    return out


def summarize_turns(run: RunResult) -> dict[str, dict[str, Any]]:
    """Conversation turns by their index ("1", "2", ...); empty when the run had none."""
    by_turn: dict[int, list[RequestResult]] = {}
    for result in run.results:
        if result.turn is not None:
            by_turn.setdefault(result.turn, []).append(result)
    return {str(turn): _summarize_group(by_turn[turn], run.wall_s) for turn in sorted(by_turn)}


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}"


def _table(label: str, summary: dict[str, dict[str, Any]]) -> list[str]:
    wall = summary.get(ALL, {}).get("wall_s")
    lines = [f"== {label}" + (f"  (wall {wall:.1f} s)" if wall is not None else "")]
    lines.append(f"{'':22}{'TTFT ms':>24}{'e2e ms':>24}")
    lines.append(
        f"{'class':<10}{'n':>6}{'ok':>6}"
        + "".join(f"{q:>8}" for q in ("p50", "p95", "p99") * 2)
        + f"{'tok/s':>9}{'rej p99':>9}"
    )
    for name, s in summary.items():
        ttft, e2e = s["ttft_ms"], s["e2e_ms"]
        lines.append(
            f"{name[:10]:<10}{s['count']:>6}{s['ok']:>6}"
            + "".join(f"{_fmt(m[q]):>8}" for m in (ttft, e2e) for q in ("p50", "p95", "p99"))
            + f"{_fmt(s['goodput_tok_s']):>9}{_fmt(s['reject_ms']['p99']):>9}"
        )
    errors = [
        f"{name} {key}={n}"
        for name, s in summary.items()
        if name != ALL
        for key, n in s["errors"].items()
    ]
    if errors:
        lines.append("errors: " + ", ".join(errors))
    retried = summary.get(ALL, {}).get("retried")
    if retried:
        lines.append(f"retried: {retried} requests, {summary[ALL]['attempts']} attempts in all")
    return lines


def _comparison(summaries: Sequence[tuple[str, dict[str, dict[str, Any]]]]) -> list[str]:
    """The figures that carry the claim, one column per target."""
    tags = [f"[{i + 1}]" for i in range(len(summaries))]
    lines = ["== side by side " + " vs ".join(tags)]
    lines.append(f"{'class':<10}{'metric':<14}" + "".join(f"{t:>10}" for t in tags))
    classes: list[str] = []
    for _, summary in summaries:
        classes.extend(c for c in summary if c not in classes)
    metrics = (
        ("ok %", lambda s: 100.0 * s["ok"] / s["count"] if s["count"] else None),
        ("ttft p50 ms", lambda s: s["ttft_ms"]["p50"]),
        ("ttft p99 ms", lambda s: s["ttft_ms"]["p99"]),
        ("e2e p99 ms", lambda s: s["e2e_ms"]["p99"]),
        ("tok/s", lambda s: s["goodput_tok_s"]),
    )
    for name in classes:
        for label, pick in metrics:
            cells = [
                _fmt(pick(summary[name])) if name in summary else "-" for _, summary in summaries
            ]
            lines.append(f"{name[:10]:<10}{label:<14}" + "".join(f"{c:>10}" for c in cells))
    return lines


def format_tables(summaries: list[tuple[str, dict[str, dict[str, Any]]]]) -> str:
    """One table per target, headed `[n] target`, then a side-by-side view when several."""
    blocks: list[str] = []
    for number, (target, summary) in enumerate(summaries, start=1):
        label = f"[{number}] {target}" if len(summaries) > 1 else target
        blocks.append("\n".join(_table(label, summary)))
    if len(summaries) > 1:
        blocks.append("\n".join(_comparison(summaries)))
    return "\n\n".join(blocks) + "\n"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _conversation_rows(rows: dict[str, dict[str, Any]], head: str) -> list[str]:
    lines = [
        f"{head:<10}{'n':>6}{'ok':>6}{'ttft mean':>11}{'p50':>8}{'p99':>8}"
        f"{'e2e p99':>9}{'req/s':>8}{'tok/s':>8}{'cached':>8}"
    ]
    for name, s in rows.items():
        ttft = s["ttft_ms"]
        lines.append(
            f"{name[:10]:<10}{s['count']:>6}{s['ok']:>6}{_fmt(ttft['mean']):>11}"
            f"{_fmt(ttft['p50']):>8}{_fmt(ttft['p99']):>8}{_fmt(s['e2e_ms']['p99']):>9}"
            f"{_fmt(s['ok_per_s']):>8}{_fmt(s['goodput_tok_s']):>8}{_pct(s['cache_hit_ratio']):>8}"
        )
    return lines


def format_conversation_tables(runs: Sequence[RunResult]) -> str:
    """Multi-turn runs: TTFT (ms) by kind of request and by turn, throughput, cache hits.

    `cached` is the share of prompt tokens the backend said it served from its prefix
    cache (`-` when it says nothing); errors follow as `status/code=count`.
    """
    blocks: list[str] = []
    summaries = []
    for number, run in enumerate(runs, start=1):
        summary = summarize_run(run)
        summaries.append(summary)
        label = f"[{number}] {run.target}" if len(runs) > 1 else run.target
        lines = [f"== {label}  (wall {run.wall_s:.1f} s)"]
        lines += _conversation_rows(summary, "requests")
        lines += _conversation_rows(summarize_turns(run), "turn")
        errors = summary[ALL]["errors"]
        lines.append(
            "errors: " + (", ".join(f"{k}={n}" for k, n in errors.items()) if errors else "none")
        )
        blocks.append("\n".join(lines))
    if len(runs) > 1:
        tags = [f"[{i + 1}]" for i in range(len(runs))]
        lines = ["== side by side " + " vs ".join(tags)]
        metrics = (
            ("ttft mean ms", lambda s: _fmt(s["ttft_ms"]["mean"])),
            ("ttft p99 ms", lambda s: _fmt(s["ttft_ms"]["p99"])),
            ("req/s", lambda s: _fmt(s["ok_per_s"])),
            ("tok/s", lambda s: _fmt(s["goodput_tok_s"])),
            ("cached", lambda s: _pct(s["cache_hit_ratio"])),
        )
        classes = list(dict.fromkeys(c for summary in summaries for c in summary))
        for name in classes:
            for label, pick in metrics:
                cells = [pick(s[name]) if name in s else "-" for s in summaries]
                lines.append(f"{name[:10]:<10}{label:<14}" + "".join(f"{c:>10}" for c in cells))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def result_to_json(result: RequestResult) -> dict[str, Any]:
    """The result's fields, without a conversation's reply text (as prompts are never kept)."""
    out = {**dataclasses.asdict(result), "ok": result.ok}
    out.pop("reply", None)
    return out


def runs_to_json(params: dict[str, Any], runs: Sequence[RunResult]) -> dict[str, Any]:
    """Run parameters, then per target: summary and raw per-request results."""
    return {
        "params": params,
        "runs": [
            {
                "target": run.target,
                "wall_s": run.wall_s,
                "run_tag": run.run_tag,
                "summary": summarize_run(run),
                **({"by_turn": turns} if (turns := summarize_turns(run)) else {}),
                "results": [result_to_json(r) for r in run.results],
            }
            for run in runs
        ],
    }


def write_json(path: str | Path, params: dict[str, Any], runs: Sequence[RunResult]) -> None:
    with open(path, "w") as f:
        json.dump(runs_to_json(params, runs), f, indent=1)
        f.write("\n")
