"""Watch an OpenAI-style SSE byte stream without re-encoding it.

The relay forwards the backend's bytes unchanged. It only needs a few facts
from them: when the first content token passed (TTFT), the final usage
(`completion_tokens`), llama.cpp's `timings` (on the same last event as the
usage), and whether the stream ended with `[DONE]`. The gateway
asks the backend for `stream_options.include_usage`; when the client did not
ask for it, the usage-only event (`"choices": []`) is removed again so the
client sees the stream it asked for.

Hot path: once the first token has passed, the complete events of a chunk
(cut at the last event boundary with one `rfind`) are forwarded as they are
after a few substring checks; only the events from the first one that may hold
the usage or an error are split and read (a fast backend's last buffer holds
hundreds of token events before its usage chunk). The token events forwarded
unread are counted (one `count` of their `data:` lines): a stream cut short
before its usage chunk (a client gone) still tells the tokens it relayed. Every
step is linear in the chunk: a slow client makes aiohttp hand over big buffers,
and a quadratic scan there would make it slower still. Events that are read are decoded with
msgspec, several times faster than `json` on these small objects.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

USAGE_MARKER = b'"usage"'
#: A choice's last event says why it finished, and may hold no token (llama.cpp's): it is
#: read, not counted as one.
FINISH_MARKER = b'"finish_reason":"'
#: How far back from the usage (or the chunk's end) a finish event is looked for: it is
#: the last token event (n = 1), followed at most by [DONE] or the usage event's head.
FINISH_WINDOW = 1024
#: A JSON key "error" (inside string values quotes are escaped, so text cannot match).
ERROR_MARKER = b'"error"'
DONE_PAYLOAD = b"[DONE]"
#: How far from a chunk's end a [DONE] is looked for (it ends the stream: nothing follows
#: it but maybe a comment). A partial first event in this window never reads as [DONE].
DONE_WINDOW = 256
EVENT_ENDINGS = (b"\n\n", b"\r\n\r\n", b"\r\r")
#: A backend that never ends an event cannot make the gateway buffer without bound:
#: past this, the pending bytes are forwarded unread.
MAX_PENDING_BYTES = 1 << 20


_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_decode = msgspec.json.Decoder().decode


def _json(payload: bytes) -> Any:
    """The payload's JSON value; None when it is not JSON (not ours to judge)."""
    try:
        return _decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return None


def complete_length(data: bytes) -> int:
    """Length of the prefix of `data` made of complete events (0 when there is none)."""
    if data.endswith(EVENT_ENDINGS):
        return len(data)
    end = data.rfind(b"\n\n")
    end = end + 2 if end >= 0 else 0
    if b"\r" in data:  # CR framings are allowed by the SSE spec, rare in practice
        crlf = data.rfind(b"\r\n\r\n")
        cr = data.rfind(b"\r\r")
        end = max(end, crlf + 4 if crlf >= 0 else 0, cr + 2 if cr >= 0 else 0)
    return end


def split_events(data: bytes) -> list[bytes]:
    """The events of `data`, which holds complete events only, each with its terminator."""
    events = []
    start = 0
    for match in _EVENT_END.finditer(data):
        events.append(data[start : match.end()])
        start = match.end()
    return events


def event_data(event: bytes) -> bytes | None:
    """The joined `data:` payload of one event, or None when it has none."""
    payload = None
    for line in event.splitlines():
        if line.startswith(b"data:"):
            value = line[5:]
            if value.startswith(b" "):
                value = value[1:]
            payload = value if payload is None else payload + b"\n" + value
    return payload


def output_choices(chunk: Any) -> int:
    """The choices of an OpenAI stream chunk that carry generated output: one token each
    (a role chunk, a finish without text and the usage chunk carry none)."""
    if not isinstance(chunk, dict):
        return 0
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return 0
    return sum(1 for choice in choices if isinstance(choice, dict) and _has_output(choice))


def _has_output(choice: dict[str, Any]) -> bool:
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(
        delta.get("content")
        or delta.get("tool_calls")
        or delta.get("reasoning_content")
        or delta.get("function_call")
    )


def data_lines(data: bytes, end: int) -> int:
    """The `data:` lines of `data[:end]` (whole events from its start): one per event from
    an OpenAI or TGI server. At a line's start only: a string in JSON holds no raw line
    break, so an answer's own text ("data: ...") is never counted."""
    return data.count(b"\ndata:", 0, end) + data.startswith(b"data:", 0, end)


class StreamWatcher:
    """Feeds on raw chunks, returns the bytes to forward, notes first token and the end.

    Subclasses say what an event means (`_inspect`) and, once the first token
    has passed, from where on a chunk must be read at all (`_read_from`).
    """

    __slots__ = (
        "strip_usage",
        "first_token_seen",
        "completion_tokens",
        "prompt_tokens",
        "cached_tokens",
        "timings",
        "done",
        "backend_error",
        "hold_errors",
        "_rest",
    )

    def __init__(self, *, strip_usage: bool = False) -> None:
        self.strip_usage = strip_usage
        #: An error event after the first token is held back, with all that follows it,
        #: so the answer can be resumed elsewhere (`resume.py`); the relay decides.
        self.hold_errors = False
        self.first_token_seen = False
        self.completion_tokens: int | None = None
        #: The backend's own count of the prompt (usage.prompt_tokens), when it says.
        self.prompt_tokens: int | None = None
        #: Prompt tokens the backend served from its cache (usage.prompt_tokens_details).
        self.cached_tokens: int | None = None
        #: The engine's own timings of the request as it sent them (llama.cpp's `timings`,
        #: on its last event: the usage chunk), read with the usage; None: not sent.
        self.timings: Any = None
        #: The stream's own end marker was seen ([DONE], or TGI's final event).
        self.done = False
        #: The backend reported an error inside the stream (`{"error": ...}`).
        self.backend_error = False
        self._rest = b""

    @property
    def held_error(self) -> bool:
        """The backend sent an error event mid-answer and it was held back (`hold_errors`)."""
        return self.backend_error and self.hold_errors and self.first_token_seen

    def _read_from(self, chunk: bytes) -> int:
        """Offset of the first event of `chunk` (whole events) that must be read."""
        raise NotImplementedError

    def _inspect(self, event: bytes) -> bool:
        """Note what the event tells; False when it must not reach the client."""
        raise NotImplementedError

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send to the client now (may be empty while an event is incomplete)."""
        if self._rest:
            chunk = self._rest + chunk
            self._rest = b""
        if not chunk.endswith(b"\n\n"):  # (whole events, the common case, skip all this)
            complete = complete_length(chunk)
            if len(chunk) - complete > MAX_PENDING_BYTES:
                return chunk
            if complete < len(chunk):
                self._rest = chunk[complete:]
                chunk = chunk[:complete]
        if self.first_token_seen:
            return self._forward(chunk)
        # Until the first token every event is read; from it on, the rest as above.
        kept: list[bytes] = []
        position = 0
        for match in _EVENT_END.finditer(chunk):
            event = chunk[position : match.end()]
            position = match.end()
            kept.append(self._pass(event))
            if self.first_token_seen:
                break
        rest = chunk[position:]
        if rest:
            kept.append(self._forward(rest) if self.first_token_seen else rest)
        return b"".join(kept)

    def _forward(self, chunk: bytes) -> bytes:
        """Whole events after the first token: read only from `_read_from` on."""
        start = self._read_from(chunk)
        if start >= len(chunk):
            return chunk
        events = split_events(chunk[start:] if start else chunk)
        kept = [self._pass(event) for event in events]
        if all(out is event for out, event in zip(kept, events, strict=True)):
            return chunk
        return chunk[:start] + b"".join(kept)

    def _pass(self, event: bytes) -> bytes:
        """What of a read event goes to the client: itself, or nothing."""
        return event if self._inspect(event) else b""

    def release_held(self) -> bytes:
        """Events held back for what might follow them, when the backend's stream ends."""
        return b""

    def flush(self) -> bytes:
        """Whatever unterminated bytes remain when the backend closes the stream."""
        rest, self._rest = self._rest, b""
        if rest:
            self._inspect(rest)
        return rest

    @property
    def relayed_tokens(self) -> int:
        """The answer's tokens in the events fed so far, for a stream cut short (a client
        gone mid-stream): the engine's own count when it came, else the token events
        counted as they passed. (TGI's watcher counts those into `completion_tokens`.)"""
        return 0 if self.completion_tokens is None else self.completion_tokens


class OpenAIStreamWatcher(StreamWatcher):
    """OpenAI chunks: first content token, final usage, [DONE]; drops the usage chunk
    the gateway asked for when the client did not.

    `tokens` counts the token events relayed, one token each as `seam.py` and TGI's
    watcher count them (vLLM, SGLang and llama.cpp stream a token an event): the usage
    chunk comes last, and a stream cut short before it (a client gone) has only this.

    The usage chunk the client did not ask for can carry more than usage: vLLM stamps
    its `system_fingerprint` on a stream's last chunk, which is the usage chunk when
    `include_usage` is on and the finishing chunk when it is off. So, while stripping,
    a finishing event without a fingerprint is held until the next event: when that is
    a stripped usage chunk with one, the fingerprint goes onto the finishing event (as
    the last member, where the engine writes it), and the client gets the bytes the
    engine writes without `include_usage`. Any other next event releases it unchanged.
    """

    __slots__ = ("tokens", "_held", "_unstamped_finish", "_fingerprint")

    def __init__(self, *, strip_usage: bool = False) -> None:
        super().__init__(strip_usage=strip_usage)
        #: Token events fed so far: unread ones one each, read ones by their output choices.
        self.tokens = 0
        #: A finishing event waiting for the next one (see the class's docstring).
        self._held = b""
        #: The event `_inspect` just read finishes a choice and has no fingerprint.
        self._unstamped_finish = False
        #: The fingerprint of the usage chunk `_inspect` just stripped.
        self._fingerprint: Any = None

    def _pass(self, event: bytes) -> bytes:
        self._unstamped_finish = False
        self._fingerprint = None
        keep = self._inspect(event)
        held, self._held = self._held, b""
        if keep and self._unstamped_finish and self.strip_usage:
            self._held = event
            return held
        if not held:
            return event if keep else b""
        if not keep and isinstance(self._fingerprint, str):
            held = stamped(held, self._fingerprint)
        return held + event if keep else held

    def release_held(self) -> bytes:
        held, self._held = self._held, b""
        return held

    @property
    def relayed_tokens(self) -> int:
        """The usage's `completion_tokens` when it came, else the token events counted."""
        return self.tokens if self.completion_tokens is None else self.completion_tokens

    def _read_from(self, chunk: bytes) -> int:
        if self._held:  # the next event decides what becomes of it: read from the start
            return 0
        marker = chunk.find(USAGE_MARKER)
        error = chunk.find(ERROR_MARKER)
        if error >= 0 and (marker < 0 or error < marker):
            marker = error
        boring = chunk if marker < 0 else chunk[:marker]
        finish = boring.find(FINISH_MARKER, -FINISH_WINDOW)
        if finish >= 0:
            marker, boring = finish, boring[:finish]
        start = len(chunk) if marker < 0 else complete_length(boring)
        # The events before the one holding a marker are token events: counted, not read.
        events = data_lines(chunk, start)
        # [DONE] is a stream's last event: looked for at the end of the chunk only.
        last = boring[-DONE_WINDOW:]
        if not self.done and DONE_PAYLOAD in last:
            self.done = any(event_data(e) == DONE_PAYLOAD for e in split_events(last))
            if self.done:
                events -= 1  # [DONE] is no token
        self.tokens += events
        return start

    def _inspect(self, event: bytes) -> bool:
        """Note what the event tells; False when it must not reach the client."""
        if self.backend_error and self.hold_errors and self.first_token_seen:
            return False  # what follows a held error event is held too
        payload = event_data(event)
        if payload is None:
            return True
        if payload.strip() == DONE_PAYLOAD:
            self.done = True
            return True
        has_usage = USAGE_MARKER in payload
        if (
            self.first_token_seen
            and not has_usage
            and ERROR_MARKER not in payload
            and FINISH_MARKER not in payload
        ):
            self.tokens += 1  # a token event, as in `_read_from`
            return True
        chunk = _json(payload)
        if not isinstance(chunk, dict):  # not ours to judge: forward it unchanged
            return True
        output = output_choices(chunk)
        if output and not self.first_token_seen:
            self.first_token_seen = True
        if "error" in chunk:
            self.backend_error = True
            if self.hold_errors and self.first_token_seen:
                return False
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            timings = chunk.get("timings")
            if timings is not None:
                self.timings = timings
            tokens = usage.get("completion_tokens")
            if type(tokens) is int:
                self.completion_tokens = tokens
            prompt = usage.get("prompt_tokens")
            if type(prompt) is int:
                self.prompt_tokens = prompt
            self.cached_tokens = cached_tokens_of(usage)
            if self.strip_usage and chunk.get("choices") == []:
                self._fingerprint = chunk.get("system_fingerprint")
                return False
        if chunk.get("system_fingerprint") is None and _finishes(chunk):
            self._unstamped_finish = True
        self.tokens += output
        return True


def _finishes(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices")
    return isinstance(choices, list) and any(
        isinstance(choice, dict) and choice.get("finish_reason") for choice in choices
    )


def stamped(event: bytes, fingerprint: str) -> bytes:
    """`event` (one `data:` line of a JSON object) with `system_fingerprint` as its last
    member; unchanged when it is not shaped so."""
    end = event.rfind(b"}")
    if end < 0 or not event.startswith(b"data:"):
        return event
    member = b',"system_fingerprint":' + msgspec.json.encode(fingerprint)
    return event[:end] + member + event[end:]


def cached_tokens_of(usage: dict[str, object]) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` (OpenAI's and vLLM's name), if given."""
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        cached = details.get("cached_tokens")
        if type(cached) is int and cached >= 0:
            return cached
    return None


TGI_NOT_FINAL = b'"generated_text":null'


class TgiStreamWatcher(StreamWatcher):
    """TGI's `/generate_stream`: a token event per token, the last one carrying
    `generated_text` (and `details.generated_tokens` when asked for); no [DONE].

    Token events are counted as they pass, so `completion_tokens` is known
    without `details` too (and for a stream cut short, what was generated).
    """

    __slots__ = ()

    def _read_from(self, chunk: bytes) -> int:
        # Every event is a non-final token event (no allocation: counts, not splits).
        events = chunk.count(b"data:")
        if events != chunk.count(TGI_NOT_FINAL):
            return 0
        self.completion_tokens = (self.completion_tokens or 0) + events
        return len(chunk)

    def _inspect(self, event: bytes) -> bool:
        payload = event_data(event)
        if payload is None:
            return True
        if self.first_token_seen and TGI_NOT_FINAL in payload:
            self.completion_tokens = (self.completion_tokens or 0) + 1
            return True
        chunk = _json(payload)
        if not isinstance(chunk, dict):
            return True
        if "error" in chunk:  # TGI ends a failed stream with its error event
            self.backend_error = self.done = True
            return not (self.hold_errors and self.first_token_seen)
        token = chunk.get("token")
        if isinstance(token, dict):
            self.completion_tokens = (self.completion_tokens or 0) + 1
            if not self.first_token_seen and not token.get("special"):
                self.first_token_seen = True
        if chunk.get("generated_text") is not None:
            self.done = True
            details = chunk.get("details")
            if isinstance(details, dict) and type(details.get("generated_tokens")) is int:
                self.completion_tokens = details["generated_tokens"]
        return True
