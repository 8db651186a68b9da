"""The matrix's traffic: chat turns beside long prompts, a real conversation trace, code.

- `chat`: the product's own mix (`loadgen.DEFAULT_MIX`): 80% chat turns of ~50 prompt
  tokens and 64 out, 20% prompts of ~3000 tokens and 512 out, Poisson arrivals;
- `prefill-heavy`: code-completion-like (`loadgen.PREFILL_HEAVY_MIX`): mostly long
  prompts with short outputs, Poisson;
- `conversation`: the Azure LLM inference trace's conversation service, its sizes *and*
  its arrivals (its bursts), a window of it chosen by the seed and rescaled in time;
- `chat-long-replies`: chat whose short turns get longer answers (128 tokens out beside
  prompts of ~3000 with 256), Poisson. On the CPU profiles it is exactly the real-engine
  benchmark's mix (`config/mix-real.toml`: ~50-token turns answered in 32, ~1500-token
  prompts in 64). Short requests that hold their slots longer show what `chat` hid: on
  an engine whose long prefill freezes every decode beside it, the real llama.cpp server
  missed the floor at 115% (1.5x) while the matrix's chat cells held at 1.0x.

A profile's prompt and output scales size them for its engine (`engines.py`). The rate
is set from the engine's measured capacity for the same sizes (`physics.capacity_rps`),
so a load of 0.8 means 80% of what the engines sustain of this very traffic.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from gateway.tools.loadgen.mix import DEFAULT_MIX, PREFILL_HEAVY_MIX, TrafficClass
from gateway.tools.replay.sources import Arrival, azure_trace

MIXES = ("chat", "conversation", "prefill-heavy", "chat-long-replies")
CHAT_LONG_REPLIES_MIX: list[TrafficClass] = [
    TrafficClass("short", 0.8, (80, 120), 128),
    TrafficClass("long", 0.2, (2800, 3200), 256),
]
POISSON_MIXES = {
    "chat": DEFAULT_MIX,
    "prefill-heavy": PREFILL_HEAVY_MIX,
    "chat-long-replies": CHAT_LONG_REPLIES_MIX,
}
#: Where the Azure trace is looked for: the hour beside the repository, else the 30-s
#: slice the tests carry.
_ROOT = Path(__file__).resolve().parents[3]
TRACE_PATHS = (
    _ROOT.parent / "shared" / "data" / "AzureLLMInferenceTrace_conv.csv",
    _ROOT / "tests" / "data" / "azure_conv_600s_30s.csv",
)


@dataclass(frozen=True, slots=True)
class Scale:
    prompt: float = 1.0
    output: float = 1.0

    def __call__(self, arrival: Arrival) -> Arrival:
        return replace(
            arrival,
            prompt_tokens=max(1, round(arrival.prompt_tokens * self.prompt)),
            max_tokens=max(1, round(arrival.max_tokens * self.output)),
        )


def sizes(mix: str, count: int, seed: int, scale: Scale) -> list[Arrival]:
    """`count` requests of `mix` with their sizes, all arriving at 0 (a closed loop's)."""
    return [replace(a, at_s=0.0) for a in arrivals(mix, 1.0, count, seed, scale)]


def arrivals(mix: str, rate: float, count: int, seed: int, scale: Scale) -> list[Arrival]:
    """`count` arrivals of `mix` at `rate` a second on average, sized by `scale`."""
    if mix == "conversation":
        drawn = _trace_window(count, seed)
    elif mix in POISSON_MIXES:
        drawn = _poisson(POISSON_MIXES[mix], count, seed)
    else:
        raise ValueError(f"unknown mix {mix!r}; the mixes are {', '.join(MIXES)}")
    span = drawn[-1].at_s - drawn[0].at_s if len(drawn) > 1 else 1.0
    stretch = (len(drawn) / span) / rate if span > 0 else 1.0
    start = drawn[0].at_s
    return [scale(replace(a, at_s=(a.at_s - start) * stretch)) for a in drawn]


def _poisson(mix: Sequence[TrafficClass], count: int, seed: int) -> list[Arrival]:
    """Poisson arrivals at one a second, each of a class drawn by its share."""
    rng = random.Random(f"matrix-{seed}")
    weights = [cls.share for cls in mix]
    at, drawn = 0.0, []
    for _ in range(count):
        at += rng.expovariate(1.0)
        cls = rng.choices(mix, weights=weights)[0]
        low, high = cls.max_tokens_bounds
        drawn.append(Arrival(at, rng.randint(*cls.prompt_tokens), rng.randint(low, high)))
    return drawn


_TRACE: list[Arrival] | None = None


def trace() -> list[Arrival]:
    """The conversation trace's arrivals (the first of `TRACE_PATHS` found), read once."""
    global _TRACE
    if _TRACE is None:
        path = next((p for p in TRACE_PATHS if p.exists()), None)
        if path is None:
            raise FileNotFoundError(
                "the conversation mix needs the Azure trace: " + " or ".join(map(str, TRACE_PATHS))
            )
        _TRACE = azure_trace(path)
    return _TRACE


def _trace_window(count: int, seed: int) -> list[Arrival]:
    """`count` consecutive arrivals of the trace from an offset the seed picks (wrapping
    around the end), its own gaps kept."""
    rows = trace()
    start = random.Random(f"matrix-trace-{seed}").randrange(len(rows))
    taken = [rows[(start + i) % len(rows)] for i in range(min(count, len(rows)))]
    at, window = 0.0, [replace(taken[0], at_s=0.0)]
    for before, row in zip(taken, taken[1:], strict=False):
        gap = row.at_s - before.at_s
        at += gap if gap >= 0 else 0.0  # across the wrap: back to back
        window.append(replace(row, at_s=at))
    return window
