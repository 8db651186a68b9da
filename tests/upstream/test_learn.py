"""What a finished request teaches its backend's model, and how its backend time is split."""

from __future__ import annotations

import pytest

from gateway.observability.record import RequestRecord
from gateway.outcomes import Outcome
from gateway.upstream.engine_timings import (
    ENGINE,
    ENGINE_WINDOW,
    ESTIMATE,
    EngineReport,
    WindowSplit,
)
from gateway.upstream.learn import engine_prefill_sample, learn_from, split_time
from gateway.upstream.pool import Backend, Slot


def served(
    *,
    stream: bool = True,
    prompt_tokens: int = 1000,
    ttft_s: float | None = 1.0,
    backend_s: float = 3.0,
    completion_tokens: int | None = 11,
    report: EngineReport | None = None,
    attempts: int = 1,
) -> tuple[RequestRecord, Slot]:
    """A request dispatched at t=10 to a fresh backend, answered as told."""
    record = RequestRecord("r", "/v1/chat/completions", arrival=9.0, stream=stream)
    record.outcome, record.status, record.attempts = Outcome.OK, 200, attempts
    record.prompt_tokens = prompt_tokens
    record.dispatched = 10.0
    record.first_byte = 10.0 + (ttft_s if stream and ttft_s is not None else backend_s)
    record.first_token = None if ttft_s is None or not stream else 10.0 + ttft_s
    record.end = 10.0 + backend_s
    record.completion_tokens = completion_tokens
    record.engine_report = report
    slot = Slot(Backend("b0", "http://b0", 4), prompt_tokens, 64, prefill_tokens=prompt_tokens)
    return record, slot


def test_the_engines_report_comes_first() -> None:
    record, slot = served(report=EngineReport(prefill_s=0.4, decode_s=2.0))
    slot.backend.engine_window, slot.backend.engine_window_tokens = WindowSplit(1, 1, 1, 3), 10
    split = split_time(record, slot)
    assert split is not None and split.source == ENGINE
    assert (split.engine_queue_s, split.prefill_s, split.decode_s) == pytest.approx((0.6, 0.4, 2.0))
    # The learned estimate beside the engine's own figure: 20 ms + 1000 tokens at 8192/s.
    assert split.prefill_estimate_s == pytest.approx(0.02 + 1000 / 8192)


def test_without_a_report_the_scaled_estimate_then_the_estimate() -> None:
    record, slot = served()
    # The prior: 20 ms + 1000 tokens at 8192 tokens/s.
    prefill = 0.02 + 1000 / 8192
    split = split_time(record, slot)
    assert split is not None and split.source == ESTIMATE
    assert (split.engine_queue_s, split.prefill_s, split.decode_s) == pytest.approx(
        (1.0 - prefill, prefill, 2.0)
    )
    assert split.prefill_estimate_s == pytest.approx(prefill)
    # The engine's histograms said its prefill took 3 times the gateway's estimate for the
    # mean prompt of the window (here, the same size as this one).
    slot.backend.engine_window = WindowSplit(0.5, 3 * prefill, 1.0, 3)
    slot.backend.engine_window_tokens = 1000
    split = split_time(record, slot)
    assert split is not None and split.source == ENGINE_WINDOW
    assert (split.engine_queue_s, split.prefill_s, split.decode_s) == pytest.approx(
        (1.0 - 3 * prefill, 3 * prefill, 2.0)
    )


def test_each_request_that_ended_well_is_noted_for_the_next_window() -> None:
    record, slot = served(prompt_tokens=1000)
    learn_from(record, slot)
    failed, _ = served()
    failed.outcome = Outcome.BACKEND_ERROR
    learn_from(failed, slot)
    assert slot.backend.take_ended() == 1000
    assert slot.backend.take_ended() is None


def test_nothing_is_split_for_a_request_no_backend_answered_or_that_failed() -> None:
    record, slot = served()
    record.first_byte = None
    assert split_time(record, slot) is None
    record, slot = served()
    record.status = 400
    assert split_time(record, slot) is None
    record, slot = served(ttft_s=None)  # a stream that never had a first token
    assert split_time(record, slot) is None


def test_a_retried_request_keeps_only_what_the_engine_reported() -> None:
    record, slot = served(attempts=2)
    assert split_time(record, slot) is None  # its dispatch time is the first backend's
    record, slot = served(attempts=2, report=EngineReport(prefill_s=0.4, decode_s=2.0))
    split = split_time(record, slot)
    assert split is not None and split.source == ENGINE
    assert (split.engine_queue_s, split.prefill_s, split.decode_s) == (None, 0.4, 2.0)


def test_the_engines_prefill_teaches_the_rate_in_the_gateways_tokens_even_when_queued() -> None:
    # The engine prefilled 300 of its 600 tokens (300 from its cache): half the prompt.
    report = EngineReport(prefill_s=0.27, decode_s=1.0, prefilled_tokens=300, cached_tokens=300)
    record, slot = served(prompt_tokens=1200, report=report, ttft_s=5.0)
    slot.engine_queued = True  # a TTFT sample would be thrown away: this one is clean
    assert engine_prefill_sample(record, slot) == (600, 0.27)
    for _ in range(3):
        learn_from(record, slot)
    # Beyond the prior's 20 ms fixed cost: 600 tokens in 0.25 s.
    assert slot.backend.model.prefill_tokens_per_s == pytest.approx(2400.0)


def test_a_short_prompt_that_waited_in_the_engine_does_not_teach_that_short_prompts_are_slow() -> (
    None
):
    model_of = {}
    for reported in (False, True):
        report = EngineReport(prefill_s=0.03, decode_s=0.1) if reported else None
        record, slot = served(prompt_tokens=50, ttft_s=2.0, report=report)  # 1.97 s queued
        for _ in range(3):
            learn_from(record, slot)
        model_of[reported] = slot.backend.model.figures().ttft_overhead_s
    # Without the engine's report the gateway cannot tell (its gauges had not shown the
    # queue yet): two seconds of "fixed cost". With it, the engine's 30 ms.
    assert model_of[False] == pytest.approx(2.0 - 50 / 8192)
    assert model_of[True] == pytest.approx(0.03 - 50 / 8192)


def test_without_the_engines_prefill_the_ttft_teaches_as_before() -> None:
    record, slot = served(prompt_tokens=2000, ttft_s=1.02)
    for _ in range(3):
        learn_from(record, slot)
    assert slot.backend.model.prefill_tokens_per_s == pytest.approx(2000 / 1.0)
    # TGI's report has no prefill of its own: nothing to learn from it but the TTFT.
    report = EngineReport(queue_s=0.5, inference_s=1.0)
    record, slot = served(prompt_tokens=2000, report=report, stream=False)
    assert engine_prefill_sample(record, slot) is None


def test_the_automatic_prefill_budget_follows_the_rate_a_request_taught_at_once() -> None:
    """An H100 learned in its first second kept the prior's 0.5 s budget until the next
    health round, five seconds, and prefilled six long prompts beside each short one."""
    _, slot = served()
    backend = slot.backend
    backend.prefill_budget_auto = True
    backend.fit_prefill_budget(4500)
    before = backend.prefill_budget_s
    assert before == pytest.approx(0.5)  # 4500 tokens at the prior's 8192/s is over it
    for _ in range(5):  # long prompts answered at 50k tokens/s
        record, each = served(prompt_tokens=4500, ttft_s=0.02 + 4500 / 50_000)
        each.backend = backend
        learn_from(record, each)
    assert backend.prefill_budget_s < before / 3
    assert backend.prefill_budget_s == pytest.approx(backend.model.prefill_s(4500))
