"""The simulator's refusals, each able to render the body its real server would send.

The simulator stands in for vLLM and TGI, so its errors must look like theirs and
not like the gateway's: tests compare the two, and the gateway passes a backend's
errors through. Its own types (rather than the gateway's refusal) keep it an
independent witness, so a change in how the gateway shapes errors cannot quietly
change what the "backend" sends too.
"""

from __future__ import annotations

from typing import Any


class SimulatorError(Exception):
    """A refusal on the OpenAI routes, rendered in the OpenAI error envelope (as vLLM does)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.error_type = error_type or _default_type(status)

    def error(self) -> dict[str, Any]:
        """The inner object: the envelope's value, and a mid-stream SSE error event's."""
        return {
            "message": self.message,
            "type": self.error_type,
            "param": self.param,
            "code": self.code,
        }

    def body(self) -> dict[str, Any]:
        """`{"error": {"message", "type", "param", "code"}}`."""
        return {"error": self.error()}


def _default_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error" if status != 503 else "service_unavailable"
    return "invalid_request_error"


def invalid_request(message: str, param: str | None = None) -> SimulatorError:
    """400 for a body the simulator cannot make sense of."""
    return SimulatorError(400, "invalid_request", message, param=param)


class TgiRejection(Exception):
    """axum's `Json` extractor refusing a body: plain text, before any handler logic runs."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class TgiError(Exception):
    """A TGI `InferError`: rendered as `ErrorResponse`, as JSON or as an SSE event."""

    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message

    def body(self) -> dict[str, str]:
        """`{"error": message, "error_type": kind}`, TGI's `ErrorResponse`."""
        return {"error": self.message, "error_type": self.error_type}


def tgi_validation(message: str) -> TgiError:
    """422 for a request TGI's router validation refuses."""
    return TgiError(422, "validation", f"Input validation error: {message}")
