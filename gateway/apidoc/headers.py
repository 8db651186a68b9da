"""The request and response headers: the OpenAPI document's, then the ones it lacks.

The OpenAPI document (`http/openapi.py`) already describes most headers; its words are
reused, and the headers it does not describe yet come from here. Once it does, its
description wins and the entry here is unused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.admission.deadline import DEADLINE_HEADER, MAX_DEADLINE_MS
from gateway.apidoc.markdown import code, count, table
from gateway.config import Settings
from gateway.http.errors import REFUSAL_HEADER

#: Request headers the OpenAPI document does not describe (yet): name, meaning.
EXTRA_REQUEST_HEADERS: tuple[tuple[str, str], ...] = (
    (
        DEADLINE_HEADER,
        f"Your own deadline for the first token, in whole milliseconds (1 to "
        f"{count(MAX_DEADLINE_MS)}). The request's queue deadline becomes the shorter of "
        "its lane's and this one (less its own predicted prefill); one that cannot make it "
        "is refused at once with 429 `wait_too_long`. Not a number: 400 `invalid_request`.",
    ),
    (
        "traceparent",
        "W3C trace context, forwarded to the backend (vLLM and TGI read it) so that your "
        "trace continues through the model server. A new one is made when it is absent or "
        "malformed.",
    ),
    (
        "x-session-id",
        "Names the conversation (or user) the request belongs to: its requests go to the "
        "same backend, whose prefix cache then holds the history (faster first tokens on "
        "later turns). Without it OpenAI's `user` field, else the API key, is used. The "
        "gateway moves a session only when its backend is down or much busier than the "
        "others.",
    ),
    (
        "Content-Type",
        "`application/json` (or none). Bodies must not be compressed (`Content-Encoding`): "
        "415 `unsupported_media_type`.",
    ),
)

#: Response headers the OpenAPI document does not describe (yet): name, meaning.
EXTRA_RESPONSE_HEADERS: tuple[tuple[str, str], ...] = (
    (
        REFUSAL_HEADER,
        "On every error the gateway itself makes: its `code` (`queue_full`, "
        "`prompt_too_long`, ...). An error *without* it is the backend's own answer, "
        "passed through.",
    ),
    (
        "x-ratelimit-limit-requests",
        "Only for an API key with `requests_per_minute`: its requests per minute (this "
        "replica's share of it while Redis is unreachable), as OpenAI sends it. On answers "
        "and refusals once the request passed admission's checks.",
    ),
    (
        "x-ratelimit-remaining-requests",
        "Requests the key may still send in this minute, this one counted.",
    ),
    (
        "x-ratelimit-reset-requests",
        "Time until the minute's window ends and the count starts again, in OpenAI's "
        "format (`59.2s`, `850ms`).",
    ),
    (
        "x-ratelimit-limit-tokens",
        "Only for an API key with `tokens_per_minute`: its tokens per minute (prompt plus "
        "output, in the backend's tokens).",
    ),
    (
        "x-ratelimit-remaining-tokens",
        "Tokens left in this minute after this request's reservation (its prompt and its "
        "whole output budget, n x max_tokens; what it does not use comes back at its end).",
    ),
    (
        "x-ratelimit-reset-tokens",
        "Time until the minute's window ends, as `x-ratelimit-reset-requests`.",
    ),
)

#: What a caller does with a header, by lower-case name.
HEADER_USE: dict[str, str] = {
    "x-request-id": "Send your own to find your request in the gateway's log; quote it in "
    "bug reports.",
    "x-gateway-lane": "Tells you which queue you waited in.",
    "x-gateway-prompt-tokens": "Your prompt's size as the gateway counts it: compare it "
    "with the lanes' bounds.",
    "x-gateway-max-tokens": "Compare with what you asked: the answer stops there "
    '(`finish_reason: "length"`).',
    "x-gateway-max-tokens-clamped-from": "Present means your `max_tokens` was lowered.",
    "x-gateway-queue-ms": "Your queue wait; the rest of the latency is the model's.",
    "server-timing": "Browsers' developer tools show it in the request's timing tab.",
    "retry-after": "Wait at least this long before retrying.",
    REFUSAL_HEADER: "Branch on it without parsing the body.",
    "x-ratelimit-remaining-requests": "Slow down before it reaches 0 instead of meeting "
    "429 `quota_exceeded`.",
    "x-ratelimit-remaining-tokens": "A request needing more than this is refused: lower "
    "`max_tokens`, or wait for the reset.",
    "x-ratelimit-reset-tokens": "When to come back after a 429 `quota_exceeded` (its "
    "`Retry-After` says the same in whole seconds).",
}


def _merged(
    documented: Iterable[tuple[str, str]], extra: Iterable[tuple[str, str]]
) -> list[tuple[str, str]]:
    """The OpenAPI document's headers, then ours it does not describe (its words win)."""
    rows = list(documented)
    known = {name.lower() for name, _ in rows}
    rows += [(name, text) for name, text in extra if name.lower() not in known]
    return rows


def _tenant_header(settings: Settings) -> list[tuple[str, str]]:
    """The header naming a request's tenant, when this gateway reads one."""
    if settings.api_keys or settings.tenants.source != "header":
        return []
    return [
        (
            settings.tenants.header,
            "Names whose request this is (your team, your product): each lane's queue is "
            "shared fairly between the names waiting in it, by the tokens each was served, "
            "so another client's flood does not decide your wait. Without it the request "
            "shares the one tenant `default`.",
        )
    ]


def headers_section(settings: Settings, document: dict[str, Any]) -> list[str]:
    """The headers the gateway reads and writes, with what a caller does with each."""
    operation = document["paths"]["/v1/chat/completions"]["post"]
    documented_requests = [
        (p["name"], p["description"]) for p in operation["parameters"] if p["in"] == "header"
    ]
    bearer = document["components"]["securitySchemes"]["bearerAuth"]["description"]
    here = "required" if settings.api_keys else "not needed (no keys are configured)"
    requests = _merged(
        [("Authorization", f"`Bearer <key>`. {bearer} Here: {here}."), *documented_requests],
        [*EXTRA_REQUEST_HEADERS, *_tenant_header(settings)],
    )
    responses = _merged(
        [
            (name, header["description"])
            for name, header in operation["responses"]["200"]["headers"].items()
        ]
        + [
            (name, header["description"])
            for name, header in document["components"]["headers"].items()
        ],
        EXTRA_RESPONSE_HEADERS,
    )
    return [
        "## Headers",
        "",
        "### Request headers the gateway reads",
        "",
        *table(("header", "meaning"), [(code(name), text) for name, text in requests]),
        "",
        "### Response headers",
        "",
        "On answers and on the gateway's own errors, as far as the request got (an error "
        "at the door has no lane yet):",
        "",
        *table(
            ("header", "meaning", "use"),
            [(code(name), text, HEADER_USE.get(name.lower(), "")) for name, text in responses],
        ),
    ]
