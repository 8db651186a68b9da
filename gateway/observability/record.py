"""One RequestRecord travels with each request and collects its timings and outcome.

Stages only stamp times and facts on it; the log line and the metrics read it
once, at the end, so every request yields exactly one of each and durations are
computed one way.

Times are `clock()`, in seconds: `time.perf_counter`, monotonic and
sub-microsecond. Not the event loop's `loop.time()`: under uvloop that ticks in
whole milliseconds, which would make every `*_ms` a whole number and a 15 ms
TTFT wrong by up to 7%.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.outcomes import Outcome
from gateway.upstream.engine_timings import EngineReport, EngineTimings

if TYPE_CHECKING:
    from gateway.observability.trace_context import TraceContext

#: The clock of every timestamp on a record (and of the scheduler's estimates).
clock = time.perf_counter


def ms_between(start: float | None, end: float | None) -> float | None:
    """Milliseconds from `start` to `end` (clock() times), rounded to µs; None if unknown."""
    if start is None or end is None:
        return None
    return round((end - start) * 1000.0, 3)


def mean_tpot_ms(first_token: float | None, end: float | None, tokens: int | None) -> float | None:
    """Mean time per output token after the first; None without two tokens."""
    if tokens is None or tokens < 2 or first_token is None or end is None:
        return None
    return round((end - first_token) * 1000.0 / (tokens - 1), 3)


def _seconds_as_ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    route: str
    arrival: float
    model: str | None = None
    #: The pool it went to (`upstream/models.py`: its models joined, `*` for the catch-all);
    #: None: refused before a pool was chosen.
    pool: str | None = None
    #: The API key's name, when keys are configured.
    client: str | None = None
    #: Who the request is for ([tenants]): the key's name, a header's or the body's
    #: `user`, else "default"; and its weight in the lanes' fair share.
    tenant: str | None = None
    tenant_weight: float | None = None
    #: What it was charged in its tenant's fair-share counter: weighted tokens (its
    #: uncached prompt, plus its output tokens times the output weight). None: not served.
    cost_tokens: float | None = None
    stream: bool = False
    lane: str | None = None
    backend: str | None = None
    #: What engine that backend runs ("vllm", "llama.cpp", ...; None: unknown), so a log
    #: read alone can say which engine's settings apply (`gateway analyze`).
    engine: str | None = None
    status: int | None = None
    outcome: Outcome | None = None
    error_code: str | None = None
    prompt_tokens: int | None = None
    #: The backend's own count of the prompt (its `usage.prompt_tokens`), when it says.
    backend_prompt_tokens: int | None = None
    max_tokens_requested: int | None = None
    max_tokens: int | None = None
    completion_tokens: int | None = None
    #: Times it was sent to a backend: 2 when the first failed before its first byte and
    #: it was retried (or it was preempted once and sent again: `preempted`).
    attempts: int = 0
    #: Times the answer was carried over to another backend mid-stream, the backends it
    #: left (in order), why the last time ("broken", "stalled", "drained"), and why a
    #: carry-over that was needed could not be done (`upstream/seam.py`'s reasons).
    resumes: int = 0
    resumed_from: list[str] | None = None
    resume_reason: str | None = None
    resume_failed: str | None = None
    #: Times it was preempted in prefill for a request of a higher lane and sent again
    #: (`scheduling/preemption.py`), and the seconds it had spent at engines before
    #: those preemptions (lost to its first token; its queue wait counts them too).
    preempted: int = 0
    preempted_s: float = 0.0
    #: The queue wait predicted at arrival, and the queue deadline in force (seconds).
    predicted_wait_s: float | None = None
    deadline_s: float | None = None
    #: Of that deadline, the grace a lower lane's next request in line got past its
    #: lane's fitted deadline (`Scheduler._grace_s`; None: none).
    deadline_grace_s: float | None = None
    #: The Retry-After a refusal carried (seconds, before rounding up).
    retry_after_s: float | None = None
    #: Prompt tokens routing expected the backend to have cached, and what the backend
    #: said it had (`usage.prompt_tokens_details.cached_tokens`), when it says.
    cached_tokens_expected: int | None = None
    cached_tokens: int | None = None
    #: Why its backend was chosen: "prefix" (cached there), "session" or "load".
    routed_by: str | None = None
    #: Milliseconds spent getting its slot's lease from Redis ([redis]; None: no lease).
    lease_ms: float | None = None
    #: Tokens its API key's quota reserved for it (prompt + output budget); None: no quota.
    quota_tokens: int | None = None
    #: When the request joined its lane's queue (after admission).
    enqueued: float | None = None
    #: When it got a slot and was sent to the backend.
    dispatched: float | None = None
    first_byte: float | None = None
    first_token: float | None = None
    end: float | None = None
    #: When it repeats a request seen shortly before (`admission/retries.py`): that one's
    #: request_id, the milliseconds from its end to this arrival (None while it was in
    #: flight) and what it got (its refusal code, else its outcome; "in_flight").
    retry_of: str | None = None
    retry_gap_ms: float | None = None
    retried_outcome: str | None = None
    #: Refused at once because it came before its earlier refusal's Retry-After.
    retry_damped: bool = False
    #: What the engine said of the request's time (llama.cpp's `timings`, TGI's headers),
    #: and the split of its backend time (engine queue, prefill, decode) from the best
    #: source there was (`upstream/engine_timings.py`); None: nothing known.
    engine_report: EngineReport | None = None
    timings: EngineTimings | None = None
    #: Its W3C trace context: the client's trace (or a new one) and what the backend is sent.
    trace: TraceContext | None = None

    @property
    def traceparent(self) -> str | None:
        """The `traceparent` header sent to the backend."""
        return None if self.trace is None else self.trace.traceparent

    @property
    def queue_ms(self) -> float | None:
        if self.enqueued is None:
            return None
        return ms_between(
            self.enqueued, self.dispatched if self.dispatched is not None else self.end
        )

    @property
    def backend_ttft_ms(self) -> float | None:
        return ms_between(self.dispatched, self.first_token)

    @property
    def ttft_ms(self) -> float | None:
        return ms_between(self.arrival, self.first_token)

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first; None without two tokens."""
        return mean_tpot_ms(self.first_token, self.end, self.completion_tokens)

    @property
    def e2e_ms(self) -> float | None:
        return ms_between(self.arrival, self.end)

    @property
    def engine_queue_ms(self) -> float | None:
        return None if self.timings is None else _seconds_as_ms(self.timings.engine_queue_s)

    @property
    def prefill_ms(self) -> float | None:
        return None if self.timings is None else _seconds_as_ms(self.timings.prefill_s)

    @property
    def decode_ms(self) -> float | None:
        return None if self.timings is None else _seconds_as_ms(self.timings.decode_s)

    def log_fields(self) -> dict[str, Any]:
        """The per-request log line's fields; absent values stay None (null)."""
        return {
            "request_id": self.request_id,
            "route": self.route,
            "model": self.model,
            "pool": self.pool,
            "client": self.client,
            "tenant": self.tenant,
            "tenant_weight": self.tenant_weight,
            "cost_tokens": self.cost_tokens,
            "stream": self.stream,
            "lane": self.lane,
            "backend": self.backend,
            "engine": self.engine,
            "status": self.status,
            "outcome": self.outcome,
            "error_code": self.error_code,
            "prompt_tokens": self.prompt_tokens,
            "backend_prompt_tokens": self.backend_prompt_tokens,
            "max_tokens_requested": self.max_tokens_requested,
            "max_tokens": self.max_tokens,
            "completion_tokens": self.completion_tokens,
            "attempts": self.attempts,
            "resumes": self.resumes,
            "resumed_from": self.resumed_from,
            "resume_reason": self.resume_reason,
            "resume_failed": self.resume_failed,
            "preempted": self.preempted,
            "preempted_ms": _seconds_as_ms(self.preempted_s) if self.preempted else None,
            "predicted_wait_ms": _seconds_as_ms(self.predicted_wait_s),
            "deadline_ms": _seconds_as_ms(self.deadline_s),
            "deadline_grace_ms": _seconds_as_ms(self.deadline_grace_s),
            "retry_after_s": self.retry_after_s,
            "cached_tokens_expected": self.cached_tokens_expected,
            "cached_tokens": self.cached_tokens,
            "routed_by": self.routed_by,
            "lease_ms": self.lease_ms,
            "quota_tokens": self.quota_tokens,
            "queue_ms": self.queue_ms,
            "backend_ttft_ms": self.backend_ttft_ms,
            "ttft_ms": self.ttft_ms,
            "tpot_ms": self.tpot_ms,
            "e2e_ms": self.e2e_ms,
            "retry_of": self.retry_of,
            "retry_gap_ms": self.retry_gap_ms,
            "retried_outcome": self.retried_outcome,
            "retry_damped": self.retry_damped,
            "engine_queue_ms": self.engine_queue_ms,
            "prefill_ms": self.prefill_ms,
            "decode_ms": self.decode_ms,
            "timing_source": None if self.timings is None else self.timings.source,
            "prefill_estimate_ms": None
            if self.timings is None
            else _seconds_as_ms(self.timings.prefill_estimate_s),
            "trace_id": None if self.trace is None else self.trace.trace_id,
        }
