"""OpenAI's chat completions and completions: `messages` or `prompt`, `max_tokens`, usage."""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from gateway.admission.admit import RequestShape
from gateway.admission.limits import OutputBudget, check_n, smallest_cap
from gateway.admission.schema import ChatCompletionRequest, CompletionRequest, parse
from gateway.admission.tokens import TokenCounter, chat_parts, completion_prompt_parts
from gateway.config import LimitsSettings
from gateway.dialects.base import Dialect, sse_event
from gateway.upstream.engine_timings import EngineReport, llamacpp_timings
from gateway.upstream.sse import OpenAIStreamWatcher, StreamWatcher, cached_tokens_of


class _OpenAIDialect(Dialect):
    def backend_body(self, shape: RequestShape, budget: OutputBudget) -> dict[str, Any]:
        body = dict(shape.body)
        for field_name in shape.max_tokens_fields or ("max_tokens",):
            body[field_name] = budget.max_tokens
        if shape.stream:
            # Ask for usage so the log line has real completion_tokens.
            options = shape.body.get("stream_options") or {}
            body["stream_options"] = {**options, "include_usage": True}
        return body

    def stream_watcher(self, shape: RequestShape) -> StreamWatcher:
        return OpenAIStreamWatcher(strip_usage=not shape.client_wants_usage)

    def completion_tokens(self, body: bytes) -> int | None:
        return _usage_count(body, "completion_tokens")

    def backend_prompt_tokens(self, body: bytes) -> int | None:
        return _usage_count(body, "prompt_tokens")

    def backend_cached_tokens(self, body: bytes) -> int | None:
        usage = _usage(body)
        return None if usage is None else cached_tokens_of(usage)

    def engine_report(self, body: bytes) -> EngineReport | None:
        answer = _answer(body)
        return None if answer is None else llamacpp_timings(answer.get("timings"))

    def error_event(self, error: dict[str, Any]) -> bytes:
        return sse_event({"error": error})


class ChatDialect(_OpenAIDialect):
    request_type = ChatCompletionRequest

    async def measure(
        self, body: dict[str, Any], limits: LimitsSettings, counter: TokenCounter
    ) -> RequestShape:
        request = parse(body, ChatCompletionRequest)
        size = await counter.measure_async(chat_parts(request))
        fields = tuple(
            name
            for name, value in (
                ("max_completion_tokens", request.max_completion_tokens),
                ("max_tokens", request.max_tokens),
            )
            if value is not None
        )
        return RequestShape(
            body=body,
            prompt_param="messages",
            model=request.model,
            stream=bool(request.stream),
            prompt_tokens=size.total,
            longest_prompt_tokens=size.longest,
            requested_max_tokens=smallest_cap(request.max_tokens, request.max_completion_tokens),
            max_tokens_fields=fields,
            n=check_n(request.n, limits),
            prompt_count=1,
            client_wants_usage=request.wants_usage,
            prefix=size.prefix,
        )


class CompletionDialect(_OpenAIDialect):
    request_type = CompletionRequest

    async def measure(
        self, body: dict[str, Any], limits: LimitsSettings, counter: TokenCounter
    ) -> RequestShape:
        request = parse(body, CompletionRequest)
        parts = completion_prompt_parts(request.prompt)
        size = await counter.measure_async(parts)
        return RequestShape(
            body=body,
            prompt_param="prompt",
            model=request.model,
            stream=bool(request.stream),
            prompt_tokens=size.total,
            longest_prompt_tokens=size.longest,
            requested_max_tokens=request.max_tokens,
            max_tokens_fields=("max_tokens",) if request.max_tokens is not None else (),
            n=check_n(request.n, limits),
            prompt_count=parts.prompt_count,
            client_wants_usage=request.wants_usage,
            prefix=size.prefix,
        )


@functools.lru_cache(maxsize=1)
def _answer(body: bytes) -> dict[str, Any] | None:
    """A whole answer, decoded once for the several facts read from it (not to be changed)."""
    try:
        answer = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    return answer if isinstance(answer, dict) else None


def _usage(body: bytes) -> dict[str, Any] | None:
    """The `usage` of a whole answer."""
    answer = _answer(body)
    usage = answer.get("usage") if answer is not None else None
    return usage if isinstance(usage, dict) else None


def _usage_count(body: bytes, name: str) -> int | None:
    """`usage[name]` of a whole answer; None when it has none."""
    usage = _usage(body)
    tokens = usage.get(name) if usage is not None else None
    return tokens if type(tokens) is int else None
