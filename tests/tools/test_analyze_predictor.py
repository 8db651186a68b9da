"""Predictor accuracy in `analyze`: the wait predicted at arrival against the wait measured.

The log lines are made by hand so each answer is obvious: errors whose median
is known, and wait_too_long refusals followed (or not) by an admitted request
of the same lane whose wait says whether the refused one would have made it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from gateway.tools.analyze import analyze, format_report, predictor_accuracy
from tests.tools.analyze.support import END_S, rec, run_cli, write_log


def at(arrival_s: float, e2e_ms: float) -> dict[str, Any]:
    """`end` and `e2e` for a request that arrived `arrival_s` after END_S."""
    end = datetime.fromtimestamp(END_S + arrival_s + e2e_ms / 1000, UTC)
    return {"end": end.strftime("%Y-%m-%dT%H:%M:%S.%fZ"), "e2e": e2e_ms}


def served(lane: str, arrival_s: float, queue: float, predicted: float | None) -> dict[str, Any]:
    return rec(
        lane,
        queue=queue,
        backend=50.0,
        predicted_wait_ms=predicted,
        deadline_ms=5000.0,
        **at(arrival_s, queue + 200.0),
    )


def refused(lane: str, arrival_s: float, deadline: float | None) -> dict[str, Any]:
    return rec(
        lane,
        "rejected_wait_too_long",
        queue=None,
        backend=None,
        error_code="wait_too_long",
        predicted_wait_ms=deadline * 2 if deadline else 9000.0,
        deadline_ms=deadline,
        **at(arrival_s, 1.0),
    )


def timed_out(lane: str, arrival_s: float, queue: float) -> dict[str, Any]:
    line = rec(
        lane,
        "queue_timeout",
        queue=queue,
        backend=None,
        predicted_wait_ms=100.0,
        deadline_ms=queue,
        **at(arrival_s, queue + 1.0),
    )
    line["status"] = 503
    return line


def test_median_absolute_error_per_lane_over_served_requests() -> None:
    records = [
        served("interactive", 0.0, queue=100.0, predicted=110.0),  # |err| 10
        served("interactive", 1.0, queue=100.0, predicted=70.0),  # 30
        served("interactive", 2.0, queue=400.0, predicted=450.0),  # 50
        served("interactive", 3.0, queue=10.0, predicted=None),  # no prediction: left out
        timed_out("interactive", 4.0, queue=5000.0),  # not a 200: left out of the error
        # A stream already started by keep-alive comments, then timed out in the queue: a
        # 200 all the same, and not served either.
        {**timed_out("interactive", 5.0, queue=5000.0), "status": 200},
        served("bulk", 0.0, queue=2000.0, predicted=1000.0),  # 1000
    ]
    result = predictor_accuracy(records)
    assert result is not None
    lanes = result["lanes"]
    assert lanes["interactive"]["admitted_with_prediction"] == 3
    assert lanes["interactive"]["median_abs_error_ms"] == pytest.approx(30.0)
    assert lanes["bulk"]["median_abs_error_ms"] == pytest.approx(1000.0)
    assert lanes["interactive"]["refused_wait_too_long"] == 0
    assert lanes["interactive"]["would_have_made_share"] is None


def test_refusals_judged_by_the_next_admitted_request_of_their_lane() -> None:
    records = [
        # Would have made it: the next admitted one came 0.4 s later and waited 300 ms, so
        # it left the queue 700 < 1000 ms after the refusal arrived.
        refused("interactive", 10.0, deadline=1000.0),
        served("bulk", 10.2, queue=10.0, predicted=10.0),  # another lane: not the successor
        served("interactive", 10.4, queue=300.0, predicted=300.0),
        # Right to refuse: the next one left 2700 >= 2000 ms after it (it timed out).
        refused("interactive", 20.0, deadline=2000.0),
        timed_out("interactive", 20.2, queue=2500.0),
        served("interactive", 21.0, queue=1.0, predicted=1.0),  # later: not the next one
        # Not judged: nothing admitted within 5 s after it.
        refused("interactive", 30.0, deadline=1000.0),
        served("interactive", 36.0, queue=1.0, predicted=1.0),
        # Not judged: no deadline logged.
        refused("interactive", 40.0, deadline=None),
        served("interactive", 40.5, queue=1.0, predicted=1.0),
    ]
    result = predictor_accuracy(records)
    assert result is not None
    lane = result["lanes"]["interactive"]
    assert lane["refused_wait_too_long"] == 4
    assert lane["refusals_judged"] == 2
    assert lane["would_have_made"] == 1
    assert lane["would_have_made_share"] == pytest.approx(0.5)
    # They would have waited 700 of 1000 ms and 2700 of 2000 ms: the median of 0.7 and 1.35.
    assert lane["would_have_waited_share_p50"] == pytest.approx((0.7 + 1.35) / 2)
    assert result["lanes"]["bulk"]["refused_wait_too_long"] == 0


def test_a_refusal_is_judged_by_when_its_successor_left_not_by_its_wait() -> None:
    """The successor waited only 600 of 1000 ms, but it arrived 0.5 s after the refusal:
    in its place, the refused request would have waited 1100 ms, past its deadline."""
    records = [
        refused("bulk", 0.0, deadline=1000.0),
        served("bulk", 0.5, queue=600.0, predicted=600.0),
    ]
    result = predictor_accuracy(records)
    assert result is not None
    lane = result["lanes"]["bulk"]
    assert (lane["refusals_judged"], lane["would_have_made"]) == (1, 0)
    assert lane["would_have_waited_share_p50"] == pytest.approx(1.1)


def test_a_log_without_the_fields_has_no_predictor_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = [rec("interactive"), rec("bulk", queue=10.0)]
    assert predictor_accuracy(old) is None
    assert "predictor" not in analyze(old)
    assert "PREDICTOR" not in format_report(analyze(old))

    new = [
        refused("interactive", 0.0, deadline=1000.0),
        served("interactive", 0.5, queue=200.0, predicted=260.0),
        served("interactive", 1.0, queue=100.0, predicted=80.0),
    ]
    report = format_report(analyze(new))
    assert "PREDICTOR" in report
    assert max(len(line) for line in report.splitlines()) <= 100
    row = next(
        line for line in report.splitlines() if line.startswith("  interactive") and "ms" in line
    )
    assert "40.0 ms" in row  # median of |60| and |20|
    assert "1 (100%)" in row
    assert report.index("REJECTIONS") < report.index("PREDICTOR") < report.index("HOW TO READ")

    path = write_log(tmp_path / "gw.log", new)
    code, out, _ = run_cli([str(path), "--json", str(tmp_path / "a.json")], capsys)
    assert code == 0 and "PREDICTOR" in out
    assert '"would_have_made_share": 1.0' in (tmp_path / "a.json").read_text()


def test_html_report_has_the_predictor_table() -> None:
    pytest.importorskip("matplotlib")
    from gateway.tools.analyze.report_html import render

    new = [
        refused("interactive", 0.0, deadline=1000.0),
        served("interactive", 0.5, queue=200.0, predicted=260.0),
    ]
    page = render(analyze(new), new, source="gw.log")
    assert "Predictor" in page and "would have made the deadline" in page
    old = [rec("interactive")]
    assert "Predictor" not in render(analyze(old), old, source="gw.log")
