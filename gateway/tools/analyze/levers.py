"""The engine settings that measured better against the wait no door can remove.

A short prompt that reaches an engine while a long one is in prefill waits for that
prefill inside the engine: the gateway decides when a request is sent, not what the
engine computes first. Some engines have a setting that changes that. Each entry
here was measured on a real engine (`scripts/bench_levers.py`: a short prompt sent
after one long prompt began its prefill, and a closed loop's throughput, the setting
on and off; docs/benchmarks.md has the runs), and the analyzer names it only under
the tail it fixes: an engine queue behind other prompts' prefill (`engine_queue_cause`
"prefill") on a backend whose log lines say it runs that engine. An engine with no
entry gets no advice: for llama.cpp's server, smaller `--batch-size`/`--ubatch-size`
(256, 64) were measured and did not let the short prompt in sooner (its slot's batch
is filled with the long prompt's tokens first), and cost throughput.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Lever:
    setting: str
    measured: str


#: Engine (as the log's `engine` names it) → the setting, with what it measured.
LEVERS = {
    "vllm": Lever(
        setting="--long-prefill-token-threshold 128",
        measured=(
            "on vLLM 0.32 (CPU, 512 batched tokens a step) a short prompt behind a "
            "2,900-token prefill waited 0.25 s instead of 0.96 s (median of 9), with the "
            "same throughput (1.27 vs 1.26 requests/s): the long prompt takes at most 128 "
            "tokens of a step, and a waiting prompt joins the step"
        ),
    ),
}


def lever_for(engine: object, cause: object) -> Lever | None:
    """The setting for a tail that queued in `engine` behind other prompts' prefill."""
    if cause != "prefill" or not isinstance(engine, str):
        return None
    return LEVERS.get(engine)
