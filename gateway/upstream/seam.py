"""What the client already has of an answer, and its continuation made to look the same.

When a backend fails mid-answer, the answer goes on on another backend
(`resume.py`). Two things make the seam invisible to the client:

- `RelayedEvents` keeps the whole events relayed so far, bounded. On the hot
  path that is one list append per write and nothing is parsed: the events are
  read only when a seam is needed (`read_openai_seam`, `read_tgi_seam`), into
  the text the client has, the tokens it got and the first part's `id`,
  `created` and `model`.
- A continued stream (`OpenAIContinuation`, `TgiContinuation`) is read event by
  event and rewritten: the first part's `id`/`created`/`model`, no second role
  chunk, TGI's token `index` and final `generated_text` carried on, and the
  usage counting every token the client got. Only a resumed stream pays this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.upstream.sse import DONE_PAYLOAD, complete_length, event_data, split_events

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode

#: Why an answer could not be carried over (the metric's and the log's `resume_failed`).
BUFFER_FULL = "buffer_full"
UNKNOWN_ENGINE = "unknown_engine"
NO_BACKEND = "no_backend"
REQUEST_SHAPE = "request_shape"  # n > 1, tools, response_format, logprobs, ...
TOOL_CALLS = "tool_calls"
LOGPROBS = "logprobs"
REASONING = "reasoning"
FINISHED = "finished"
LIMIT = "limit"
DISABLED = "disabled"


#: What every chunk of one OpenAI answer has the same of (the continuation's rewritten).
HEAD_KEYS = ("id", "object", "created", "model")


class RelayedEvents:
    """The whole SSE events relayed to the client so far, up to `limit` bytes.

    Past the limit the buffer is dropped (`overflowed`): the answer cannot be resumed,
    and a long answer holds no memory for it.
    """

    __slots__ = ("limit", "size", "parts")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self.parts: list[bytes] | None = []

    def keep(self, events: bytes) -> None:
        parts = self.parts
        if parts is None:
            return
        self.size += len(events)
        if self.size > self.limit:
            self.parts = None
        else:
            parts.append(events)

    @property
    def overflowed(self) -> bool:
        return self.parts is None

    def data(self) -> bytes:
        return b"" if self.parts is None else b"".join(self.parts)


@dataclass(slots=True)
class Seam:
    """What the client has of the answer at a seam."""

    #: The answer's text so far (what the next backend is asked to continue).
    text: str = ""
    #: Token events the client got (one token each, as vLLM, SGLang, llama.cpp and TGI
    #: stream them): the budget still left is the request's less these.
    tokens: int = 0
    #: The first part's `id`, `created`, `model` (OpenAI), for every later chunk.
    head: dict[str, Any] = field(default_factory=dict)
    #: TGI's last token `index`.
    index: int = 0
    #: Why the answer cannot be continued faithfully (None: it can).
    obstacle: str | None = None
    #: How the first part wrote its events' data field (TGI's axum: no space after the
    #: colon; OpenAI servers: one), so the continued part is written the same way.
    data_prefix: bytes = b"data: "

    @property
    def sent_text(self) -> str:
        """What the next backend is asked to go on from: the text without its trailing
        whitespace. A text ending in a space ("hundred: ") is a tokenization no model
        wrote (and chat templates trim it), so the engine writes the space again with
        its next word (" 1"): the client read a double space. It goes on from
        "hundred:" instead, and the continuation's first whitespace, which the client
        has already, is dropped (`Continuation.heal`)."""
        kept = self.text.rstrip()
        return kept or self.text

    @property
    def held_back(self) -> str:
        """The trailing whitespace the client has and the next backend is not sent."""
        return self.text[len(self.sent_text) :]


def _data_prefix(data: bytes) -> bytes:
    at = data.find(b"data:")
    return b"data:" if at >= 0 and data[at + 5 : at + 6] != b" " else b"data: "


def _payloads(data: bytes) -> list[Any]:
    values = []
    for event in split_events(data):
        payload = event_data(event)
        if payload is None or payload.strip() == DONE_PAYLOAD:
            continue
        try:
            values.append(_decode(payload))
        except (msgspec.DecodeError, RecursionError):
            continue
    return values


def read_openai_seam(data: bytes) -> Seam:
    """The seam of an OpenAI chat or completions stream (`choices[0].delta.content` or
    `choices[0].text`)."""
    seam = Seam(data_prefix=_data_prefix(data))
    texts: list[str] = []
    for chunk in _payloads(data):
        if not isinstance(chunk, dict):
            continue
        if not seam.head and "id" in chunk:
            seam.head = {k: chunk[k] for k in HEAD_KEYS if k in chunk}
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            continue
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("index", 0) != 0:
                seam.obstacle = REQUEST_SHAPE
            if choice.get("logprobs") is not None:
                seam.obstacle = LOGPROBS
            if choice.get("finish_reason") is not None:
                seam.obstacle = FINISHED
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(delta, dict):
                if delta.get("tool_calls") or delta.get("function_call"):
                    seam.obstacle = TOOL_CALLS
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    seam.obstacle = REASONING
            if isinstance(text, str) and text:
                texts.append(text)
                seam.tokens += 1
    seam.text = "".join(texts)
    return seam


def read_tgi_seam(data: bytes) -> Seam:
    """The seam of a TGI `/generate_stream` stream: its token events' texts."""
    seam = Seam(data_prefix=_data_prefix(data))
    texts: list[str] = []
    for chunk in _payloads(data):
        if not isinstance(chunk, dict):
            continue
        token = chunk.get("token")
        if isinstance(token, dict):
            seam.tokens += 1
            if type(chunk.get("index")) is int:
                seam.index = chunk["index"]
            text = token.get("text")
            if isinstance(text, str) and not token.get("special"):
                texts.append(text)
        if chunk.get("generated_text") is not None:
            seam.obstacle = FINISHED
    seam.text = "".join(texts)
    return seam


class Continuation:
    """A continued stream, whole events in, rewritten events out (one JSON parse each)."""

    __slots__ = (
        "seam",
        "strip_usage",
        "tokens",
        "completion_tokens",
        "first_token_seen",
        "done",
        "backend_error",
        "_rest",
        "_held",
        "_healed",
    )

    def __init__(self, seam: Seam, *, strip_usage: bool) -> None:
        self.seam = seam
        self.strip_usage = strip_usage
        #: Token events of this part.
        self.tokens = 0
        #: The whole answer's, from the usage (or TGI's details) this part ended with.
        self.completion_tokens: int | None = None
        self.first_token_seen = False
        self.done = False
        #: It sent an error event (held back: the caller may resume again).
        self.backend_error = False
        self._rest = b""
        #: What is left of the seam's held-back whitespace to drop from this part's start.
        self._held = seam.held_back
        #: The characters dropped so far.
        self._healed = ""

    def feed(self, chunk: bytes) -> bytes:
        data = self._rest + chunk if self._rest else chunk
        end = complete_length(data)
        self._rest = data[end:]
        if self.backend_error:
            return b""
        out = []
        for event in split_events(data[:end]):
            rewritten = self._rewrite(event)
            if self.backend_error:
                break
            out.append(rewritten)
        return b"".join(out)

    def _rewrite(self, event: bytes) -> bytes:
        payload = event_data(event)
        if payload is None:
            return event
        if payload.strip() == DONE_PAYLOAD:
            self.done = True
            return event
        try:
            chunk = _decode(payload)
        except (msgspec.DecodeError, RecursionError):
            return event
        if not isinstance(chunk, dict):
            return event
        if "error" in chunk:
            self.backend_error = True
            return b""
        return self._rewrite_chunk(chunk)

    def _rewrite_chunk(self, chunk: dict[str, Any]) -> bytes:
        raise NotImplementedError

    def heal(self, text: str) -> str:
        """`text` without the whitespace the client already has at the seam (`held_back`):
        the engine writes it again before its next word. Only the start of this part
        is healed; whitespace that differs from what was held back is the engine's."""
        held = self._held
        if not held:
            return text
        same = 0
        for mine, theirs in zip(text, held, strict=False):
            if mine != theirs:
                break
            same += 1
        self._held = held[same:] if same == len(text) else ""
        self._healed += text[:same]
        return text[same:]

    @property
    def total_tokens(self) -> int:
        """Tokens the client got in all: the seam's and this part's."""
        return self.seam.tokens + self.tokens


def sse(chunk: Any, prefix: bytes = b"data: ") -> bytes:
    return prefix + _encode(chunk) + b"\n\n"


class OpenAIContinuation(Continuation):
    """An OpenAI continuation. When its first text repeats, in one delta, the whole text
    it was asked to go on from, the repeat is dropped: llama.cpp's server streams the
    last assistant message it continues as its first content delta (the portable build
    of `scripts/real_backend.sh` does), and the client read its answer so far twice. One
    token cannot hold two tokens' text, so a seam of two tokens or more is never taken
    for a repeat by a new token that happens to begin the same way."""

    __slots__ = ("_echo",)

    def __init__(self, seam: Seam, *, strip_usage: bool) -> None:
        super().__init__(seam, strip_usage=strip_usage)
        #: The text it was sent, until this part's first text came (None: then on).
        self._echo: str | None = seam.sent_text if seam.tokens >= 2 else None

    def _rewrite_chunk(self, chunk: dict[str, Any]) -> bytes:
        for key, value in self.seam.head.items():
            if key in chunk:
                chunk[key] = value
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._carry_usage(usage)
        choices = chunk.get("choices")
        if isinstance(choices, list):
            if not choices and isinstance(usage, dict) and self.strip_usage:
                return b""
            if choices and not any(self._note_choice(c) for c in choices):
                return b""  # its role chunk: the client had one already
        return sse(chunk, self.seam.data_prefix)

    def _note_choice(self, choice: Any) -> bool:
        """Count a token; False when the choice says nothing the client lacks."""
        if not isinstance(choice, dict):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict):
            delta.pop("role", None)
            holder, key = delta, "content"
            other = any(v for k, v in delta.items() if k != "content")
        else:
            holder, key, other = choice, "text", False
        text = holder.get(key)
        finish = choice.get("finish_reason") is not None
        if self._echo is not None and isinstance(text, str) and text:
            if text.startswith(self._echo):  # the answer so far, repeated: not a token
                text = holder[key] = text[len(self._echo) :]
                if not text:
                    self._echo = None
                    return other or finish
            self._echo = None
        if isinstance(text, str) and text:
            text = holder[key] = self.heal(text)
            if text:  # (whitespace the client had is no token of the answer)
                self.tokens += 1
                self.first_token_seen = True
                return True
        return other or finish

    def _carry_usage(self, usage: dict[str, Any]) -> None:
        """The usage of the whole answer: this part's completion plus the seam's tokens;
        its prompt less them (the continued text was part of this part's prompt)."""
        sent = self.seam.tokens
        completion = usage.get("completion_tokens")
        if type(completion) is int:
            usage["completion_tokens"] = completion = completion + sent
            self.completion_tokens = completion
        prompt = usage.get("prompt_tokens")
        if type(prompt) is int:
            usage["prompt_tokens"] = prompt = max(0, prompt - sent)
        if type(prompt) is int and type(completion) is int:
            usage["total_tokens"] = prompt + completion


class TgiContinuation(Continuation):
    __slots__ = ()

    def _rewrite_chunk(self, chunk: dict[str, Any]) -> bytes:
        token = chunk.get("token")
        if isinstance(token, dict):
            self.tokens += 1
            self.first_token_seen = True
            if type(chunk.get("index")) is int:
                chunk["index"] += self.seam.index
            if isinstance(token.get("text"), str) and not token.get("special"):
                token["text"] = self.heal(token["text"])
        generated = chunk.get("generated_text")
        if isinstance(generated, str):
            self.done = True
            if generated.startswith(self._healed):
                generated = generated[len(self._healed) :]
            chunk["generated_text"] = self.seam.text + generated
            details = chunk.get("details")
            if isinstance(details, dict) and type(details.get("generated_tokens")) is int:
                details["generated_tokens"] += self.seam.tokens
                self.completion_tokens = details["generated_tokens"]
        return sse(chunk, self.seam.data_prefix)
