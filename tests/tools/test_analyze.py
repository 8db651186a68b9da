"""`python -m gateway analyze`: reading logs, percentiles, the queue-vs-backend verdict, reports.

Unit tests use hand-made records whose answer is obvious (90% queued vs 90% in
the backend); the integration test overloads a real gateway in front of the
simulator and checks the analyzer calls it what it is: queueing.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.config import LaneSettings
from gateway.tools import analyze as analyzer
from gateway.tools.analyze import (
    NO_LANE,
    VERDICT_TEXT,
    analyze,
    arrival_s,
    breakdown,
    format_report,
    load_records,
    queue_depth_series,
    tail_size,
    verdict,
)
from tests.conftest import StartGateway, StartSimulator, chat

END = "2026-01-01T00:00:10.000000Z"  # 1767225610.0 as epoch seconds
END_S = 1767225610.0
_IDS = itertools.count(1)


def rec(
    lane: str | None = "interactive",
    outcome: str = "ok",
    queue: float | None = 1.0,
    backend: float | None = 10.0,
    *,
    stream: bool = True,
    e2e: float | None = None,
    end: str = END,
    **fields: Any,
) -> dict[str, Any]:
    """A request line as the gateway writes it; ttft = queue + backend + 0.5 ms of admission."""
    ttft = None if backend is None or not stream else (queue or 0.0) + backend + 0.5
    if e2e is None:
        e2e = (ttft or (queue or 0.0) + (backend or 0.0)) + 100.0
    line = {
        "request_id": f"req-{next(_IDS)}",
        "route": "/v1/chat/completions",
        "model": "m",
        "stream": stream,
        "lane": lane,
        "backend": None if backend is None else "b0",
        "status": 200 if outcome == "ok" else 429,
        "outcome": outcome,
        "error_code": None,
        "prompt_tokens": 10,
        "max_tokens_requested": 20,
        "max_tokens": 20,
        "completion_tokens": 20 if outcome == "ok" else None,
        "queue_ms": queue,
        "backend_ttft_ms": backend if stream else None,
        "ttft_ms": ttft,
        "tpot_ms": 5.0 if stream and outcome == "ok" else None,
        "e2e_ms": e2e,
        "event": "request",
        "level": "info",
        "timestamp": end,
    }
    line.update(fields)
    return line


def lane_with_slow_tail(lane: str, queue: float, backend: float, fast: int = 99) -> list[dict]:
    """`fast` quick requests and one slow one split queue/backend as given."""
    return [rec(lane, queue=1.0, backend=10.0) for _ in range(fast)] + [
        rec(lane, queue=queue, backend=backend, request_id=f"{lane}-slowest")
    ]


# ----------------------------------------------------------------------------- reading


def test_load_records_keeps_request_lines_and_counts_the_rest() -> None:
    lines = [
        "simulator listening on http://127.0.0.1:8000\n",  # a banner in the same stream
        json.dumps(rec()) + "\n",
        '{"event": "gateway_started", "url": "http://127.0.0.1:8080", "level": "info"}\n',
        "\n",  # blank lines are neither records nor skipped
        '{"event": "request", "queue_ms": 1.0',  # cut off mid-line (log rotation)
        "[1, 2, 3]\n",
        "2026-01-01T00:00:10.1Z stdout F " + json.dumps(rec(lane="bulk")) + "\n",  # kubectl
        json.dumps(rec(outcome="rejected_queue_full")),
    ]
    records, skipped = load_records(lines)
    assert [r["lane"] for r in records] == ["interactive", "bulk", "interactive"]
    assert skipped == 4


# ----------------------------------------------------------------------------- the numbers


def test_percentiles_per_lane_and_outcome() -> None:
    records = [rec(queue=float(q), backend=2.0 * q) for q in range(1, 101)]
    records += [rec(outcome="rejected_queue_full", queue=0.1, backend=None) for _ in range(3)]
    lane = analyze(records)["lanes"]["interactive"]
    ok = lane["outcomes"]["ok"]["latency"]
    assert lane["requests"] == 103
    assert lane["outcomes"]["ok"]["count"] == 100
    # numpy's linear method over 1..100: p50 50.5, p95 95.05, p99 99.01
    assert ok["queue_ms"] == {"count": 100, "mean": 50.5, "p50": 50.5, "p95": 95.05, "p99": 99.01}
    assert ok["backend_ttft_ms"]["p99"] == pytest.approx(198.02)
    assert ok["ttft_ms"]["p50"] == pytest.approx(50.5 * 3 + 0.5)
    rejected = lane["outcomes"]["rejected_queue_full"]["latency"]
    assert rejected["queue_ms"]["p99"] == pytest.approx(0.1)
    assert rejected["ttft_ms"] == {"count": 0, "mean": None, "p50": None, "p95": None, "p99": None}


def test_slow_requests_mostly_queued_are_queueing_bound() -> None:
    tail = analyze(lane_with_slow_tail("interactive", queue=900.0, backend=100.0))["lanes"][
        "interactive"
    ]["tail"]
    assert tail["size"] == 1 and tail["ranked"] == 100
    assert tail["measures"] == {"ttft_ms": 1}
    assert tail["slowest"][0]["request_id"] == "interactive-slowest"
    assert tail["queue_vs_backend"] == pytest.approx(0.9)
    assert tail["mean_queue_ms"] == 900.0 and tail["mean_backend_ms"] == 100.0
    assert tail["mean_gateway_ms"] == pytest.approx(0.5)
    assert tail["verdict"] == "queueing"
    assert tail["verdict_text"] == "queueing-bound → scheduling (lanes, slots, fail-fast)"


def test_slow_requests_mostly_in_the_backend_are_backend_bound() -> None:
    records = lane_with_slow_tail("interactive", queue=900.0, backend=100.0)
    records += lane_with_slow_tail("bulk", queue=100.0, backend=900.0)
    lanes = analyze(records)["lanes"]
    assert lanes["interactive"]["tail"]["verdict"] == "queueing"
    assert lanes["bulk"]["tail"]["verdict"] == "backend"
    assert lanes["bulk"]["tail"]["queue_vs_backend"] == pytest.approx(0.1)
    assert lanes["bulk"]["tail"]["verdict_text"] == "backend-bound → capacity or request size"


def test_verdict_threshold_is_more_than_half_queued() -> None:
    assert verdict(queue_ms=90.0, backend_ms=10.0) == "queueing"
    assert verdict(queue_ms=10.0, backend_ms=90.0) == "backend"
    assert verdict(queue_ms=50.0, backend_ms=50.0) == "backend"  # a tie is not "dominates"
    assert verdict(queue_ms=51.0, backend_ms=49.0) == "queueing"
    assert verdict(queue_ms=0.0, backend_ms=0.0) == "unknown"
    assert verdict(queue_ms=70.0, backend_ms=30.0, threshold=0.8) == "backend"


@pytest.mark.parametrize(
    ("ranked", "size"), [(0, 0), (1, 1), (8, 1), (100, 1), (101, 2), (700, 7), (1000, 10)]
)
def test_the_tail_is_the_slowest_percent_and_at_least_one(ranked: int, size: int) -> None:
    assert tail_size(ranked) == size


def test_tail_fraction_is_configurable() -> None:
    records = [rec(queue=float(i), backend=1.0) for i in range(100)]
    tail = analyze(records, tail_fraction=0.1)["lanes"]["interactive"]["tail"]
    assert tail["size"] == 10
    assert tail["cutoff_ms"] == pytest.approx(90 + 1 + 0.5)
    assert tail["max_ms"] == pytest.approx(99 + 1 + 0.5)


def test_mixed_outcomes_give_rejection_and_timeout_rates() -> None:
    records = [rec() for _ in range(14)]
    records += [rec(outcome="rejected_queue_full", queue=0.05, backend=None) for _ in range(4)]
    records += [rec(outcome="queue_timeout", queue=10000.0, backend=None, e2e=10000.2)]
    records += [rec(outcome="backend_timeout", queue=2.0, backend=None, e2e=60002.0, backend_x=1)]
    records += [rec(lane=None, outcome="rejected_prompt_too_long", queue=None, backend=None)]
    analysis = analyze(records)
    assert list(analysis["lanes"]) == ["interactive", NO_LANE]
    lane = analysis["lanes"]["interactive"]
    assert lane["requests"] == 20
    assert {f["reason"]: (f["count"], f["percent"]) for f in lane["failures"]} == {
        "rejected_queue_full": (4, 20.0),
        "queue_timeout": (1, 5.0),
        "backend_timeout": (1, 5.0),
    }
    assert analysis["lanes"][NO_LANE]["failures"] == [
        {"reason": "rejected_prompt_too_long", "count": 1, "percent": 100.0}
    ]
    # The backend timeout (60 s, e2e, never dispatched in this record) tops the lane:
    # no backend named, so its time is the gateway's, not the model's.
    slowest = lane["tail"]["slowest"]
    assert [s["outcome"] for s in slowest[:2]] == ["backend_timeout", "queue_timeout"]
    assert slowest[1]["measure"] == "e2e_ms" and slowest[1]["queue_ms"] == 10000.0


def test_null_fields_do_not_crash_and_are_not_made_up() -> None:
    records = [
        rec(stream=False, queue=5.0, backend=50.0, e2e=400.0),  # non-stream: no TTFT
        rec() | {m: None for m in ("queue_ms", "backend_ttft_ms", "ttft_ms", "e2e_ms")},
        rec() | {"queue_ms": "12", "ttft_ms": True, "e2e_ms": float("nan")},  # foreign values
    ]
    analysis = analyze(records)
    lane = analysis["lanes"]["interactive"]
    assert lane["requests"] == 3
    ok = lane["outcomes"]["ok"]["latency"]
    assert ok["ttft_ms"]["count"] == 0 and ok["ttft_ms"]["p99"] is None
    assert ok["queue_ms"]["count"] == 1 and ok["e2e_ms"]["count"] == 1
    # Only the non-stream request has a time: the tail is measured end to end.
    tail = lane["tail"]
    assert tail["ranked"] == 1 and tail["measures"] == {"e2e_ms": 1}
    assert tail["mean_queue_ms"] == 5.0 and tail["mean_backend_ms"] == 395.0
    assert tail["verdict"] == "backend"
    assert breakdown(records[1]) is None
    json.dumps(analysis, allow_nan=False)  # the --json output is strict JSON


def test_a_lane_refused_at_the_door_has_no_verdict() -> None:
    records = [rec(lane=None, outcome="rejected_prompt_too_long", queue=None, backend=None)]
    tail = analyze(records)["lanes"][NO_LANE]["tail"]
    assert tail["verdict"] == "unknown"
    assert tail["verdict_text"] == VERDICT_TEXT["unknown"]


def test_time_axis_is_rebuilt_from_end_minus_e2e() -> None:
    a = rec(queue=1000.0, backend=10.0, e2e=3000.0, end="2026-01-01T00:00:10Z")
    b = rec(queue=500.0, backend=10.0, e2e=1000.0, end="2026-01-01T00:00:09.5+00:00")
    c = rec(queue=None, backend=None, e2e=5.0)  # refused before queueing
    assert arrival_s(a) == pytest.approx(END_S - 3.0)
    assert arrival_s(b) == pytest.approx(END_S - 1.5)
    assert arrival_s(rec(timestamp="not a time")) is None
    # a queued [7, 8), b queued [8.5, 9)
    depth = [(round(t - END_S, 3), d) for t, d in queue_depth_series([a, b, c])]
    assert depth == [(-3.0, 1), (-2.0, 0), (-1.5, 1), (-1.0, 0)]
    window = analyze([a, b, c])["window"]
    assert window == {
        "start": "2026-01-01T00:00:07.000Z",
        "end": "2026-01-01T00:00:10.000Z",
        "seconds": 3.0,
    }


def test_text_report_leads_with_the_verdicts_and_fits_100_columns() -> None:
    records = lane_with_slow_tail("interactive", queue=900.0, backend=100.0)
    records += lane_with_slow_tail("bulk-with-a-rather-long-lane-name", 100.0, 900.0, fast=9)
    records += [rec(outcome="rejected_wait_too_long_and_then_some_more", queue=0.1, backend=None)]
    records += [rec(lane=None, outcome="rejected_prompt_too_long", queue=None, backend=None)]
    report = format_report(analyze(records, skipped=2))
    lines = report.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert "2 other line(s) skipped" in lines[0]
    verdicts = report.index("VERDICT")
    assert verdicts < report.index("LATENCY") < report.index("REJECTIONS")
    assert "interactive: queueing-bound → scheduling (lanes, slots, fail-fast)" in report
    assert "bulk-with-a-rather-long-lane-name: backend-bound → capacity" in report
    assert "1 of 10 requests, measured by TTFT\n" in report
    assert "2 of 101 requests, measured by TTFT ×1, e2e (no first token) ×1" in report
    assert "queue 100.0 ms (10%) + backend 900.0 ms (90%)" in report
    assert re.search(r"rejected_prompt_too_long\s+1\s+1\s+100.0%", report)


def test_empty_input_says_so() -> None:
    report = format_report(analyze([], skipped=3))
    assert "0 requests" in report and "3 other line(s) skipped" in report
    assert "no request lines" in report


# ----------------------------------------------------------------------------- command line


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    analyzer.add_arguments(parser)
    code = analyzer.main(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write_log(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("banner\n" + "".join(json.dumps(r) + "\n" for r in records))
    return path


def test_cli_reads_a_file_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    log = write_log(tmp_path / "gw.log", lane_with_slow_tail("interactive", 900.0, 100.0))
    code, out, _ = run_cli([str(log), "--json", str(tmp_path / "out.json")], capsys)
    assert code == 0
    assert out.startswith("gateway analyze: 100 requests in 1 lane(s), 1 other line(s) skipped")
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["requests"] == 100 and data["skipped_lines"] == 1
    assert data["lanes"]["interactive"]["tail"]["verdict"] == "queueing"


def test_cli_reads_stdin_and_json_to_stdout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    text = "".join(json.dumps(r) + "\n" for r in lane_with_slow_tail("x", 10.0, 900.0))
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    code, out, _ = run_cli(["--json", "-"], capsys)
    assert code == 0
    assert json.loads(out)["lanes"]["x"]["tail"]["verdict"] == "backend"


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, _, err = run_cli([str(tmp_path / "missing.log")], capsys)
    assert code == 2 and "cannot read" in err
    empty = tmp_path / "empty.log"
    empty.write_text("nothing to see\n")
    code, out, _ = run_cli([str(empty)], capsys)
    assert code == 1 and "no request lines" in out
    code, _, err = run_cli([str(empty), "--tail-percent", "0"], capsys)
    assert code == 2 and "--tail-percent" in err


def test_html_without_matplotlib_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import fails
    log = write_log(tmp_path / "gw.log", [rec()])
    code, _, err = run_cli([str(log), "--html", str(tmp_path / "r.html")], capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        "analyze: --html needs matplotlib: pip install 'llm-tail-gateway[report]'"
    ]
    assert not (tmp_path / "r.html").exists()


def test_html_report_is_self_contained(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    records = lane_with_slow_tail("interactive", 900.0, 100.0)
    records += lane_with_slow_tail("bulk", 100.0, 900.0, fast=20)
    records += [rec(outcome="rejected_queue_full", queue=0.1, backend=None) for _ in range(3)]
    records += [rec(outcome="queue_timeout", queue=5000.0, backend=None, e2e=5000.0)]
    records += [rec(lane=None, outcome="rejected_prompt_too_long", queue=None, backend=None)]
    records += [rec(stream=False, e2e=300.0), rec(queue=None, backend=None, e2e=None)]
    log = write_log(tmp_path / "gw.log", records)
    out = tmp_path / "report.html"
    code, _, _ = run_cli([str(log), "--html", str(out)], capsys)
    assert code == 0
    page = out.read_text()
    assert page.count("<svg") == 3
    assert "queueing-bound" in page and "backend-bound" in page
    assert_self_contained(page)


def assert_self_contained(page: str) -> None:
    """No script, stylesheet, image or font is fetched from anywhere."""
    assert "<script" not in page.lower()
    assert not re.search(r"<link\b", page, re.I)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert not re.search(r"@import|url\(\s*['\"]?\s*(https?:)?//", page, re.I)
    # Every id is unique: several inline SVGs share one document.
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids))


# ----------------------------------------------------------------------------- integration


async def test_overloaded_interactive_lane_is_diagnosed_as_queueing(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    """Eight short streams through one slot: the last waits for seven others, so it queued."""
    sim = await start_simulator_at()
    gateway = await start_gateway(
        [sim],
        max_concurrency=1,
        lanes=[
            LaneSettings(
                name="interactive",
                max_prompt_tokens=1024,
                max_output_tokens=256,
                queue_timeout_s=10,
                reject_predicted_wait=False,
            ),
            LaneSettings(name="bulk"),
        ],
    )
    sent = 8
    async with aiohttp.ClientSession() as http:

        async def one(i: int) -> int:
            body = chat(f"Short question number {i}?", stream=True, max_tokens=40)
            async with http.post(gateway.url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                return resp.status

        statuses = await asyncio.gather(*(one(i) for i in range(sent)))
    assert statuses == [200] * sent
    for _ in range(200):  # each line is written as its request finishes; wait for the last
        if len(gateway.request_lines()) == sent:
            break
        await asyncio.sleep(0.01)

    # The log as it would be captured: the simulator's banner mixed into the same stream.
    text = "simulator listening on " + sim + "\n" + gateway.log.getvalue()
    records, skipped = load_records(text.splitlines())
    assert len(records) == sent and skipped >= 1
    analysis = analyze(records, skipped=skipped)
    lane = analysis["lanes"]["interactive"]
    assert list(analysis["lanes"]) == ["interactive"]
    assert lane["requests"] == sent
    assert lane["outcomes"]["ok"]["count"] == sent
    assert lane["outcomes"]["ok"]["latency"]["ttft_ms"]["count"] == sent
    assert lane["failures"] == []
    tail = lane["tail"]
    assert tail["measures"] == {"ttft_ms": 1}
    # ~7 requests × ~40 tokens ahead of it vs one prefill: seconds against milliseconds.
    assert tail["verdict"] == "queueing", tail
    assert tail["queue_vs_backend"] > 0.7
    assert tail["mean_queue_ms"] > 500

    # The same through the command line, on the file as an operator would have it.
    log = tmp_path / "gateway.log"
    log.write_text(text)
    code, out, _ = run_cli([str(log), "--json", str(tmp_path / "a.json")], capsys)
    assert code == 0
    assert "interactive: queueing-bound → scheduling (lanes, slots, fail-fast)" in out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert json.loads((tmp_path / "a.json").read_text()) == analysis
    print(out)  # shown with -s: what on-call would read
