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
  between. A window's mean cannot say which of its requests queued (in a burst
  the first did not and the last did), but the prefill depends on the prompt,
  not the load: the engine's mean prefill over the gateway's estimate for the
  mean prompt of the requests it saw end in the same interval scales the
  estimate below, so each request's prefill is its own prompt's, at the rate
  the engine really prefilled, and the rest of its TTFT is its queue. This
  keeps working while the engine queues all the time, when TTFT teaches the
  learned rate nothing. The window is the latest in which requests ended.
  Its limit: an engine's prefill time counts the steps a prompt shares with
  others' prefill (chunked, first come first served), so with prompts of mixed
  sizes the scale grows and a long prompt's scaled prefill takes up time it
  really waited (on the simulator, 8 slots over a 2-place engine, prompts of 50
  to 3000 tokens: engine queue error P90 ~160-500 ms, against ~6-76 ms for the
  estimate alone; a burst of like prompts it gets within a few ms).
- `estimate`: the learned backend model: the prefill of the tokens it really
  prefilled (not cached) at the learned rate; the rest of the backend's TTFT is
  its queue; first token to end its decode. A whole answer: decode at the
  learned time per token, the queue what is left. The parts always add up to
  the request's own backend time.

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
    #: The learned model's prefill for this prompt, whatever the source: beside an
    #: engine's own figure it measures the estimate's error.
    prefill_estimate_s: float | None = None


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


#: Bounds of a window's prefill scale: a stray window cannot make the split absurd.
PREFILL_SCALE_BOUNDS = (0.1, 10.0)


def prefill_scale(window: WindowSplit, estimate_s: float) -> float | None:
    """The engine's mean prefill over one window against the gateway's estimate for the
    mean prompt of the requests it saw end in that window (the estimate is linear in the
    tokens, so that is their mean estimate, with the model as it is now); None when the
    gateway estimated nothing."""
    if estimate_s <= 0:
        return None
    low, high = PREFILL_SCALE_BOUNDS
    return min(high, max(low, window.prefill_s / estimate_s))


def from_window(
    scale: float,
    *,
    prefill_estimate_s: float,
    backend_ttft_s: float | None,
    backend_s: float | None,
    decode_estimate_s: float | None,
) -> EngineTimings | None:
    """The estimate, its prefill scaled to what the engine's histograms say prefill took.

    A window's means cannot say which of its requests queued: in a burst the first
    ones did not and the last ones did. The prefill depends on the prompt, not on the
    load, so the learned estimate, which knows this prompt's size, is what is scaled;
    the queue is then the rest of the request's own TTFT, as in `estimated`.
    """
    split = estimated(
        prefill_estimate_s=prefill_estimate_s * scale,
        backend_ttft_s=backend_ttft_s,
        backend_s=backend_s,
        decode_estimate_s=decode_estimate_s,
    )
    if split is None:
        return None
    return EngineTimings(split.engine_queue_s, split.prefill_s, split.decode_s, ENGINE_WINDOW)
