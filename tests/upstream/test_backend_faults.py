"""The relay against misbehaving backends: stale keep-alive, hangs, broken streams, errors.

Each backend here is a small real server on 127.0.0.1 that misbehaves on purpose.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from msgspec.structs import replace

from gateway.config import Settings
from tests.conftest import StartGateway, chat, sse_events

CHUNK = b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi "},"finish_reason":null}]}\n\n'
USAGE = b'data: {"id":"x","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
DONE = b"data: [DONE]\n\n"


class StaleKeepAliveBackend:
    """Answers the first request on a connection, then closes it when the next one arrives.

    That is what a pooled connection looks like when the backend closed it while
    idle (llama.cpp's server does after 5 s) and the close raced the reuse.
    """

    def __init__(self) -> None:
        self.connections = 0
        self.answered = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served_here = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                if served_here == 1:
                    writer.close()  # closed without an answer
                    return
                body = json.dumps(
                    {
                        "object": "chat.completion",
                        "usage": {"completion_tokens": 1},
                        "choices": [{"message": {"content": "ok"}}],
                    }
                ).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
                served_here += 1
                if head.startswith(b"POST"):  # not the gateway's health checks
                    self.answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def stale_backend() -> AsyncIterator[StaleKeepAliveBackend]:
    backend = StaleKeepAliveBackend()
    yield backend
    await backend.stop()


async def test_a_pooled_connection_closed_by_the_backend_is_retried_not_502(
    stale_backend: StaleKeepAliveBackend, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    url = await stale_backend.start()
    gateway = await start_gateway([url])
    for _ in range(3):
        async with http.post(gateway.url + "/v1/chat/completions", json=chat(max_tokens=1)) as resp:
            assert resp.status == 200, await resp.text()
    assert stale_backend.answered == 3
    assert stale_backend.connections >= 2  # the retries went out on fresh connections


@pytest.fixture
async def fault_backend() -> AsyncIterator[tuple[str, dict[str, int]]]:
    """One backend with a route per fault; counts how handlers ended."""
    seen = {"cancelled": 0}

    async def hang(request: web.Request) -> web.StreamResponse:
        await request.read()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen["cancelled"] += 1
            raise
        return web.Response()

    async def stall_after_headers(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen["cancelled"] += 1
            raise
        return response

    async def break_mid_stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(CHUNK)
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()  # drop the connection mid-stream
        return response

    async def stall_mid_stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(CHUNK)
        await asyncio.sleep(3600)
        return response

    async def usage_split_across_chunks(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        payload = CHUNK + CHUNK + USAGE + DONE
        for i in range(0, len(payload), 7):  # the worst case: 7-byte pieces
            await response.write(payload[i : i + 7])
        return response

    async def overloaded(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(
            {"error": {"message": "busy", "type": "x", "code": 42}}, status=503
        )

    app = web.Application()
    app.router.add_post("/hang/v1/chat/completions", hang)
    app.router.add_post("/stall/v1/chat/completions", stall_after_headers)
    app.router.add_post("/break/v1/chat/completions", break_mid_stream)
    app.router.add_post("/idle/v1/chat/completions", stall_mid_stream)
    app.router.add_post("/split/v1/chat/completions", usage_split_across_chunks)
    app.router.add_post("/busy/v1/chat/completions", overloaded)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), seen
    await server.close()


def short_timeouts(settings: Settings) -> Settings:
    return replace(settings, timeouts=replace(settings.timeouts, first_token_s=0.3, idle_s=0.3))


@pytest.mark.parametrize("fault", ["hang", "stall"])
async def test_no_first_byte_in_time_gives_504_and_closes_the_backend_request(
    fault: str,
    fault_backend: tuple[str, dict[str, int]],
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    base, seen = fault_backend
    gateway = await start_gateway([f"{base}/{fault}"], configure=short_timeouts)
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with http.post(gateway.url + "/v1/chat/completions", json=chat(stream=True)) as resp:
        body = await resp.json()
    assert resp.status == 504 and body["error"]["code"] == "backend_timeout"
    assert 0.25 < loop.time() - started < 2
    await asyncio.sleep(0.2)
    assert seen["cancelled"] == 1  # the backend saw the connection close
    assert gateway.state.scheduler.lane("interactive").in_flight == 0
    assert gateway.request_lines()[0]["outcome"] == "backend_timeout"


async def test_stream_broken_mid_way_ends_with_an_sse_error_event(
    fault_backend: tuple[str, dict[str, int]],
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    base, _ = fault_backend
    gateway = await start_gateway([f"{base}/break"])
    async with http.post(gateway.url + "/v1/chat/completions", json=chat(stream=True)) as resp:
        assert resp.status == 200
        events = sse_events(await resp.read())
    assert events[0]["choices"][0]["delta"]["content"] == "hi "
    assert events[-1]["error"]["code"] == "backend_error"
    line = gateway.request_lines()[0]
    assert line["outcome"] == "backend_error" and line["status"] == 200
    assert gateway.state.scheduler.lane("interactive").in_flight == 0


async def test_stream_silent_past_idle_timeout_ends_with_an_sse_error_event(
    fault_backend: tuple[str, dict[str, int]],
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    base, _ = fault_backend
    gateway = await start_gateway([f"{base}/idle"], configure=short_timeouts)
    async with http.post(gateway.url + "/v1/chat/completions", json=chat(stream=True)) as resp:
        assert resp.status == 200
        events = sse_events(await resp.read())
    assert events[-1]["error"]["code"] == "backend_timeout"
    assert gateway.request_lines()[0]["outcome"] == "backend_timeout"


async def test_usage_event_split_across_tiny_chunks_is_still_found_and_removed(
    fault_backend: tuple[str, dict[str, int]],
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    base, _ = fault_backend
    gateway = await start_gateway([f"{base}/split"])
    async with http.post(gateway.url + "/v1/chat/completions", json=chat(stream=True)) as resp:
        raw = await resp.read()
    assert raw == CHUNK + CHUNK + DONE
    line = gateway.request_lines()[0]
    assert line["completion_tokens"] == 2 and line["outcome"] == "ok"
    assert line["ttft_ms"] is not None


async def test_backend_error_status_is_passed_through(
    fault_backend: tuple[str, dict[str, int]],
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    base, _ = fault_backend
    gateway = await start_gateway([f"{base}/busy"])
    async with http.post(gateway.url + "/v1/chat/completions", json=chat(stream=True)) as resp:
        body = await resp.json()
    assert resp.status == 503
    assert body == {"error": {"message": "busy", "type": "x", "code": 42}}
    assert resp.headers["x-gateway-lane"] == "interactive"
    assert gateway.request_lines()[0]["outcome"] == "backend_error"


async def test_error_event_inside_a_stream_is_relayed_and_logged(
    start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    error = b'data: {"error": {"message": "engine died", "type": "server_error", "code": 500}}\n\n'

    async def failing(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(CHUNK)
        await response.write(error + DONE)
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", failing)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        gateway = await start_gateway([str(server.make_url("")).rstrip("/")])
        async with http.post(gateway.url + "/v1/chat/completions", json=chat(stream=True)) as resp:
            raw = await resp.read()
        assert raw == CHUNK + error + DONE  # unchanged, nothing added
        line = gateway.request_lines()[0]
        assert line["outcome"] == "backend_error" and line["status"] == 200
    finally:
        await server.close()
