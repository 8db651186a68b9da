"""Percentiles shared by the analyzer, the load generator and the benchmarks.

The definition must match numpy's default ("linear") so that a number in our
report equals the one an engineer recomputes in a notebook.
"""

from __future__ import annotations

import random

import pytest

from gateway.tools.stats import percentile, summarize


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        # rank = (n - 1) * q / 100, interpolated linearly between the neighbours
        ([1, 2, 3, 4], 50, 2.5),
        ([1, 2, 3, 4], 25, 1.75),
        ([1, 2, 3, 4], 75, 3.25),
        ([10, 20, 30, 40, 50], 95, 48.0),  # rank 3.8: 40 + 0.8 * 10
        ([10, 20, 30, 40, 50], 99, 49.6),  # rank 3.96
        ([10, 20, 30, 40, 50], 50, 30.0),  # exact rank: no interpolation
        ([50, 10, 40, 20, 30], 95, 48.0),  # input order does not matter
        ([3, 1, 2], 0, 1.0),
        ([3, 1, 2], 100, 3.0),
        ([7], 99, 7.0),
        ([0.5, 0.5, 100.0], 50, 0.5),  # duplicates
        (list(range(1, 101)), 99, 99.01),
        (list(range(1, 101)), 50, 50.5),
    ],
)
def test_percentile_is_numpys_linear_method(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_matches_numpy_on_random_data() -> None:
    numpy = pytest.importorskip("numpy")
    rng = random.Random(7)
    for n in (1, 2, 3, 10, 101, 999):
        values = [rng.lognormvariate(3, 1.5) for _ in range(n)]
        for q in (0, 1, 50, 90, 95, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)))


def test_percentile_of_nothing_is_none() -> None:
    assert percentile([], 50) is None


@pytest.mark.parametrize("q", [-0.1, 100.1, -50, 1000])
def test_percentile_out_of_range_is_an_error(q: float) -> None:
    with pytest.raises(ValueError, match="percentile"):
        percentile([1.0, 2.0], q)


def test_summarize_skips_none() -> None:
    summary = summarize([None, 4.0, None, 1.0, 2.0, 3.0])
    assert summary["count"] == 4
    assert summary["mean"] == pytest.approx(2.5)
    assert summary["p50"] == pytest.approx(2.5)
    assert summary["p95"] == pytest.approx(3.85)
    assert summary["p99"] == pytest.approx(3.97)


def test_summarize_of_only_none_has_no_figures() -> None:
    assert summarize([None, None]) == {
        "count": 0,
        "mean": None,
        "p50": None,
        "p95": None,
        "p99": None,
    }


def test_summarize_takes_other_percentiles_and_any_iterable() -> None:
    summary = summarize((v for v in [1.0, 2.0, 3.0]), qs=(0, 99.9))
    assert set(summary) == {"count", "mean", "p0", "p99.9"}
    assert summary["p0"] == 1.0
    assert summary["p99.9"] == pytest.approx(2.998)
