"""The one map from refusals to HTTP: status, OpenAI error `type`, envelope, SSE error event.

Only this module knows which status a refusal gets. The error table of docs/diagnosing.md
and the OpenAPI document are checked against (or built from) `ERRORS`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import msgspec
from aiohttp import web

from gateway.dialects.base import IN_BAND_FIELDS
from gateway.outcomes import Refusal


class ErrorKind(NamedTuple):
    status: int
    type: str
    #: When the gateway answers with it (docs/diagnosing.md's and the OpenAPI document's words).
    situation: str


_INVALID = "invalid_request_error"
_SERVER = "server_error"
_UNAVAILABLE = "service_unavailable"

#: Every `code` the gateway itself answers with: its status, OpenAI `type` and situation.
ERRORS: dict[str, ErrorKind] = {
    "invalid_request": ErrorKind(
        400, _INVALID, "malformed JSON (or not UTF-8), wrong types, missing `messages`"
    ),
    "invalid_lane": ErrorKind(400, _INVALID, "`X-Gateway-Lane` names no lane"),
    "max_tokens_too_large": ErrorKind(400, _INVALID, "max_tokens over the cap in reject mode"),
    "context_length_exceeded": ErrorKind(
        400, _INVALID, "prompt + max_tokens over the model's context"
    ),
    "invalid_api_key": ErrorKind(
        401, _INVALID, "missing or wrong API key (when keys are configured)"
    ),
    "lane_not_allowed": ErrorKind(
        403, "permission_error", "the key may not use the request's lane"
    ),
    "not_found": ErrorKind(404, _INVALID, "no such route"),
    "model_not_found": ErrorKind(404, _INVALID, "no backend serves the requested model"),
    "method_not_allowed": ErrorKind(405, _INVALID, "another method on this path"),
    "request_timeout": ErrorKind(408, _INVALID, "the body did not arrive within `read_timeout_s`"),
    "prompt_too_long": ErrorKind(413, _INVALID, "prompt over the token cap, or no lane admits it"),
    "body_too_large": ErrorKind(413, _INVALID, "body over the byte limit"),
    "unsupported_media_type": ErrorKind(
        415, _INVALID, "a body declared as non-JSON, or compressed"
    ),
    "queue_full": ErrorKind(429, "rate_limit_error", "the lane's queue is full"),
    "wait_too_long": ErrorKind(
        429, "rate_limit_error", "the predicted wait is over the lane's deadline"
    ),
    "quota_exceeded": ErrorKind(
        429, "rate_limit_error", "over the API key's requests or tokens per minute"
    ),
    "internal_error": ErrorKind(500, _SERVER, "a gateway bug (its log has the traceback)"),
    "backend_error": ErrorKind(502, _SERVER, "backend unreachable / broke before the first byte"),
    "queue_timeout": ErrorKind(503, _UNAVAILABLE, "waited in queue past the lane's timeout"),
    "no_backend": ErrorKind(503, _UNAVAILABLE, "no healthy backend for the lane"),
    "shutting_down": ErrorKind(503, _UNAVAILABLE, "the gateway is shutting down (SIGTERM)"),
    "backend_timeout": ErrorKind(504, _SERVER, "backend sent no first byte in time"),
}
#: Codes whose answers carry `Retry-After`.
RETRY_AFTER_CODES = frozenset(
    {
        "queue_full",
        "wait_too_long",
        "queue_timeout",
        "no_backend",
        "shutting_down",
        "quota_exceeded",
    }
)

#: What a caller should do about each code: the API page's advice
#: (`python -m gateway api-doc`), kept next to the table it must cover.
CALLER_ADVICE: dict[str, str] = {
    "invalid_request": "Fix the request: `param` names the offending field or header. "
    "Do not retry it unchanged.",
    "invalid_lane": "Name one of the lanes the message lists, or drop `X-Gateway-Lane`.",
    "max_tokens_too_large": "Lower `max_tokens` to the cap the message gives, or leave it "
    "out to get the default.",
    "context_length_exceeded": "Shorten the prompt or lower `max_tokens` so that both fit "
    "in the context window (the message has the numbers).",
    "invalid_api_key": "Send `Authorization: Bearer <key>` with a valid key. Retrying with "
    "the same key fails again.",
    "lane_not_allowed": "Make the request smaller (prompt, `max_tokens`, `n`) so that it "
    "fits a lane your key may use, or ask for a key with that lane.",
    "not_found": "Check the path and the base URL (the OpenAI SDKs' `base_url` ends in `/v1`).",
    "model_not_found": "Ask for a model `GET /v1/models` lists (the message names them). "
    "Retrying unchanged fails again.",
    "method_not_allowed": "Use the method the `Allow` header names.",
    "request_timeout": "Send the whole body at once; retry once if the network was slow.",
    "prompt_too_long": "Shorten the prompt: summarize or split the work into several "
    "requests (or lower `max_tokens` / `n` when no lane admits the pair). Retrying "
    "unchanged fails again.",
    "body_too_large": "Send a smaller body: split the work into several requests.",
    "unsupported_media_type": "Send uncompressed JSON with `Content-Type: application/json`.",
    "queue_full": "Retry after `Retry-After` seconds, with jitter and at most a few times; "
    "defer work that can wait.",
    "wait_too_long": "Retry after `Retry-After` seconds. If you sent `x-request-deadline-ms`, "
    "a longer deadline may be admitted now.",
    "quota_exceeded": "Wait for `Retry-After` seconds (the quota's minute ends then); "
    "pace your requests by the `x-ratelimit-remaining-*` headers every answer carries. "
    "A request bigger than the whole token quota never fits: lower `max_tokens`.",
    "internal_error": "Retry once; if it happens again, report it with the `x-request-id`.",
    "backend_error": "Retry with backoff. Nothing was generated; the gateway has already "
    "tried another backend when it had one.",
    "queue_timeout": "Retry after `Retry-After` seconds with backoff: the backends are "
    "saturated. A smaller request goes in a faster lane.",
    "no_backend": "Retry after `Retry-After` seconds (the next health check).",
    "shutting_down": "Retry after `Retry-After` seconds: a load balancer in front sends it "
    "to another instance.",
    "backend_timeout": "The model was too slow to start or stalled: retry later with "
    "backoff, or with a shorter prompt.",
}

#: The response header that names why the gateway itself answered with an error.
REFUSAL_HEADER = "x-gateway-refusal"

_encode = msgspec.json.Encoder().encode


def status_of(refusal: Refusal) -> int:
    return ERRORS[refusal.code].status


def error_body(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """The inside of the envelope: `{"message", "type", "param", "code"}`."""
    return {"message": message, "type": ERRORS[code].type, "param": param, "code": code}


def refusal_body(refusal: Refusal) -> dict[str, Any]:
    return error_body(refusal.code, refusal.message, refusal.param)


def retry_after_seconds(retry_after_s: float) -> int:
    """`Retry-After`'s value: whole seconds (RFC 9110), at least 1."""
    return max(1, math.ceil(retry_after_s))


def in_band_error(
    error: dict[str, Any], *, retry_after_s: float | None, queue_ms: float | None
) -> dict[str, Any]:
    """An error object for a stream whose 200 and headers went out before it failed.

    Its client can read neither `Retry-After` nor `x-gateway-queue-ms`, so the error
    carries them: `retry_after` (the header's whole seconds) and `queue_ms`. Extra
    members are safe: the openai SDK raises `APIError` with the whole object as `body`
    and reads only `message`; `type`, `param` and `code` keep their meaning.
    """
    retry_after, queued = IN_BAND_FIELDS
    extra: dict[str, Any] = {}
    if retry_after_s is not None:
        extra[retry_after] = retry_after_seconds(retry_after_s)
    if queue_ms is not None:
        extra[queued] = round(queue_ms, 1)
    return {**error, **extra}


def error_response(
    refusal: Refusal, headers: Mapping[str, str] | None = None, *, status: int | None = None
) -> web.Response:
    """The refusal as an HTTP answer; `status` only for aiohttp's own errors (431, ...).

    `x-gateway-refusal` names the reason (the error's code) where proxies, load
    balancers and dashboards can read it without parsing the body.
    """
    all_headers = dict(headers or {})
    all_headers[REFUSAL_HEADER] = refusal.code
    if refusal.retry_after_s is not None:
        all_headers["Retry-After"] = str(retry_after_seconds(refusal.retry_after_s))
    return web.Response(
        status=status or status_of(refusal),
        body=_encode({"error": refusal_body(refusal)}),
        content_type="application/json",
        headers=all_headers,
    )
