"""GatewayMetrics.observe: one finished request, one set of samples, read back by name."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import pytest

from gateway.observability.metrics import GatewayMetrics
from gateway.observability.record import RequestRecord
from gateway.upstream.engine_timings import EngineTimings

HISTOGRAMS = (
    "gateway_queue_wait_seconds",
    "gateway_ttft_seconds",
    "gateway_backend_ttft_seconds",
    "gateway_tpot_seconds",
    "gateway_e2e_seconds",
)


def record(**changes: Any) -> RequestRecord:
    """Served in the interactive lane: 0.5 s queued, 0.75 s backend TTFT, 5 tokens."""
    fields: dict[str, Any] = {
        "request_id": "r-1",
        "route": "/v1/chat/completions",
        "arrival": 100.0,
        "lane": "interactive",
        "backend": "b0",
        "status": 200,
        "outcome": "ok",
        "prompt_tokens": 12,
        "completion_tokens": 5,
        "enqueued": 100.25,
        "dispatched": 100.75,
        "first_token": 101.5,
        "end": 103.5,
    }
    fields.update(changes)
    return RequestRecord(**fields)


def value(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_a_served_request_gives_one_sample_per_lane_histogram_in_seconds() -> None:
    metrics = GatewayMetrics()
    metrics.observe(record())
    expected_s = {
        "gateway_queue_wait_seconds": 0.5,
        "gateway_ttft_seconds": 1.5,
        "gateway_backend_ttft_seconds": 0.75,
        "gateway_tpot_seconds": 0.5,
        "gateway_e2e_seconds": 3.5,
    }
    for name, seconds in expected_s.items():
        assert value(metrics, f"{name}_count", lane="interactive") == 1, name
        assert value(metrics, f"{name}_sum", lane="interactive") == pytest.approx(seconds), name
    assert value(metrics, "gateway_queue_wait_seconds_bucket", lane="interactive", le="0.5") == 1
    assert value(metrics, "gateway_queue_wait_seconds_bucket", lane="interactive", le="0.25") == 0


def test_the_requests_counter_has_lane_outcome_and_status_labels() -> None:
    metrics = GatewayMetrics()
    metrics.observe(record())
    metrics.observe(record())
    metrics.observe(record(lane="bulk", status=503, outcome="queue_timeout"))
    ok = {"lane": "interactive", "outcome": "ok", "status": "200"}
    assert value(metrics, "gateway_requests_total", **ok) == 2
    timeout = {"lane": "bulk", "outcome": "queue_timeout", "status": "503"}
    assert value(metrics, "gateway_requests_total", **timeout) == 1
    assert value(metrics, "gateway_requests_total", **{**ok, "status": "503"}) is None


def test_token_counters_count_admitted_prompts_and_reported_completions() -> None:
    metrics = GatewayMetrics()
    metrics.observe(record())
    metrics.observe(record(prompt_tokens=8, completion_tokens=None))
    assert value(metrics, "gateway_prompt_tokens_total", lane="interactive") == 20
    assert value(metrics, "gateway_completion_tokens_total", lane="interactive") == 5


def test_a_queue_timeout_records_its_wait_but_no_backend_timings() -> None:
    metrics = GatewayMetrics()
    metrics.observe(
        record(
            lane="bulk",
            status=503,
            outcome="queue_timeout",
            backend=None,
            completion_tokens=None,
            dispatched=None,
            first_token=None,
            end=102.25,
        )
    )
    assert value(metrics, "gateway_queue_wait_seconds_count", lane="bulk") == 1
    assert value(metrics, "gateway_queue_wait_seconds_sum", lane="bulk") == pytest.approx(2.0)
    assert value(metrics, "gateway_e2e_seconds_count", lane="bulk") == 1
    for name in ("gateway_ttft_seconds", "gateway_backend_ttft_seconds", "gateway_tpot_seconds"):
        assert not value(metrics, f"{name}_count", lane="bulk"), name
    # Never sent to a backend: its prompt tokens did not cost anything.
    assert not value(metrics, "gateway_prompt_tokens_total", lane="bulk")


def test_a_graced_request_is_counted_by_lane_and_how_it_ended() -> None:
    metrics = GatewayMetrics()
    metrics.observe(record(lane="bulk", deadline_grace_s=12.5))
    metrics.observe(
        record(lane="bulk", status=200, outcome="queue_timeout_in_stream", deadline_grace_s=12.5)
    )
    metrics.observe(record(lane="bulk"))  # served within its deadline: no grace
    assert value(metrics, "gateway_deadline_graces_total", lane="bulk", outcome="ok") == 1
    timed_out = {"lane": "bulk", "outcome": "queue_timeout_in_stream"}
    assert value(metrics, "gateway_deadline_graces_total", **timed_out) == 1
    assert value(metrics, "gateway_deadline_graces_total", lane="interactive", outcome="ok") is None


def test_a_refusal_before_a_lane_counts_the_request_and_nothing_else() -> None:
    metrics = GatewayMetrics()
    refused = RequestRecord(request_id="r-2", route="/v1/chat/completions", arrival=1.0)
    refused.status, refused.outcome, refused.end = 400, "rejected_invalid_request", 1.001
    metrics.observe(refused)
    labels = {"lane": "none", "outcome": "rejected_invalid_request", "status": "400"}
    assert value(metrics, "gateway_requests_total", **labels) == 1
    for name in HISTOGRAMS:
        assert not value(metrics, f"{name}_count", lane="none"), name


def test_a_string_enum_outcome_is_labelled_with_its_value() -> None:
    class Outcome(StrEnum):
        OK = "ok"

    metrics = GatewayMetrics()
    metrics.observe(record(outcome=Outcome.OK))
    ok = {"lane": "interactive", "outcome": "ok", "status": "200"}
    assert value(metrics, "gateway_requests_total", **ok) == 1


def test_each_gateway_has_its_own_registry() -> None:
    first, second = GatewayMetrics(), GatewayMetrics()
    first.observe(record())
    ok = {"lane": "interactive", "outcome": "ok", "status": "200"}
    assert value(first, "gateway_requests_total", **ok) == 1
    assert value(second, "gateway_requests_total", **ok) is None


def test_the_backend_time_split_gives_one_sample_per_part_in_seconds() -> None:
    metrics = GatewayMetrics()
    metrics.observe(record(timings=EngineTimings(0.25, 0.5, 2.0, "engine")))
    metrics.observe(record(timings=EngineTimings(None, 0.1, None, "estimate")))
    metrics.observe(record())  # nothing known: no sample
    for name, count, total in (
        ("gateway_engine_queue_seconds", 1, 0.25),
        ("gateway_prefill_seconds", 2, 0.6),
        ("gateway_decode_seconds", 1, 2.0),
    ):
        assert value(metrics, f"{name}_count", lane="interactive") == count, name
        assert value(metrics, f"{name}_sum", lane="interactive") == pytest.approx(total), name
