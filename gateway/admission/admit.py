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
    read_positive_int,
    requested_max_tokens,
)
from gateway.admission.tokens import (
    PromptParts,
    TokenCounter,
    chat_prompt_parts,
    completion_prompt_parts,
)
from gateway.config import LaneSettings, Settings
from gateway.errors import GatewayError, invalid_request

CHAT = "chat"
COMPLETION = "completion"
#: Hugging Face TGI's native API (`/generate`, `/generate_stream`).
TGI = "tgi"


@dataclass(slots=True)
class RequestShape:
    """What the request asks for, measured: known before any policy is applied."""

    kind: str
    body: dict[str, Any]
    model: str | None
    stream: bool
    prompt_tokens: int
    #: Tokens of the longest prompt (a completions batch holds several).
    longest_prompt_tokens: int
    #: The smallest of the max-tokens fields the client set; None when it set none.
    requested_max_tokens: int | None
    #: The fields that carried it (they get the capped value).
    max_tokens_fields: tuple[str, ...]
    n: int
    prompt_count: int
    #: The client asked for the usage chunk itself (so it must not be removed).
    client_wants_usage: bool


@dataclass(slots=True)
class Admission:
    budget: OutputBudget
    lane: LaneSettings
    #: The body to send to the backend, with caps and stream options applied.
    backend_body: dict[str, Any]


async def measure_openai(
    body: dict[str, Any], settings: Settings, counter: TokenCounter, *, kind: str
) -> RequestShape:
    """Validate a `/v1/chat/completions` (kind=CHAT) or `/v1/completions` body and count it."""
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

    if kind == CHAT:
        parts = chat_prompt_parts(body.get("messages"), body.get("tools"))
        fields: tuple[str, ...] = MAX_TOKENS_FIELDS
    else:
        if "prompt" not in body:
            raise invalid_request("'prompt' is required", "prompt")
        parts = completion_prompt_parts(body["prompt"])
        fields = ("max_tokens",)
    n = read_n(body, settings.limits)
    requested = requested_max_tokens(body, fields)
    size = await counter.measure_async(parts)
    return RequestShape(
        kind=kind,
        body=body,
        model=model,
        stream=stream,
        prompt_tokens=size.total,
        longest_prompt_tokens=size.longest,
        requested_max_tokens=requested,
        max_tokens_fields=tuple(f for f in fields if body.get(f) is not None),
        n=n,
        prompt_count=parts.prompt_count,
        client_wants_usage=bool(stream_options and stream_options.get("include_usage") is True),
    )


async def measure_tgi(
    body: dict[str, Any], settings: Settings, counter: TokenCounter, *, stream: bool | None
) -> RequestShape:
    """Validate a TGI `/generate`, `/generate_stream` or `/` body and count it.

    `stream` is fixed by the route, or None for TGI's `/`, which reads the body's `stream`.
    """
    if stream is None:
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise invalid_request("'stream' must be true or false", "stream")
    inputs = body.get("inputs")
    if not isinstance(inputs, str):
        raise invalid_request("'inputs' must be a string", "inputs")
    parameters = body.get("parameters")
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict):
        raise invalid_request("'parameters' must be an object", "parameters")
    requested = read_positive_int(parameters, "max_new_tokens")
    best_of = read_n(parameters, settings.limits, "best_of")
    size = await counter.measure_async(PromptParts(texts=[inputs]))
    return RequestShape(
        kind=TGI,
        body=body,
        model=None,
        stream=stream,
        prompt_tokens=size.total,
        longest_prompt_tokens=size.longest,
        requested_max_tokens=requested,
        max_tokens_fields=("max_new_tokens",),
        n=best_of,
        prompt_count=1,
        client_wants_usage=False,
    )


def admit(
    shape: RequestShape, settings: Settings, lane_override: LaneSettings | None = None
) -> Admission:
    """Apply the caps, choose the lane and shape the backend body; GatewayError if refused.

    `lane_override` (a key allowed to choose its lane) skips the lanes' size
    limits, not the caps.
    """
    prompt_param = {CHAT: "messages", COMPLETION: "prompt", TGI: "inputs"}[shape.kind]
    check_prompt(shape.prompt_tokens, settings.limits, prompt_param)
    budget = decide_output_budget(
        shape.requested_max_tokens,
        shape.prompt_tokens,
        settings.limits,
        n=shape.n,
        prompt_count=shape.prompt_count,
        param=(shape.max_tokens_fields or ("max_tokens",))[0],
        longest_prompt_tokens=shape.longest_prompt_tokens,
    )
    lane = lane_override or choose_lane(settings.lanes, shape.prompt_tokens, budget.total)
    if lane is None:
        raise GatewayError(
            413,
            "prompt_too_long",
            f"No lane admits a request of {shape.prompt_tokens} prompt tokens and "
            f"{budget.total} output tokens.",
            param=prompt_param,
        )
    backend_body = dict(shape.body)
    if shape.kind == TGI:
        parameters = dict(shape.body.get("parameters") or {})
        parameters["max_new_tokens"] = budget.max_tokens
        backend_body["parameters"] = parameters
        return Admission(budget=budget, lane=lane, backend_body=backend_body)
    for field_name in shape.max_tokens_fields or ("max_tokens",):
        backend_body[field_name] = budget.max_tokens
    if shape.stream:
        # Ask for usage so the log line has real completion_tokens.
        options = shape.body.get("stream_options") or {}
        backend_body["stream_options"] = {**options, "include_usage": True}
    return Admission(budget=budget, lane=lane, backend_body=backend_body)
