"""How a request ended (`Outcome`) and why it was refused (`Refusal` and its kinds).

Every stage that refuses a request raises one of these: admission, the
scheduler, the backend pool, the relay. They carry what the client must be
told (a code, a message, the offending field, when to come back) but never an
HTTP status: only `http/errors.py` maps a code to a status and an envelope,
from one table, so the scheduler and the relay stay free of HTTP and a new
front end (another dialect, a gRPC door) renders the same refusals its own way.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar


class Outcome(StrEnum):
    """The `outcome` of the log line and of the `gateway_requests` metric.

    Values are the strings the log has always had; `rejected_*` are refusals
    at the door, before the request reached a backend.
    """

    OK = "ok"
    CLIENT_DISCONNECTED = "client_disconnected"
    QUEUE_TIMEOUT = "queue_timeout"
    #: Timed out in the queue after keep-alive comments had started its stream: the client
    #: already had a 200, and gets the 503 as the stream's last event. A broken promise
    #: (it was admitted to wait), counted apart from the refusals a client can act on.
    QUEUE_TIMEOUT_IN_STREAM = "queue_timeout_in_stream"
    NO_BACKEND = "no_backend"
    BACKEND_ERROR = "backend_error"
    #: The backend refused the request itself (a 4xx): the client's problem, not the server's.
    BACKEND_REJECTED = "backend_rejected"
    BACKEND_TIMEOUT = "backend_timeout"
    INTERNAL_ERROR = "internal_error"
    REJECTED_INVALID_REQUEST = "rejected_invalid_request"
    REJECTED_UNAUTHORIZED = "rejected_unauthorized"
    REJECTED_LANE_NOT_ALLOWED = "rejected_lane_not_allowed"
    REJECTED_INVALID_LANE = "rejected_invalid_lane"
    REJECTED_REQUEST_TIMEOUT = "rejected_request_timeout"
    REJECTED_UNSUPPORTED_MEDIA_TYPE = "rejected_unsupported_media_type"
    REJECTED_BODY_TOO_LARGE = "rejected_body_too_large"
    REJECTED_PROMPT_TOO_LONG = "rejected_prompt_too_long"
    REJECTED_MAX_TOKENS_TOO_LARGE = "rejected_max_tokens_too_large"
    REJECTED_CONTEXT_LENGTH_EXCEEDED = "rejected_context_length_exceeded"
    REJECTED_QUEUE_FULL = "rejected_queue_full"
    REJECTED_WAIT_TOO_LONG = "rejected_wait_too_long"
    REJECTED_SHUTTING_DOWN = "rejected_shutting_down"
    REJECTED_QUOTA_EXCEEDED = "rejected_quota_exceeded"
    REJECTED_MODEL_NOT_FOUND = "rejected_model_not_found"

    @property
    def counts_against_backend(self) -> bool:
        """Passive health: this outcome says the backend is in trouble."""
        return self in (Outcome.BACKEND_ERROR, Outcome.BACKEND_TIMEOUT)

    @property
    def counts_for_backend(self) -> bool:
        """Passive health: the backend answered as a healthy server does."""
        return self in (Outcome.OK, Outcome.BACKEND_REJECTED)


class Refusal(Exception):
    """A request the gateway will not (or could not) serve, and what to tell its client.

    `code` is the OpenAI envelope's `code`; `param` the offending field;
    `retry_after_s` when the client may come back (sent as `Retry-After`).
    """

    code: ClassVar[str]
    outcome: ClassVar[Outcome]

    def __init__(
        self, message: str, *, param: str | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s


class InvalidRequest(Refusal):
    """A body the gateway cannot make sense of: malformed JSON, wrong types, missing fields."""

    code = "invalid_request"
    outcome = Outcome.REJECTED_INVALID_REQUEST


class Unauthorized(Refusal):
    code = "invalid_api_key"
    outcome = Outcome.REJECTED_UNAUTHORIZED


class LaneNotAllowed(Refusal):
    code = "lane_not_allowed"
    outcome = Outcome.REJECTED_LANE_NOT_ALLOWED


class InvalidLane(Refusal):
    code = "invalid_lane"
    outcome = Outcome.REJECTED_INVALID_LANE


class RequestTimeout(Refusal):
    """The body did not arrive in time."""

    code = "request_timeout"
    outcome = Outcome.REJECTED_REQUEST_TIMEOUT


class UnsupportedMediaType(Refusal):
    code = "unsupported_media_type"
    outcome = Outcome.REJECTED_UNSUPPORTED_MEDIA_TYPE


class BodyTooLarge(Refusal):
    code = "body_too_large"
    outcome = Outcome.REJECTED_BODY_TOO_LARGE


class ModelNotFound(Refusal):
    """No pool serves the request's `model` (nor is it an alias): what OpenAI answers."""

    code = "model_not_found"
    outcome = Outcome.REJECTED_MODEL_NOT_FOUND


class PromptTooLong(Refusal):
    code = "prompt_too_long"
    outcome = Outcome.REJECTED_PROMPT_TOO_LONG


class MaxTokensTooLarge(Refusal):
    code = "max_tokens_too_large"
    outcome = Outcome.REJECTED_MAX_TOKENS_TOO_LARGE


class ContextLengthExceeded(Refusal):
    code = "context_length_exceeded"
    outcome = Outcome.REJECTED_CONTEXT_LENGTH_EXCEEDED


class QueueFull(Refusal):
    code = "queue_full"
    outcome = Outcome.REJECTED_QUEUE_FULL


class WaitTooLong(Refusal):
    """The predicted wait is over the lane's deadline: refused at once, not after it."""

    code = "wait_too_long"
    outcome = Outcome.REJECTED_WAIT_TOO_LONG


class QuotaExceeded(Refusal):
    """Over the API key's requests or tokens per minute; Retry-After: the window's end."""

    code = "quota_exceeded"
    outcome = Outcome.REJECTED_QUOTA_EXCEEDED


class QueueTimeout(Refusal):
    code = "queue_timeout"
    outcome = Outcome.QUEUE_TIMEOUT


class NoBackend(Refusal):
    code = "no_backend"
    outcome = Outcome.NO_BACKEND


class ShuttingDown(Refusal):
    code = "shutting_down"
    outcome = Outcome.REJECTED_SHUTTING_DOWN


class BackendError(Refusal):
    """The backend failed: unreachable, broken answer, or a stream cut short."""

    code = "backend_error"
    outcome = Outcome.BACKEND_ERROR


class BackendTimeout(Refusal):
    code = "backend_timeout"
    outcome = Outcome.BACKEND_TIMEOUT


class InternalError(Refusal):
    """A gateway bug: logged with its traceback, answered with a 500 envelope."""

    code = "internal_error"
    outcome = Outcome.INTERNAL_ERROR


#: Every kind of refusal, for the one code-to-status table (and its completeness test).
REFUSALS: tuple[type[Refusal], ...] = (
    InvalidRequest,
    Unauthorized,
    LaneNotAllowed,
    InvalidLane,
    RequestTimeout,
    UnsupportedMediaType,
    BodyTooLarge,
    PromptTooLong,
    MaxTokensTooLarge,
    ContextLengthExceeded,
    QueueFull,
    WaitTooLong,
    QuotaExceeded,
    QueueTimeout,
    NoBackend,
    ShuttingDown,
    BackendError,
    BackendTimeout,
    InternalError,
)
