"""Hugging Face TGI's native routes: /generate, /generate_stream, / (compat), /info.

They go through the same admission as the OpenAI routes: prompt tokens from
`inputs`, `parameters.max_new_tokens` capped and defaulted like max_tokens,
the same lanes, queues and records; TTFT from the first token event.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.admission.admit import RequestShape, measure_tgi
from gateway.http.openai import pass_through_get
from gateway.http.proxy import Route, proxy
from gateway.state import GATEWAY, GatewayState


async def _measure_generate(body: dict[str, Any], state: GatewayState) -> RequestShape:
    return await measure_tgi(body, False, state.settings, state.counter)


async def _measure_generate_stream(body: dict[str, Any], state: GatewayState) -> RequestShape:
    return await measure_tgi(body, True, state.settings, state.counter)


async def _measure_compat(body: dict[str, Any], state: GatewayState) -> RequestShape:
    return await measure_tgi(body, None, state.settings, state.counter)


GENERATE_ROUTE = Route("/generate", _measure_generate)
GENERATE_STREAM_ROUTE = Route("/generate_stream", _measure_generate_stream)
#: TGI's `/` takes `"stream"` in the body; huggingface_hub's InferenceClient posts here.
COMPAT_ROUTE = Route("/", _measure_compat)


async def generate(request: web.Request) -> web.StreamResponse:
    return await proxy(request, request.app[GATEWAY], GENERATE_ROUTE)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    return await proxy(request, request.app[GATEWAY], GENERATE_STREAM_ROUTE)


async def compat(request: web.Request) -> web.StreamResponse:
    return await proxy(request, request.app[GATEWAY], COMPAT_ROUTE)


async def info(request: web.Request) -> web.Response:
    return await pass_through_get(request, "/info")
