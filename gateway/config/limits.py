"""[tokenizer] and [limits]: how a prompt is counted, and the caps on what a request asks.

One model's own caps, over these, are `[[models]] limits` (`models.ModelLimits`).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from gateway.config.constraints import NonEmpty, Positive, rule


class TokenizerSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    encoding: NonEmpty = "cl100k_base"
    #: Prompts with more characters than this are encoded in a worker thread.
    offload_min_chars: int = 16_384


class LimitsSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    max_prompt_tokens: Positive = 32_768
    default_max_tokens: Positive = 256
    max_output_tokens: Positive = 1024
    #: "clamp" lowers an over-cap max_tokens to the cap; "reject" answers 400.
    on_max_tokens_over: Literal["clamp", "reject"] = "clamp"
    #: The model's context window in tokens; 0 when unknown (no check).
    context_window: Annotated[int, rule("be >= 0 (0: unknown)", ge=0)] = 0
    #: Most choices (`n`) one request may ask for.
    max_n: Positive = 16
