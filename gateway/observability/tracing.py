"""W3C trace context for every request, and optional OpenTelemetry spans made from its record.

Propagation is always on and costs about a microsecond: the client's `traceparent`
is parsed (or a new trace started when it is absent or malformed) and forwarded to
the backend, which vLLM and TGI read, so a backend's spans and logs join the
client's trace; the request log line carries the `trace_id`.

Spans are optional (`[tracing] enabled`, the `tracing` extra). They are not timed
stage by stage: at the end of a request, `RequestTracer.export` builds the whole
tree at once from the `RequestRecord`'s timestamps (explicit start and end times),
so nothing runs per stage and a request that is not sampled costs nothing more. The
catch is that the backend must be told the gateway's span id before that span
exists: `begin` picks the id up front, and `PresetIds`, the provider's id generator,
hands it to the SDK when the root span is finally made. The SDK is imported only
when tracing is asked for; spans leave through a BatchSpanProcessor, whose thread
does the exporting, so a slow or dead collector never delays or fails a request.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from gateway.observability.record import clock
from gateway.observability.trace_context import (
    RANDOM_TRACE_ID,
    ClientParent,
    Headers,
    TraceContext,
    client_parent_of,
    new_span_id,
    new_trace_id,
)

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    from opentelemetry.trace import Span, Tracer

    from gateway.config import TracingSettings
    from gateway.observability.record import RequestRecord


ROOT_SPAN = "gateway.request"
ADMISSION_SPAN = "gateway.admission"
QUEUE_SPAN = "gateway.queue_wait"
BACKEND_TTFT_SPAN = "gateway.backend_ttft"
STREAM_SPAN = "gateway.stream"

#: `service.name` when neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES names one.
DEFAULT_SERVICE_NAME = "llm-tail-gateway"
#: What to run when the SDK is missing. The package is not on any index, so
#: `pip install 'llm-tail-gateway[tracing]'` cannot work; in a clone this does.
TRACING_INSTALL = "make install-tracing (in a clone; or: .venv/bin/pip install -e '.[tracing]')"
#: Longest the shutdown waits for the last spans to leave (a dead collector must not
#: hold a SIGTERM'd gateway for the exporter's 30 s default).
SHUTDOWN_TIMEOUT_S = 5.0


def incoming_trace(headers: Headers, tracer: RequestTracer | None) -> TraceContext:
    """The request's trace context: the client's, continued, or a new trace."""
    parent, state = client_parent_of(headers)
    if tracer is not None:
        try:
            return tracer.begin(parent, state)
        except Exception as error:  # a tracing bug must never fail a request: propagate only
            tracer.failed("begin", error)
    if parent is not None:
        return TraceContext(parent.trace_id, parent.header, state, parent)
    trace_id = new_trace_id()
    return TraceContext(trace_id, f"00-{trace_id}-{new_span_id()}-01")


class PresetIds:
    """The SDK's id generator, able to hand out ids chosen earlier.

    The root span's id was forwarded to the backend long before the span is made,
    and a new trace's id was logged and forwarded too; `preset` them just before
    `start_span` and the SDK takes them. Used on the event loop's thread only.
    """

    def __init__(self) -> None:
        self._trace_id: int | None = None
        self._span_id: int | None = None

    def preset(self, trace_id: int, span_id: int) -> None:
        self._trace_id, self._span_id = trace_id, span_id

    def clear(self) -> None:
        self._trace_id = self._span_id = None

    def generate_trace_id(self) -> int:
        preset, self._trace_id = self._trace_id, None
        return preset if preset is not None else int(new_trace_id(), 16)

    def generate_span_id(self) -> int:
        preset, self._span_id = self._span_id, None
        return preset if preset is not None else int(new_span_id(), 16)

    def is_trace_id_random(self) -> bool:
        # False keeps the flags at the level-1 "sampled" bit the gateway forwards.
        return False


class RequestTracer:
    """Makes each request's span tree, after the fact, from its record."""

    def __init__(self, provider: TracerProvider, ids: PresetIds, events: Any = None) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
        from opentelemetry.trace.status import Status, StatusCode

        self.provider = provider
        self._ids = ids
        self._tracer: Tracer = provider.get_tracer("gateway")
        self._sampler = provider.sampler
        self._set_span_in_context = trace.set_span_in_context
        self._non_recording_span = NonRecordingSpan
        self._span_context = SpanContext
        self._trace_flags = TraceFlags
        self._server_kind = SpanKind.SERVER
        self._error_status = lambda code: Status(StatusCode.ERROR, code)
        self._events = events
        #: Requests whose tracing failed (they were served all the same).
        self.failures = 0

    def failed(self, stage: str, error: Exception) -> None:
        """Count a tracing failure; say so once (not once per request)."""
        self.failures += 1
        if self.failures == 1 and self._events is not None:
            self._events.warning("tracing_failed", stage=stage, error=repr(error)[:200])

    def begin(self, client: ClientParent | None, tracestate: str | None) -> TraceContext:
        """The request's context, with the gateway's span id chosen (and sampled) now."""
        span_id = new_span_id()
        parent_context: Context | None = None
        if client is None:
            trace_id = new_trace_id()
        else:
            trace_id = client.trace_id
            # The tracestate goes to the backend as it came, but not into our spans:
            # the SDK would log a warning for each malformed one, a client could flood it.
            remote = self._span_context(
                int(trace_id, 16),
                int(client.span_id, 16),
                is_remote=True,
                trace_flags=self._trace_flags(client.flags),
            )
            parent_context = self._set_span_in_context(self._non_recording_span(remote))
        decision = self._sampler.should_sample(
            parent_context, int(trace_id, 16), ROOT_SPAN, self._server_kind
        )
        sampled = decision.decision.is_sampled()
        # As the SDK will flag our span: sampled or not, and the parent's random-id bit.
        flags = int(sampled) | (client.flags & RANDOM_TRACE_ID if client is not None else 0)
        return TraceContext(
            trace_id,
            f"00-{trace_id}-{span_id}-{flags:02x}",
            tracestate,
            client,
            span_id,
            sampled,
            parent_context,
        )

    def export(self, record: RequestRecord) -> None:
        """The request's spans, handed to the exporters' queue; never raises."""
        trace = record.trace
        if trace is None or trace.span_id is None or not trace.sampled:
            return
        try:
            self._export(record, trace)
        except Exception as error:  # a tracing bug must never fail a request
            self._ids.clear()
            self.failed("export", error)

    def _export(self, record: RequestRecord, trace: TraceContext) -> None:
        assert trace.span_id is not None
        # perf_counter seconds to epoch ns, with an offset read now (no drift to correct).
        offset_ns = time.time_ns() - time.perf_counter_ns()

        def ns(t: float) -> int:
            return int(t * 1e9) + offset_ns

        end = record.end if record.end is not None else clock()
        self._ids.preset(int(trace.trace_id, 16), int(trace.span_id, 16))
        try:
            root = self._tracer.start_span(
                ROOT_SPAN,
                context=trace.otel_parent,
                kind=self._server_kind,
                attributes=_root_attributes(record),
                start_time=ns(record.arrival),
            )
        finally:
            self._ids.clear()
        if record.status is not None and record.status >= 500:
            root.set_status(self._error_status(record.error_code or str(record.status)))
        inside = self._set_span_in_context(root)

        def child(name: str, start: float, stop: float, attributes: dict[str, Any]) -> Span:
            span = self._tracer.start_span(
                name, context=inside, attributes=attributes, start_time=ns(start)
            )
            span.end(end_time=ns(stop))
            return span

        admitted = record.enqueued if record.enqueued is not None else end
        child(ADMISSION_SPAN, record.arrival, admitted, _present({"gateway.lane": record.lane}))
        if record.enqueued is not None:
            dispatched = record.dispatched if record.dispatched is not None else end
            child(
                QUEUE_SPAN,
                record.enqueued,
                dispatched,
                _present(
                    {
                        "gateway.lane": record.lane,
                        "gateway.predicted_wait_ms": _ms(record.predicted_wait_s),
                        "gateway.deadline_ms": _ms(record.deadline_s),
                    }
                ),
            )
        if record.dispatched is not None:
            first_token = record.first_token if record.first_token is not None else end
            backend = self._tracer.start_span(
                BACKEND_TTFT_SPAN,
                context=inside,
                attributes=_present(
                    {"gateway.backend": record.backend, "gateway.attempts": record.attempts}
                ),
                start_time=ns(record.dispatched),
            )
            if record.first_byte is not None:
                backend.add_event("first_byte", timestamp=ns(record.first_byte))
            backend.end(end_time=ns(first_token))
        if record.first_token is not None:
            child(
                STREAM_SPAN,
                record.first_token,
                end,
                _present({"gen_ai.usage.output_tokens": record.completion_tokens}),
            )
        root.end(end_time=ns(end))

    async def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> bool:
        """Flush and stop the exporters from a daemon thread, waiting at most `timeout_s`:
        a dead collector must neither block the loop nor hold the process's exit."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def stop() -> None:
            try:
                self.provider.shutdown()
            finally:
                loop.call_soon_threadsafe(_resolve, done)

        threading.Thread(target=stop, name="tracing-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout_s)
        except TimeoutError:
            return False
        return True


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def _present(attributes: dict[str, Any]) -> dict[str, Any]:
    """OpenTelemetry refuses None attribute values (with a warning each): leave them out."""
    return {key: value for key, value in attributes.items() if value is not None}


def _root_attributes(record: RequestRecord) -> dict[str, Any]:
    """OpenTelemetry's semantic-convention names where one exists, `gateway.*` otherwise."""
    return _present(
        {
            "gateway.request_id": record.request_id,
            "http.request.method": "POST",
            "http.route": record.route,
            "http.response.status_code": record.status,
            "gateway.lane": record.lane,
            "gateway.backend": record.backend,
            "gateway.client": record.client,
            "gateway.stream": record.stream,
            "gateway.outcome": None if record.outcome is None else str(record.outcome),
            "error.type": record.error_code,
            "gen_ai.request.model": record.model,
            "gen_ai.request.max_tokens": record.max_tokens,
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
        }
    )


# ----------------------------------------------------------------------------- set-up


def make_tracer(
    exporters: Sequence[SpanExporter], *, batch: bool = True, events: Any = None
) -> RequestTracer:
    """A tracer whose spans go to `exporters`: through a BatchSpanProcessor each (its own
    thread, bounded queue), or synchronously (`batch=False`, for tests)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    ids = PresetIds()
    # The sampler comes from OTEL_TRACES_SAMPLER (default: parent-based, always on).
    # Not the global provider: several gateways may share a process (the tests do).
    # PresetIds has IdGenerator's methods; subclassing it would import the SDK with us.
    provider = TracerProvider(
        resource=_resource(os.environ),
        id_generator=cast("IdGenerator", ids),
        shutdown_on_exit=False,
    )
    for exporter in exporters:
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        provider.add_span_processor(processor)
    return RequestTracer(provider, ids, events)


def build_tracer(
    settings: TracingSettings, events: Any, env: Mapping[str, str] | None = None
) -> RequestTracer | None:
    """The tracer the settings and the standard OTEL_* variables ask for, or None.

    None (with a warning saying why) when tracing is off, disabled by OTEL_SDK_DISABLED,
    the SDK is not installed, or no exporter can be made; the gateway then forwards
    `traceparent` all the same.
    """
    if not settings.enabled:
        return None
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        events.warning("tracing_off", reason="OTEL_SDK_DISABLED=true")
        return None
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        events.warning(
            "tracing_off",
            reason="[tracing] enabled is set but opentelemetry-sdk is not installed",
            hint=TRACING_INSTALL,
        )
        return None
    exporters, names = _exporters_from_env(env, events)
    if not exporters:
        events.warning("tracing_off", reason="no span exporter (OTEL_TRACES_EXPORTER)")
        return None
    tracer = make_tracer(exporters, events=events)
    events.info(
        "tracing_on",
        exporters=names,
        sampler=env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on"),
        service_name=tracer.provider.resource.attributes.get("service.name"),
    )
    return tracer


def _exporters_from_env(
    env: Mapping[str, str], events: Any
) -> tuple[list[SpanExporter], list[str]]:
    """The exporters OTEL_TRACES_EXPORTER names (default `otlp`): `otlp` (OTLP over
    http/protobuf, or grpc when OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL says so and its
    package is installed), `console` (to stderr: stdout carries the request log), `none`.
    The OTLP exporter reads its endpoint, headers and timeout from OTEL_EXPORTER_OTLP_*."""
    exporters: list[SpanExporter] = []
    names: list[str] = []
    wanted = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    for name in wanted:
        if name in ("", "none"):
            continue
        exporter = _exporter(name, env, events)
        if exporter is not None:
            exporters.append(exporter)
            names.append(name)
    return exporters, names


def _exporter(name: str, env: Mapping[str, str], events: Any) -> SpanExporter | None:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter(out=sys.stderr)
    if name != "otlp":
        events.warning("tracing_exporter_unknown", exporter=name, known="otlp, console, none")
        return None
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    try:
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter()
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found,unused-ignore]
                OTLPSpanExporter as GrpcSpanExporter,
            )

            exporter: SpanExporter = GrpcSpanExporter()
            return exporter
    except ImportError as missing:
        events.warning(
            "tracing_exporter_unavailable",
            exporter=name,
            protocol=protocol,
            missing=missing.name,
            hint=f"{TRACING_INSTALL}; grpc also needs opentelemetry-exporter-otlp-proto-grpc",
        )
        return None
    events.warning(
        "tracing_exporter_unknown", exporter=name, protocol=protocol, known="http/protobuf, grpc"
    )
    return None


def _resource(env: Mapping[str, str]) -> Any:
    """OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES as the SDK reads them, with this
    gateway's name instead of `unknown_service` when neither names the service."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    resource = Resource.create({})
    named = env.get("OTEL_SERVICE_NAME") or f"{SERVICE_NAME}=" in env.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    if not named:
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource
