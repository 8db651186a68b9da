"""A gateway started fresh in front of a slow engine refuses nothing it would not refuse
an hour in (#40), in virtual time.

The issue's case: a slow whole-prompt engine (4 sequences, a 1500-token prompt ~6 s, a
50-token one ~0.2 s, 30 ms a token at four streams), a long request every 8 s and a
short one every 0.6 s for 30 s, below capacity (about 3 of its 4 slots busy). A gateway that had not learned the engine refused 17 of the 50 short
requests against its configured 5-s deadline, below what one long prefill takes; the
engine served them all.
"""

from __future__ import annotations

import msgspec

from gateway.config import BackendSettings, load_settings
from gateway.tools.replay.answers import ModelledEngine
from gateway.tools.replay.runs import classify, run_direct, run_gateway
from gateway.tools.replay.sources import Arrival
from gateway.tools.simulator.config import SimulatorConfig

SLOW_WHOLE_PROMPT = ModelledEngine(
    SimulatorConfig(
        prefix_cache=False,
        max_batch=4,
        prefill="whole",
        prefill_tokens_per_step=2048,
        step_base_ms=10.0,
        prefill_ms_per_token=4.0,
        decode_ms_per_seq=5.0,
    ),
    kind="llama.cpp",
    metrics=False,
)


def schedule(cycles: int) -> list[Arrival]:
    """The issue's 30 s of traffic (a long request every 8 s, a short one every 0.6 s),
    thinned to stay well below this engine's capacity (every 12 s, every 1.2 s), again
    after each 30-s pause."""
    arrivals = []
    for cycle in range(cycles):
        start = 60.0 * cycle
        arrivals += [Arrival(start + 12.0 * i, 1500, 64) for i in range(3)]
        arrivals += [Arrival(start + 0.3 + 1.2 * i, 50, 32) for i in range(25)]
    return sorted(arrivals, key=lambda a: a.at_s)


def test_a_fresh_gateway_refuses_nothing_it_would_not_refuse_an_hour_in() -> None:
    settings = msgspec.structs.replace(
        load_settings(None), backends=[BackendSettings(url="http://slow.invalid", name="slow")]
    )
    arrivals = schedule(cycles=4)
    classes = [classify(a, settings) for a in arrivals]
    short = settings.lanes[0].name
    direct = run_direct(arrivals, classes, 1, [SLOW_WHOLE_PROMPT]).results
    assert all(r.first_token is not None for r in direct)
    through = run_gateway(arrivals, classes, settings, [SLOW_WHOLE_PROMPT]).results
    refused = [
        (round(r.arrival), r.refused) for r in through if r.cls == short and r.refused is not None
    ]
    first_cycle = [moment for moment in refused if moment[0] < 60]
    assert first_cycle == [], f"refused while learning the engine: {first_cycle}"
    assert refused == [], f"short requests refused below capacity: {refused}"
