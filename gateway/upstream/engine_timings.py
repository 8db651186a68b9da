"""Where a request's backend time went: the engine's own queue, its prefill, its decode.

`backend_ttft_ms` (dispatch to first token) adds two different things: the time
a request sat in the *engine's* queue, because the gateway gave the engine more
than it batches, and its prefill. The first is fixed by a lower
`max_concurrency`, the second only by capacity or smaller prompts; a tail
cannot be diagnosed without telling them apart. So every request that reached
a backend gets `engine_queue_s`, `prefill_s` and `decode_s` from the best
source there is, named in `source`:

- `engine`: the engine's own per-request report.
  - llama.cpp: the answer's `timings` (the non-streamed body; a stream's last
    event, the usage chunk): `prompt_ms` is the prefill of `prompt_n` tokens
    (`cache_n` more came from its cache), `predicted_ms` the decode, from the
    first token to the last. It gives no queue time: the engine queue is what
    the backend's TTFT has beyond the prefill (for a whole answer, what the
    backend's time has beyond prefill and decode), at least 0. That rest holds
    the network too, a millisecond on a LAN.
  - TGI: the headers of a non-streamed answer, in whole ms: `x-queue-time`
    (plus `x-validation-time`, its tokenizing, which comes before: time in the
    engine before its compute began) is the queue; `x-inference-time` is prefill
    and decode together (`x-time-per-token` is only that over the generated
    tokens, no more). TGI does not split it, so the prefill is the learned
    estimate for this prompt, never more than the inference time, and decode
    the rest. Queue and total are TGI's, exact.
- `engine_window`: vLLM and SGLang report nothing per request, but their
  `/metrics` histograms do per engine (vLLM: `vllm:request_queue_time_seconds`,
  `..._prefill_time_...`, `..._decode_time_...`; SGLang: `sglang:queue_time_seconds`,
  with prefill as its TTFT less its queue and decode as its end-to-end less its
  TTFT). The gateway scrapes them with the engine's load every health round;
  the deltas between two scrapes are the means of the requests that ended in
  between. A request's own backend time is split in the proportions of the
  latest such window: its TTFT into queue and prefill, the rest (first token
  to end) is its decode; a whole answer's time in all three proportions. So
  the parts always add up to what this request took, and the window tells only
  where it went. The window is the one before the request ended (at most a
  health round old), not the one it ends in, which is not scraped yet.
- `estimate`: the learned backend model: the prefill of the tokens it really
  prefilled (not cached) at the learned rate; the rest of the backend's TTFT is
  its queue; first token to end its decode. A whole answer: decode at the
  learned time per token, the queue what is left.

Pure arithmetic over plain values: no clock, no I/O. Every parser answers None
for what it cannot read: garbage costs the timing, never a request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

ENGINE = "engine"
ENGINE_WINDOW = "engine_window"
ESTIMATE = "estimate"


@dataclass(frozen=True, slots=True)
class EngineReport:
    """What an engine said about one request's time (seconds); None where it did not say."""

    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    #: Prefill and decode together, when only their sum is given (TGI's inference time).
    inference_s: float | None = None
    #: Prompt tokens it prefilled, and served from its cache (llama.cpp prompt_n, cache_n).
    prefilled_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class EngineTimings:
    """A request's backend time split three ways (seconds; None: not known), and how."""

    engine_queue_s: float | None
    prefill_s: float | None
    decode_s: float | None
    source: str


# ----------------------------------------------------------------------------- parsing


def _duration_ms(value: Any) -> float | None:
    """A duration in ms as JSON gives it (a finite number >= 0), in seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return value / 1000.0


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def llamacpp_timings(value: Any) -> EngineReport | None:
    """llama.cpp's `timings` object; None when it is not one (or says nothing of time)."""
    if not isinstance(value, dict):
        return None
    prefill = _duration_ms(value.get("prompt_ms"))
    decode = _duration_ms(value.get("predicted_ms"))
    if prefill is None and decode is None:
        return None
    return EngineReport(
        prefill_s=prefill,
        decode_s=decode,
        prefilled_tokens=_count(value.get("prompt_n")),
        cached_tokens=_count(value.get("cache_n")),
    )


def _header_ms(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return _duration_ms(value)


def tgi_headers(headers: Mapping[str, str]) -> EngineReport | None:
    """TGI's timing headers of a non-streamed answer (whole ms); None without them."""
    if headers.get("x-queue-time") is None and headers.get("x-inference-time") is None:
        return None  # the common case, any other engine: one lookup each
    queue = _header_ms(headers, "x-queue-time")
    inference = _header_ms(headers, "x-inference-time")
    if queue is None and inference is None:
        return None
    validation = _header_ms(headers, "x-validation-time")
    if queue is not None and validation is not None:
        queue += validation
    return EngineReport(queue_s=queue, inference_s=inference)


# ----------------------------------------------------------------------------- splitting


def _rest(total: float | None, *parts: float | None) -> float | None:
    """`total` less `parts`, at least 0; None when any is unknown."""
    if total is None or any(part is None for part in parts):
        return None
    return max(0.0, total - sum(part for part in parts if part is not None))


def from_report(
    report: EngineReport,
    *,
    backend_ttft_s: float | None,
    backend_s: float | None,
    prefill_estimate_s: float | None,
) -> EngineTimings | None:
    """The split of an engine's own report, its gaps filled from the request's times.

    `backend_ttft_s`: dispatch to first token (a stream), `backend_s`: dispatch to the
    answer's end; None where unknown. `prefill_estimate_s`: the learned model's prefill
    for this prompt, used only to split TGI's inference time.
    """
    queue, prefill, decode = report.queue_s, report.prefill_s, report.decode_s
    inference = report.inference_s
    if prefill is None and inference is not None and prefill_estimate_s is not None:
        prefill = min(inference, max(0.0, prefill_estimate_s))
    if decode is None and inference is not None:
        decode = _rest(inference, prefill)
    if queue is None and prefill is not None:
        queue = (
            _rest(backend_ttft_s, prefill)
            if backend_ttft_s is not None
            else _rest(backend_s, prefill, decode)
        )
    if queue is None and prefill is None and decode is None:
        return None
    return EngineTimings(queue, prefill, decode, ENGINE)


def estimated(
    *,
    prefill_estimate_s: float,
    backend_ttft_s: float | None,
    backend_s: float | None,
    decode_estimate_s: float | None,
) -> EngineTimings | None:
    """The learned model's split of the request's own backend time.

    A stream: prefill at the learned rate, never more than its TTFT; the rest of the TTFT
    is the engine's queue; first token to end the decode. A whole answer (no first token
    seen): prefill, then decode at the learned time per token, each within what is left;
    the queue is the remainder.
    """
    prefill_estimate_s = max(0.0, prefill_estimate_s)
    if backend_ttft_s is not None:
        prefill = min(prefill_estimate_s, max(0.0, backend_ttft_s))
        return EngineTimings(
            _rest(backend_ttft_s, prefill), prefill, _rest(backend_s, backend_ttft_s), ESTIMATE
        )
    if backend_s is None:
        return None
    total = max(0.0, backend_s)
    prefill = min(prefill_estimate_s, total)
    if decode_estimate_s is None:
        return EngineTimings(None, prefill, None, ESTIMATE)
    decode = min(max(0.0, decode_estimate_s), total - prefill)
    return EngineTimings(total - prefill - decode, prefill, decode, ESTIMATE)


# ----------------------------------------------------------------------------- windows


@dataclass(frozen=True, slots=True)
class Totals:
    """One histogram's cumulative sum (seconds) and count at a scrape."""

    sum_s: float
    count: float


@dataclass(frozen=True, slots=True)
class RequestTimeTotals:
    """An engine's per-request time histograms at one scrape; None where it has none.

    vLLM has queue, prefill and decode; SGLang queue, TTFT and end-to-end.
    """

    queue: Totals | None = None
    prefill: Totals | None = None
    decode: Totals | None = None
    ttft: Totals | None = None
    e2e: Totals | None = None


#: Histogram families read, and the field of RequestTimeTotals each fills. vLLM:
#: vllm/v1/metrics/loggers.py (labels model_name, engine); SGLang: srt/metrics/collector.py.
TIME_HISTOGRAMS = {
    "vllm:request_queue_time_seconds": "queue",
    "vllm:request_prefill_time_seconds": "prefill",
    "vllm:request_decode_time_seconds": "decode",
    "sglang:queue_time_seconds": "queue",
    "sglang:time_to_first_token_seconds": "ttft",
    "sglang:e2e_request_latency_seconds": "e2e",
}
#: The sample names that carry them (`<family>_sum`, `<family>_count`), to their field.
TIME_SAMPLES = {
    f"{family}{suffix}": (field, suffix)
    for family, field in TIME_HISTOGRAMS.items()
    for suffix in ("_sum", "_count")
}


def time_totals(samples: Iterable[tuple[str, float]]) -> RequestTimeTotals | None:
    """The totals from (sample name, value) pairs, summed over label sets; None if none.

    A histogram counts only with both its sum and its count.
    """
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for name, value in samples:
        known = TIME_SAMPLES.get(name)
        if known is None or not math.isfinite(value):
            continue
        field, suffix = known
        into = sums if suffix == "_sum" else counts
        into[field] = into.get(field, 0.0) + value
    fields = {field: Totals(sums[field], counts[field]) for field in sums.keys() & counts.keys()}
    return RequestTimeTotals(**fields) if fields else None


@dataclass(frozen=True, slots=True)
class WindowSplit:
    """The mean request of one scrape window on one backend (seconds)."""

    queue_s: float
    prefill_s: float
    decode_s: float
    requests: float


def _mean(before: Totals | None, after: Totals | None) -> tuple[float, float] | None:
    """(mean, requests) of the window between two scrapes; None when it had none."""
    if before is None or after is None:
        return None
    count = after.count - before.count
    total = after.sum_s - before.sum_s
    if count <= 0 or total < 0:  # no request ended, or the engine restarted
        return None
    return total / count, count


def window_split(before: RequestTimeTotals, after: RequestTimeTotals) -> WindowSplit | None:
    """The mean split of the requests that ended between two scrapes; None when none did
    (or the histograms do not give all three parts)."""
    queue = _mean(before.queue, after.queue)
    if queue is None:
        return None
    prefill = _mean(before.prefill, after.prefill)
    decode = _mean(before.decode, after.decode)
    ttft = _mean(before.ttft, after.ttft)
    e2e = _mean(before.e2e, after.e2e)
    prefill_s = prefill[0] if prefill is not None else None if ttft is None else ttft[0] - queue[0]
    decode_s = (
        decode[0]
        if decode is not None
        else None
        if ttft is None or e2e is None
        else e2e[0] - ttft[0]
    )
    if prefill_s is None or decode_s is None:
        return None
    return WindowSplit(queue[0], max(0.0, prefill_s), max(0.0, decode_s), queue[1])


def from_window(
    window: WindowSplit, *, backend_ttft_s: float | None, backend_s: float | None
) -> EngineTimings | None:
    """The request's own backend time split in the proportions of the window's mean.

    A stream: its TTFT into queue and prefill as the window's mean divides them, first
    token to end its decode. A whole answer: its backend time in all three proportions.
    """
    if backend_ttft_s is not None:
        ttft = max(0.0, backend_ttft_s)
        before_first = window.queue_s + window.prefill_s
        queue = ttft * window.queue_s / before_first if before_first > 0 else 0.0
        return EngineTimings(queue, ttft - queue, _rest(backend_s, backend_ttft_s), ENGINE_WINDOW)
    if backend_s is None:
        return None
    total = max(0.0, backend_s)
    whole = window.queue_s + window.prefill_s + window.decode_s
    if whole <= 0:
        return None
    queue = total * window.queue_s / whole
    prefill = total * window.prefill_s / whole
    return EngineTimings(queue, prefill, max(0.0, total - queue - prefill), ENGINE_WINDOW)
