"""CORS: let a page on another origin call the gateway and read its headers.

Off unless `[server] cors_origins` lists origins (`["*"]`: any). When on, two hooks:

- a middleware answers preflights (`OPTIONS` with `Origin` and
  `Access-Control-Request-Method`) from an allowed origin on any route the gateway
  has with 204 and the allow headers. Anything else goes on as without CORS: a
  preflight from another origin gets today's 405 envelope and no allow headers.
- an `on_response_prepare` signal adds `Access-Control-Allow-Origin` and
  `Access-Control-Expose-Headers` to every answer to an allowed origin. A signal,
  not a middleware, because SSE streams are prepared (their headers sent) inside the
  relay before any middleware sees the response; the signal runs for those, for
  plain answers and for the error envelope alike.

Why not `aiohttp-cors` (maintained, 0.8.1): it needs every route registered with it
and adds OPTIONS routes of its own; it answers preflights 200 without `Vary: Origin`
and refuses other origins with a plain-text 403 rather than leaving the answer to
the gateway; and it allows only the one method asked for. The rules here fit in a
page, with the status and headers the gateway wants.

The origin is echoed (never `*`), with `Vary: Origin`, so a cache in between keeps
one answer per origin. No `Access-Control-Allow-Credentials`: clients authenticate
with an `Authorization` header, which CORS allows without credentials mode.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from aiohttp import hdrs, web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: Request headers a page may send (beyond the CORS-safelisted ones): what the
#: gateway reads, what the OpenAI JS SDK adds (`x-stainless-*`, `openai-*`), tracing.
ALLOWED_REQUEST_HEADERS = frozenset(
    {
        "authorization",
        "content-type",
        "accept",
        "x-request-id",
        "x-gateway-lane",
        "x-request-deadline-ms",
        "x-session-id",
        "traceparent",
        "tracestate",
    }
)
ALLOWED_REQUEST_HEADER_PREFIXES = ("x-stainless-", "openai-")
#: Response headers a page may read: the gateway's own and what says when to retry.
EXPOSED_HEADERS = (
    "x-request-id",
    "x-gateway-lane",
    "x-gateway-max-tokens",
    "x-gateway-max-tokens-clamped-from",
    "x-gateway-prompt-tokens",
    "x-gateway-queue-ms",
    "x-gateway-refusal",
    "Retry-After",
    "Server-Timing",
    # a key's quota, as OpenAI sends them
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)
#: How long a browser may reuse a preflight's answer (Chromium caps it at 2 h).
MAX_AGE_S = 600
#: A header name (an RFC 9110 token); anything else asked for is not echoed.
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
#: Most header names a preflight's answer echoes.
MAX_REQUESTED_HEADERS = 32


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    """Which origins may call: exact origins (compared case-insensitively) or any."""

    origins: frozenset[str]
    any_origin: bool

    @classmethod
    def from_origins(cls, origins: Iterable[str]) -> CorsPolicy:
        listed = frozenset(o.strip().lower() for o in origins)
        return cls(origins=listed - {"*"}, any_origin="*" in listed)

    @property
    def enabled(self) -> bool:
        return self.any_origin or bool(self.origins)

    def allows(self, origin: str | None) -> bool:
        if not origin:
            return False
        return self.any_origin or origin.lower() in self.origins


def install(app: web.Application, origins: Iterable[str]) -> None:
    """Answer preflights and label answers for `origins`; nothing at all when empty."""
    policy = CorsPolicy.from_origins(origins)
    if not policy.enabled:
        return
    app.middlewares.append(preflight_middleware(policy))

    async def label(request: web.Request, response: web.StreamResponse) -> None:
        label_response(policy, request, response)

    app.on_response_prepare.append(label)


def preflight_middleware(policy: CorsPolicy) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def answer_preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not is_preflight(request) or not policy.allows(request.headers.get(hdrs.ORIGIN)):
            return await handler(request)
        methods = route_methods(request)
        if methods is None:  # no such route: its 404 envelope, as without CORS
            return await handler(request)
        return preflight_response(request, methods)

    return answer_preflight


def is_preflight(request: web.Request) -> bool:
    return (
        request.method == hdrs.METH_OPTIONS
        and hdrs.ORIGIN in request.headers
        and hdrs.ACCESS_CONTROL_REQUEST_METHOD in request.headers
    )


def route_methods(request: web.Request) -> frozenset[str] | None:
    """The methods the requested path answers to; None when no route has that path."""
    match_info = request.match_info
    failure = match_info.http_exception
    if isinstance(failure, web.HTTPMethodNotAllowed):
        return frozenset(failure.allowed_methods)
    if failure is not None:
        return None
    resource = match_info.route.resource
    if resource is None:
        return None
    return frozenset(route.method for route in resource if route.method != hdrs.METH_ANY)


def preflight_response(request: web.Request, methods: frozenset[str]) -> web.Response:
    """204 with what the browser needs to send the real request (the origin is added
    by the signal, as on every answer)."""
    headers: dict[str, str] = {
        hdrs.ACCESS_CONTROL_ALLOW_METHODS: ", ".join(sorted(methods | {hdrs.METH_OPTIONS})),
        hdrs.ACCESS_CONTROL_MAX_AGE: str(MAX_AGE_S),
    }
    asked = allowed_request_headers(request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_HEADERS, ""))
    if asked:
        headers[hdrs.ACCESS_CONTROL_ALLOW_HEADERS] = ", ".join(asked)
    # Chromium's Private Network Access: a public page calling a gateway on a private address.
    if request.headers.get("Access-Control-Request-Private-Network", "").lower() == "true":
        headers["Access-Control-Allow-Private-Network"] = "true"
    return web.Response(status=204, headers=headers)


def allowed_request_headers(requested: str) -> list[str]:
    """The headers asked for that a page may send, in the browser's own spelling."""
    names = [name.strip() for name in requested.split(",")][:MAX_REQUESTED_HEADERS]
    return [name for name in names if _TOKEN.match(name) and is_allowed_request_header(name)]


def is_allowed_request_header(name: str) -> bool:
    lowered = name.lower()
    return lowered in ALLOWED_REQUEST_HEADERS or lowered.startswith(ALLOWED_REQUEST_HEADER_PREFIXES)


def label_response(policy: CorsPolicy, request: web.Request, response: web.StreamResponse) -> None:
    """An answer to an allowed origin says so and lets the page read the gateway's headers.

    Every answer varies by Origin once CORS is on, the refused origin's too.
    """
    add_vary_origin(response)
    origin = request.headers.get(hdrs.ORIGIN)
    if not policy.allows(origin):
        return
    assert origin is not None
    response.headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = origin
    response.headers[hdrs.ACCESS_CONTROL_EXPOSE_HEADERS] = ", ".join(EXPOSED_HEADERS)


def add_vary_origin(response: web.StreamResponse) -> None:
    vary = response.headers.get(hdrs.VARY)
    if vary is None:
        response.headers[hdrs.VARY] = "Origin"
    elif "origin" not in (part.strip().lower() for part in vary.split(",")) and vary != "*":
        response.headers[hdrs.VARY] = f"{vary}, Origin"
