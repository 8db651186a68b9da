"""Answer aiohttp's own HTTP errors (404, 405, 413 ...) in the OpenAI error envelope too.

An unexpected exception (a gateway bug) is logged with its traceback and answered
with a 500 envelope, never with aiohttp's plain-text page.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.http.errors import error_response
from gateway.outcomes import InternalError, InvalidRequest, Refusal
from gateway.state import GATEWAY

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
}


class _HttpError(Refusal):
    """aiohttp's own refusals (no route, wrong method, ...), in the same envelope."""

    outcome = InvalidRequest.outcome

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # type: ignore[misc]


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
        return error_response(_HttpError(code, message), headers, status=exc.status)
    except Exception:
        request.app[GATEWAY].events.exception(
            "unhandled_error", method=request.method, path=request.path
        )
        return error_response(InternalError("The gateway failed on this request; see its log."))
