"""W3C trace context (parse, make, forward) and the spans made from a request's record.

The spans are checked on a real gateway in front of the real simulator, in-process,
with the SDK's InMemorySpanExporter; the simulator app carries a middleware that keeps
the headers each backend request arrived with, so the test sees what vLLM would.
"""

from __future__ import annotations

import re
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from dataclasses import replace as replace_field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace
from multidict import CIMultiDict, CIMultiDictProxy
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.config import Settings, TracingSettings
from gateway.observability.record import RequestRecord, clock
from gateway.observability.trace_context import client_parent_of, parse_traceparent
from gateway.observability.tracing import (
    ADMISSION_SPAN,
    BACKEND_TTFT_SPAN,
    QUEUE_SPAN,
    ROOT_SPAN,
    STREAM_SPAN,
    build_tracer,
    incoming_trace,
    make_tracer,
)
from gateway.tools.simulator import SimulatorConfig
from gateway.tools.simulator.server import build_simulator_app
from tests.conftest import RunningGateway, StartGateway, chat, free_port, sse_events

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
VALID = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
TRACEPARENT_00 = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


def headers(*pairs: tuple[str, str]) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(pairs))


# ----------------------------------------------------------------------------- parsing


def test_a_valid_version_00_header_is_read_and_kept_as_it_came() -> None:
    parent = parse_traceparent(VALID)
    assert parent is not None
    assert (parent.trace_id, parent.span_id, parent.flags, parent.header) == (
        TRACE_ID,
        CLIENT_SPAN,
        1,
        VALID,
    )
    unsampled = parse_traceparent(f"00-{TRACE_ID}-{CLIENT_SPAN}-00")
    assert unsampled is not None and unsampled.flags == 0
    # Unknown flag bits are carried, not refused (a level-2 client sets 0x02).
    assert parse_traceparent(f"00-{TRACE_ID}-{CLIENT_SPAN}-03") is not None


@pytest.mark.parametrize(
    "value",
    [
        "",
        "00",
        f"00-{TRACE_ID}-{CLIENT_SPAN}",  # no flags
        f"00-{TRACE_ID}-{CLIENT_SPAN}-1",  # one flag digit
        f"00-{TRACE_ID}-{CLIENT_SPAN}-01-",  # version 00 has exactly four fields
        f"00-{TRACE_ID}-{CLIENT_SPAN}-01-extra",
        f"00-{TRACE_ID}-{CLIENT_SPAN}-01 ",
        f" 00-{TRACE_ID}-{CLIENT_SPAN}-01",
        f"00-{TRACE_ID[:-1]}-{CLIENT_SPAN}-01",  # short trace id
        f"00-{TRACE_ID}0-{CLIENT_SPAN}-01",  # long trace id
        f"00-{TRACE_ID}-{CLIENT_SPAN[:-1]}-01",
        f"00_{TRACE_ID}_{CLIENT_SPAN}_01",  # wrong separators
        f"00-{TRACE_ID[:-1]}g-{CLIENT_SPAN}-01",  # not hex
        f"00-{TRACE_ID}-{CLIENT_SPAN}-0g",
        f"0-{TRACE_ID}-{CLIENT_SPAN}-01",
        f"000-{TRACE_ID}-{CLIENT_SPAN}-01",
        f"00-{TRACE_ID[:-1]}\u0661-{CLIENT_SPAN}-01",  # an Arabic-Indic digit is no hex
    ],
)
def test_malformed_headers_are_refused(value: str) -> None:
    assert parse_traceparent(value) is None


def test_all_zero_ids_are_invalid() -> None:
    assert parse_traceparent(f"00-{'0' * 32}-{CLIENT_SPAN}-01") is None
    assert parse_traceparent(f"00-{TRACE_ID}-{'0' * 16}-01") is None


@pytest.mark.parametrize(
    "value",
    [
        f"00-{TRACE_ID.upper()}-{CLIENT_SPAN}-01",
        f"00-{TRACE_ID}-{CLIENT_SPAN.upper()}-01",
        f"00-{TRACE_ID}-{CLIENT_SPAN}-0A",
        f"0A-{TRACE_ID}-{CLIENT_SPAN}-01",
    ],
)
def test_uppercase_hex_is_invalid(value: str) -> None:
    """The spec's fields are HEXDIGLC: an uppercase header restarts the trace."""
    assert parse_traceparent(value) is None


def test_version_ff_is_invalid() -> None:
    assert parse_traceparent(f"ff-{TRACE_ID}-{CLIENT_SPAN}-01") is None


@pytest.mark.parametrize(
    ("value", "flags"),
    [
        (f"01-{TRACE_ID}-{CLIENT_SPAN}-01", 1),
        (f"cc-{TRACE_ID}-{CLIENT_SPAN}-01-what-the-future-will-be-like", 1),
        (f"cc-{TRACE_ID}-{CLIENT_SPAN}-08", 0),  # only the sampled bit is understood
        (f"fe-{TRACE_ID}-{CLIENT_SPAN}-09-", 1),
    ],
)
def test_a_future_version_is_read_forward_compatibly_and_sent_on_as_00(
    value: str, flags: int
) -> None:
    parent = parse_traceparent(value)
    assert parent is not None
    assert (parent.trace_id, parent.span_id, parent.flags) == (TRACE_ID, CLIENT_SPAN, flags)
    assert parent.header == f"00-{TRACE_ID}-{CLIENT_SPAN}-{flags:02x}"


@pytest.mark.parametrize(
    "value",
    [
        f"cc-{TRACE_ID}-{CLIENT_SPAN}-01.future",  # the flags must end or be followed by "-"
        f"cc-{TRACE_ID}-{CLIENT_SPAN}-0",  # shorter than 55
        f"cc-{TRACE_ID}-{CLIENT_SPAN}",
    ],
)
def test_a_future_version_still_needs_the_four_fields(value: str) -> None:
    assert parse_traceparent(value) is None


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80) | st.from_regex(r"[0-9a-fA-F]{2}-[0-9a-f]{32}-[0-9a-f]{16}-.{0,6}"))
def test_any_header_gives_a_valid_traceparent_to_forward(value: str) -> None:
    """Whatever the client sends, the backend gets a well-formed version-00 header."""
    context = incoming_trace(headers(("traceparent", value)), None)
    assert TRACEPARENT_00.fullmatch(context.traceparent), context.traceparent
    assert parse_traceparent(context.traceparent) is not None
    assert context.traceparent[3:35] == context.trace_id


# ----------------------------------------------------------------------------- context


def test_without_tracing_the_clients_header_and_tracestate_go_on_unchanged() -> None:
    context = incoming_trace(
        headers(("traceparent", VALID), ("tracestate", "congo=t61rcWkgMzE")), None
    )
    assert context.trace_id == TRACE_ID
    assert context.backend_headers() == {"traceparent": VALID, "tracestate": "congo=t61rcWkgMzE"}


def test_an_absent_or_malformed_header_starts_a_new_sampled_trace() -> None:
    made = [
        incoming_trace(headers(), None),
        incoming_trace(headers(("traceparent", VALID.upper())), None),
        incoming_trace(headers(("traceparent", "garbage"), ("tracestate", "a=b")), None),
    ]
    for context in made:
        parent = parse_traceparent(context.traceparent)
        assert parent is not None and parent.flags == 1
        assert context.client is None
        assert "tracestate" not in context.backend_headers()  # never read after a bad parent
    assert len({c.trace_id for c in made}) == 3


def test_repeated_traceparent_headers_restart_the_trace() -> None:
    parent, state = client_parent_of(headers(("traceparent", VALID), ("traceparent", VALID)))
    assert parent is None and state is None


def test_several_tracestate_headers_are_joined_and_a_hostile_one_dropped() -> None:
    _, state = client_parent_of(
        headers(("traceparent", VALID), ("tracestate", "a=1"), ("tracestate", "b=2"))
    )
    assert state == "a=1,b=2"
    _, state = client_parent_of(headers(("traceparent", VALID), ("tracestate", "a=\x01")))
    assert state is None  # aiohttp's client would refuse to send it: the request would fail


def test_with_tracing_the_backend_is_told_the_gateways_own_span() -> None:
    tracer = make_tracer([InMemorySpanExporter()], batch=False)
    context = incoming_trace(headers(("traceparent", VALID), ("tracestate", "a=1")), tracer)
    parent = parse_traceparent(context.traceparent)
    assert parent is not None
    assert parent.trace_id == TRACE_ID
    assert parent.span_id == context.span_id != CLIENT_SPAN
    assert parent.flags == 1
    assert context.backend_headers()["tracestate"] == "a=1"
    # The client's "not sampled" is honoured (parent-based sampling) and said onwards.
    quiet = incoming_trace(headers(("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN}-00")), tracer)
    assert not quiet.sampled and quiet.traceparent.endswith("-00")


# ----------------------------------------------------------------------------- set-up


@dataclass
class Events:
    """The gateway's event logger, kept: (level, event, fields)."""

    seen: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)

    def info(self, event: str, **fields: Any) -> None:
        self.seen.append(("info", event, fields))

    def warning(self, event: str, **fields: Any) -> None:
        self.seen.append(("warning", event, fields))


ON = TracingSettings(enabled=True)


def test_tracing_is_off_unless_enabled() -> None:
    events = Events()
    assert build_tracer(TracingSettings(), events, env={"OTEL_TRACES_EXPORTER": "console"}) is None
    assert events.seen == []


def test_otel_sdk_disabled_turns_it_off_with_a_warning() -> None:
    events = Events()
    assert build_tracer(ON, events, env={"OTEL_SDK_DISABLED": "TRUE"}) is None
    assert events.seen[0][:2] == ("warning", "tracing_off")


def test_without_the_sdk_the_warning_names_a_command_that_works_in_a_clone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The package is on no index: `pip install 'llm-tail-gateway[tracing]'` cannot work."""
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # the import fails
    events = Events()
    assert build_tracer(ON, events, env={}) is None
    (level, event, fields), *_ = events.seen
    assert (level, event) == ("warning", "tracing_off")
    assert "not installed" in fields["reason"]
    assert fields["hint"].startswith("make install-tracing (in a clone")
    assert ".venv/bin/pip install -e '.[tracing]'" in fields["hint"]
    assert "pip install 'llm-tail-gateway" not in fields["hint"]


def test_exporters_follow_otel_traces_exporter() -> None:
    events = Events()
    assert build_tracer(ON, events, env={"OTEL_TRACES_EXPORTER": "none"}) is None
    assert events.seen[-1][1] == "tracing_off"
    events = Events()
    tracer = build_tracer(ON, events, env={"OTEL_TRACES_EXPORTER": "console,zipkin"})
    assert tracer is not None
    assert ("warning", "tracing_exporter_unknown") in [s[:2] for s in events.seen]
    assert events.seen[-1][:2] == ("info", "tracing_on")
    assert events.seen[-1][2]["exporters"] == ["console"]
    events = Events()
    otlp = build_tracer(ON, events, env={})  # the default exporter is OTLP (http/protobuf)
    assert otlp is not None and events.seen[-1][2]["exporters"] == ["otlp"]
    assert otlp.provider.resource.attributes["service.name"] == "llm-tail-gateway"


async def test_the_config_switch_builds_the_tracer(
    start_gateway: StartGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-gateway")
    gateway = await start_gateway(
        [f"http://127.0.0.1:{free_port()}"],
        configure=lambda s: replace(s, tracing=TracingSettings(enabled=True)),
    )
    tracer = gateway.state.tracer
    assert tracer is not None
    assert tracer.provider.resource.attributes["service.name"] == "edge-gateway"
    off = await start_gateway([f"http://127.0.0.1:{free_port()}"])
    assert off.state.tracer is None


# ----------------------------------------------------------------------------- spans


@dataclass
class RecordingSimulator:
    """The simulator, with the headers each generation request reached it with."""

    url: str
    seen: list[CIMultiDictProxy[str]]

    def headers_for(self, request_id: str) -> CIMultiDictProxy[str]:
        found = [h for h in self.seen if h.get("x-request-id") == request_id]
        assert len(found) == 1, f"{len(found)} backend requests for {request_id}"
        return found[0]


async def start_recording_simulator(**knobs: Any) -> tuple[RecordingSimulator, web.AppRunner]:
    seen: list[CIMultiDictProxy[str]] = []

    @web.middleware
    async def keep_headers(
        request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        if request.method == "POST":
            seen.append(CIMultiDictProxy(request.headers.copy()))
        response: web.StreamResponse = await handler(request)
        return response

    app = build_simulator_app(SimulatorConfig(**knobs))
    app.middlewares.append(keep_headers)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return RecordingSimulator(f"http://127.0.0.1:{runner.addresses[0][1]}", seen), runner


@pytest.fixture
async def simulator() -> AsyncIterator[RecordingSimulator]:
    sim, runner = await start_recording_simulator(step_base_ms=2.0, prefill_ms_per_token=0.01)
    yield sim
    await runner.cleanup()


def by_name(spans: tuple[ReadableSpan, ...] | list[ReadableSpan]) -> dict[str, ReadableSpan]:
    named = {span.name: span for span in spans}
    assert len(named) == len(spans), [s.name for s in spans]
    return named


def duration_ms(span: ReadableSpan) -> float:
    assert span.start_time is not None and span.end_time is not None
    return (span.end_time - span.start_time) / 1e6


async def traced_gateway(
    start_gateway: StartGateway, backend: str, **kwargs: Any
) -> tuple[RunningGateway, InMemorySpanExporter]:
    """A gateway whose tracer exports to memory (synchronously: spans are there at once)."""
    exporter = InMemorySpanExporter()
    gateway = await start_gateway([backend], **kwargs)
    gateway.state.tracer = make_tracer([exporter], batch=False)
    return gateway, exporter


async def test_a_streamed_request_makes_a_root_span_and_four_stages(
    start_gateway: StartGateway, simulator: RecordingSimulator, http: aiohttp.ClientSession
) -> None:
    gateway, exporter = await traced_gateway(start_gateway, simulator.url)
    async with http.post(
        gateway.url + "/v1/chat/completions",
        json=chat(stream=True, max_tokens=6),
        headers={"traceparent": VALID, "tracestate": "congo=t61rcWkgMzE", "x-request-id": "r-1"},
    ) as response:
        assert response.status == 200
        events = sse_events(await response.read())
    assert events[-1] == "[DONE]"
    [line] = gateway.request_lines()
    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == {ROOT_SPAN, ADMISSION_SPAN, QUEUE_SPAN, BACKEND_TTFT_SPAN, STREAM_SPAN}
    root = spans[ROOT_SPAN]

    # Structure: the root is the client's span's child; every stage is the root's child.
    assert root.kind == SpanKind.SERVER
    assert root.parent is not None and root.parent.is_remote
    assert f"{root.parent.span_id:016x}" == CLIENT_SPAN
    assert {f"{s.context.trace_id:032x}" for s in spans.values()} == {TRACE_ID}
    for name in (ADMISSION_SPAN, QUEUE_SPAN, BACKEND_TTFT_SPAN, STREAM_SPAN):
        parent = spans[name].parent
        assert parent is not None and parent.span_id == root.context.span_id
    # The backend was told the root span as its parent; the tracestate went on unchanged.
    sent = simulator.headers_for("r-1")
    assert sent["traceparent"] == f"00-{TRACE_ID}-{root.context.span_id:016x}-01"
    assert sent["tracestate"] == "congo=t61rcWkgMzE"
    assert line["trace_id"] == TRACE_ID

    # Durations are the record's (the log line's), stages tile the root.
    assert duration_ms(root) == pytest.approx(line["e2e_ms"], abs=0.01)
    assert duration_ms(spans[QUEUE_SPAN]) == pytest.approx(line["queue_ms"], abs=0.01)
    assert duration_ms(spans[BACKEND_TTFT_SPAN]) == pytest.approx(line["backend_ttft_ms"], abs=0.01)
    ttft = duration_ms(spans[ADMISSION_SPAN]) + line["queue_ms"] + line["backend_ttft_ms"]
    assert ttft == pytest.approx(line["ttft_ms"], abs=0.01)
    assert spans[ADMISSION_SPAN].start_time == root.start_time
    assert spans[STREAM_SPAN].end_time == root.end_time
    assert spans[QUEUE_SPAN].start_time == spans[ADMISSION_SPAN].end_time
    assert spans[BACKEND_TTFT_SPAN].start_time == spans[QUEUE_SPAN].end_time
    assert spans[STREAM_SPAN].start_time == spans[BACKEND_TTFT_SPAN].end_time
    assert [e.name for e in spans[BACKEND_TTFT_SPAN].events] == ["first_byte"]

    # Attributes.
    attributes = dict(root.attributes or {})
    assert attributes["gateway.request_id"] == "r-1"
    assert attributes["gateway.lane"] == line["lane"] == "interactive"
    assert attributes["gateway.backend"] == line["backend"]
    assert attributes["http.response.status_code"] == 200
    assert attributes["gateway.outcome"] == "ok"
    assert attributes["gen_ai.usage.input_tokens"] == line["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == line["completion_tokens"] == 6
    assert attributes["http.route"] == "/v1/chat/completions"
    assert "error.type" not in attributes
    assert root.status.status_code == StatusCode.UNSET
    assert dict(spans[STREAM_SPAN].attributes or {})["gen_ai.usage.output_tokens"] == 6


async def test_a_request_without_traceparent_is_a_new_root(
    start_gateway: StartGateway, simulator: RecordingSimulator, http: aiohttp.ClientSession
) -> None:
    gateway, exporter = await traced_gateway(start_gateway, simulator.url)
    async with http.post(
        gateway.url + "/v1/completions",
        json={"model": "sim-model", "prompt": "Hi", "max_tokens": 3},
        headers={"x-request-id": "r-2"},
    ) as response:
        assert response.status == 200
    [line] = gateway.request_lines()
    root = by_name(exporter.get_finished_spans())[ROOT_SPAN]
    assert root.parent is None
    trace_id = f"{root.context.trace_id:032x}"
    assert line["trace_id"] == trace_id
    sent = simulator.headers_for("r-2")["traceparent"]
    assert sent == f"00-{trace_id}-{root.context.span_id:016x}-01"


async def test_a_refusal_at_admission_has_only_its_admission_span(
    start_gateway: StartGateway, simulator: RecordingSimulator, http: aiohttp.ClientSession
) -> None:
    gateway, exporter = await traced_gateway(
        start_gateway,
        simulator.url,
        configure=lambda s: replace(s, limits=replace(s.limits, max_prompt_tokens=5)),
    )
    async with http.post(
        gateway.url + "/v1/chat/completions",
        json=chat("a prompt that is far longer than five tokens, surely"),
        headers={"traceparent": VALID},
    ) as response:
        assert response.status == 413
    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == {ROOT_SPAN, ADMISSION_SPAN}
    attributes = dict(spans[ROOT_SPAN].attributes or {})
    assert attributes["http.response.status_code"] == 413
    assert attributes["error.type"] == "prompt_too_long"
    assert attributes["gateway.outcome"] == gateway.request_lines()[0]["outcome"]
    assert spans[ROOT_SPAN].status.status_code == StatusCode.UNSET  # a 4xx is the client's
    assert simulator.seen == []


async def test_no_healthy_backend_marks_the_root_span_as_an_error(
    start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway, exporter = await traced_gateway(start_gateway, f"http://127.0.0.1:{free_port()}")
    async with http.post(
        gateway.url + "/v1/chat/completions",
        json=chat(max_tokens=2),
        headers={"traceparent": VALID},
    ) as response:
        assert response.status == 503
    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == {ROOT_SPAN, ADMISSION_SPAN}
    root = spans[ROOT_SPAN]
    assert root.status.status_code == StatusCode.ERROR
    assert root.status.description == "no_backend"
    assert dict(root.attributes or {})["error.type"] == "no_backend"
    assert spans[ADMISSION_SPAN].end_time == root.end_time


@pytest.fixture
async def failing_backend() -> AsyncIterator[str]:
    """A backend that is healthy but answers every generation with a 500 of its own."""

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def fail(_: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "engine died"}}, status=500)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", fail)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


async def test_a_backend_error_ends_the_backend_stage_without_a_stream(
    start_gateway: StartGateway, failing_backend: str, http: aiohttp.ClientSession
) -> None:
    gateway, exporter = await traced_gateway(start_gateway, failing_backend)
    async with http.post(
        gateway.url + "/v1/chat/completions",
        json=chat(max_tokens=2),
        headers={"traceparent": VALID},
    ) as response:
        assert response.status == 500
    spans = by_name(exporter.get_finished_spans())
    # It got a slot and was sent: queue and backend stages, but no first token, no stream.
    assert set(spans) == {ROOT_SPAN, ADMISSION_SPAN, QUEUE_SPAN, BACKEND_TTFT_SPAN}
    root = spans[ROOT_SPAN]
    assert root.status.status_code == StatusCode.ERROR
    assert dict(root.attributes or {})["http.response.status_code"] == 500
    assert spans[BACKEND_TTFT_SPAN].end_time == root.end_time


async def test_an_unsampled_trace_exports_nothing_and_says_so_onwards(
    start_gateway: StartGateway, simulator: RecordingSimulator, http: aiohttp.ClientSession
) -> None:
    gateway, exporter = await traced_gateway(start_gateway, simulator.url)
    quiet = f"00-{TRACE_ID}-{CLIENT_SPAN}-00"
    async with http.post(
        gateway.url + "/v1/chat/completions",
        json=chat(max_tokens=2),
        headers={"traceparent": quiet, "x-request-id": "r-3"},
    ) as response:
        assert response.status == 200
    assert exporter.get_finished_spans() == ()
    sent = parse_traceparent(simulator.headers_for("r-3")["traceparent"])
    assert sent is not None and sent.trace_id == TRACE_ID and sent.flags == 0
    assert gateway.request_lines()[0]["trace_id"] == TRACE_ID


async def test_without_tracing_the_backend_gets_the_clients_headers_unchanged(
    start_gateway: StartGateway, simulator: RecordingSimulator, http: aiohttp.ClientSession
) -> None:
    gateway = await start_gateway([simulator.url])
    assert gateway.state.tracer is None
    for request_id, sent in (("r-4", VALID), ("r-5", VALID.upper())):
        async with http.post(
            gateway.url + "/v1/chat/completions",
            json=chat(stream=True, max_tokens=2),
            headers={"traceparent": sent, "tracestate": "a=1", "x-request-id": request_id},
        ) as response:
            assert response.status == 200
            await response.read()
    kept, fresh = simulator.headers_for("r-4"), simulator.headers_for("r-5")
    assert (kept["traceparent"], kept["tracestate"]) == (VALID, "a=1")
    made = parse_traceparent(fresh["traceparent"])
    assert made is not None and made.trace_id != TRACE_ID and "tracestate" not in fresh
    lines = {line["request_id"]: line for line in gateway.request_lines()}
    assert lines["r-4"]["trace_id"] == TRACE_ID
    assert lines["r-5"]["trace_id"] == made.trace_id


def test_settings_without_tracing_section_default_off() -> None:
    assert Settings().tracing.enabled is False


def test_a_tracing_failure_never_reaches_the_request_and_is_said_once() -> None:
    events = Events()
    exporter = InMemorySpanExporter()
    tracer = make_tracer([exporter], batch=False, events=events)
    context = incoming_trace(headers(("traceparent", VALID)), tracer)
    broken = replace_field(context, span_id="not hex")  # what a bug upstream could leave
    for _ in range(3):
        record = RequestRecord("r", "/v1/completions", clock(), status=200, end=clock())
        record.trace = broken
        tracer.export(record)  # does not raise
    assert tracer.failures == 3
    assert [e[:2] for e in events.seen] == [("warning", "tracing_failed")]
    assert exporter.get_finished_spans() == ()
    # The next good request is traced as usual (no preset id was left behind).
    record = RequestRecord("r", "/v1/completions", clock(), status=200, end=clock())
    record.trace = incoming_trace(headers(("traceparent", VALID)), tracer)
    tracer.export(record)
    [root] = [s for s in exporter.get_finished_spans() if s.name == ROOT_SPAN]
    assert f"{root.context.span_id:016x}" == record.trace.span_id
