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
from gateway.upstream.seam import (
    LOGPROBS,
    REQUEST_SHAPE,
    Continuation,
    OpenAIContinuation,
    Seam,
    read_openai_seam,
    sse,
)
from gateway.upstream.sse import OpenAIStreamWatcher, StreamWatcher, cached_tokens_of

#: Request fields whose answer a continuation could not reproduce faithfully: the tool
#: calls or the structure in progress, the logprobs of tokens already sent.
NOT_CONTINUABLE_FIELDS = (
    "tools",
    "functions",
    "response_format",
    "echo",
    "suffix",
    "best_of",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "continue_final_message",
)
#: Engines that continue a chat's last assistant message when asked with vLLM's flags
#: (the simulator speaks vLLM's API and takes both forms).
CONTINUE_FINAL_MESSAGE_ENGINES = frozenset({"vllm", "sglang", "simulator"})
#: Engines that serve OpenAI completions, where the prompt is simply extended.
COMPLETION_ENGINES = frozenset({"vllm", "sglang", "llama.cpp", "tgi", "simulator"})


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

    def not_resumable(self, shape: RequestShape) -> str | None:
        body = shape.body
        if shape.n > 1 or shape.prompt_count != 1:
            return REQUEST_SHAPE
        if body.get("logprobs") or body.get("top_logprobs"):
            return LOGPROBS
        if any(body.get(name) not in (None, False) for name in NOT_CONTINUABLE_FIELDS):
            return REQUEST_SHAPE
        return None

    def read_seam(self, relayed: bytes) -> Seam:
        return read_openai_seam(relayed)

    def continued_stream(self, seam: Seam, shape: RequestShape) -> Continuation:
        return OpenAIContinuation(seam, strip_usage=not shape.client_wants_usage)

    def end_of_answer(self, seam: Seam, shape: RequestShape) -> bytes | None:
        """The usage chunk the client asked for (the backend's never came: its prompt is
        the gateway's count) and `[DONE]`."""
        end = seam.data_prefix + b"[DONE]\n\n"
        if not shape.client_wants_usage:
            return end
        usage = {
            "prompt_tokens": shape.prompt_tokens,
            "completion_tokens": seam.tokens,
            "total_tokens": shape.prompt_tokens + seam.tokens,
        }
        return sse({**seam.head, "choices": [], "usage": usage}, seam.data_prefix) + end


def _with_budget(fields: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """The output cap fields set to what is left of the budget."""
    names = [n for n in ("max_completion_tokens", "max_tokens") if n in fields] or ["max_tokens"]
    for name in names:
        fields[name] = max_tokens
    return fields


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

    def not_resumable(self, shape: RequestShape) -> str | None:
        messages = shape.body.get("messages")
        if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
            return REQUEST_SHAPE  # the client's own prefill: one continuation at a time
        return super().not_resumable(shape)

    def continuation(
        self, fields: dict[str, Any], seam: Seam, max_tokens: int, engine: str | None
    ) -> dict[str, Any] | None:
        """vLLM and SGLang: the text as a final assistant message with
        `continue_final_message` (and no generation prompt, which vLLM requires);
        llama.cpp: a last assistant message, which it continues by default."""
        answer = {"role": "assistant", "content": seam.sent_text}
        body = dict(fields, messages=[*fields["messages"], answer])
        if engine in CONTINUE_FINAL_MESSAGE_ENGINES:
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        elif engine != "llama.cpp":
            return None
        return _with_budget(body, max_tokens)


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

    def not_resumable(self, shape: RequestShape) -> str | None:
        prompt = shape.body.get("prompt")
        if not isinstance(prompt, str) and not (
            isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str)
        ):
            return REQUEST_SHAPE  # token ids: the text would have to be encoded as theirs
        return super().not_resumable(shape)

    def continuation(
        self, fields: dict[str, Any], seam: Seam, max_tokens: int, engine: str | None
    ) -> dict[str, Any] | None:
        """Every engine: the prompt followed by the text so far."""
        if engine not in COMPLETION_ENGINES:
            return None
        prompt = fields["prompt"]
        text = seam.sent_text
        prompt = prompt + text if isinstance(prompt, str) else [prompt[0] + text]
        return _with_budget(dict(fields, prompt=prompt), max_tokens)


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
