"""Admission of an OpenAI request: validate, count, cap, choose a lane, shape the body.

Everything here happens before the request takes any place in a queue, so a
request that cannot be served is refused in microseconds (or a few ms for a
huge prompt) with the reason, instead of after a wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.admission.lanes import choose_lane
from gateway.admission.limits import (
    MAX_TOKENS_FIELDS,
    OutputBudget,
    check_prompt,
    decide_output_budget,
    read_n,
    requested_max_tokens,
)
from gateway.admission.tokens import TokenCounter, chat_prompt_parts, completion_prompt_parts
from gateway.config import LaneSettings, Settings
from gateway.errors import GatewayError, invalid_request

CHAT = "chat"
COMPLETION = "completion"


@dataclass(slots=True)
class Admission:
    model: str | None
    stream: bool
    prompt_tokens: int
    budget: OutputBudget
    lane: LaneSettings
    #: The client asked for the usage chunk itself (so it must not be removed).
    client_wants_usage: bool
    #: The body to send to the backend, with caps and stream options applied.
    backend_body: dict[str, Any]


async def admit_openai(
    body: dict[str, Any], kind: str, settings: Settings, counter: TokenCounter
) -> Admission:
    """Admit a `/v1/chat/completions` (kind=CHAT) or `/v1/completions` body."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid_request("'model' must be a string", "model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid_request("'stream' must be true or false", "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise invalid_request("'stream_options' must be an object", "stream_options")
    client_wants_usage = bool(stream_options and stream_options.get("include_usage") is True)

    if kind == CHAT:
        parts = chat_prompt_parts(body.get("messages"), body.get("tools"))
        fields = MAX_TOKENS_FIELDS
    else:
        if "prompt" not in body:
            raise invalid_request("'prompt' is required", "prompt")
        parts = completion_prompt_parts(body["prompt"])
        fields = ("max_tokens",)
    n = read_n(body, settings.limits)
    requested = requested_max_tokens(body, fields)
    prompt_tokens = await counter.count_async(parts)
    check_prompt(prompt_tokens, settings.limits)
    budget = decide_output_budget(
        requested, prompt_tokens, settings.limits, n=n, prompt_count=parts.prompt_count
    )
    lane = choose_lane(settings.lanes, prompt_tokens, budget.total)
    if lane is None:
        raise GatewayError(
            413,
            "prompt_too_long",
            f"No lane admits a request of {prompt_tokens} prompt tokens and "
            f"{budget.total} output tokens.",
            param="messages" if kind == CHAT else "prompt",
        )

    backend_body = dict(body)
    present = [f for f in fields if f in body and body[f] is not None]
    for field_name in present or ["max_tokens"]:
        backend_body[field_name] = budget.max_tokens
    if stream:
        # Ask for usage so the log line has real completion_tokens.
        backend_body["stream_options"] = {**(stream_options or {}), "include_usage": True}
    return Admission(
        model=model,
        stream=stream,
        prompt_tokens=prompt_tokens,
        budget=budget,
        lane=lane,
        client_wants_usage=client_wants_usage,
        backend_body=backend_body,
    )
