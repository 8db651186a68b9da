"""OpenAI-compatible routes."""

from __future__ import annotations

from aiohttp import web

from gateway.dialects import ChatDialect, CompletionDialect
from gateway.http.errors import error_response
from gateway.http.proxy import request_id_of, route_handler
from gateway.outcomes import NoBackend, Refusal
from gateway.state import GATEWAY

chat_completions = route_handler(ChatDialect("/v1/chat/completions"))
completions = route_handler(CompletionDialect("/v1/completions"))


async def models(request: web.Request) -> web.Response:
    """The model list of an available backend, passed through."""
    return await pass_through_get(request, "/v1/models")


async def pass_through_get(request: web.Request, path: str) -> web.Response:
    """A GET that needs no slot (model lists, server info), sent to an available backend."""
    state = request.app[GATEWAY]
    try:
        state.keys.identify(request.headers.get("Authorization"))
        backend = state.pool.any_backend()
        if backend is None:
            raise NoBackend("No healthy backend right now.")
        headers = {"X-Request-Id": request_id_of(request)}
        if backend.api_key:
            headers["Authorization"] = f"Bearer {backend.api_key}"
        response = await state.upstream.get(backend, path, headers)
    except Refusal as refusal:
        return error_response(refusal)
    async with response:
        body = await response.read()
        return web.Response(
            status=response.status,
            body=body,
            content_type=response.content_type or "application/json",
        )
