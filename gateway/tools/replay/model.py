"""The engine model's capacity for a traffic mix, and the arrival scaling `--load` asks for.

A request costs its engine its prefill (prompt × ms per token) and its decode (output ×
the per-sequence decode cost plus its share of a full batch's fixed step time); one
engine serves 1000 / mean cost requests a second. `--load 1.2` rescales the arrival times
so the offered rate is 1.2 × that, times the backend count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gateway.tools.replay.sources import Arrival
from gateway.tools.simulator.config import SimulatorConfig


def request_cost_ms(arrival: Arrival, config: SimulatorConfig) -> float:
    per_output = config.decode_ms_per_seq + config.step_base_ms / config.max_batch
    return arrival.prompt_tokens * config.prefill_ms_per_token + arrival.max_tokens * per_output


def capacity_rps(arrivals: Sequence[Arrival], config: SimulatorConfig, backends: int) -> float:
    """Requests per second `backends` engines sustain for this mix."""
    mean = sum(request_cost_ms(a, config) for a in arrivals) / max(1, len(arrivals))
    return backends * 1000.0 / mean


def source_rps(arrivals: Sequence[Arrival]) -> float:
    span = arrivals[-1].at_s - arrivals[0].at_s if len(arrivals) > 1 else 0.0
    return len(arrivals) / span if span > 0 else float("inf")


def scaled(arrivals: Sequence[Arrival], factor: float) -> list[Arrival]:
    """Arrival times divided by `factor` (2: twice the rate)."""
    if not factor > 0:
        raise ValueError(f"the rate factor must be > 0, got {factor}")
    return [replace(a, at_s=a.at_s / factor) for a in arrivals]


def speed_for_load(
    arrivals: Sequence[Arrival], config: SimulatorConfig, backends: int, load: float
) -> float:
    """The rate factor that offers `load` × the engines' capacity."""
    return load * capacity_rps(arrivals, config, backends) / source_rps(arrivals)
