"""[logging] and [tracing]: what the gateway says about itself besides the request lines."""

from __future__ import annotations

from typing import Annotated

import msgspec

from gateway.config.constraints import rule


class LoggingSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    #: Per-request JSON lines go to stdout; this sets the level of the others.
    level: Annotated[
        str, rule("be debug, info, warning or error", pattern="(?i)^(debug|info|warning|error)$")
    ] = "info"


class TracingSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """OpenTelemetry spans of each request (admission, queue wait, backend TTFT, stream).

    Exported as the standard OTEL_* variables say (OTEL_TRACES_EXPORTER,
    OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER; OTEL_SDK_DISABLED
    turns it off); needs the `tracing` extra. Off or on, the client's W3C `traceparent` (or
    a new one) is forwarded to the backend and its trace id logged.
    """

    #: Off by default: an OTEL_* variable injected into every pod must not add span work
    #: to the gateway's hot path unasked; this one switch is what check-config shows.
    enabled: bool = False
