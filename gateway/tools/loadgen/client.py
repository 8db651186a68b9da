"""The load generator's client: streams each planned request and times it as the user feels it.

Every request is timed from the client's side of the wire (first send → first
content token, → end), because that is the promise the gateway makes; its own
headers (lane, queue wait) are kept next to the client's numbers to explain
them. Errors are read the way the gateway reports them: the OpenAI envelope
before the stream, or a final SSE error event once it has started.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp

from gateway.tools.loadgen.mix import PlannedRequest
from gateway.tools.loadgen.prompts import with_run_tag

#: Statuses worth retrying: overload (429, 503), and a gateway/proxy that lost the backend.
RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})
#: Most bytes of an error body kept (error envelopes are small; HTML error pages are not).
MAX_ERROR_BODY = 64 * 1024
MAX_ERROR_MESSAGE = 300


@dataclass(slots=True)
class RetryPolicy:
    """Client retries: exponential backoff with full jitter, at least any `Retry-After`.

    `eager_share` of the requests (chosen by their index, the same in every run) stand
    for the clients that retry at once, with no backoff and no regard for Retry-After,
    up to `eager_attempts` attempts in all: what makes a retry storm.
    """

    max_attempts: int = 1
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    eager_share: float = 0.0
    #: Attempts in all of an eager request; None: `max_attempts`.
    eager_attempts: int | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or (self.eager_attempts is not None and self.eager_attempts < 1):
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("backoff times must be >= 0")
        if not 0.0 <= self.eager_share <= 1.0:
            raise ValueError(f"eager_share must be from 0 to 1, got {self.eager_share}")

    def eager(self, index: int) -> bool:
        """Whether request `index` is sent by a client that retries at once."""
        return self.eager_share > 0 and random.Random(index).random() < self.eager_share

    def attempts(self, eager: bool) -> int:
        if eager and self.eager_attempts is not None:
            return self.eager_attempts
        return self.max_attempts

    def delay_s(self, retry: int, retry_after_s: float | None, rng: random.Random) -> float:
        """Wait before retry number `retry` (1 for the first retry)."""
        ceiling = min(self.max_backoff_s, self.backoff_s * 2 ** (retry - 1))
        delay = rng.uniform(0.0, ceiling)
        if retry_after_s is not None:
            delay = max(delay, retry_after_s)
        return delay


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; durations in ms, None when absent (never made up)."""

    index: int
    cls: str
    prompt_tokens: int
    max_tokens: int
    request_id: str
    #: Planned and actual first-send offsets from the start of the run.
    scheduled_ms: float
    sent_ms: float | None = None
    #: Status of the last attempt; None when no HTTP answer came (connection error, timeout).
    status: int | None = None
    #: From the OpenAI error envelope, a mid-stream SSE error event, or the client itself
    #: (`connection_error`, `client_timeout`, `stream_truncated`).
    error_code: str | None = None
    error_message: str | None = None
    #: First send → first non-empty content chunk.
    ttft_ms: float | None = None
    #: (last token − first token) / (completion_tokens − 1).
    tpot_ms: float | None = None
    #: First send → end of the last attempt's answer (includes any retry waits).
    e2e_ms: float | None = None
    #: From the usage chunk; None when the server sent none.
    completion_tokens: int | None = None
    #: Chunks with content: a stand-in for tokens when the server sends no usage.
    content_chunks: int = 0
    lane: str | None = None
    queue_ms: float | None = None
    #: The last `Retry-After` seen over all attempts, in seconds.
    retry_after_s: float | None = None
    attempts: int = 0
    #: Sent by a client that retries at once, without backoff (`RetryPolicy.eager_share`).
    eager: bool = False
    #: Last attempt's send → its 4xx/5xx answer: how fast the server said no.
    reject_ms: float | None = None
    #: A multi-turn conversation's id and 1-based turn (None for a request of its own).
    conversation: str | None = None
    turn: int | None = None
    #: Prompt tokens the backend served from its prefix cache, from the usage's
    #: `prompt_tokens_details.cached_tokens` (OpenAI, vLLM); None when it said nothing.
    cached_tokens: int | None = None
    #: The streamed content, kept only for conversation turns (the next turn resends it).
    reply: str | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error_code is None

    @property
    def tokens(self) -> int:
        """Completion tokens, from usage when present, else counted content chunks."""
        return self.completion_tokens if self.completion_tokens is not None else self.content_chunks


@dataclass(slots=True)
class RunResult:
    """All results of one run against one target."""

    target: str
    results: list[RequestResult]
    wall_s: float
    #: The digits written into every prompt's opening for this run (defeats prefix caches).
    run_tag: str = ""


def chat_url(target: str) -> str:
    """Accept a base URL, a `/v1` URL, or the full route."""
    base = target.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    if base.endswith("/v1"):
        return base + "/chat/completions"
    return base + "/v1/chat/completions"


@dataclass(slots=True)
class _Attempt:
    """What one HTTP attempt produced; folded into the request's result."""

    status: int | None = None
    error_code: str | None = None
    error_message: str | None = None
    retry_after_s: float | None = None
    retryable: bool = False
    first_token: float | None = None
    last_token: float | None = None
    end: float | None = None
    completion_tokens: int | None = None
    content_chunks: int = 0
    lane: str | None = None
    queue_ms: float | None = None
    cached_tokens: int | None = None
    #: The content chunks, collected when the reply is kept.
    reply_parts: list[str] | None = None


class Client:
    """Shared state of one run: session, URL, body template, clock, retry randomness."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        target: str,
        *,
        retry: RetryPolicy,
        timeout_s: float,
        model: str,
        extra_body: dict[str, Any] | None,
        run_tag: str,
    ) -> None:
        self.session = session
        self.url = chat_url(target)
        self.retry = retry
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.model = model
        self.extra_body = dict(extra_body or {})
        self.run_tag = run_tag
        self.loop = asyncio.get_running_loop()
        self.start = self.loop.time()
        self.rng = random.Random()

    def body(self, planned: PlannedRequest, messages: list[dict[str, str]] | None = None) -> bytes:
        """The chat body: the planned prompt as one user message, or a conversation's
        `messages` (then OpenAI's `user` field names the conversation, as a chat app's
        end-user id would)."""
        if messages is None:
            messages = [{"role": "user", "content": with_run_tag(planned.prompt, self.run_tag)}]
        session = {"user": planned.conversation} if planned.conversation is not None else {}
        return json.dumps(
            {
                "model": self.model,
                "messages": messages,
                "max_tokens": planned.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
                **session,
                **self.extra_body,
            }
        ).encode()

    async def send(
        self, planned: PlannedRequest, messages: list[dict[str, str]] | None = None
    ) -> RequestResult:
        """Send with retries; TTFT and e2e count from the first attempt's send.

        With `messages` (a conversation's turn) the reply's text is kept in the result;
        a turn's conversation id goes out as `x-session-id` and in the body's `user`.
        """
        result = RequestResult(
            index=planned.index,
            cls=planned.cls,
            prompt_tokens=planned.prompt_tokens,
            max_tokens=planned.max_tokens,
            request_id=f"loadgen-{self.run_tag}-{planned.index}",
            scheduled_ms=planned.at_s * 1000.0,
            conversation=planned.conversation,
            turn=planned.turn,
        )
        body = self.body(planned, messages)
        keep_reply = messages is not None
        first_send = self.loop.time()
        result.sent_ms = (first_send - self.start) * 1000.0
        result.eager = eager = self.retry.eager(planned.index)
        attempt = _Attempt()
        sent = first_send
        retry_after: float | None = None
        for number in range(1, self.retry.attempts(eager) + 1):
            if number > 1:
                if not eager:
                    await asyncio.sleep(
                        self.retry.delay_s(number - 1, attempt.retry_after_s, self.rng)
                    )
                sent = self.loop.time()
            attempt = await self._attempt(body, result.request_id, planned.conversation, keep_reply)
            result.attempts = number
            if attempt.retry_after_s is not None:
                retry_after = attempt.retry_after_s
            if not attempt.retryable:
                break
        self._fold(result, attempt, first_send, sent)
        result.retry_after_s = retry_after
        return result

    def _fold(
        self, result: RequestResult, attempt: _Attempt, first_send: float, last_send: float
    ) -> None:
        ms = 1000.0
        result.status = attempt.status
        result.error_code = attempt.error_code
        result.error_message = attempt.error_message
        result.lane = attempt.lane
        result.queue_ms = attempt.queue_ms
        result.completion_tokens = attempt.completion_tokens
        result.content_chunks = attempt.content_chunks
        result.cached_tokens = attempt.cached_tokens
        if attempt.reply_parts is not None:
            result.reply = "".join(attempt.reply_parts)
        if attempt.end is not None:
            result.e2e_ms = (attempt.end - first_send) * ms
        if attempt.first_token is not None:
            result.ttft_ms = (attempt.first_token - first_send) * ms
            tokens = result.tokens
            if attempt.last_token is not None and tokens > 1:
                result.tpot_ms = (attempt.last_token - attempt.first_token) * ms / (tokens - 1)
        if attempt.status is not None and attempt.status >= 400 and attempt.end is not None:
            result.reject_ms = (attempt.end - last_send) * ms

    async def _attempt(
        self, body: bytes, request_id: str, session_id: str | None = None, keep_reply: bool = False
    ) -> _Attempt:
        out = _Attempt(reply_parts=[] if keep_reply else None)
        headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "x-request-id": request_id,
        }
        if session_id is not None:
            headers["x-session-id"] = session_id
        try:
            async with self.session.post(
                self.url, data=body, headers=headers, timeout=self.timeout
            ) as response:
                out.status = response.status
                out.lane = response.headers.get("x-gateway-lane")
                out.queue_ms = _float_or_none(response.headers.get("x-gateway-queue-ms"))
                out.retry_after_s = parse_retry_after(response.headers.get("Retry-After"))
                if response.status != 200:
                    raw = await response.content.read(MAX_ERROR_BODY)
                    out.end = self.loop.time()
                    out.error_code, out.error_message = error_from_body(raw)
                    out.retryable = response.status in RETRYABLE_STATUSES
                    return out
                await self._read_stream(response, out)
        except TimeoutError:
            out.error_code, out.error_message = "client_timeout", "no complete answer in time"
        except aiohttp.ClientPayloadError as exc:
            out.error_code, out.error_message = "stream_truncated", _short(str(exc))
        except (aiohttp.ClientConnectionError, OSError) as exc:
            out.error_code, out.error_message = "connection_error", _short(repr(exc))
            # Nothing came back yet (or the connection dropped): safe to try again.
            out.retryable = out.status is None
        if out.end is None:
            out.end = self.loop.time()
        return out

    async def _read_stream(self, response: aiohttp.ClientResponse, out: _Attempt) -> None:
        done = False
        pending = b""
        async for chunk in response.content.iter_any():
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                done = self._line(line, out) or done
        out.end = self.loop.time()
        done = self._line(pending, out) or done
        if not done and out.error_code is None:
            out.error_code = "stream_truncated"
            out.error_message = "the stream ended without [DONE]"

    def _line(self, line: bytes, out: _Attempt) -> bool:
        """Handle one SSE line; True when it is the `[DONE]` sentinel."""
        if not line.startswith(b"data:"):
            return False
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return True
        if payload:
            self._event(payload, out)
        return False

    def _event(self, payload: bytes, out: _Attempt) -> None:
        try:
            event = json.loads(payload)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        if "error" in event:
            out.error_code, out.error_message = _error_fields(event)
            return
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            out.completion_tokens = usage["completion_tokens"]
        if isinstance(usage, dict):
            out.cached_tokens = cached_tokens(usage)
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if text:
                now = self.loop.time()
                if out.first_token is None:
                    out.first_token = now
                out.last_token = now
                out.content_chunks += 1
                if out.reply_parts is not None and isinstance(text, str):
                    out.reply_parts.append(text)


def cached_tokens(usage: dict[str, Any]) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` (OpenAI, vLLM), None when absent."""
    details = usage.get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if type(value) is int and value >= 0 else None


def _short(text: str) -> str:
    return text if len(text) <= MAX_ERROR_MESSAGE else text[: MAX_ERROR_MESSAGE - 1] + "…"


def _float_or_none(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a `Retry-After` header: delta-seconds or an HTTP date."""
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _error_fields(obj: dict[str, Any]) -> tuple[str, str | None]:
    error = obj.get("error")
    if isinstance(error, dict):
        # llama.cpp puts the HTTP status in `code`; its `type` says more.
        code = error.get("code")
        if not isinstance(code, str) or not code:
            code = error.get("type") or code
        message = error.get("message")
        return (
            str(code) if code is not None else "error",
            _short(str(message)) if message is not None else None,
        )
    # TGI's native shape: {"error": "message", "error_type": "..."}.
    code = obj.get("error_type") or "error"
    return str(code), _short(str(error)) if error is not None else None


def error_from_body(raw: bytes) -> tuple[str | None, str | None]:
    """(code, message) from an error answer; code None when the body is no error envelope."""
    try:
        obj = json.loads(raw)
    except ValueError:
        text = raw.decode(errors="replace").strip()
        return None, _short(text) if text else None
    if isinstance(obj, dict) and "error" in obj:
        return _error_fields(obj)
    if isinstance(obj, dict) and obj.get("object") == "error":
        return _error_fields({"error": obj})  # older vLLM: the envelope's content, unwrapped
    return None, _short(raw.decode(errors="replace"))
