"""Hugging Face TGI's native routes: /generate, /generate_stream, / (compat), /info.

They go through the same admission as the OpenAI routes: prompt tokens from
`inputs`, `parameters.max_new_tokens` capped and defaulted like max_tokens,
the same lanes, queues and records; TTFT from the first token event.
"""

from __future__ import annotations

from aiohttp import web

from gateway.dialects import TgiDialect
from gateway.http.openai import pass_through_get
from gateway.http.proxy import route_handler

generate = route_handler(TgiDialect("/generate", stream=False))
generate_stream = route_handler(TgiDialect("/generate_stream", stream=True))
#: TGI's `/` takes `"stream"` in the body; huggingface_hub's InferenceClient posts here.
compat = route_handler(TgiDialect("/", stream=None))


async def info(request: web.Request) -> web.Response:
    return await pass_through_get(request, "/info")
