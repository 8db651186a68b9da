"""The request bodies the gateway reads, as types: one source for validation and OpenAPI.

Only the fields admission needs are declared; every other field is ignored
here and reaches the backend untouched (the gateway forwards the client's
object, not these types). msgspec validates a decoded body against a type in
C and names the offending field (`messages[0].role`); `http/openapi.py` turns
the same types into the document's schemas, so the two cannot drift apart.

Decided on purpose:
- NaN and Infinity are not JSON: refused (400), as are numbers out of range.
- A lone UTF-16 surrogate (`"\\ud800"`) cannot be sent on as UTF-8: refused.
- Duplicate keys: the last one wins, as with Python's json and most servers,
  and the backend gets the body re-encoded from that one value, so the gateway
  and the backend can never read two different `max_tokens`.
- Integers of any size: `max_tokens: 10**4000` is clamped to the cap, not refused.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from gateway.outcomes import InvalidRequest

#: Largest token id a completions prompt may hold (what engines accept as int32).
MAX_TOKEN_ID = 2**31 - 1
CHAT_ROLES = ("assistant", "developer", "function", "system", "tool", "user")

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
Role = Literal["assistant", "developer", "function", "system", "tool", "user"]


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class RefusalPart(msgspec.Struct, tag_field="type", tag="refusal"):
    refusal: str


class ImagePart(msgspec.Struct, tag_field="type", tag="image_url"):
    """Counted at a fixed cost (85 tokens, OpenAI's low-detail price); not read."""


class AudioPart(msgspec.Struct, tag_field="type", tag="input_audio"):
    """Not counted: its size is unknown to the gateway."""


class FilePart(msgspec.Struct, tag_field="type", tag="file"):
    """Not counted: its size is unknown to the gateway."""


ContentPart = TextPart | RefusalPart | ImagePart | AudioPart | FilePart


class ToolCall(msgspec.Struct):
    #: String `name` and `arguments` are counted; other members are ignored.
    function: dict[str, Any]


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    #: Counted when a string; passed through whatever it is.
    tool_call_id: Any = None


_N = Annotated[
    PositiveInt | None,
    msgspec.Meta(description="Choices per prompt; at most limits.max_n."),
]
_MAX_TOKENS = Annotated[
    PositiveInt | None,
    msgspec.Meta(
        description="Output cap per choice; defaulted when absent, clamped (or refused) "
        "over limits.max_output_tokens."
    ),
]


class OpenAIRequest(msgspec.Struct, kw_only=True):
    model: Annotated[str | None, msgspec.Meta(description="Passed to the backend as is.")] = None
    stream: Annotated[
        bool | None, msgspec.Meta(description="true: Server-Sent Events, relayed byte for byte.")
    ] = None
    stream_options: Annotated[
        dict[str, Any] | None,
        msgspec.Meta(
            description="Passed through; the gateway adds include_usage=true towards the "
            "backend and strips the usage chunk again unless the client asked for it."
        ),
    ] = None
    n: _N = None

    @property
    def wants_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage") is True)


class ChatCompletionRequest(OpenAIRequest, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    tools: Annotated[
        list[dict[str, Any]] | None,
        msgspec.Meta(description="Counted as their JSON towards the prompt."),
    ] = None
    max_tokens: _MAX_TOKENS = None
    max_completion_tokens: Annotated[
        PositiveInt | None,
        msgspec.Meta(description="Same as max_tokens; with both set the smaller one counts."),
    ] = None


_TOKEN_IDS: dict[str, Any] = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID},
}
_PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "minItems": 1, "items": {"type": "string"}},
        _TOKEN_IDS,
        {"type": "array", "minItems": 1, "items": _TOKEN_IDS},
    ],
    "description": "A string, strings, token ids, or arrays of token ids.",
}


class CompletionRequest(OpenAIRequest, kw_only=True):
    #: Its four shapes are told apart in tokens.py (msgspec unions hold one array type).
    prompt: Annotated[str | list[Any], msgspec.Meta(extra_json_schema=_PROMPT_SCHEMA)]
    max_tokens: _MAX_TOKENS = None


class TgiParameters(msgspec.Struct, kw_only=True):
    """Passed to the backend with max_new_tokens set to the cap in force."""

    max_new_tokens: Annotated[
        PositiveInt | None,
        msgspec.Meta(description="Output cap, defaulted and capped like max_tokens."),
    ] = None
    best_of: Annotated[PositiveInt | None, msgspec.Meta(description="At most limits.max_n.")] = None


class TgiGenerateRequest(msgspec.Struct, kw_only=True):
    inputs: str
    parameters: TgiParameters | None = None


class TgiCompatRequest(TgiGenerateRequest, kw_only=True):
    """TGI's `/`: the body says whether to stream."""

    stream: bool = False


#: The types the OpenAPI document describes, by the name it gives them.
REQUEST_TYPES: tuple[type[msgspec.Struct], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    TgiGenerateRequest,
    TgiCompatRequest,
)

T = TypeVar("T")

_QUOTED = re.compile(r"'[^']*'")
_PATH = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"^Object missing required field `([^`]*)`")


def parse(body: dict[str, Any], request_type: type[T]) -> T:
    """`body` as `request_type`, or InvalidRequest naming the field that is wrong."""
    try:
        return msgspec.convert(body, request_type)
    except msgspec.ValidationError as exc:
        raise invalid_from(exc) from None


def invalid_from(exc: msgspec.ValidationError) -> InvalidRequest:
    """msgspec's message, without the client's own text, and its path as `param`."""
    text = str(exc)
    match = _PATH.search(text)
    path = match.group(1) if match else ""
    detail = text[: match.start()] if match else text
    missing = _MISSING.match(detail)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    # Enum and tag errors quote the client's value: never echo client text.
    detail = _QUOTED.sub("", detail).replace("  ", " ").strip()
    param = path or None
    return InvalidRequest(f"{detail} (at '{param}')." if param else f"{detail}.", param=param)
