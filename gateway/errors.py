"""The one exception type every stage raises for a request it must refuse.

It lives outside `http/` so that pure logic (admission, scheduling) can refuse
a request without knowing about aiohttp; `http/errors.py` renders it in the
OpenAI error envelope.
"""

from __future__ import annotations


class GatewayError(Exception):
    """A refusal with the status, OpenAI `code` and log `outcome` it maps to."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        error_type: str | None = None,
        retry_after_s: float | None = None,
        outcome: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.error_type = error_type or _default_type(status)
        self.retry_after_s = retry_after_s
        self.outcome = outcome or f"rejected_{code}"


def _default_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error" if status != 503 else "service_unavailable"
    return "invalid_request_error"


def invalid_request(message: str, param: str | None = None) -> GatewayError:
    """400 for a body the gateway cannot make sense of (the client's mistake)."""
    return GatewayError(400, "invalid_request", message, param=param)
