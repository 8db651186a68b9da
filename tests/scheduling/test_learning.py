"""The learned backend model: converges on synthetic samples, ignores outliers."""

from __future__ import annotations

import random

import pytest

from gateway.scheduling.learning import (
    PRIOR_PREFILL_TOKENS_PER_S,
    TOKEN_RATIO_BOUNDS,
    BackendModel,
    WindowedMedian,
    changed_a_lot,
)


def feed_engine(model: BackendModel, rate: float, overhead: float, n: int, seed: int = 1) -> None:
    """Streams of an engine prefilling `rate` tokens/s with a fixed first-token cost."""
    rng = random.Random(seed)
    for _ in range(n):
        tokens = rng.randint(40, 3000)
        ttft = overhead + tokens / rate
        model.observe_ttft(tokens, 0, ttft * rng.uniform(0.95, 1.05))


def test_prior_before_samples_is_a_fast_engine() -> None:
    model = BackendModel()
    assert model.prefill_tokens_per_s == PRIOR_PREFILL_TOKENS_PER_S
    assert not model.prefill_learned
    assert model.prefill_s(4096) < 1.0


@pytest.mark.parametrize("rate", [300.0, 2_000.0, 50_000.0])
def test_prefill_rate_converges_on_cpu_and_gpu_engines(rate: float) -> None:
    model = BackendModel()
    feed_engine(model, rate, overhead=0.03, n=60)
    assert model.prefill_learned
    assert model.prefill_tokens_per_s == pytest.approx(rate, rel=0.25)
    assert model.prefill_s(1500) == pytest.approx(0.03 + 1500 / rate, rel=0.3)


def test_outliers_do_not_move_the_estimate() -> None:
    model = BackendModel()
    feed_engine(model, 500.0, overhead=0.02, n=40)
    for _ in range(10):  # a GC pause, a cold cache: 20x slower, a fifth of the window
        model.observe_ttft(1500, 0, 60.0)
    assert model.prefill_tokens_per_s == pytest.approx(500.0, rel=0.25)


def test_prefill_in_flight_ahead_counts_as_work() -> None:
    model = BackendModel()
    for _ in range(10):  # a short prompt behind 1500 tokens still in prefill: 1550 tokens
        model.observe_ttft(50, 1500, 0.02 + 1550 / 1000.0)
    assert model.prefill_tokens_per_s == pytest.approx(1000.0, rel=0.1)


def test_a_new_engine_is_followed_within_a_window() -> None:
    model = BackendModel()
    feed_engine(model, 10_000.0, overhead=0.01, n=48)
    feed_engine(model, 400.0, overhead=0.01, n=30, seed=2)  # swapped for a CPU box
    assert model.prefill_tokens_per_s == pytest.approx(400.0, rel=0.3)


def test_decode_time_per_token_by_concurrency() -> None:
    model = BackendModel()
    for _ in range(10):
        model.observe_tpot(0.02, streams=1)
        model.observe_tpot(0.08, streams=8)
    assert model.tpot_s(1) == pytest.approx(0.02)
    assert model.tpot_s(7) == pytest.approx(0.08)
    assert model.figures(1).decode_tokens_per_s == pytest.approx(50.0)
    # A concurrency never seen: the overall median.
    assert model.tpot_s(100) == pytest.approx(0.05)


def test_token_ratio_converges_and_is_bounded() -> None:
    model = BackendModel()
    assert model.token_ratio == 1.0
    for tokens in range(100, 1100, 100):
        model.observe_prompt_count(tokens, round(tokens * 1.3))
    assert model.token_ratio == pytest.approx(1.3, abs=0.01)
    hostile = BackendModel()
    for _ in range(10):
        hostile.observe_prompt_count(100, 10_000_000)
    assert hostile.token_ratio == TOKEN_RATIO_BOUNDS[1]
    tiny = BackendModel()
    tiny.observe_prompt_count(3, 30)  # a few tokens say nothing about the tokenizer
    assert len(tiny.figures().to_json()) and tiny.figures().token_samples == 0


def test_windowed_median_keeps_the_prior_until_enough_samples() -> None:
    median = WindowedMedian(5.0, window=4, min_samples=3)
    median.add(1.0)
    median.add(1.0)
    assert median.value == 5.0
    median.add(100.0)
    assert median.value == 1.0
    for _ in range(4):
        median.add(2.0)
    assert median.value == 2.0 and len(median) == 4


def test_changed_a_lot() -> None:
    assert changed_a_lot(100, 200) and changed_a_lot(200, 100)
    assert not changed_a_lot(100, 120)
    assert changed_a_lot(0, 5)
