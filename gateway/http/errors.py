"""Render refusals in the OpenAI error envelope, as a response or as a final SSE event."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

from aiohttp import web

from gateway.errors import GatewayError


def envelope(error: GatewayError) -> dict[str, dict[str, str | None]]:
    return {
        "error": {
            "message": error.message,
            "type": error.error_type,
            "param": error.param,
            "code": error.code,
        }
    }


def error_response(error: GatewayError, headers: Mapping[str, str] | None = None) -> web.Response:
    all_headers = dict(headers or {})
    if error.retry_after_s is not None:
        all_headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    return web.Response(
        status=error.status,
        body=json.dumps(envelope(error)).encode(),
        content_type="application/json",
        headers=all_headers,
    )


def error_event(error: GatewayError, stream_format: str = "openai") -> bytes:
    """The last event of a stream that failed after it had started.

    TGI clients (huggingface_hub) read a TGI stream's error as a string with an
    `error_type`, so TGI streams get TGI's shape; OpenAI streams the envelope.
    """
    if stream_format == "tgi":
        payload: object = {"error": error.message, "error_type": error.code}
    else:
        payload = envelope(error)
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
