"""OpenAI-compatible routes."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.admission.admit import CHAT, COMPLETION, RequestShape, measure_openai
from gateway.errors import GatewayError
from gateway.http.errors import error_response
from gateway.http.proxy import Route, proxy, request_id_of
from gateway.state import GATEWAY, GatewayState


async def _measure_chat(body: dict[str, Any], state: GatewayState) -> RequestShape:
    return await measure_openai(body, CHAT, state.settings, state.counter)


async def _measure_completion(body: dict[str, Any], state: GatewayState) -> RequestShape:
    return await measure_openai(body, COMPLETION, state.settings, state.counter)


CHAT_ROUTE = Route("/v1/chat/completions", _measure_chat)
COMPLETION_ROUTE = Route("/v1/completions", _measure_completion)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await proxy(request, request.app[GATEWAY], CHAT_ROUTE)


async def completions(request: web.Request) -> web.StreamResponse:
    return await proxy(request, request.app[GATEWAY], COMPLETION_ROUTE)


async def models(request: web.Request) -> web.Response:
    """The model list of an available backend, passed through."""
    return await pass_through_get(request, "/v1/models")


async def pass_through_get(request: web.Request, path: str) -> web.Response:
    """A GET that needs no slot (model lists, server info), sent to an available backend."""
    state = request.app[GATEWAY]
    backend = state.pool.any_backend()
    if backend is None:
        return error_response(GatewayError(503, "no_backend", "No healthy backend right now."))
    headers = {"X-Request-Id": request_id_of(request)}
    if backend.api_key:
        headers["Authorization"] = f"Bearer {backend.api_key}"
    try:
        response = await state.upstream.get(backend, path, headers)
    except GatewayError as error:
        return error_response(error)
    async with response:
        body = await response.read()
        return web.Response(
            status=response.status,
            body=body,
            content_type=response.content_type or "application/json",
        )
