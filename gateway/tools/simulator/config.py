"""The simulated server's knobs, in one dataclass that every part of the simulator reads.

The engine reads the timing knobs, the API modules read the context window,
default output length and model name, and the CLI turns each field into a flag;
keeping them in their own module lets all of those import it without importing
each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class SimulatorConfig:
    """The knobs of the simulated server; defaults make effects large (4000-token prefill ~2 s)."""

    #: Most sequences in the batch at once (prefilling or decoding); the rest wait FIFO.
    max_batch: int = 8
    #: Prompt tokens prefilled per step, taken FCFS across the running sequences.
    prefill_tokens_per_step: int = 512
    #: Fixed cost of one step (scheduling, kernel launches, sampling).
    step_base_ms: float = 5.0
    #: Extra step time per prompt token prefilled in the step.
    prefill_ms_per_token: float = 0.5
    #: Extra step time per sequence decoding a token in the step.
    decode_ms_per_seq: float = 0.5
    #: Output length when the request names no `max_tokens`.
    default_max_tokens: int = 256
    #: Context window: prompt + max_tokens above it is refused with a 400, as vLLM does.
    max_model_len: int = 32768
    #: Seeds the generated words (each request's text depends on seed and arrival order).
    seed: int = 0
    #: Model name served by `/v1/models` and echoed when a request names none.
    model: str = "sim-model"
    #: The simulator's own prompt count is tiktoken's times this: a backend whose tokenizer
    #: counts the same text differently from the gateway's (usage, context check, prefill).
    token_ratio: float = 1.0

    def __post_init__(self) -> None:
        for name in ("max_batch", "prefill_tokens_per_step", "default_max_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("step_base_ms", "prefill_ms_per_token", "decode_ms_per_seq"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if (
            self.step_base_ms == 0
            and self.prefill_ms_per_token == 0
            and self.decode_ms_per_seq == 0
        ):
            # A zero-length step would never yield to the event loop for long enough to matter
            # and makes every effect this simulator exists for vanish.
            raise ValueError("at least one of the step time knobs must be > 0")
        if not self.model:
            raise ValueError("model must be a non-empty name")
        if not (math.isfinite(self.token_ratio) and self.token_ratio > 0):
            raise ValueError(f"token_ratio must be > 0, got {self.token_ratio}")

    def backend_tokens(self, counted: int) -> int:
        """A prompt's length in this backend's own tokens, from the tiktoken count.

        Rounded half up and at least 1, so a short prompt never vanishes under a small
        ratio; an empty prompt stays empty, and a ratio of 1 changes nothing.
        """
        if counted <= 0 or self.token_ratio == 1.0:
            return counted
        return max(1, math.floor(counted * self.token_ratio + 0.5))

    def step_ms(self, prefilled_tokens: int, decoding_seqs: int) -> float:
        """How long a step with this much work takes."""
        return (
            self.step_base_ms
            + self.prefill_ms_per_token * prefilled_tokens
            + self.decode_ms_per_seq * decoding_seqs
        )
