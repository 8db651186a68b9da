"""What one finished request teaches the gateway about the backend that served it.

Called once per request that held a slot, before the slot is given back, so
the backend's stream count is the one the request ran beside. Only clean
samples teach: a stream that answered (not a retry, whose dispatch time is
another backend's), not one that waited in the engine's own queue. A prompt
partly served from the engine's cache teaches by the part it prefilled.
"""

from __future__ import annotations

from gateway.observability.record import RequestRecord
from gateway.outcomes import Outcome
from gateway.upstream.pool import Slot


def learn_from(record: RequestRecord, slot: Slot) -> None:
    model = slot.backend.model
    if record.outcome is not Outcome.OK or record.attempts > 1:
        return
    if (
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
