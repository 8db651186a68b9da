"""Tracing on a real `python -m gateway serve` process.

The backend is the simulator with a middleware that keeps the headers each request
reached it with; the span collector is a small OTLP/HTTP receiver in the test that
decodes what the gateway's real exporter sends. Clients are the `openai` SDK and aiohttp.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from gateway.observability.trace_context import parse_traceparent
from gateway.observability.tracing import (
    ADMISSION_SPAN,
    BACKEND_TTFT_SPAN,
    QUEUE_SPAN,
    ROOT_SPAN,
    STREAM_SPAN,
)
from tests.conftest import chat, free_port, wait_ready
from tests.observability.test_tracing import RecordingSimulator, start_recording_simulator

ROOT = Path(__file__).resolve().parents[2]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
CLIENT_TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@pytest.fixture
async def simulator() -> AsyncIterator[RecordingSimulator]:
    sim, runner = await start_recording_simulator(step_base_ms=2.0, prefill_ms_per_token=0.01)
    yield sim
    await runner.cleanup()


@dataclass
class Collector:
    """An OTLP/HTTP trace receiver: the spans it was sent, with their service name."""

    url: str
    spans: list[dict[str, Any]] = field(default_factory=list)

    def of_trace(self, trace_id: str) -> dict[str, dict[str, Any]]:
        found = [s for s in self.spans if s["trace_id"] == trace_id]
        return {s["name"]: s for s in found}

    async def wait_for(self, trace_id: str, count: int, timeout_s: float = 15.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(self.of_trace(trace_id)) < count:
            assert loop.time() < deadline, f"{self.of_trace(trace_id).keys()} of trace {trace_id}"
            await asyncio.sleep(0.05)


@pytest.fixture
async def collector() -> AsyncIterator[Collector]:
    received = Collector("")

    async def traces(request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest()
        export.ParseFromString(await request.read())
        for resource_spans in export.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.spans.append(
                        {
                            "service": resource.get("service.name"),
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex(),
                            "duration_ms": (span.end_time_unix_nano - span.start_time_unix_nano)
                            / 1e6,
                            "attributes": {a.key: a.value for a in span.attributes},
                        }
                    )
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    received.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield received
    await runner.cleanup()


@dataclass
class GatewayProcess:
    url: str
    process: asyncio.subprocess.Process

    async def request_line(self, timeout_s: float = 10.0) -> dict[str, Any]:
        assert self.process.stdout is not None
        while True:
            raw = await asyncio.wait_for(self.process.stdout.readline(), timeout_s)
            assert raw, "the gateway closed its stdout"
            line: dict[str, Any] = json.loads(raw)
            if line.get("event") == "request":
                return line

    async def stop(self, timeout_s: float = 15.0) -> tuple[int, str]:
        """SIGTERM, and its exit status and stderr (JSON event lines)."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        assert self.process.stderr is not None
        stderr, status = await asyncio.wait_for(
            asyncio.gather(self.process.stderr.read(), self.process.wait()), timeout_s
        )
        return status, stderr.decode()


@pytest.fixture
async def start_gateway_process(
    http: aiohttp.ClientSession,
) -> AsyncIterator[Any]:
    started: list[GatewayProcess] = []

    async def start(
        backend: str, env: Mapping[str, str], *, preamble: str | None = None
    ) -> GatewayProcess:
        port = free_port()
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "OTEL_"))}
        clean |= {"GATEWAY_HEALTH_PROBE_ON_START": "false", **env}
        args = ["serve", "--backend", backend, "--port", str(port)]
        if preamble is None:
            command = [sys.executable, "-m", "gateway", *args]
        else:  # run the CLI after `preamble` (e.g. one that hides a package)
            code = f"{preamble}\nimport sys\nfrom gateway.cli import main\nsys.exit(main({args!r}))"
            command = [sys.executable, "-c", code]
        process = await asyncio.create_subprocess_exec(
            *command,
            cwd=ROOT,
            env=clean,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        gateway = GatewayProcess(f"http://127.0.0.1:{port}", process)
        started.append(gateway)
        await wait_ready(http, gateway.url, timeout_s=30)
        return gateway

    yield start
    for gateway in started:
        if gateway.process.returncode is None:
            gateway.process.kill()
            await gateway.process.wait()


async def test_the_backend_joins_the_clients_trace_and_the_spans_reach_the_collector(
    simulator: RecordingSimulator,
    collector: Collector,
    start_gateway_process: Any,
    http: aiohttp.ClientSession,
) -> None:
    gateway = await start_gateway_process(
        simulator.url,
        {
            "GATEWAY_TRACING_ENABLED": "true",
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
            "OTEL_SERVICE_NAME": "gateway-under-test",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        },
    )
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "Hello there!"}],
        max_tokens=5,
        stream=True,
        extra_headers={
            "traceparent": CLIENT_TRACEPARENT,
            "tracestate": "rojo=00f067aa0ba902b7",
            "x-request-id": "traced-1",
        },
    )
    chunks = [chunk async for chunk in stream]
    assert chunks, "the stream parsed"
    line = await gateway.request_line()
    assert (line["request_id"], line["status"], line["trace_id"]) == ("traced-1", 200, TRACE_ID)

    sent = simulator.headers_for("traced-1")
    forwarded = parse_traceparent(sent["traceparent"])
    assert forwarded is not None
    assert forwarded.trace_id == TRACE_ID
    assert forwarded.span_id != CLIENT_SPAN  # the gateway's own span is the backend's parent
    assert sent["tracestate"] == "rojo=00f067aa0ba902b7"

    await collector.wait_for(TRACE_ID, 5)
    spans = collector.of_trace(TRACE_ID)
    assert set(spans) == {ROOT_SPAN, ADMISSION_SPAN, QUEUE_SPAN, BACKEND_TTFT_SPAN, STREAM_SPAN}
    root = spans[ROOT_SPAN]
    assert root["service"] == "gateway-under-test"
    assert root["parent_span_id"] == CLIENT_SPAN
    assert root["span_id"] == forwarded.span_id
    for name in (ADMISSION_SPAN, QUEUE_SPAN, BACKEND_TTFT_SPAN, STREAM_SPAN):
        assert spans[name]["parent_span_id"] == root["span_id"]
    assert root["duration_ms"] == pytest.approx(line["e2e_ms"], abs=0.01)
    assert spans[BACKEND_TTFT_SPAN]["duration_ms"] == pytest.approx(
        line["backend_ttft_ms"], abs=0.01
    )
    assert root["attributes"]["gateway.request_id"].string_value == "traced-1"
    assert root["attributes"]["http.response.status_code"].int_value == 200

    # A malformed header: a fresh valid trace, never a 4xx or a 500.
    async with http.post(
        gateway.url + "/v1/chat/completions",
        json=chat(max_tokens=3),
        headers={"traceparent": CLIENT_TRACEPARENT.upper(), "x-request-id": "traced-2"},
    ) as response:
        assert response.status == 200
        await response.read()
    line = await gateway.request_line()
    fresh = parse_traceparent(simulator.headers_for("traced-2")["traceparent"])
    assert fresh is not None and fresh.trace_id != TRACE_ID
    assert line["trace_id"] == fresh.trace_id
    await collector.wait_for(fresh.trace_id, 4)  # admission, queue, backend TTFT, stream
    assert collector.of_trace(fresh.trace_id)[ROOT_SPAN]["parent_span_id"] == ""  # a new root

    status, _ = await gateway.stop()
    assert status == 0


@pytest.fixture
async def silent_collector() -> AsyncIterator[str]:
    """A collector that takes connections and never answers (a hung one)."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    for writer in held:
        writer.close()
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize("collector_kind", ["refusing", "silent"])
async def test_a_dead_collector_never_fails_or_holds_a_request(
    simulator: RecordingSimulator,
    start_gateway_process: Any,
    http: aiohttp.ClientSession,
    silent_collector: str,
    collector_kind: str,
) -> None:
    endpoint = (
        f"http://127.0.0.1:{free_port()}" if collector_kind == "refusing" else silent_collector
    )
    gateway = await start_gateway_process(
        simulator.url,
        {
            "GATEWAY_TRACING_ENABLED": "true",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        },
    )

    async def one(i: int) -> int:
        async with http.post(
            gateway.url + "/v1/chat/completions",
            json=chat(max_tokens=3, stream=i % 2 == 0),
            headers={"traceparent": CLIENT_TRACEPARENT},
        ) as response:
            await response.read()
            return response.status

    loop = asyncio.get_running_loop()
    started = loop.time()
    for _ in range(3):  # rounds spaced out so exports are attempted (and fail) between them
        assert await asyncio.gather(*(one(i) for i in range(10))) == [200] * 10
        await asyncio.sleep(0.3)
    assert loop.time() - started < 10
    lines = [await gateway.request_line() for _ in range(30)]
    assert {line["trace_id"] for line in lines} == {TRACE_ID}
    # SIGTERM: the flush of spans nobody takes is cut short (the exporter alone would
    # wait its 10 s timeout per try, 30 s in all); the exit is clean.
    stopping = loop.time()
    status, stderr = await gateway.stop(timeout_s=25)
    assert status == 0, stderr
    assert loop.time() - stopping < 12
    if collector_kind == "silent":
        assert '"tracing_flush_timeout"' in stderr


async def test_without_the_sdk_the_gateway_warns_and_still_propagates(
    simulator: RecordingSimulator, start_gateway_process: Any, http: aiohttp.ClientSession
) -> None:
    gateway = await start_gateway_process(
        simulator.url,
        {"GATEWAY_TRACING_ENABLED": "true"},
        # As if opentelemetry were not installed: every import of it fails.
        preamble="import sys; sys.modules['opentelemetry'] = None",
    )
    async with http.post(
        gateway.url + "/v1/chat/completions",
        json=chat(max_tokens=3),
        headers={"traceparent": CLIENT_TRACEPARENT, "tracestate": "a=1", "x-request-id": "n-1"},
    ) as response:
        assert response.status == 200
    sent = simulator.headers_for("n-1")
    assert (sent["traceparent"], sent["tracestate"]) == (CLIENT_TRACEPARENT, "a=1")
    assert (await gateway.request_line())["trace_id"] == TRACE_ID
    status, stderr = await gateway.stop()
    assert status == 0
    warnings = [json.loads(line) for line in stderr.splitlines() if '"tracing_off"' in line]
    assert len(warnings) == 1 and "not installed" in warnings[0]["reason"]
    assert warnings[0]["hint"].startswith("make install-tracing")
    assert warnings[0]["level"] == "warning"
