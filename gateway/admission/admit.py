"""Admission: one step from a measured request and its caller to the whole decision.

Everything here happens before the request takes any place in a queue, so a
request that cannot be served is refused in microseconds (or a few ms for a
huge prompt) with the reason, instead of after a wait. Measuring a body (how
many tokens, which output caps) is the dialect's job (`gateway/dialects/`);
the policy that follows (caps, lane, the caller's rights) is the same for all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gateway.admission.auth import check_lane_allowed, lane_override
from gateway.admission.lanes import choose_lane
from gateway.admission.limits import OutputBudget, check_prompt, decide_output_budget
from gateway.admission.prefix import PromptPrefix
from gateway.config import ApiKeySettings, LaneSettings, LimitsSettings, Settings
from gateway.outcomes import PromptTooLong


@dataclass(slots=True)
class RequestShape:
    """What the request asks for, measured: known before any policy is applied."""

    #: The client's body, as decoded (the backend gets it with the caps applied).
    body: dict[str, Any]
    #: The field a prompt-size refusal names (`messages`, `prompt`, `inputs`).
    prompt_param: str
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
    #: The prompt's chained block hashes, for cache-aware routing (None: not hashable).
    prefix: PromptPrefix | None = None


@dataclass(slots=True)
class Admission:
    budget: OutputBudget
    lane: LaneSettings
    #: The client named a lane in X-Gateway-Lane without the right to: ignored (and logged).
    override_ignored: bool = False


def calibrated(tokens: int, token_ratio: float) -> int:
    """The gateway's count in the backend's tokens (its learned ratio), rounded up."""
    return tokens if token_ratio == 1.0 else math.ceil(tokens * token_ratio)


def admit(
    shape: RequestShape,
    settings: Settings,
    client: ApiKeySettings | None = None,
    requested_lane: str | None = None,
    *,
    limits: LimitsSettings | None = None,
    token_ratio: float = 1.0,
    cached_tokens: int = 0,
) -> Admission:
    """Apply the caps, choose the lane, check the caller may use it; a Refusal if not.

    `requested_lane` (X-Gateway-Lane) counts only for a key allowed to choose
    its lane; it skips the lanes' size limits, not the caps. `limits`: the caps
    in force (the config's, tightened by what the backends accept). The caps and
    lane sizes are in the model's tokens: the gateway's tiktoken count times
    `token_ratio`, the backends' learned tokens per gateway token. `cached_tokens`:
    prompt tokens a backend probably has cached, which do not count for the lane (only
    when `[routing] lane_by_uncached_tokens` is on; the caps count every token).
    """
    limits = limits or settings.limits
    override = lane_override(client, requested_lane, settings.lanes)
    prompt_tokens = calibrated(shape.prompt_tokens, token_ratio)
    check_prompt(prompt_tokens, limits, shape.prompt_param)
    budget = decide_output_budget(
        shape.requested_max_tokens,
        prompt_tokens,
        limits,
        n=shape.n,
        prompt_count=shape.prompt_count,
        param=(shape.max_tokens_fields or ("max_tokens",))[0],
        longest_prompt_tokens=calibrated(shape.longest_prompt_tokens, token_ratio),
    )
    lane_tokens = max(0, prompt_tokens - calibrated(cached_tokens, token_ratio))
    lane = override or choose_lane(settings.lanes, lane_tokens, budget.total)
    if lane is None:
        raise PromptTooLong(
            f"No lane admits a request of {prompt_tokens} prompt tokens and "
            f"{budget.total} output tokens.",
            param=shape.prompt_param,
        )
    check_lane_allowed(client, lane)
    return Admission(budget, lane, override_ignored=bool(requested_lane) and override is None)
