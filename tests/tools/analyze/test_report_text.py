"""The plain-text report: verdicts first, 100 columns, and an empty log said plainly."""

from __future__ import annotations

import re

from gateway.tools.analyze import (
    analyze,
    format_report,
)
from tests.tools.analyze.support import lane_with_slow_tail, rec


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
