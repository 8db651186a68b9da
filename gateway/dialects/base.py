"""A `Dialect` is one API the gateway speaks: OpenAI chat, OpenAI completions, TGI.

Dialects differ in how a body is validated and counted, how the backend's body
is shaped (caps in their fields, usage asked for), how the backend's stream is
watched, how an answer's token usage is read and how an error inside a started
stream is written. Everything else (admission policy, lanes, slots, relay,
records) is the same for all, so a route is a path plus its dialect, and
nothing downstream switches on the API's name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import msgspec

from gateway.admission.admit import RequestShape
from gateway.admission.limits import OutputBudget
from gateway.admission.tokens import TokenCounter
from gateway.config import LimitsSettings
from gateway.upstream.engine_timings import EngineReport
from gateway.upstream.seam import REQUEST_SHAPE, Continuation, Seam
from gateway.upstream.sse import StreamWatcher


class Dialect(ABC):
    #: The request type its bodies are validated as.
    request_type: type[msgspec.Struct]

    def __init__(self, backend_path: str) -> None:
        #: Where requests of this dialect go on the backend.
        self.backend_path = backend_path

    @abstractmethod
    async def measure(
        self, body: dict[str, Any], limits: LimitsSettings, counter: TokenCounter
    ) -> RequestShape:
        """Validate `body` (InvalidRequest naming the field) and count its prompt."""

    @abstractmethod
    def backend_body(self, shape: RequestShape, budget: OutputBudget) -> dict[str, Any]:
        """The client's body with the output cap in force (and what the gateway must see)."""

    @abstractmethod
    def stream_watcher(self, shape: RequestShape) -> StreamWatcher:
        """Watches the backend's SSE bytes: first token, end, usage."""

    @abstractmethod
    def completion_tokens(self, body: bytes) -> int | None:
        """Generated tokens, from a whole (non-stream) answer; None when it does not say."""

    def backend_prompt_tokens(self, body: bytes) -> int | None:
        """The backend's count of the prompt, from a whole answer; None when it does not say."""
        return None

    def backend_cached_tokens(self, body: bytes) -> int | None:
        """Prompt tokens the backend served from its cache, from a whole answer; None when
        it does not say."""
        return None

    def engine_report(self, body: bytes) -> EngineReport | None:
        """The engine's own timings of the request, from a whole answer's body (llama.cpp's
        `timings`); None when it has none."""
        return None

    def client_body(self, shape: RequestShape, body: bytes) -> bytes:
        """A whole answer as the client asked for it (only TGI ever changes it)."""
        return body

    # -- resuming an answer on another backend (`upstream/resume.py`) ------------------

    def not_resumable(self, shape: RequestShape) -> str | None:
        """Why a stream of this request could not be continued faithfully elsewhere; None
        when it could (what the client already has is then kept for a seam)."""
        return REQUEST_SHAPE

    def read_seam(self, relayed: bytes) -> Seam:
        """What the client has of the answer, from the events relayed to it."""
        return Seam(obstacle=REQUEST_SHAPE)

    def continuation(
        self, fields: dict[str, Any], seam: Seam, max_tokens: int, engine: str | None
    ) -> dict[str, Any] | None:
        """The backend body that asks `engine` to go on from `seam.sent_text` with `max_tokens`
        more at most; None when that engine's way of continuing is not known."""
        return None

    def end_of_answer(self, seam: Seam, shape: RequestShape) -> bytes | None:
        """The events that end a stream whose backend sent its whole answer but broke off
        before its end marker; None when this API has no such end to add."""
        return None

    def continued_stream(self, seam: Seam, shape: RequestShape) -> Continuation:
        """Rewrites a continuation's events so the client sees one answer."""
        raise NotImplementedError

    @abstractmethod
    def error_event(self, error: dict[str, Any]) -> bytes:
        """The last SSE event of a stream that failed after it started.

        `error` is the envelope's inside (`message`, `type`, `param`, `code`).
        """


#: What an in-band error adds to the envelope's four members, on a stream whose headers
#: went out before it failed (`http.errors.in_band_error`): a dialect that reshapes
#: the error keeps them.
IN_BAND_FIELDS = ("retry_after", "queue_ms")


def sse_event(payload: Any) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"
