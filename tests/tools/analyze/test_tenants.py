"""The tenant analysis: the per-tenant table, Jain's index over contended windows, the VTC gap.

Logs are built with the gateway's own RequestRecord and log line renderer
(`tenant_line`), with times chosen so every figure can be worked out by hand;
each test says how.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from gateway.tools.analyze import (
    NO_TENANT,
    analyze,
    arrival_s,
    dispatch_s,
    format_report,
    jain_index,
    tenant_analysis,
    tenant_of,
)
from gateway.tools.analyze.tenants import COST_FALLBACK, COST_LOGGED
from tests.tools.analyze.support import fair_log, rec, tenant_line, unfair_log

# ----------------------------------------------------------------------------- per tenant


def test_per_tenant_table_on_a_small_known_log() -> None:
    records = [
        # alice, weight 2: waits 10, 20, 40 ms, TTFT 100, 200, 400 ms, 100 + 10/20/30 tokens
        tenant_line(
            "alice",
            2.0,
            arrive=0.0,
            dispatch=0.010,
            end=1.0,
            cost=120.0,
            completion=10,
            ttft_after_dispatch=0.090,
        ),
        tenant_line(
            "alice",
            2.0,
            arrive=1.0,
            dispatch=1.020,
            end=2.0,
            cost=140.0,
            completion=20,
            ttft_after_dispatch=0.180,
        ),
        tenant_line(
            "alice",
            2.0,
            arrive=2.0,
            dispatch=2.040,
            end=3.0,
            cost=160.0,
            completion=30,
            ttft_after_dispatch=0.360,
        ),
        tenant_line("alice", 2.0, arrive=3.0, dispatch=None, end=3.001, refusal="queue_full"),
        # bob, weight 1: one request of 1000 prompt tokens (600 cached) + 100 output
        tenant_line(
            "bob",
            1.0,
            arrive=0.5,
            dispatch=0.505,
            end=2.5,
            cost=600.0,
            prompt=1000,
            completion=100,
            cached=600,
            ttft_after_dispatch=0.045,
        ),
        tenant_line("bob", 1.0, arrive=4.0, dispatch=None, end=4.001, refusal="quota_exceeded"),
        tenant_line("bob", 1.0, arrive=4.5, dispatch=None, end=4.501, refusal="quota_exceeded"),
    ]
    tenants = analyze(records)["tenants"]
    assert tenants["count"] == 2 and tenants["tagged"] is True
    assert list(tenants["table"]) == ["alice", "bob"]  # most requests first
    alice, bob = tenants["table"]["alice"], tenants["table"]["bob"]
    assert {k: alice[k] for k in ("requests", "served", "tokens_served", "weight")} == {
        "requests": 4,
        "served": 3,
        "tokens_served": 3 * 100 + 10 + 20 + 30,
        "weight": 2.0,
    }
    assert alice["cost_tokens"] == 420.0 and alice["weighted_service"] == 210.0
    # numpy's linear percentiles of 100, 200, 400: p50 200, p99 200 + 0.98 · 200
    assert alice["ttft_ms"] == {"p50": pytest.approx(200.0), "p99": pytest.approx(396.0)}
    # the refusal never queued: waits 10, 20, 40
    assert alice["queue_ms"] == {"p50": pytest.approx(20.0), "p99": pytest.approx(39.6)}
    assert alice["refusals"] == {"queue_full": 1}
    assert bob["requests"] == 3 and bob["served"] == 1 and bob["tokens_served"] == 1100
    assert bob["cost_tokens"] == 600.0 and bob["weighted_service"] == 600.0
    assert bob["ttft_ms"] == {"p50": pytest.approx(50.0), "p99": pytest.approx(50.0)}
    assert bob["queue_ms"] == {"p50": pytest.approx(5.0), "p99": pytest.approx(5.0)}
    assert bob["refusals"] == {"quota_exceeded": 2}
    assert tenants["cost_source"] == {COST_LOGGED: 4, COST_FALLBACK: 0}


# ----------------------------------------------------------------------------- Jain's index


def test_jain_index() -> None:
    assert jain_index([1000.0, 1000.0]) == 1.0
    assert jain_index([1500.0, 500.0]) == pytest.approx(0.8)
    assert jain_index([1.0, 0.0]) == pytest.approx(0.5)  # one got all: 1/n
    assert jain_index([]) is None and jain_index([0.0, 0.0]) is None


def test_jain_is_one_for_two_tenants_served_by_weight() -> None:
    fairness = analyze(fair_log())["tenants"]["fairness"]
    assert fairness["full_windows"] == 1  # the log spans 10.8 s: one full 10 s window
    lane = fairness["lanes"]["interactive"]
    assert lane["tenants"] == 2
    assert lane["windows"] == 1 and lane["windows_one_tenant"] == 0
    assert lane["min_jain"] == 1.0 and lane["median_jain"] == 1.0
    assert lane["worst_window"]["weighted_service"] == {"a": 1000.0, "b": 1000.0}
    assert fairness["windows"] == 1 and fairness["min_jain"] == 1.0


def test_jain_is_lower_for_an_unfair_log() -> None:
    lane = analyze(unfair_log())["tenants"]["fairness"]["lanes"]["interactive"]
    assert lane["windows"] == 1
    assert lane["min_jain"] == pytest.approx(0.8) and lane["median_jain"] == pytest.approx(0.8)
    assert lane["worst_window"]["weighted_service"] == {"a": 1500.0, "b": 500.0}


def test_median_and_minimum_over_several_windows() -> None:
    """Three 10 s windows as in the fair, the unfair and the fair log: J = 1.0, 0.8, 1.0."""
    a: list[tuple[float, float]] = []  # (dispatch, cost)
    b: list[tuple[float, float]] = []
    for start, fair in ((0.0, True), (10.0, False), (20.0, True)):
        a += [(start + 0.5 + i, 200.0 if fair else 300.0) for i in range(10)]
        b += [
            (start + (0.25 + i if fair else 1.0 + 2 * i), 100.0) for i in range(10 if fair else 5)
        ]
    a.append((30.5, 200.0))
    b.append((30.2, 100.0))
    lines = [
        tenant_line(name, weight, arrive=0.0, dispatch=t, end=t + 0.3, cost=cost)
        for name, weight, dispatches in (("a", 2.0, a), ("b", 1.0, b))
        for t, cost in dispatches
    ]
    lane = analyze(lines)["tenants"]["fairness"]["lanes"]["interactive"]
    assert lane["jain"] == [1.0, pytest.approx(0.8), 1.0]
    assert lane["windows"] == 3
    assert lane["min_jain"] == pytest.approx(0.8) and lane["median_jain"] == 1.0
    assert lane["worst_window"]["start"].endswith(":40.000Z")  # the second window


def test_windows_with_only_one_backlogged_tenant_are_not_counted() -> None:
    """a queues all along; b's requests are each dispatched 10 ms after they arrive."""
    lines = [
        tenant_line("a", 1.0, arrive=0.0, dispatch=0.5 + i, end=0.8 + i, cost=100.0)
        for i in range(11)
    ]
    lines += [
        tenant_line("b", 1.0, arrive=0.2 + i, dispatch=0.21 + i, end=0.5 + i, cost=100.0)
        for i in range(11)
    ]
    lane = analyze(lines)["tenants"]["fairness"]["lanes"]["interactive"]
    assert lane["windows"] == 0 and lane["windows_one_tenant"] == 1
    assert lane["min_jain"] is None and lane["median_jain"] is None


def test_a_backlogged_tenant_that_got_nothing_is_counted_apart() -> None:
    """b waits from 0 to 10.5 while a is served every second: one tenant served, one starved."""
    lines = [
        tenant_line("a", 1.0, arrive=0.0, dispatch=0.5 + i, end=0.8 + i, cost=100.0)
        for i in range(11)
    ]
    lines.append(tenant_line("b", 1.0, arrive=0.0, dispatch=10.5, end=10.8, cost=100.0))
    lane = analyze(lines)["tenants"]["fairness"]["lanes"]["interactive"]
    assert lane["windows"] == 0 and lane["windows_one_tenant"] == 1
    assert lane["backlogged_unserved"] == 1
    report = format_report(analyze(lines))
    assert "1 time(s) a tenant backlogged ≥ 80% of a window got nothing while another" in report


@pytest.mark.parametrize(("b_backlogged_s", "counted"), [(7.5, 0), (8.5, 1)])
def test_a_tenant_contends_when_backlogged_for_80_percent_of_the_window(
    b_backlogged_s: float, counted: int
) -> None:
    """b's requests all arrive at 10 - b_backlogged_s: backlogged 75% or 85% of [0, 10)."""
    arrive = 10.0 - b_backlogged_s
    lines = [
        tenant_line("a", 1.0, arrive=0.0, dispatch=0.5 + i, end=0.8 + i, cost=100.0)
        for i in range(11)
    ]
    lines += [
        tenant_line(
            "b", 1.0, arrive=arrive, dispatch=arrive + 0.25 + i, end=arrive + 0.5 + i, cost=100.0
        )
        for i in range(11)
    ]
    fairness = analyze(lines)["tenants"]["fairness"]
    assert fairness["lanes"]["interactive"]["windows"] == counted
    assert fairness["backlog_share"] == 0.8


def test_tenants_in_different_lanes_are_not_compared() -> None:
    lines = [
        tenant_line("a", 1.0, arrive=0.0, dispatch=0.5 + i, end=0.8 + i, cost=100.0)
        for i in range(11)
    ]
    lines += [
        tenant_line("b", 1.0, arrive=0.0, dispatch=0.5 + i, end=0.8 + i, cost=900.0, lane="bulk")
        for i in range(11)
    ]
    fairness = analyze(lines)["tenants"]["fairness"]
    assert fairness["lanes"] == {} and fairness["windows"] == 0


# ----------------------------------------------------------------------------- the gap


def test_gap_of_the_fair_log_is_within_the_bound() -> None:
    """W_a/2 − W_b moves −100 (b at x.25), +100 (a at x.5) ... and −100 at 10.2: min −100, max 0.

    U = max(200/2, 100/1) = 100, so the bound is 200.
    """
    gap = analyze(fair_log())["tenants"]["fairness"]["lanes"]["interactive"]["gap"]
    assert gap["pair"] == ["a", "b"]
    assert gap["pair_intervals"] == 1  # both backlogged from 0 until b's last dispatch, 10.2
    assert gap["end"].endswith(":40.200Z")
    assert gap["max_gap"] == pytest.approx(100.0)
    assert gap["largest_request"] == 100.0 and gap["bound"] == 200.0
    assert gap["verdict"] == "within_bound" and gap["intervals_over_bound"] == 0


def test_gap_of_the_unfair_log_is_over_the_bound() -> None:
    """Over (0, 10.5]: a adds 150 eleven times, b takes 100 five times → 1650 − 500 = 1150.

    The difference never dips below 0, so the gap is 1150; U = max(300/2, 100/1) = 150,
    bound 300; each request is 0.3 s in flight, one at a time: 150 at most.
    """
    gap = analyze(unfair_log())["tenants"]["fairness"]["lanes"]["interactive"]["gap"]
    assert gap["max_gap"] == pytest.approx(1150.0)
    assert gap["largest_request"] == 150.0 and gap["bound"] == 300.0
    assert gap["in_flight_max"] == pytest.approx(150.0)
    assert gap["verdict"] == "over_bound" and gap["intervals_over_bound"] == 1


def test_a_gap_explained_by_requests_in_flight() -> None:
    """a is dispatched at 1, 2, 3 and b at 4, 9.5 (100 tokens each, weights 1): the gap is 300.

    That is over 2·U = 200, but a's three requests run 5 s each, so at t = 3 its counter
    had not seen 300 of its service yet: within the bound plus what was in flight.
    """
    lines = [
        tenant_line("a", 1.0, arrive=0.0, dispatch=t, end=t + 5.0, cost=100.0)
        for t in (1.0, 2.0, 3.0, 10.0)
    ]
    lines += [
        tenant_line("b", 1.0, arrive=0.0, dispatch=t, end=t + 0.1, cost=100.0) for t in (4.0, 9.5)
    ]
    gap = analyze(lines)["tenants"]["fairness"]["lanes"]["interactive"]["gap"]
    assert gap["max_gap"] == pytest.approx(300.0) and gap["bound"] == 200.0
    assert gap["in_flight_max"] == pytest.approx(300.0)
    assert gap["verdict"] == "within_bound_plus_in_flight"


def test_gap_counts_the_dispatch_that_ends_a_backlog() -> None:
    """b waits from 0 to 20; a is backlogged twice: dispatched at 1, 2, then at 6, 7, 8.

    Two co-backlogged intervals, (0, 2] with a gap of 200 (= 2·U, U = 100) and (5, 8] with
    300: the dispatch at 8 both ends a's backlog and belongs to it.
    """
    lines = [
        tenant_line("a", 1.0, arrive=arrive, dispatch=t, end=t + 0.3, cost=100.0)
        for arrive, dispatches in ((0.0, (1.0, 2.0)), (5.0, (6.0, 7.0, 8.0)))
        for t in dispatches
    ]
    lines.append(tenant_line("b", 1.0, arrive=0.0, dispatch=20.0, end=20.3, cost=100.0))
    gap = analyze(lines)["tenants"]["fairness"]["lanes"]["interactive"]["gap"]
    assert gap["pair_intervals"] == 2
    assert gap["max_gap"] == pytest.approx(300.0) and gap["bound"] == 200.0
    assert gap["intervals_over_bound"] == 1
    assert gap["start"].endswith(":35.000Z") and gap["end"].endswith(":38.000Z")


def test_gap_matches_a_brute_force_over_every_sub_interval() -> None:
    """Four tenants with random arrivals and waits; every pair and sub-interval checked by hand."""
    rng = random.Random(7)
    lines = []
    for _ in range(120):
        tenant = rng.choice("abcd")
        weight = {"a": 1.0, "b": 2.0, "c": 0.5, "d": 1.0}[tenant]
        arrive = rng.uniform(0, 30)
        dispatch = arrive + rng.expovariate(1 / 1.5)
        lines.append(
            tenant_line(
                tenant,
                weight,
                arrive=arrive,
                dispatch=dispatch,
                end=dispatch + rng.uniform(0.1, 2.0),
                cost=float(rng.randint(10, 400)),
            )
        )
    gap = analyze(lines)["tenants"]["fairness"]["lanes"]["interactive"]["gap"]
    expected = _brute_force_gaps(lines)
    assert gap["pair_intervals"] == len(expected)
    assert gap["max_gap"] == pytest.approx(max(g for g, _ in expected), abs=1e-3)
    assert gap["intervals_over_bound"] == sum(g > gap["bound"] + 1e-9 for g, _ in expected)
    assert gap["intervals_over_bound"] > 0  # the log exercises the bound both ways
    assert gap["intervals_over_bound"] < len(expected)


def _brute_force_gaps(lines: list[dict[str, Any]]) -> list[tuple[float, tuple[str, str]]]:
    queued: dict[str, list[tuple[float, float]]] = {}
    served: dict[str, list[tuple[float, float]]] = {}
    for line in lines:
        start, left = arrival_s(line), dispatch_s(line)
        assert start is not None and left is not None
        queued.setdefault(tenant_of(line), []).append((start, left))
        served.setdefault(tenant_of(line), []).append(
            (left, line["cost_tokens"] / line["tenant_weight"])
        )
    union = {t: _union(spans) for t, spans in queued.items()}
    gaps = []
    for f, g in itertools.combinations(sorted(union), 2):
        for s1, e1 in union[f]:
            for s2, e2 in union[g]:
                low, high = max(s1, s2), min(e1, e2)
                if low >= high:
                    continue
                moments = sorted({t for t, _ in served[f] + served[g] if low < t <= high})
                points = [0.0] + [
                    sum(w for t, w in served[f] if low < t <= until)
                    - sum(w for t, w in served[g] if low < t <= until)
                    for until in moments
                ]
                widest = max(
                    (abs(y - x) for x, y in itertools.combinations(points, 2)), default=0.0
                )
                gaps.append((widest, (f, g)))
    return gaps


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


# ----------------------------------------------------------------------------- older logs


def test_an_old_log_without_tenant_fields_is_one_tenant() -> None:
    records = [rec() for _ in range(5)]  # no tenant, tenant_weight or cost_tokens at all
    records += [
        rec(outcome="rejected_queue_full", queue=None, backend=None, error_code="queue_full")
    ]
    tenants = analyze(records)["tenants"]
    assert tenants["count"] == 1 and tenants["tagged"] is False
    row = tenants["table"][NO_TENANT]
    assert row["requests"] == 6 and row["served"] == 5
    assert row["tokens_served"] == 5 * (10 + 20)
    assert row["weight"] is None
    # no cost_tokens: uncached prompt + completion = 10 + 20 per served request, weight 1
    assert row["cost_tokens"] == 150.0 and row["weighted_service"] == 150.0
    assert row["refusals"] == {"queue_full": 1}
    assert tenants["cost_source"] == {COST_LOGGED: 0, COST_FALLBACK: 5}
    assert tenants["fairness"]["lanes"] == {} and tenants["fairness"]["windows"] == 0


def test_without_cost_tokens_service_is_uncached_prompt_plus_completion() -> None:
    """The fair log again, its costs given as tokens: a 250 prompt (100 cached) + 50 output = 200."""
    lines = []
    for line in fair_log():
        cost = line.pop("cost_tokens")
        line["cost_tokens"] = None
        if cost == 200.0:
            line |= {"prompt_tokens": 250, "cached_tokens": 100, "completion_tokens": 50}
        else:
            line |= {"prompt_tokens": 80, "cached_tokens": None, "completion_tokens": 20}
        lines.append(line)
    tenants = analyze(lines)["tenants"]
    assert tenants["cost_source"] == {COST_LOGGED: 0, COST_FALLBACK: 22}
    lane = tenants["fairness"]["lanes"]["interactive"]
    assert lane["min_jain"] == 1.0
    assert lane["worst_window"]["weighted_service"] == {"a": 1000.0, "b": 1000.0}


def test_the_empty_log_and_broken_fields_do_not_fail() -> None:
    assert tenant_analysis([])["count"] == 0
    odd = [
        rec(tenant="", tenant_weight=-1, cost_tokens="12"),  # all three unusable
        rec(tenant="x", tenant_weight=float("nan"), cost_tokens=None, timestamp="never"),
    ]
    tenants = analyze(odd)["tenants"]
    assert set(tenants["table"]) == {NO_TENANT, "x"}
    assert tenants["table"][NO_TENANT]["weight"] is None
    assert tenants["table"][NO_TENANT]["cost_tokens"] == 30.0  # fell back to 10 + 20


def test_the_window_width_is_a_parameter() -> None:
    """5 s windows split the fair log's one contended 10 s window in two, each 1.0."""
    fairness = analyze(fair_log(), fairness_window_s=5.0)["tenants"]["fairness"]
    assert fairness["window_s"] == 5.0 and fairness["full_windows"] == 2
    assert fairness["lanes"]["interactive"]["jain"] == [1.0, 1.0]
    with pytest.raises(ValueError, match="window_s"):
        tenant_analysis(fair_log(), window_s=0)
