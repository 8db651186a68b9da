#!/usr/bin/env python3
"""A fast mock OpenAI backend for overhead benchmarks: it must never be the bottleneck.

Written on raw asyncio protocols (uvloop when installed) instead of aiohttp so
that one stream chunk costs the mock a few microseconds: a benchmark of what a
proxy costs must spend its CPU in the proxy, not in the backend.

`POST /v1/chat/completions` with `"stream": true` answers the way vLLM does:
chunked transfer encoding, one SSE event per token (a role chunk, max_tokens
content chunks, the last with `finish_reason`, a usage-only chunk when
`stream_options.include_usage` is true, then `data: [DONE]`). The delay
between tokens comes from the body field `mock_delay_ms`, else the header
`x-mock-delay-ms`, else `--delay-ms`; `mock_first_token_ms` / `--first-token-ms`
delay the first content token after the role chunk. Delay 0 still yields to
the loop between tokens, so every token is its own write, as on a real engine.
Non-stream requests get one JSON completion. `GET /health` answers 200.

    python scripts/overhead_mock_backend.py --port 8000 [--delay-ms 0] [--no-uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

TOKEN_TEXT = " tok"
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024
JSON_HEADERS = b"Content-Type: application/json\r\n"


def chunk(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk holding one SSE event."""
    event = b"data: " + payload + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


def compact(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def usage_of(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": 10, "total_tokens": tokens + 10, "completion_tokens": tokens}


DONE_CHUNK = chunk(b"[DONE]")
LAST_CHUNK = b"0\r\n\r\n"


class MockServer:
    """Shared settings and counters of the mock."""

    def __init__(self, delay_ms: float, first_token_ms: float) -> None:
        self.delay_ms = delay_ms
        self.first_token_ms = first_token_ms
        self.requests = 0
        self.open_streams = 0


class MockProtocol(asyncio.Protocol):
    """One connection: HTTP/1.1 keep-alive, one request at a time (no pipelining)."""

    def __init__(self, server: MockServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self.writable = asyncio.Event()
        self.writable.set()

    # -- asyncio.Protocol ------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.task is None:
            self._next_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.writable.set()
        if self.task is not None:
            self.task.cancel()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    # -- HTTP ------------------------------------------------------------------
    def _next_request(self) -> None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEADER_BYTES:
                self._fail(431)
            return
        head = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        try:
            method, path, _ = head[0].split(" ", 2)
        except ValueError:
            self._fail(400)
            return
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._fail(411)  # the benchmark's clients and proxies all send Content-Length
            return
        length = int(headers.get("content-length", "0") or 0)
        if length > MAX_BODY_BYTES:
            self._fail(413)
            return
        if len(self.buffer) < end + 4 + length:
            return  # wait for the rest of the body
        body = bytes(self.buffer[end + 4 : end + 4 + length])
        del self.buffer[: end + 4 + length]
        keep_alive = headers.get("connection", "").lower() != "close"
        self.task = asyncio.ensure_future(self._handle(method, path, headers, body, keep_alive))

    def _fail(self, status: int) -> None:
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 %d Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n" % status
        )
        self.transport.close()

    def _send(self, status: int, body: bytes, keep_alive: bool) -> None:
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 %d OK\r\n%sContent-Length: %d\r\n%s\r\n%s"
            % (
                status,
                JSON_HEADERS,
                len(body),
                b"" if keep_alive else b"Connection: close\r\n",
                body,
            )
        )

    async def _handle(
        self, method: str, path: str, headers: dict[str, str], body: bytes, keep_alive: bool
    ) -> None:
        try:
            path = path.split("?", 1)[0]
            if method == "GET" and path in ("/health", "/healthz"):
                self._send(200, b"{}", keep_alive)
            elif method == "GET" and path == "/v1/models":
                self._send(
                    200,
                    b'{"object":"list","data":[{"id":"mock","object":"model","owned_by":"mock"}]}',
                    keep_alive,
                )
            elif method == "GET" and path == "/stats":
                stats = {"requests": self.server.requests, "open_streams": self.server.open_streams}
                self._send(200, json.dumps(stats).encode(), keep_alive)
            elif method == "POST" and path == "/v1/chat/completions":
                self.server.requests += 1
                await self._completion(headers, body, keep_alive)
            else:
                self._send(404, b'{"error":{"message":"not found"}}', keep_alive)
        except asyncio.CancelledError:
            return
        finally:
            self.task = None
        if not keep_alive and self.transport is not None:
            self.transport.close()
        elif not self.closed and self.buffer:
            self._next_request()

    async def _completion(self, headers: dict[str, str], raw: bytes, keep_alive: bool) -> None:
        try:
            body: dict[str, Any] = json.loads(raw)
            tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        except (ValueError, TypeError, AttributeError):
            self._send(400, b'{"error":{"message":"bad request"}}', keep_alive)
            return
        delay_ms = float(
            body.get("mock_delay_ms", headers.get("x-mock-delay-ms", self.server.delay_ms))
        )
        first_ms = float(body.get("mock_first_token_ms", self.server.first_token_ms))
        base: dict[str, Any] = {
            "id": f"chatcmpl-mock{self.server.requests}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": body.get("model") or "mock",
        }
        if not body.get("stream"):
            message = {"role": "assistant", "content": TOKEN_TEXT * tokens}
            whole = {
                **base,
                "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
                "usage": usage_of(tokens),
            }
            if delay_ms > 0:
                await asyncio.sleep(delay_ms * tokens / 1000)
            self._send(200, compact(whole), keep_alive)
            return
        options = body.get("stream_options") or {}
        include_usage = isinstance(options, dict) and options.get("include_usage") is True

        def choice(delta: dict[str, str], finish: str | None) -> bytes:
            extra = {"stop_reason": None} if finish else {}
            item = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}
            return chunk(compact({**base, "choices": [item]}))

        role = choice({"role": "assistant", "content": ""}, None)
        content = choice({"content": TOKEN_TEXT}, None)
        last = choice({"content": TOKEN_TEXT}, "length")
        transport = self.transport
        assert transport is not None
        transport.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
            b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n%s\r\n%s"
            % (b"" if keep_alive else b"Connection: close\r\n", role)
        )
        self.server.open_streams += 1
        try:
            loop = asyncio.get_running_loop()
            start = loop.time() + first_ms / 1000
            step = delay_ms / 1000
            for i in range(tokens):
                if delay_ms > 0 or (i == 0 and first_ms > 0):
                    wait = start + i * step - loop.time()
                    await asyncio.sleep(wait if wait > 0 else 0)
                else:
                    await asyncio.sleep(0)
                if self.closed:
                    return
                if not self.writable.is_set():
                    await self.writable.wait()
                    if self.closed:
                        return
                transport.write(last if i == tokens - 1 else content)
            tail = DONE_CHUNK + LAST_CHUNK
            if include_usage:
                usage: dict[str, Any] = {**base, "choices": [], "usage": usage_of(tokens)}
                tail = chunk(compact(usage)) + tail
            transport.write(tail)
        finally:
            self.server.open_streams -= 1


async def serve(host: str, port: int, server: MockServer) -> None:
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(
        lambda: MockProtocol(server), host, port, backlog=4096, reuse_address=True
    )
    print(f"mock backend on http://{host}:{port}", file=sys.stderr, flush=True)
    async with listener:
        await listener.serve_forever()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--delay-ms", type=float, default=0.0, help="time between tokens")
    parser.add_argument("--first-token-ms", type=float, default=0.0, help="role chunk to token 1")
    parser.add_argument("--no-uvloop", action="store_true", help="use asyncio's own loop")
    args = parser.parse_args()
    server = MockServer(args.delay_ms, args.first_token_ms)
    runner = asyncio.run
    if not args.no_uvloop:
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:
            pass
    try:
        runner(serve(args.host, args.port, server))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
