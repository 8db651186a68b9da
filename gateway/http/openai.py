"""OpenAI-compatible routes."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from gateway.dialects import ChatDialect, CompletionDialect
from gateway.http.errors import error_response
from gateway.http.proxy import request_id_of, route_handler
from gateway.outcomes import NoBackend, Refusal
from gateway.state import GATEWAY
from gateway.upstream.pool import Backend, BackendPool

chat_completions = route_handler(ChatDialect("/v1/chat/completions"))
completions = route_handler(CompletionDialect("/v1/completions"))


async def models(request: web.Request) -> web.Response:
    """The models clients may ask for, in OpenAI's shape.

    One backend and no aliases: its list, passed through as it always was. Otherwise
    the union of one available backend's list per pool (every available backend's in a
    pool whose engines say what they serve: they may list different models), then the
    names the gateway knows besides (served models no engine listed now, engines' lists
    read at the last check, aliases), each id once.
    """
    state = request.app[GATEWAY]
    router = state.pools
    if len(router.pools) == 1 and not router.aliases and len(router.default.pool.backends) <= 1:
        return await pass_through_get(request, "/v1/models")
    try:
        state.keys.identify(request.headers.get("Authorization"))
    except Refusal as refusal:
        return error_response(refusal)
    entries: dict[str, dict[str, Any]] = {}
    asked = [backend for each in router.pools for backend in _listing_backends(each.pool)]
    for listed in await asyncio.gather(*(_engine_models(request, b) for b in asked)):
        for entry in listed:
            entries.setdefault(entry["id"], entry)
    for name in router.listed_names():
        entries.setdefault(
            name, {"id": name, "object": "model", "created": 0, "owned_by": "llm-tail-gateway"}
        )
    return web.json_response({"object": "list", "data": list(entries.values())})


def _listing_backends(pool: BackendPool) -> list[Backend]:
    """Whose `/v1/models` to ask: one available backend per distinct list among those that
    read their engine's (a fleet of replicas of one model costs one call; each not read
    yet is asked), else one available backend."""
    now = pool.clock()
    reading: dict[object, Backend] = {}
    for b in pool.backends:
        if b.served.from_engine and b.available(now):
            reading.setdefault(b.served.names if b.served.known else b.name, b)
    if reading:
        return list(reading.values())
    backend = pool.any_backend()
    return [] if backend is None else [backend]


async def _engine_models(request: web.Request, backend: Backend) -> list[dict[str, Any]]:
    """A backend's `/v1/models` entries; none when it cannot say (down, TGI)."""
    state = request.app[GATEWAY]
    headers = {"X-Request-Id": request_id_of(request)}
    if backend.api_key:
        headers["Authorization"] = f"Bearer {backend.api_key}"
    try:
        response = await state.upstream.get(backend, "/v1/models", headers)
        async with response:
            if response.status != 200:
                return []
            listed = msgspec.json.decode(await response.read())
    except (Refusal, aiohttp.ClientError, TimeoutError, msgspec.DecodeError):
        return []
    data = listed.get("data") if isinstance(listed, dict) else None
    if not isinstance(data, list):
        return []
    return [e for e in data if isinstance(e, dict) and isinstance(e.get("id"), str)]


async def pass_through_get(request: web.Request, path: str) -> web.Response:
    """A GET that needs no slot (model lists, server info), sent to an available backend
    of the default pool (TGI's `/info` answers for the default model)."""
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
