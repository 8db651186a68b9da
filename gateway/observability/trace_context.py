"""W3C trace context: the client's `traceparent` read, and what the backend is sent.

The propagation half of tracing, always on and free of the OpenTelemetry SDK. It
stands apart from `tracing` (the spans) so that `record`, which carries a request's
`TraceContext`, and `tracing`, which reads a finished `RequestRecord`, do not import
each other.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

#: The trace-flags bits this gateway knows (W3C Trace Context level 2).
SAMPLED = 0x01
RANDOM_TRACE_ID = 0x02


# version-traceid-parentid-flags, lowercase hex only; a future version may append
# "-..." fields. Anchored by fullmatch.
_TRACEPARENT_RE = re.compile(
    r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.DOTALL
)
_ZERO_TRACE_ID = "0" * 32
_ZERO_SPAN_ID = "0" * 16
_VERSION_00_LENGTH = 55


@dataclass(slots=True)
class ClientParent:
    """A valid `traceparent` from the client: the span the gateway's request belongs to."""

    trace_id: str
    span_id: str
    flags: int
    #: The header as it came (forwarded unchanged when the gateway records no span).
    header: str


def parse_traceparent(value: str) -> ClientParent | None:
    """The client's parent span, or None when the header is malformed.

    Strict for version 00 (exactly 55 characters, lowercase hex, ids not all zero)
    and, for higher versions, the spec's forward-compatible reading: the same four
    fields, then the end or a dash; only the sampled flag is kept, and the header
    is forwarded as version 00, the one this gateway speaks. Version ff is invalid.
    """
    match = _TRACEPARENT_RE.fullmatch(value)
    if match is None:
        return None
    version, trace_id, span_id, flags = match.group(1, 2, 3, 4)
    if trace_id == _ZERO_TRACE_ID or span_id == _ZERO_SPAN_ID:
        return None
    if version == "00":
        if len(value) != _VERSION_00_LENGTH:
            return None
        return ClientParent(trace_id, span_id, int(flags, 16), value)
    if version == "ff":
        return None
    sampled = int(flags, 16) & SAMPLED
    return ClientParent(trace_id, span_id, sampled, f"00-{trace_id}-{span_id}-{sampled:02x}")


def new_trace_id() -> str:
    """32 random hex digits, never all zero. `random` (not urandom): no syscall per request,
    and what the OpenTelemetry SDK itself uses; trace ids need spread, not secrecy."""
    return f"{random.getrandbits(128) or 1:032x}"


def new_span_id() -> str:
    return f"{random.getrandbits(64) or 1:016x}"


class Headers(Protocol):
    """The request's headers (aiohttp's CIMultiDictProxy): a header may come several times."""

    def getall(self, key: str, default: Sequence[str], /) -> Sequence[str]: ...


def client_parent_of(headers: Headers) -> tuple[ClientParent | None, str | None]:
    """The client's `traceparent` (None when absent, repeated or malformed) and, with a
    valid one, its `tracestate` (several headers joined with commas, as the spec says).

    A `tracestate` that is not printable ASCII is dropped: it would make the client
    library refuse to send the backend request (header injection), failing the request.
    """
    values = headers.getall(TRACEPARENT, ())
    if len(values) != 1:
        return None, None  # absent, or repeated (the spec's test suite: restart the trace)
    parent = parse_traceparent(values[0])
    if parent is None:
        return None, None  # never read tracestate when traceparent is invalid
    states = headers.getall(TRACESTATE, ())
    if not states:
        return parent, None
    state = states[0] if len(states) == 1 else ",".join(states)
    if not (state.isascii() and state.isprintable()):
        return parent, None
    return parent, state


@dataclass(slots=True)
class TraceContext:
    """The request's place in its trace; what the backend is sent, and what spans need."""

    trace_id: str
    #: The `traceparent` sent to the backend: its parent is the gateway's span when
    #: tracing is on, else the client's span (its header unchanged) or a new one.
    traceparent: str
    #: Forwarded unchanged with a valid client `traceparent`.
    tracestate: str | None = None
    #: The client's span, when it sent a valid `traceparent`.
    client: ClientParent | None = None
    #: The gateway's own span id, chosen up front, when tracing is on.
    span_id: str | None = None
    #: Whether the sampler records this request's spans (decided up front, when on).
    sampled: bool = False
    #: The OpenTelemetry parent context (the client's span), built once, when on.
    otel_parent: Any = None

    def backend_headers(self) -> dict[str, str]:
        if self.tracestate is None:
            return {TRACEPARENT: self.traceparent}
        return {TRACEPARENT: self.traceparent, TRACESTATE: self.tracestate}
