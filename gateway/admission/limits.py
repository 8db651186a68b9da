"""Server-side caps on prompt and output size: pure functions over plain values.

A client that omits `max_tokens` lets the backend generate up to the context
window, which is exactly the request that drags a batch's tail; so a default is
injected, and an over-cap value is clamped (or refused) before scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import LimitsSettings
from gateway.outcomes import ContextLengthExceeded, InvalidRequest, MaxTokensTooLarge, PromptTooLong


@dataclass(slots=True, frozen=True)
class OutputBudget:
    """The output size in force for one request, and how it was decided."""

    #: What the client asked for; None when it did not say.
    requested: int | None
    #: The max_tokens sent to the backend (per choice, per prompt).
    max_tokens: int
    clamped: bool
    n: int = 1
    prompt_count: int = 1

    @property
    def total(self) -> int:
        """Tokens the backend may generate for the whole request."""
        return self.max_tokens * self.n * self.prompt_count


def smallest_cap(*values: int | None) -> int | None:
    """The smallest output cap the client set over the fields its API knows; None if none."""
    given = [v for v in values if v is not None]
    return min(given) if given else None


def check_n(n: int | None, limits: LimitsSettings, param: str = "n") -> int:
    """Choices per prompt (`n`, TGI's `best_of`): 1 when absent, at most `max_n`."""
    if n is None:
        return 1
    if n > limits.max_n:
        raise InvalidRequest(f"'{param}' must be at most {limits.max_n}", param=param)
    return n


def check_prompt(prompt_tokens: int, limits: LimitsSettings, param: str = "messages") -> None:
    if prompt_tokens > limits.max_prompt_tokens:
        raise PromptTooLong(
            f"The prompt has {prompt_tokens} tokens; this gateway accepts at most "
            f"{limits.max_prompt_tokens}. Shorten it or split the work.",
            param=param,
        )


def decide_output_budget(
    requested: int | None,
    prompt_tokens: int,
    limits: LimitsSettings,
    *,
    n: int = 1,
    prompt_count: int = 1,
    param: str = "max_tokens",
    longest_prompt_tokens: int | None = None,
) -> OutputBudget:
    """Default, clamp or refuse max_tokens, then check the context window.

    The window holds one prompt and its output: for a batch of prompts it is
    checked against the longest one (`longest_prompt_tokens`).
    """
    clamped = False
    if requested is None:
        max_tokens = limits.default_max_tokens
    elif requested > limits.max_output_tokens:
        if limits.on_max_tokens_over == "reject":
            raise MaxTokensTooLarge(
                f"'{param}' is {requested}; this gateway allows at most {limits.max_output_tokens}.",
                param=param,
            )
        max_tokens, clamped = limits.max_output_tokens, True
    else:
        max_tokens = requested
    window = limits.context_window
    if window:
        longest = prompt_tokens if longest_prompt_tokens is None else longest_prompt_tokens
        room = window - longest
        if room < 1 or (requested is not None and not clamped and max_tokens > room):
            raise ContextLengthExceeded(
                f"This model's context window is {window} tokens; the prompt has {longest} "
                f"and {param} asks for {max_tokens}.",
                param=param,
            )
        if max_tokens > room:  # a default or clamped value: fit it to the window
            max_tokens, clamped = room, requested is not None
    return OutputBudget(requested, max_tokens, clamped, n=n, prompt_count=prompt_count)
