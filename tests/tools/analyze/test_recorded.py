"""The four-part verdict on logs a real gateway wrote, in front of a simulator that batches 2.

Recorded with the engine split of #27 (`timing_source: engine`, from the
simulator's llama.cpp-style `timings`):

    python -m gateway simulate --port 18000 --max-batch 2 --timings llamacpp
    python -m gateway serve --config gw.toml --port 18080   # [[backends]] max_concurrency = 8, then 2
    python -m gateway loadgen --target http://127.0.0.1:18080 --rate 5 --duration 20 \\
        --class short:1:40-60:64

`batch2_slots8.log.gz`: eight slots for an engine that runs two; the slowest 10%
waited mostly in the engine, and the in-flight counts at dispatch say 2.
`batch2_slots2.log.gz`: the same load with the advised 2: the engine's queue is
gone and the wait is in the gateway's queue, where lanes and deadlines apply.

`retry_storm_undamped.log.gz`: the retry storm benchmark of #27 with damping off
(`[retries] damp = false`): a simulator behind 8 slots at 120% load, 30% of the
clients retrying every refusal at once, reusing their `x-request-id` (the gateway
marks those as retries of the line with the same id).
"""

from __future__ import annotations

import gzip
from pathlib import Path

from gateway.tools.analyze import analyze, format_report, load_records

RECORDED = Path(__file__).parent / "recorded"


def _analysis(name: str) -> dict:
    with gzip.open(RECORDED / name, "rt", encoding="utf-8") as stream:
        records, skipped = load_records(stream)
    return analyze(records, skipped=skipped, tail_fraction=0.1)


def test_slots_above_what_the_engine_batches_get_an_engine_queue_verdict_and_the_figure() -> None:
    analysis = _analysis("batch2_slots8.log.gz")
    assert analysis["requests"] == 85 and analysis["engine_split"] is True
    lane = analysis["lanes"]["interactive"]
    assert lane["timing_sources"] == {"engine": 85}
    tail = lane["tail"]
    assert tail["split"] == "four" and tail["verdict"] == "engine_queue"
    assert tail["parts"]["engine_queue_ms"]["share"] > 0.5
    [advice] = tail["engine_queue_advice"]
    assert advice["backend"] == "sim"
    assert advice["advised_max_concurrency"] == 2 and advice["first_queued_in_flight"] == 3
    slots = analysis["backends"]["sim"]["by_in_flight"]
    assert slots["1"]["queued"] == slots["2"]["queued"] == 0
    assert all(row["queued"] >= 0.9 * row["requests"] for n, row in slots.items() if int(n) > 2)
    report = format_report(analysis)
    assert max(len(line) for line in report.splitlines()) <= 100
    prose = " ".join(report.split())
    assert "max_concurrency (sim: 7 → 2)" in prose
    assert (
        "sim: 1: 0/7, 2: 0/13, 3: 24/25, 4: 29/29, 5: 2/2, 6: 6/6, 7: 3/3 → it batches 2: "
        "max_concurrency 2 (none queued in the engine at ≤ 2 in flight, queued from 3)"
    ) in prose


def test_the_advised_value_moves_the_wait_into_the_gateway() -> None:
    analysis = _analysis("batch2_slots2.log.gz")
    tail = analysis["lanes"]["interactive"]["tail"]
    assert tail["verdict"] == "queueing"
    assert tail["parts"]["engine_queue_ms"]["share"] < 0.02
    assert tail["parts"]["queue_ms"]["share"] > 0.9
    backend = analysis["backends"]["sim"]
    assert backend["max_in_flight"] == 2 and backend["first_queued_in_flight"] is None


def test_a_recorded_retry_storm_is_found_with_its_cost() -> None:
    retries = _analysis("retry_storm_undamped.log.gz")["retries"]
    assert (retries["requests"], retries["retries"]) == (709, 420)
    assert retries["verdict"] == "storm" and retries["storm_windows"] == 4
    # Every retry reused its id and is joined to the line before it, never to itself.
    assert retries["earlier_found"] == retries["judged_against_retry_after"] == 420
    assert retries["faster_than_told"] == 379 and retries["damped"] == 0
    assert retries["refusals"]["share"] > 0.9  # the refusals were mostly of retries
    assert 0.2 < retries["queue_ms"]["share"] < 0.35
    assert retries["over_max_retries"] > 300  # far beyond the seed's two retries
