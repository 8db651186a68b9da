"""What the gateway's client asks of a backend: bytes it can read, and no stored cookies."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.conftest import StartGateway, chat

ANSWER = {
    "id": "c-1",
    "object": "chat.completion",
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi " * 200}}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 200, "total_tokens": 205},
}
EVENTS = (
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
    + b'data: {"choices":[{"index":0,"delta":{"content":"hi "}}]}\n\n' * 100
    + b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":100}}\n\n'
    + b"data: [DONE]\n\n"
)


@pytest.fixture
async def compressing_backend() -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    """Compresses whatever the client accepts (as a gzip middleware in front would) and
    sets a cookie (as a sticky load balancer would); notes each request's headers."""
    seen: list[dict[str, str]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(dict(request.headers))
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            response.set_cookie("route", "replica-a")
            response.enable_compression()
            await response.prepare(request)
            await response.write(EVENTS)
            await response.write_eof()
            return response
        answer = web.json_response(ANSWER)
        answer.set_cookie("route", "replica-a")
        answer.enable_compression()
        return answer

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    # A host name, not an address: a cookie jar keeps cookies only for names.
    yield f"http://localhost:{server.port}", seen
    await server.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_backend_that_would_compress_answers_in_plain_bytes(
    stream: bool,
    compressing_backend: tuple[str, list[dict[str, str]]],
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    url, seen = compressing_backend
    gateway = await start_gateway([url])
    async with http.post(gateway.url + "/v1/chat/completions", json=chat(stream=stream)) as resp:
        assert resp.status == 200
        assert "Content-Encoding" not in resp.headers
        raw = await resp.read()
    line = gateway.request_lines()[0]
    if stream:
        assert raw.endswith(b"data: [DONE]\n\n")
    else:
        assert (await resp.json())["choices"][0]["message"]["content"].startswith("hi hi")
    assert line["outcome"] == "ok"
    assert line["completion_tokens"] == (100 if stream else 200)
    assert seen[0]["Accept-Encoding"] == "identity"


async def test_a_cookie_a_backend_sets_is_never_sent_with_the_next_request(
    compressing_backend: tuple[str, list[dict[str, str]]],
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    url, seen = compressing_backend
    gateway = await start_gateway([url])
    for _ in range(2):
        async with http.post(gateway.url + "/v1/chat/completions", json=chat()) as resp:
            assert resp.status == 200
            await resp.read()
    assert len(seen) == 2
    assert "Cookie" not in seen[1]
