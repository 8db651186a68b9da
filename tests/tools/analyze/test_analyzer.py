"""The analysis: reading logs, percentiles per lane and outcome, the queue-vs-backend verdict.

Records are hand-made so the answer is obvious (90% queued vs 90% in the backend).
"""

from __future__ import annotations

import json

import pytest

from gateway.tools.analyze import (
    NO_LANE,
    VERDICT_TEXT,
    analyze,
    arrival_s,
    breakdown,
    load_records,
    queue_depth_series,
    tail_size,
    verdict,
)
from tests.tools.analyze.support import END_S, lane_with_slow_tail, rec


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


def test_a_tail_spent_in_the_gateway_itself_is_gateway_bound() -> None:
    """TTFT 50 ms of which 2 queued and 3 in the backend: the gateway's own loop is the delay."""
    slow = [rec(queue=2.0, backend=3.0, ttft_ms=50.0, e2e=60.0) for _ in range(10)]
    tail = analyze(slow)["lanes"]["interactive"]["tail"]
    assert tail["verdict"] == "gateway"
    assert tail["verdict_text"] == VERDICT_TEXT["gateway"]
    # The same split with the backend slower than the gateway's share stays backend-bound.
    fine = [rec(queue=2.0, backend=40.0, ttft_ms=50.0, e2e=60.0) for _ in range(10)]
    assert analyze(fine)["lanes"]["interactive"]["tail"]["verdict"] == "backend"
