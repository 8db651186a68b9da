"""What the gateway learns about each backend from its own traffic: how fast it is.

Fixed numbers in a config assume one kind of engine; the same defaults must work
in front of an H100 running vLLM and a CPU running llama.cpp, whose prefill
rates differ a hundredfold. So each backend gets a `BackendModel`, fed with the
records of the requests it served:

- **prefill rate** (prompt tokens per second): backend TTFT against the prompt
  tokens it had to prefill first, its own plus those still in prefill ahead of
  it on that backend when it was dispatched; or, when the engine reports it
  (llama.cpp's `timings`), the engine's own prefill time of the tokens it
  prefilled, a cleaner sample (no queue, no network: `upstream/learn.py`);
- **TTFT overhead**: what a first token costs beyond prefill (a decode step,
  the network), so a tiny prompt is not predicted at zero;
- **decode time per token** (TPOT) by how many streams ran beside it;
- **token ratio**: the backend's own `usage.prompt_tokens` over the gateway's
  tiktoken count, since tiktoken is not the model's tokenizer.

Every figure is the median of a window of recent samples: robust to outliers (a
GC pause, a cold cache) and quick to follow a change of hardware. Before enough
samples it is a prior, a middle-of-the-road GPU engine, so a fast backend is
never held back on its first requests and a slow one is learned within a few.

Pure arithmetic: no clock, no I/O; the caller passes measured durations in.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

#: Samples each median is taken over.
WINDOW = 48
#: Samples needed before a median replaces the prior.
MIN_SAMPLES = 3
#: Prior prefill rate: 4096 prompt tokens in 0.5 s, the old token budget in seconds.
PRIOR_PREFILL_TOKENS_PER_S = 8192.0
PRIOR_TTFT_OVERHEAD_S = 0.02
PRIOR_TPOT_S = 0.02
#: Prompts smaller than this say little about the prefill rate (overhead dominates).
MIN_PREFILL_SAMPLE_TOKENS = 256
#: A learned token ratio is kept within these bounds (a garbled `usage` cannot
#: make the gateway refuse everything, or let anything through).
TOKEN_RATIO_BOUNDS = (0.5, 2.0)
#: Concurrency buckets of the TPOT table: 1, 2, 3-4, 5-8, 9-16, 17-32, 33+.
_TPOT_BUCKET_TOPS = (1, 2, 4, 8, 16, 32)


class WindowedMedian:
    """The median of the last `window` samples, or `prior` before `min_samples`.

    The median is taken when it is read after a change, not at every sample:
    each finished request adds samples to several of these, and most of them
    are read far less often than that.
    """

    __slots__ = ("prior", "min_samples", "_samples", "_value")

    def __init__(self, prior: float, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        self.prior = prior
        self.min_samples = min_samples
        self._samples: deque[float] = deque(maxlen=window)
        #: The median of the samples as they are, or None when a sample came since.
        self._value: float | None = prior

    def add(self, sample: float) -> None:
        self._samples.append(sample)
        self._value = None

    @property
    def value(self) -> float:
        if self._value is None:
            self._value = (
                statistics.median(self._samples)
                if len(self._samples) >= self.min_samples
                else self.prior
            )
        return self._value

    @property
    def learned(self) -> bool:
        return len(self._samples) >= self.min_samples

    def __len__(self) -> int:
        return len(self._samples)


def _tpot_bucket(streams: int) -> int:
    for index, top in enumerate(_TPOT_BUCKET_TOPS):
        if streams <= top:
            return index
    return len(_TPOT_BUCKET_TOPS)


@dataclass(frozen=True, slots=True)
class LearnedFigures:
    """A backend's learned figures, for metrics, logs and `GET /debug/backends`."""

    prefill_tokens_per_s: float
    ttft_overhead_s: float
    decode_tokens_per_s: float
    token_ratio: float
    prefill_samples: int
    decode_samples: int
    token_samples: int

    def to_json(self) -> dict[str, float | int]:
        return {
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 1),
            "ttft_overhead_ms": round(self.ttft_overhead_s * 1000.0, 1),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "token_ratio": round(self.token_ratio, 3),
            "prefill_samples": self.prefill_samples,
            "decode_samples": self.decode_samples,
            "token_samples": self.token_samples,
        }


class BackendModel:
    """One backend's service rates, learned from the requests it served."""

    def __init__(self) -> None:
        self._prefill_rate = WindowedMedian(PRIOR_PREFILL_TOKENS_PER_S)
        self._overhead = WindowedMedian(PRIOR_TTFT_OVERHEAD_S)
        self._tpot_all = WindowedMedian(PRIOR_TPOT_S)
        self._tpot_by_streams: dict[int, WindowedMedian] = {}
        self._token_ratio = WindowedMedian(1.0)
        self._cache_hits: deque[float] = deque(maxlen=WINDOW)
        self._cache_hit_sum = 0.0

    # -- learning ------------------------------------------------------------------

    def observe_ttft(self, prompt_tokens: int, ahead_tokens: int, ttft_s: float) -> None:
        """A stream's first token came `ttft_s` after dispatch.

        `ahead_tokens`: prompt tokens of other requests that were in prefill on
        the backend when this one was dispatched (engines prefill in order).
        Small prompts teach the fixed cost of a first token, large ones the rate
        (their time beyond that cost, per token): two medians, no regression to
        be thrown off by one wild sample.
        """
        if ttft_s <= 0:
            return
        work = prompt_tokens + max(0, ahead_tokens)
        if work < MIN_PREFILL_SAMPLE_TOKENS:
            self._overhead.add(max(0.0, ttft_s - work / self._prefill_rate.value))
            return
        beyond = ttft_s - min(self._overhead.value, 0.5 * ttft_s)
        self._prefill_rate.add(work / max(beyond, 1e-6))

    def observe_tpot(self, tpot_s: float, streams: int) -> None:
        """Mean time per output token of a stream that ran beside `streams` streams (itself
        included)."""
        if tpot_s <= 0:
            return
        self._tpot_all.add(tpot_s)
        bucket = self._tpot_by_streams.setdefault(_tpot_bucket(max(1, streams)), WindowedMedian(0))
        bucket.add(tpot_s)

    def observe_prompt_count(self, gateway_tokens: int, backend_tokens: int) -> None:
        """The backend's own count of a prompt the gateway counted `gateway_tokens`."""
        if gateway_tokens < 16 or backend_tokens <= 0:
            return
        low, high = TOKEN_RATIO_BOUNDS
        self._token_ratio.add(min(high, max(low, backend_tokens / gateway_tokens)))

    def observe_cache(self, expected_tokens: int, reported_tokens: int) -> None:
        """Routing expected `expected_tokens` of a prompt cached here; the backend said it
        served `reported_tokens` from its cache (both in its tokens or both in ours)."""
        if expected_tokens <= 0:
            return
        hits = self._cache_hits
        if len(hits) == hits.maxlen:
            self._cache_hit_sum -= hits[0]
        share = min(1.0, max(0.0, reported_tokens / expected_tokens))
        hits.append(share)
        self._cache_hit_sum += share

    # -- predictions ---------------------------------------------------------------

    @property
    def cache_hit_share(self) -> float:
        """The share of the tokens routing expects cached that the backend really serves
        from its cache (the mean of recent requests): 0 for an engine without a prefix
        cache, so the expectation stops counting there. 1 until it has said."""
        hits = self._cache_hits
        if len(hits) < MIN_SAMPLES:
            return 1.0
        return self._cache_hit_sum / len(hits)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._prefill_rate.value

    def prefill_s(self, prompt_tokens: int) -> float:
        """Predicted dispatch-to-first-token of a prompt on an otherwise idle prefill."""
        return self._overhead.value + prompt_tokens / self._prefill_rate.value

    def tpot_s(self, streams: int) -> float:
        """Predicted time per output token with `streams` streams running."""
        bucket = self._tpot_by_streams.get(_tpot_bucket(max(1, streams)))
        if bucket is not None and bucket.learned:
            return bucket.value
        return self._tpot_all.value

    @property
    def token_ratio(self) -> float:
        return self._token_ratio.value

    @property
    def prefill_learned(self) -> bool:
        return self._prefill_rate.learned

    # -- kept across a restart (`upstream/learned_state.py`) ---------------------------

    def snapshot(self) -> dict[str, Any]:
        """The learned medians (what is still a prior is left out), as plain JSON."""
        medians = {
            "prefill_tokens_per_s": self._prefill_rate,
            "ttft_overhead_s": self._overhead,
            "tpot_s": self._tpot_all,
            "token_ratio": self._token_ratio,
        }
        found: dict[str, Any] = {k: m.value for k, m in medians.items() if m.learned}
        buckets = {str(b): m.value for b, m in self._tpot_by_streams.items() if m.learned}
        if buckets:
            found["tpot_s_by_streams_bucket"] = buckets
        return found

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Start from figures learned before a restart: each as `MIN_SAMPLES` samples, so
        they count as learned at once and the backend's own traffic outvotes them within
        a few requests (a window of `WINDOW`)."""
        medians = {
            "prefill_tokens_per_s": self._prefill_rate,
            "ttft_overhead_s": self._overhead,
            "tpot_s": self._tpot_all,
            "token_ratio": self._token_ratio,
        }
        for key, median in medians.items():
            value = snapshot.get(key)
            if isinstance(value, (int, float)) and value > 0:
                for _ in range(MIN_SAMPLES):
                    median.add(float(value))
        for bucket, value in (snapshot.get("tpot_s_by_streams_bucket") or {}).items():
            if str(bucket).isdigit() and isinstance(value, (int, float)) and value > 0:
                median = self._tpot_by_streams.setdefault(int(bucket), WindowedMedian(0))
                for _ in range(MIN_SAMPLES):
                    median.add(float(value))

    def forget(self) -> None:
        """Back to the priors: the engine at this address changed, learn it anew."""
        self.__init__()  # type: ignore[misc]

    def figures(self, streams: int = 1) -> LearnedFigures:
        return LearnedFigures(
            prefill_tokens_per_s=self._prefill_rate.value,
            ttft_overhead_s=self._overhead.value,
            decode_tokens_per_s=1.0 / self.tpot_s(streams),
            token_ratio=self._token_ratio.value,
            prefill_samples=len(self._prefill_rate),
            decode_samples=len(self._tpot_all),
            token_samples=len(self._token_ratio),
        )


def changed_a_lot(before: float, after: float, factor: float = 1.5) -> bool:
    """True when `after` is more than `factor` times `before` or less than 1/factor."""
    if before <= 0 or after <= 0:
        return before != after
    ratio = after / before
    return ratio > factor or ratio < 1 / factor
