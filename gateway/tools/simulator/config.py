"""The simulated server's knobs, in one dataclass that every part of the simulator reads.

The engine reads the timing knobs, the API modules read the context window,
default output length and model name, and the CLI turns each field into a flag;
keeping them in their own module lets all of those import it without importing
each other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.tools.simulator.prefix_cache import DEFAULT_BLOCK_TOKENS, PromptBlocks, prompt_blocks

#: The prefix cache's default size: 16384 blocks of 16 tokens = 262,144 tokens, the KV the
#: default batch could hold at full context (8 x 32,768, what `vllm:gpu_cache_usage_perc`
#: is measured against). That is room for ~130 cached 2000-token conversations, 16 times
#: `max_batch` of them, the order of a GPU server's pool (vLLM gives a Llama-3-8B ~450k
#: tokens on an 80 GB card); a benchmark with fewer conversations than that never evicts.
DEFAULT_PREFIX_CACHE_BLOCKS = 16_384
#: What the simulator tells of where each request's time went (`timings`, below).
TIMINGS_MODES = ("vllm", "llamacpp", "none")
#: How the engine prefills (`prefill`, below): prompts cut into chunks of a per-step token
#: budget, first come first served across the batch (vLLM and SGLang; llama.cpp, whose
#: budget is `n_batch`, 2048 by default), or whole prompts, several to a step up to the
#: budget, with the batch's decoding paused meanwhile (TGI's token-budget batching).
PREFILL_MODES = ("chunked", "whole")
#: Which engine's info routes the simulator answers as (`pose_as`, below).
POSES = ("simulator", "vllm", "tgi", "llama.cpp")
#: `owned_by` of its `/v1/models` cards, per pose (what each engine writes there).
OWNED_BY = {"simulator": "simulator", "vllm": "vllm", "llama.cpp": "llamacpp"}


@dataclass(slots=True)
class SimulatorConfig:
    """The knobs of the simulated server; defaults make effects large (4000-token prefill ~2 s)."""

    #: Most sequences in the batch at once (prefilling or decoding); the rest wait FIFO.
    max_batch: int = 8
    #: TGI's `max_batch_total_tokens` (0: no such bound): a waiting sequence joins the
    #: batch, first come first served, only while the prompt tokens and `max_tokens` of
    #: all it runs fit in it (TGI's router reserves a request's whole output at
    #: admission); told in `/info` when it poses as TGI.
    max_batch_tokens: int = 0
    #: Prompt tokens prefilled per step, taken FCFS across the running sequences.
    prefill_tokens_per_step: int = 512
    #: "chunked": each step prefills up to `prefill_tokens_per_step` prompt tokens, a long
    #: prompt over several steps, and decodes the rest of the batch (vLLM, SGLang,
    #: llama.cpp); "whole": a step that prefills takes whole prompts, first come first
    #: served, as many as fit in `prefill_tokens_per_step` (at least one), and nobody
    #: decodes in it (TGI's prefill batches).
    prefill: str = "chunked"
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
    #: Automatic prefix caching (vLLM V1's and llama.cpp's default): a prompt whose leading
    #: blocks are cached skips their prefill and reports them as `cached_tokens`.
    prefix_cache: bool = True
    #: Tokens per KV block (vLLM's `--block-size`); only full blocks are cached.
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    #: KV blocks the prefix cache holds, pinned (running) and evictable (LRU) together.
    prefix_cache_blocks: int = DEFAULT_PREFIX_CACHE_BLOCKS
    #: A sequence aborted before its prompt is prefilled leaves the blocks it filled in the
    #: prefix cache. Off, as measured on vLLM 0.32 (its CPU build): a prompt aborted
    #: mid-prefill and sent again found none of it cached (0 hits, its whole prefill
    #: again), though one aborted after its prefill found all of it.
    keep_aborted_prefill: bool = False
    #: Where each request's time went (queue in the engine, prefill, decode), told as:
    #: "vllm", vLLM's request time histograms in /metrics (and nothing per answer, as
    #: vLLM); "llamacpp", those and llama.cpp's `timings` object in every OpenAI answer
    #: (the non-streamed body, the stream's last event); "none", neither. The TGI routes
    #: send TGI's timing headers on non-streamed answers whatever this says.
    timings: str = "vllm"
    #: LoRA adapters served on top of `model`, comma-separated (vLLM's `--lora-modules`):
    #: listed by /v1/models with `parent` = model; a request names one as its `model`.
    lora_adapters: str = ""
    #: Serve LoRA adapters even with none at start (vLLM's `--enable-lora`), so they can be
    #: added with POST /v1/load_lora_adapter; implied by `lora_adapters`.
    enable_lora: bool = False
    #: Distinct adapters that may run in one batch, and adapters resident on the GPU
    #: (vLLM's `--max-loras`, default 1).
    max_lora: int = 1
    #: Time added to a step that loads an adapter not resident (a swap).
    lora_swap_ms: float = 25.0
    #: Answer 404 `model_not_found` for a `model` it does not serve, as vLLM and SGLang
    #: do; off: any name is answered, as llama.cpp does (LoRA serving implies it).
    strict_model: bool = False
    #: Which engine it answers its info routes as, so a gateway's engine detection meets
    #: what it meets in the field: "simulator" (llama.cpp's /props with a `simulator`
    #: object, /v1/models owned by "simulator", TGI's /info); "vllm" (no /props nor
    #: /info, /v1/models owned by "vllm", and strict: vLLM answers 404 for a model it does
    #: not serve); "tgi" (/info only, no /props nor /v1/models; any name is answered, TGI
    #: ignores `model`); "llama.cpp" (/props as llama.cpp's, /v1/models owned by
    #: "llamacpp", no /info; any name answered). The serving routes stay the same.
    pose_as: str = "simulator"

    @property
    def tgi_batch_tokens(self) -> int:
        """The `max_batch_total_tokens` it tells as TGI (which always tells one): the
        configured bound, else all of its sequences at full context, a bound that never
        binds before `max_batch`."""
        return self.max_batch_tokens or self.max_batch * self.max_model_len

    @property
    def strict(self) -> bool:
        """A `model` it does not serve is a 404 (`strict_model`, or posing as vLLM)."""
        return self.strict_model or self.pose_as == "vllm"

    @property
    def lora(self) -> bool:
        """LoRA serving is on (adapters given, or enabled for loading at run time)."""
        return self.enable_lora or bool(self.lora_adapters.strip())

    def __post_init__(self) -> None:
        for name in (
            "max_batch",
            "prefill_tokens_per_step",
            "default_max_tokens",
            "max_model_len",
            "block_tokens",
            "prefix_cache_blocks",
            "max_lora",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_batch_tokens < 0:
            raise ValueError(f"max_batch_tokens must be >= 0, got {self.max_batch_tokens}")
        for name in ("step_base_ms", "prefill_ms_per_token", "decode_ms_per_seq", "lora_swap_ms"):
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
        if self.prefill not in PREFILL_MODES:
            raise ValueError(
                f"prefill must be one of {', '.join(PREFILL_MODES)}, got {self.prefill!r}"
            )
        if self.timings not in TIMINGS_MODES:
            raise ValueError(
                f"timings must be one of {', '.join(TIMINGS_MODES)}, got {self.timings!r}"
            )
        if self.pose_as not in POSES:
            raise ValueError(f"pose_as must be one of {', '.join(POSES)}, got {self.pose_as!r}")
        if self.model in [a.strip() for a in self.lora_adapters.split(",")]:
            raise ValueError("lora_adapters must not name the base model")
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

    def backend_token_ids(self, token_ids: Sequence[int]) -> list[int]:
        """The prompt's ids in this backend's own tokens: `backend_tokens(len(ids))` of them.

        Position i takes tiktoken's id at i / token_ratio, a mapping that depends on the
        position alone, so a shared prefix of two prompts stays a shared prefix.
        """
        if self.token_ratio == 1.0:
            return list(token_ids)
        ratio = self.token_ratio
        return [token_ids[int(i / ratio)] for i in range(self.backend_tokens(len(token_ids)))]

    def backend_prompt(
        self, token_ids: Sequence[int], keep_last: int | None = None
    ) -> PromptBlocks:
        """A prompt's length in backend tokens and, with the prefix cache on, its blocks.

        `keep_last`: TGI's `truncate`, which keeps the prompt's last tokens.
        """
        ids = self.backend_token_ids(token_ids)
        if keep_last is not None and 0 < keep_last < len(ids):
            ids = ids[-keep_last:]
        if not self.prefix_cache:
            return PromptBlocks(tokens=len(ids))
        return prompt_blocks(ids, self.block_tokens)

    def describe(self) -> str:
        """What engine this models, in one line (its /props and /info say it)."""
        prefill = (
            f"chunked prefill, {self.prefill_tokens_per_step} prompt tokens a step"
            if self.prefill == "chunked"
            else f"whole-prompt prefill batches of up to {self.prefill_tokens_per_step} tokens"
        )
        return (
            f"llm-tail-gateway simulator: {self.max_batch} sequences a batch, {prefill}; "
            f"step {self.step_base_ms:g} ms + {self.prefill_ms_per_token:g} ms a prompt token "
            f"+ {self.decode_ms_per_seq:g} ms a decoding sequence"
        )

    def step_ms(self, prefilled_tokens: int, decoding_seqs: int) -> float:
        """How long a step with this much work takes."""
        return (
            self.step_base_ms
            + self.prefill_ms_per_token * prefilled_tokens
            + self.decode_ms_per_seq * decoding_seqs
        )
