"""The engines a replay runs against: the simulator's own continuous-batching engine,
stepped on the replay's virtual clock.

The engine is not re-modelled here: `Engine` is the very class the simulator serves
with (chunked first-come prefill, one decode token per running sequence per step),
run on the virtual loop, so its `asyncio.sleep` between steps costs nothing. Its
knobs come from the flags, else from what the source measured (our log's time per
output token and prefill milliseconds per token), else the simulator's defaults —
the same engine `gateway serve` starts when no backend is configured.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

from gateway.tools.replay.sources import Source
from gateway.tools.simulator.config import SimulatorConfig
from gateway.tools.simulator.engine import Engine, Sequence, TokenEvent


@dataclass(frozen=True, slots=True)
class EngineModel:
    """One engine's knobs, and where each came from (printed with every result)."""

    config: SimulatorConfig
    origin: dict[str, str]

    def describe(self) -> str:
        c = self.config
        parts = [
            f"slots={c.max_batch}",
            f"prefill_tokens_per_step={c.prefill_tokens_per_step}",
            f"step_base_ms={c.step_base_ms:g}",
            f"prefill_ms_per_token={c.prefill_ms_per_token:g}",
            f"decode_ms_per_seq={c.decode_ms_per_seq:g}",
        ]
        sources = sorted(set(self.origin.values()))
        return " ".join(parts) + f" (from {', '.join(sources)})"

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "slots": c.max_batch,
            "prefill_tokens_per_step": c.prefill_tokens_per_step,
            "step_base_ms": c.step_base_ms,
            "prefill_ms_per_token": c.prefill_ms_per_token,
            "decode_ms_per_seq": c.decode_ms_per_seq,
            "origin": dict(self.origin),
        }


#: Flag names (as `engine_model` takes them) and the SimulatorConfig field each sets.
KNOBS = {
    "slots": "max_batch",
    "prefill_tokens_per_step": "prefill_tokens_per_step",
    "step_base_ms": "step_base_ms",
    "prefill_ms_per_token": "prefill_ms_per_token",
    "decode_ms_per_seq": "decode_ms_per_seq",
}


def engine_model(source: Source | None = None, **flags: float | int | None) -> EngineModel:
    """Flags first, then the source's measured figures, then the simulator's defaults.

    A measured time per output token is one step of a batch that was decoding: with
    `slots` sequences it is `step_base_ms + decode_ms_per_seq * slots`, so the decode
    cost per sequence is what is left after the fixed step cost (never below zero).
    """
    unknown = set(flags) - set(KNOBS)
    if unknown:
        raise ValueError(f"unknown engine knobs: {', '.join(sorted(unknown))}")
    defaults = SimulatorConfig(prefix_cache=False)
    values: dict[str, Any] = {}
    origin = {name: "simulator defaults" for name in KNOBS}
    for name, value in flags.items():
        if value is not None:
            values[KNOBS[name]] = value
            origin[name] = "flags"
    if source is not None and source.prefill_ms_per_token is not None:
        if "prefill_ms_per_token" not in values:
            values["prefill_ms_per_token"] = round(source.prefill_ms_per_token, 4)
            origin["prefill_ms_per_token"] = "source log"
    if source is not None and source.tpot_ms is not None and "decode_ms_per_seq" not in values:
        slots = int(values.get("max_batch", defaults.max_batch))
        base = float(values.get("step_base_ms", defaults.step_base_ms))
        values["decode_ms_per_seq"] = round(max(0.0, (source.tpot_ms - base) / slots), 4)
        origin["decode_ms_per_seq"] = "source log"
    return EngineModel(replace(defaults, **values), origin)


@dataclass(slots=True)
class Generation:
    """One request on an engine: when its first and last token came (virtual seconds)."""

    first_token: asyncio.Future[float]
    done: asyncio.Future[float]


class VirtualEngine:
    """One simulator `Engine` on the running (virtual) loop, read by its first and last
    token only: the engine's per-token queue would cost a task switch per token."""

    def __init__(self, name: str, config: SimulatorConfig) -> None:
        self.name = name
        self.engine = Engine(config)
        self.engine.on_token = self._on_token
        self._generations: dict[int, Generation] = {}

    def start(self) -> None:
        self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()

    @property
    def in_flight(self) -> int:
        return self.engine.in_flight

    def submit(self, prompt_tokens: int, max_tokens: int) -> Generation:
        loop = asyncio.get_running_loop()
        seq = self.engine.submit(prompt_tokens, max_tokens)
        generation = Generation(loop.create_future(), loop.create_future())
        self._generations[seq.seq_id] = generation
        return generation

    def _on_token(self, seq: Sequence, event: TokenEvent) -> None:
        generation = self._generations[seq.seq_id]
        if seq.generated == 1:
            generation.first_token.set_result(self.engine.now())
        if event.finish_reason is not None:
            del self._generations[seq.seq_id]
            generation.done.set_result(self.engine.now())


def engines(model: EngineModel, count: int) -> list[VirtualEngine]:
    return [VirtualEngine(f"engine{i}", model.config) for i in range(count)]

