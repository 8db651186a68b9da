"""What one finished request teaches the gateway about the backend that served it, and
where its time on that backend went.

Called once per request that held a slot, before the slot is given back, so
the backend's stream count is the one the request ran beside. Only clean
samples teach: a stream that answered (not a retry, whose dispatch time is
another backend's), not one that waited in the engine's own queue. A prompt
partly served from the engine's cache teaches by the part it prefilled. The
engine's own prefill time, when it reports one (llama.cpp's `timings`), is the
cleanest sample: neither the engine's queue nor the network is in it, so it
teaches however long the request waited in the engine (a TTFT that did would
teach the model that short prompts are slow), and a whole answer teaches too.

The split of its backend time (`split_time`) takes the engine's own report
first, then the learned model scaled by the engine's latest histogram window,
then the learned model alone (`engine_timings.py` says how each is read).
"""

from __future__ import annotations

from gateway.observability.record import RequestRecord
from gateway.outcomes import Outcome
from gateway.upstream.engine_timings import (
    EngineTimings,
    estimated,
    from_report,
    from_window,
    prefill_scale,
)
from gateway.upstream.pool import Slot


def learn_from(record: RequestRecord, slot: Slot) -> None:
    model = slot.backend.model
    if record.outcome is not Outcome.OK or record.attempts > 1:
        return
    # Against the engine's histograms at the next scrape.
    slot.backend.note_ended(prefilled_tokens(record, slot))
    sample = engine_prefill_sample(record, slot)
    if sample is not None:
        # The engine's own prefill is a TTFT with nothing ahead, no queue and no network
        # in it, however long the request waited: big prompts teach the rate, small ones
        # the fixed cost of a first token.
        model.observe_ttft(sample[0], 0, sample[1])
    elif (
        record.stream
        and not slot.engine_queued
        and record.first_token is not None
        and record.dispatched is not None
    ):
        model.observe_ttft(
            prefilled_tokens(record, slot),
            slot.ahead_tokens,
            record.first_token - record.dispatched,
        )
    slot.backend.refit_prefill_budget()
    tpot_ms = record.tpot_ms
    if tpot_ms is not None:
        model.observe_tpot(tpot_ms / 1000.0, slot.backend.in_flight)
    if record.backend_prompt_tokens is not None and record.prompt_tokens is not None:
        model.observe_prompt_count(record.prompt_tokens, record.backend_prompt_tokens)
    if record.cached_tokens is not None and record.backend_prompt_tokens:
        # Its report, in the gateway's tokens, against the prefix routing sent it for.
        reported = record.cached_tokens * slot.prompt_tokens / record.backend_prompt_tokens
        model.observe_cache(slot.matched_tokens, round(reported))


def prefilled_tokens(record: RequestRecord, slot: Slot) -> int:
    """The prompt tokens the backend really prefilled (not served from its cache), in the
    gateway's count: its own report of cached tokens when it gives one, else routing's
    guess."""
    cached, prompt = record.cached_tokens, record.backend_prompt_tokens
    if cached is not None and prompt:
        return round(slot.prompt_tokens * max(0.0, 1.0 - cached / prompt))
    return slot.prefill_tokens


def engine_prefill_sample(record: RequestRecord, slot: Slot) -> tuple[int, float] | None:
    """(prompt tokens it prefilled, in the gateway's count; seconds) as the engine itself
    timed them; None when it did not. Its own token counts (llama.cpp's `prompt_n` and
    `cache_n`) say which share of the prompt it prefilled."""
    report = record.engine_report
    if report is None or report.prefill_s is None:
        return None
    done = report.prefilled_tokens
    whole = (
        done + report.cached_tokens
        if done is not None and report.cached_tokens is not None
        else record.backend_prompt_tokens
    )
    if done is not None and whole:
        return round(slot.prompt_tokens * min(1.0, done / whole)), report.prefill_s
    return prefilled_tokens(record, slot), report.prefill_s


def split_time(record: RequestRecord, slot: Slot) -> EngineTimings | None:
    """Its backend time as engine queue, prefill and decode; None when no backend answered.

    A retried request's dispatch time is the first backend's: only what the engine
    itself reported is kept then, nothing derived from the gateway's clock. A stream
    with no first token has nothing to split. The learned prefill estimate for its
    prompt goes with the split, whatever its source.
    """
    dispatched = record.dispatched
    if dispatched is None or record.first_byte is None or (record.status or 0) >= 300:
        return None
    prefill_estimate_s = slot.backend.model.prefill_s(prefilled_tokens(record, slot))
    split = _split_time(record, slot, dispatched, prefill_estimate_s)
    if split is None:
        return None
    # Built anew, not dataclasses.replace (its field introspection costs ~3 us a request).
    return EngineTimings(
        split.engine_queue_s, split.prefill_s, split.decode_s, split.source, prefill_estimate_s
    )


def _split_time(
    record: RequestRecord, slot: Slot, dispatched: float, prefill_estimate_s: float
) -> EngineTimings | None:
    model = slot.backend.model
    retried = record.attempts > 1
    first_token = None if retried else record.first_token
    # A stream cut off before its first token: where its time went is not known.
    end = (
        None
        if retried or (record.stream and first_token is None)
        else (record.end if record.stream else record.first_byte)
    )
    ttft_s = None if first_token is None else first_token - dispatched
    backend_s = None if end is None else end - dispatched
    if record.engine_report is not None:
        split = from_report(
            record.engine_report,
            backend_ttft_s=ttft_s,
            backend_s=backend_s,
            prefill_estimate_s=prefill_estimate_s,
        )
        if split is not None:
            return split
    if retried:
        return None
    tokens = record.completion_tokens
    decode_estimate_s = (
        None
        if tokens is None
        else model.tpot_s(max(1, slot.backend.in_flight)) * max(0, tokens - 1)
    )
    window, window_tokens = slot.backend.engine_window, slot.backend.engine_window_tokens
    scale = (
        None
        if window is None or window_tokens is None
        else prefill_scale(window, model.prefill_s(round(window_tokens)))
    )
    if scale is not None:
        return from_window(
            scale,
            prefill_estimate_s=prefill_estimate_s,
            backend_ttft_s=ttft_s,
            backend_s=backend_s,
            decode_estimate_s=decode_estimate_s,
        )
    return estimated(
        prefill_estimate_s=prefill_estimate_s,
        backend_ttft_s=ttft_s,
        backend_s=backend_s,
        decode_estimate_s=decode_estimate_s,
    )
