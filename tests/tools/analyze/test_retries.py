"""Retry storms: the share of traffic that was retries, whose, when, and what it cost.

The log is `support.storm_log`: a calm client, a polite one that honours
Retry-After, and a rushed one that retries every refusal 100 ms later, three
times, in one 10 s window. Its docstring has the figures worked out.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.tools.analyze import analyze, format_report
from gateway.tools.analyze.retries import retry_analysis
from tests.tools.analyze.support import rec, retry_line, run_cli, storm_log, write_log


def test_the_storm_its_clients_and_what_it_cost() -> None:
    retries = analyze(storm_log())["retries"]
    assert retries["tagged"] is True
    assert (retries["requests"], retries["retries"]) == (102, 31)
    assert retries["verdict"] == "storm"
    assert retries["verdict_text"] == (
        "retry storm → client backoff: at most two retries with exponential backoff, "
        "honouring Retry-After"
    )
    storms = [w for w in retries["windows"] if w["storm"]]
    assert [(w["start"], w["requests"], w["retries"]) for w in storms] == [
        ("2025-12-31T23:43:50.000Z", 50, 30)
    ]
    assert retries["windows"][0] | {"start": None} == {
        "start": None,
        "requests": 12,
        "retries": 1,
        "share": 0.0833,
        "storm": False,
    }
    assert retries["storm_clients"] == {"rush": 30}
    # rush never waited its 2 s; polite waited 2.5 s of its 2 s
    assert retries["clients_faster_than_told"] == {"rush": 30}
    assert retries["clients"]["polite"] | {} == {
        "requests": 2,
        "retries": 1,
        "share": 0.5,
        "told": 1,
        "faster_than_told": 0,
        "median_gap_ms": 2500.0,
        "longest_chain": 1,
        "over_max_retries": 0,
        "refused": 0,
    }
    assert retries["clients"]["rush"]["longest_chain"] == 3
    assert retries["over_max_retries"] == 10  # each third retry is beyond the seed's two
    assert retries["queue_ms"] == {"total": 4061.0, "retries": 4001.0, "share": 0.9852}
    assert retries["refusals"] == {"total": 31, "retries": 20, "share": 0.6452}
    assert retries["retried_outcomes"] == {"wait_too_long": 31}
    assert retries["damped"] == 0


def test_damped_retries_are_counted() -> None:
    lines = storm_log()
    for line in lines:
        if line["client"] == "rush" and line["retry_of"] and line["status"] == 429:
            line["retry_damped"] = True
    retries = analyze(lines)["retries"]
    assert retries["damped"] == 20
    assert "damped by the gateway (refused at once, before their Retry-After): 20" in (
        format_report(analyze(lines))
    )


def test_the_storm_is_a_verdict_in_the_text_report() -> None:
    report = format_report(analyze(storm_log()))
    assert max(len(line) for line in report.splitlines()) <= 100
    verdicts = report[report.index("VERDICT") : report.index("LATENCY")]
    assert "retries: retry storm → client backoff: at most two retries" in verdicts
    section = " ".join(report[report.index("RETRIES:") : report.index("HOW TO READ")].split())
    assert "RETRIES: 31 of 102 requests (30%) were retries; 1 of 6 window(s) of 10 s" in section
    assert "storm windows (start, retries/requests): 23:43:50.000 30/50 (60%)" in section
    assert "retries in storm windows by client: rush 30" in section
    assert "cost: 99% of the queue wait (4001 of 4061 ms queue_ms), 65% of the refusals" in section
    assert "faster than told (before their Retry-After): rush 30 of 30" in section
    assert "beyond the seed's 2 retries of one request: 10" in section
    assert "rush 40 30 75% 30 30 100.0 ms 3 20" in section


def test_below_the_threshold_there_is_no_storm() -> None:
    retries = retry_analysis(storm_log(), threshold=0.7)
    assert retries["storm_windows"] == 0 and retries["verdict"] == "retries"
    assert retries["clients_faster_than_told"] == {"rush": 30}  # still said
    assert (
        "retries: " not in format_report(analyze(storm_log(), storm_share=0.7)).split("LATENCY")[0]
    )
    # A window of fewer than 10 requests is never a storm, whatever its share.
    first = retry_line("a", 0.0, took_s=0.001, refused="queue_full", retry_after=1.0)
    assert retry_analysis([first, retry_line("a", 0.1, earlier=first)])["storm_windows"] == 0


def test_an_older_log_cannot_tell_retries() -> None:
    analysis = analyze([rec() for _ in range(3)])
    assert analysis["retries"]["tagged"] is False
    assert (
        "RETRIES: this log has no retry_of field (a gateway from before retries were marked)"
        in " ".join(format_report(analysis).split())
    )


def test_a_reused_request_id_joins_to_the_earlier_line_not_itself() -> None:
    first = retry_line("c", 0.0, took_s=0.001, refused="wait_too_long", retry_after=3.0)
    again = retry_line("c", 1.0, earlier=first) | {"request_id": first["request_id"]}
    retries = retry_analysis([first, again])
    assert retries["earlier_found"] == 1
    assert retries["clients"]["c"]["faster_than_told"] == 1  # 1 s after a 3 s Retry-After


def test_a_retry_whose_earlier_line_is_gone_is_not_judged() -> None:
    first = retry_line("c", 0.0, took_s=0.001, refused="wait_too_long", retry_after=3.0)
    retries = retry_analysis([retry_line("c", 1.0, earlier=first)])  # the first rotated out
    assert retries["retries"] == 1 and retries["earlier_found"] == 0
    assert retries["clients"]["c"]["told"] == 0 and retries["faster_than_told"] == 0
    assert retries["retried_outcomes"] == {"wait_too_long": 1}


def test_cli_storm_options_and_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    log = write_log(tmp_path / "gw.log", storm_log())
    code, out, _ = run_cli([str(log), "--json", "-"], capsys)
    assert code == 0 and json.loads(out)["retries"]["storm_windows"] == 1
    code, out, _ = run_cli(
        [str(log), "--storm-window", "60", "--storm-percent", "35", "--json", "-"], capsys
    )
    retries = json.loads(out)["retries"]
    assert retries["window_s"] == 60.0 and retries["threshold"] == 0.35
    assert [w["retries"] for w in retries["windows"]] == [31]  # 30% of the minute: below 35%
    assert retries["verdict"] == "retries"
    for flag, bad in (
        ("--storm-window", "0"),
        ("--storm-window", "nan"),
        ("--storm-percent", "100"),
    ):
        code, _, err = run_cli([str(log), flag, bad], capsys)
        assert code == 2 and flag in err
