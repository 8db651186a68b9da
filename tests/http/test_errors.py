"""Gateway-produced errors: always the OpenAI envelope, never aiohttp's plain-text pages."""

from __future__ import annotations

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.app import build_app
from gateway.config import BackendSettings, ServerSettings, Settings
from tests.conftest import encoding


async def start(app: web.Application) -> TestServer:
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def test_unknown_route_and_wrong_method_get_envelopes(http: aiohttp.ClientSession) -> None:
    settings = Settings(backends=[BackendSettings(url="http://127.0.0.1:9", name="b")])
    server = await start(build_app(settings, encoding=encoding()))
    try:
        async with http.get(server.make_url("/v1/nothing")) as resp:
            body = await resp.json()
        assert resp.status == 404 and body["error"]["code"] == "not_found"
        assert resp.headers["x-gateway-refusal"] == "not_found"
        async with http.get(server.make_url("/v1/completions")) as resp:
            body = await resp.json()
        assert resp.status == 405 and body["error"]["code"] == "method_not_allowed"
        assert resp.headers["x-gateway-refusal"] == "method_not_allowed"
        assert "POST" in resp.headers["Allow"]
        async with http.post(
            server.make_url("/v1/chat/completions"),
            data=b"{",
            headers={"Content-Type": "application/json"},
        ) as resp:
            body = await resp.json()
        assert resp.status == 400 and resp.headers["x-gateway-refusal"] == "invalid_request"
    finally:
        await server.close()


async def test_a_gateway_bug_is_a_500_envelope_and_a_logged_traceback(
    http: aiohttp.ClientSession, capsys
) -> None:  # type: ignore[no-untyped-def]
    settings = Settings(backends=[BackendSettings(url="http://127.0.0.1:9", name="b")])
    app = build_app(settings, encoding=encoding())

    async def broken(request: web.Request) -> web.Response:
        raise RuntimeError("a bug")

    app.router.add_get("/broken", broken)
    server = await start(app)
    try:
        async with http.get(server.make_url("/broken")) as resp:
            body = await resp.json()
        assert resp.status == 500 and body["error"]["code"] == "internal_error"
        assert "a bug" not in body["error"]["message"]
    finally:
        await server.close()
    assert "RuntimeError: a bug" in capsys.readouterr().err


async def test_body_over_the_byte_limit_is_refused_before_being_read(
    http: aiohttp.ClientSession,
) -> None:
    settings = Settings(
        server=ServerSettings(max_body_bytes=1000),
        backends=[BackendSettings(url="http://127.0.0.1:9", name="b")],
    )
    server = await start(build_app(settings, encoding=encoding()))
    try:
        big = b'{"messages": [{"role": "user", "content": "' + b"x" * 5000 + b'"}]}'
        json_type = {"Content-Type": "application/json"}
        async with http.post(
            server.make_url("/v1/chat/completions"), data=big, headers=json_type
        ) as resp:
            body = await resp.json()
        assert resp.status == 413 and body["error"]["code"] == "body_too_large"

        async def chunks():  # type: ignore[no-untyped-def]
            for _ in range(10):
                yield b"x" * 500  # no Content-Length: chunked, cut off by the reader

        async with http.post(
            server.make_url("/v1/chat/completions"), data=chunks(), headers=json_type
        ) as resp:
            body = await resp.json()
        assert resp.status == 413 and body["error"]["code"] == "body_too_large"
    finally:
        await server.close()


async def test_a_body_declared_as_something_else_than_json_gets_415(
    http: aiohttp.ClientSession,
) -> None:
    settings = Settings(backends=[BackendSettings(url="http://127.0.0.1:9", name="b")])
    server = await start(build_app(settings, encoding=encoding()))
    try:
        body = b'{"messages": [{"role": "user", "content": "hi"}]}'
        async with http.post(
            server.make_url("/v1/chat/completions"),
            data=body,
            headers={"Content-Type": "text/plain"},
        ) as resp:
            answer = await resp.json()
        assert resp.status == 415 and answer["error"]["code"] == "unsupported_media_type"
    finally:
        await server.close()
