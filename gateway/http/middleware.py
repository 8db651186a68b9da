"""Answer aiohttp's own HTTP errors (404, 405, 413 ...) in the OpenAI error envelope too."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

from gateway.errors import GatewayError
from gateway.http.errors import error_response

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
log = structlog.get_logger("gateway")

CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
}


@web.middleware
async def error_envelope(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = CODES.get(exc.status, "invalid_request" if exc.status < 500 else "internal_error")
        message = exc.reason if exc.status != 404 else f"No route {request.method} {request.path}."
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return error_response(GatewayError(exc.status, code, message), headers)
