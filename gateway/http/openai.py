"""OpenAI-compatible routes."""

from __future__ import annotations

from functools import partial

from aiohttp import web

from gateway.admission.admit import CHAT, COMPLETION, measure_openai
from gateway.errors import GatewayError
from gateway.http.errors import error_response
from gateway.http.proxy import request_id_of, route_handler
from gateway.state import GATEWAY

chat_completions = route_handler("/v1/chat/completions", partial(measure_openai, kind=CHAT))
completions = route_handler("/v1/completions", partial(measure_openai, kind=COMPLETION))


async def models(request: web.Request) -> web.Response:
    """The model list of an available backend, passed through."""
    return await pass_through_get(request, "/v1/models")


async def pass_through_get(request: web.Request, path: str) -> web.Response:
    """A GET that needs no slot (model lists, server info), sent to an available backend."""
    state = request.app[GATEWAY]
    try:
        state.keys.identify(request.headers.get("Authorization"))
    except GatewayError as error:
        return error_response(error)
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
