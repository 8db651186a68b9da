"""The plain-text report: verdicts first, 100 columns, and an empty log said plainly."""

from __future__ import annotations

import re

from gateway.outcomes import Outcome
from gateway.tools.analyze import (
    analyze,
    format_report,
)
from tests.tools.analyze.support import (
    fair_log,
    lane_with_slow_tail,
    rec,
    tenant_line,
    unfair_log,
)


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


def test_text_report_has_the_tenant_section_with_its_numbers() -> None:
    records = unfair_log()
    records.append(
        tenant_line("b", 1.0, arrive=2.0, dispatch=None, end=2.001, refusal="quota_exceeded")
    )
    report = format_report(analyze(records))
    lines = report.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert report.index("REJECTIONS") < report.index("TENANTS: 2") < report.index("HOW TO READ")
    # a: 11 served × (100 prompt + 20 completion); b: 6 served, one refused
    assert re.search(r"\n  a +2 +11 +11 +1320 ", report)
    assert re.search(r"\n  b +1 +7 +6 +720 .* 1\n", report)
    assert "  refused by code: b quota_exceeded 1\n" in report
    assert re.search(r"\n  interactive +2 +1 +0 +0\.800 +0\.800 +1150 +300\.0 +150\.0\n", report)
    assert "largest gap a vs b" in report
    assert (
        "    least fair window from 23:43:30.000: J 0.800, weighted service a 1500, b 500.0\n"
        in report
    )
    assert "over the bound, in-flight requests included" in report
    assert (
        "all lanes: 1 window(s), min J 0.800, median J 0.800 (1.0 = served exactly by weight)"
        in report
    )
    assert "service counted from cost_tokens (what the gateway charged), 17 request(s)" in report
    prose = " ".join(report.split())
    assert "The gateway charges output tokens when a request ends, so a request in flight" in prose
    assert "backlogged for ≥ 80% of it" in prose


def test_text_report_of_a_fair_log_is_within_the_bound() -> None:
    report = format_report(analyze(fair_log()))
    assert re.search(r"\n  interactive +2 +1 +0 +1\.000 +1\.000 +100\.0 +200\.0 +100\.0\n", report)
    prose = " ".join(report.split())
    assert "within VTC's bound; 0 of 1 co-backlogged interval(s) over 2·U" in prose


def test_text_report_of_an_old_log_says_there_is_one_tenant() -> None:
    records = [rec() for _ in range(3)]
    report = format_report(analyze(records))
    assert (
        'TENANTS: one tenant, "(none)" (this log has no tenant field): nothing to compare' in report
    )
    assert re.search(r"\n  \(none\) +- +3 +3 +90 ", report)
    assert "FAIR SHARE" not in report


def test_text_report_says_when_service_is_counted_without_cost_tokens() -> None:
    records = [line | {"cost_tokens": None} for line in fair_log()]
    report = format_report(analyze(records))
    assert max(len(line) for line in report.splitlines()) <= 100
    assert (
        "service counted from uncached prompt + completion tokens (lines without cost_tokens; "
        "output weight taken as 1), 22 request(s)"
    ) in " ".join(report.split())


def test_names_are_never_cut_to_fit_a_column() -> None:
    """#51: an outcome column showed `rejected_max_tokens_too_larg`. A name as long as the
    longest outcome the gateway writes widens its column; a longer one (another writer's,
    a long lane or tenant) gets a line of its own, its row below it with the figures under
    their headers; either way the name is whole and the report fits 100 columns."""
    longest = max((outcome.value for outcome in Outcome), key=len)
    odd = "rejected_by_a_proxy_in_front_of_the_gateway_for_reasons_of_its_own"
    lane = "interactive-for-the-customer-support-assistants"
    tenant = "team-customer-support-assistants"
    records = [rec(lane, tenant=tenant) for _ in range(5)]
    for outcome in ("rejected_max_tokens_too_large", longest, odd):
        records.append(rec(lane, outcome, queue=None, backend=None, tenant=tenant))
    report = format_report(analyze(records))
    lines = report.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert f"\n  {lane}: no verdict" in report  # the VERDICT line names the lane whole too
    # LATENCY: the column widened for the gateway's own outcomes, the odd one above its row.
    assert re.search(r"\n    rejected_max_tokens_too_large +1  e2e_ms +1 ", report)
    assert re.search(rf"\n    {longest} +1  e2e_ms +1 ", report)
    assert f"\n    {odd}\n" in report
    header = next(line for line in lines if line.lstrip().startswith("lane / outcome"))
    row = lines[lines.index(f"    {odd}") + 1]
    assert re.fullmatch(r" +1  e2e_ms +1 +\S+ +\S+ +\S+", row) and len(row) == len(header)
    # REJECTIONS: the lane on a line of its own, then each reason whole beside its counts.
    rejections = report[report.index("REJECTIONS") : report.index("TENANTS")]
    assert f"\n  {lane}\n" in rejections
    assert re.search(r"\n +rejected_max_tokens_too_large +1 +8 +12\.5%\n", rejections)
    assert re.search(rf"\n +{longest} +1 +8 +12\.5%\n", rejections)
    assert f"{odd}\n" in rejections
    # TENANTS: the tenant whole, its figures below under the headers.
    assert f"\n  {tenant}\n" in report
    assert "_too_larg " not in report and "_too_larg\n" not in report
