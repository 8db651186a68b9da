"""Every error code with what to do about it, and how Retry-After is made.

The rows are `ERRORS` (status, type, situation) with `CALLER_ADVICE` next to it in
`http/errors.py`; the example envelope is a real refusal of the prompt cap.
"""

from __future__ import annotations

import math

import msgspec

from gateway.admission.limits import check_prompt
from gateway.apidoc.markdown import code, fenced, seconds, table
from gateway.config import Settings
from gateway.http.errors import (
    CALLER_ADVICE,
    ERRORS,
    REFUSAL_HEADER,
    RETRY_AFTER_CODES,
    refusal_body,
)
from gateway.http.proxy import shutting_down
from gateway.outcomes import PromptTooLong
from gateway.scheduling.scheduler import MAX_RETRY_AFTER_S

#: The refusals whose Retry-After the scheduler makes from the lane's drain rate.
LANE_CODES = ("queue_full", "wait_too_long", "queue_timeout")


def errors_section(settings: Settings) -> list[str]:
    """One row per code: a caller branches on the code, so each needs its own advice."""
    rows = []
    for error_code, kind in sorted(ERRORS.items(), key=lambda item: item[1].status):
        rows.append(
            (
                code(error_code),
                kind.status,
                code(kind.type),
                "yes" if error_code in RETRY_AFTER_CODES else "",
                kind.situation,
                CALLER_ADVICE[error_code],
            )
        )
    try:
        check_prompt(settings.limits.max_prompt_tokens + 1, settings.limits)
    except PromptTooLong as refusal:
        example = {"error": refusal_body(refusal)}
    else:  # pragma: no cover
        raise AssertionError("the prompt cap admitted a prompt over it")
    envelope = msgspec.json.format(msgspec.json.encode(example), indent=2).decode()
    return [
        "## Errors",
        "",
        "Every error the gateway itself makes is OpenAI's error envelope, on every route "
        f"(TGI's too), and carries `{REFUSAL_HEADER}: <code>`. For example:",
        "",
        *fenced("json", envelope),
        "",
        "`param` names the offending field (`messages[0].content[1].text`) or header. An "
        f"error without `{REFUSAL_HEADER}` comes from the backend and is passed through "
        "with its own status and body (e.g. TGI's 422 for parameters it refuses).",
        "",
        *table(("code", "status", "type", "Retry-After", "when", "what to do"), rows),
    ]


def retry_after_section(settings: Settings) -> list[str]:
    """How each Retry-After is made: a caller that knows it is an estimate adds jitter."""
    draining = shutting_down().retry_after_s
    assert draining is not None
    return [
        "## Retry-After",
        "",
        "Sent with "
        + ", ".join(code(c) for c in sorted(RETRY_AFTER_CODES, key=_status_then_name))
        + ", in whole seconds (at least 1). It is the gateway's estimate of when a retry "
        "can be served, not a constant:",
        "",
        f"- {', '.join(code(c) for c in LANE_CODES)}: the "
        "time the line ahead of you takes to drain at the rate the lane has been "
        "dispatching requests lately (requests ahead ÷ requests dispatched per second, its "
        "own and those of the lanes before it); for `wait_too_long`, less the wait a "
        "request may have (its deadline's share). Before the gateway has measured a rate, "
        f"its predicted wait. At most {MAX_RETRY_AFTER_S} s.",
        f"- `no_backend`: the next health check, {seconds(settings.health.interval_s)}.",
        "- `quota_exceeded`: until the API key's minute window ends (Redis time when "
        "replicas share it).",
        f"- `shutting_down`: {seconds(math.ceil(draining))}; another instance can serve you now.",
        "",
        "Honour it, add jitter (so that refused clients do not come back together) and "
        "bound your retries: two retries with exponential backoff are plenty. A client "
        "that retries at once, without limit, turns one slow moment into an outage. Do "
        "not retry a 4xx other than 408 and 429 unchanged: it fails again. The `openai` "
        "SDKs already retry 408, 429 and 5xx (twice by default) and honour Retry-After; "
        "do not wrap another unbounded loop around them.",
        *_damping(settings),
    ]


def _damping(settings: Settings) -> list[str]:
    """What a retry that comes too soon gets ([retries]); nothing when it is off."""
    retries = settings.retries
    if not (retries.damp and retries.window_s > 0 and retries.max_remembered > 0):
        return []
    tenant_header = (
        f"{code(settings.tenants.header)}, " if settings.tenants.source == "header" else ""
    )
    return [
        "",
        "**A retry that comes too soon is refused again at once.** The gateway remembers "
        f"each request for {seconds(retries.window_s)} after its end (who sent it and a "
        "hash of its body, never the body). The same request again (the same body bytes "
        f"from the same API key, {tenant_header}`x-session-id` or body `user`, or your own "
        "`x-request-id` sent again) before the `Retry-After` of its `queue_full`, "
        "`wait_too_long`, `queue_timeout` or `no_backend` refusal gets "
        "the same code and status at once, with `Retry-After` the time left, and takes no "
        "place in the queue; its message says which request it repeats. A client that "
        "waits its `Retry-After` is never affected. A request with no such identity (the "
        "same body from the same address: two people behind one proxy may send the same "
        "text) is never refused for this.",
    ]


def _status_then_name(error_code: str) -> tuple[int, str]:
    return ERRORS[error_code].status, error_code
