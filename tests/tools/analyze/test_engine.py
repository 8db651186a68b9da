"""The four-part verdict: gateway queue, engine queue, prefill, decode, and the slots a backend batches.

The logs come from `support.engine_run`, a gateway with N slots in front of an
engine that batches M, both first come first served: what the gateway sends
beyond M waits in the engine, so the answer is known before the analyzer runs.
"""

from __future__ import annotations

import pytest

from gateway.tools.analyze import analyze, format_report
from gateway.tools.analyze.analyzer import ENGINE_QUEUE_TEXT, TWO_PART_NOTE
from gateway.tools.analyze.engine import (
    ENGINE_FIELDS,
    ENGINE_QUEUE_CAUSES,
    _slots,
    backend_slots,
    engine_parts,
    engine_ran,
    four_part_verdict,
    queued_in_engine,
)
from tests.tools.analyze.support import bursts, engine_run, prefill_interference_log

#: Twenty bursts of eight requests 50 ms apart, one every 3 s: the engine has 4 seats.
BURSTS = bursts(20, 8, every_s=3.0, spacing_s=0.05)


def test_a_tail_waiting_in_the_engine_gets_the_max_concurrency_it_batches() -> None:
    """8 slots in front of an engine that batches 4: the 5th to 8th of each burst wait in it."""
    lines = engine_run(BURSTS, gateway_slots=8, engine_slots=4, prefill_s=0.1, decode_s=1.0)
    analysis = analyze(lines, tail_fraction=0.1)
    tail = analysis["lanes"]["interactive"]["tail"]
    assert tail["split"] == "four" and tail["split_note"] is None
    assert tail["verdict"] == "engine_queue"
    assert tail["parts"]["engine_queue_ms"] == {"mean_ms": 900.0, "share": pytest.approx(0.9, 1e-3)}
    assert tail["parts"]["prefill_ms"]["mean_ms"] == 100.0
    assert tail["parts"]["queue_ms"]["mean_ms"] == 0.0
    assert tail["timing_sources"] == {"engine": 16}
    assert tail["engine_queue_advice"] == [
        {
            "backend": "b0",
            "tail_engine_queue_ms": 16 * 900.0,
            "max_in_flight": 8,
            "first_queued_in_flight": 5,
            "advised_max_concurrency": 4,
            "basis": "none queued in the engine at ≤ 4 in flight, queued from 5",
            "note": None,
            "cause": "batch",
            "engine": None,
            "engine_setting": None,
            "engine_setting_measured": None,
        }
    ]
    assert tail["engine_queue_cause"] == analysis["backends"]["b0"]["engine_queue_cause"] == "batch"
    assert tail["verdict_text"] == (
        "engine-queue-bound → the backend has more slots than it batches: lower "
        "max_concurrency (b0: 8 → 4)"
    )
    slots = analysis["backends"]["b0"]["by_in_flight"]
    assert [slots[str(n)]["queued"] for n in range(1, 9)] == [0] * 4 + [20] * 4

    report = format_report(analysis)
    assert max(len(line) for line in report.splitlines()) <= 100
    prose = " ".join(report.split())
    assert "interactive: engine-queue-bound → the backend has more slots than it batches" in prose
    assert "engine queue 900.0 (90%), prefill 100.0 (10%)" in prose
    assert "timings of the slowest: engine 16" in prose
    assert (
        "b0: up to 8 in flight when requests were sent; none queued in the engine at ≤ 4 in flight, "
        "queued from 5: set its max_concurrency to 4"
    ) in prose
    assert "TIME SPLIT per lane and percentile band" in report


def test_the_advised_value_moves_the_wait_into_the_gateways_queue() -> None:
    """The same bursts with max_concurrency 4: no engine queue, the wait is the gateway's."""
    lines = engine_run(BURSTS, gateway_slots=4, engine_slots=4, prefill_s=0.1, decode_s=1.0)
    analysis = analyze(lines, tail_fraction=0.1)
    tail = analysis["lanes"]["interactive"]["tail"]
    assert tail["verdict"] == "queueing"
    assert tail["parts"]["engine_queue_ms"]["mean_ms"] == 0.0
    assert tail["parts"]["queue_ms"]["mean_ms"] == pytest.approx(900.0, abs=1)  # 0.2 s → 1.1 s
    assert analysis["backends"]["b0"]["max_in_flight"] == 4
    assert analysis["backends"]["b0"]["advised_max_concurrency"] is None


def test_a_slow_prefill_is_not_a_queue() -> None:
    """Long prompts on an idle engine: 2 s of prefill, 0.2 s of decode, nothing queued."""
    lines = engine_run(
        [3.0 * i for i in range(50)], gateway_slots=4, engine_slots=4, prefill_s=2.0, decode_s=0.2
    )
    tail = analyze(lines)["lanes"]["interactive"]["tail"]
    assert tail["verdict"] == "prefill"
    assert tail["verdict_text"].startswith("prefill-bound → the model is slow for this prompt size")
    assert tail["parts"]["prefill_ms"]["share"] == pytest.approx(1.0, abs=1e-3)
    assert tail["engine_queue_advice"] == []


def test_long_outputs_are_decode_bound_and_a_first_token_comes_before_decode() -> None:
    arrivals = [5.0 * i for i in range(30)]
    whole = engine_run(
        arrivals, gateway_slots=4, engine_slots=4, prefill_s=0.05, decode_s=3.0, stream=False
    )
    tail = analyze(whole)["lanes"]["interactive"]["tail"]
    assert tail["measures"] == {"e2e_ms": 1}
    assert tail["verdict"] == "decode"
    assert tail["verdict_text"].startswith("decode-bound → outputs are long")
    assert tail["parts"]["decode_ms"]["mean_ms"] == 3000.0
    # Streamed, the same requests are judged by TTFT, which ends before decode starts.
    streamed = engine_run(arrivals, gateway_slots=4, engine_slots=4, prefill_s=0.05, decode_s=3.0)
    tail = analyze(streamed)["lanes"]["interactive"]["tail"]
    assert tail["verdict"] == "prefill" and tail["parts"]["decode_ms"]["mean_ms"] == 0.0


def test_an_older_log_keeps_the_two_part_verdict_and_says_so() -> None:
    lines = engine_run(BURSTS, gateway_slots=8, engine_slots=4, prefill_s=0.1, decode_s=1.0)
    for line in lines:
        for field in (*ENGINE_FIELDS, "timing_source"):
            del line[field]
    analysis = analyze(lines, tail_fraction=0.1)
    tail = analysis["lanes"]["interactive"]["tail"]
    assert analysis["engine_split"] is False and "backends" not in analysis
    assert tail["split"] == "two" and tail["split_note"] == TWO_PART_NOTE["no_fields"]
    assert tail["verdict"] == "backend"
    assert tail["verdict_text"] == "backend-bound → capacity or request size"
    report = format_report(analysis)
    assert "two-part verdict: this log has no engine_queue_ms / prefill_ms / decode_ms" in report
    assert "TIME SPLIT" not in report


def test_a_tail_without_engine_timings_falls_back_too() -> None:
    """The fields are there but null (a backend that reported nothing, no estimate)."""
    lines = engine_run(BURSTS, gateway_slots=8, engine_slots=4, prefill_s=0.1, decode_s=1.0)
    for line in lines:
        line.update(dict.fromkeys(ENGINE_FIELDS), timing_source=None)
    tail = analyze(lines, tail_fraction=0.1)["lanes"]["interactive"]["tail"]
    assert tail["split"] == "two" and tail["split_note"] == TWO_PART_NOTE["no_split"]
    assert tail["verdict"] == "backend" and tail["timing_sources"] == {"none": 16}
    assert "two-part verdict: most of the slowest" in format_report(analyze(lines))


def test_engine_parts_add_up_to_the_backend_time() -> None:
    line = {"engine_queue_ms": 300.0, "prefill_ms": 300.0, "decode_ms": 50.0}
    # An estimate that overshoots the 400 ms measured is scaled down to it.
    parts = engine_parts(line | {"timing_source": "estimate"}, "ttft_ms", 400.0)
    assert parts == {
        "engine_queue_ms": 200.0,
        "prefill_ms": 200.0,
        "decode_ms": 0.0,  # TTFT ends at the first token
        "backend_other_ms": 0.0,
        "timing_source": "estimate",
    }
    parts = engine_parts(line, "e2e_ms", 1000.0)
    assert parts["decode_ms"] == 50.0 and parts["backend_other_ms"] == 350.0
    assert engine_parts({}, "ttft_ms", 10.0)["backend_other_ms"] == 10.0


def test_four_part_verdict_asks_wait_or_work_first() -> None:
    def kind(**parts: float) -> str | None:
        base = dict.fromkeys(("queue_ms", "engine_queue_ms", "prefill_ms", "decode_ms"), 0.0)
        return four_part_verdict(base | {"backend_other_ms": 0.0} | parts, 0.5)

    # 30 + 30 waiting of 100: the queues together dominate; the gateway's is the larger.
    assert kind(queue_ms=31, engine_queue_ms=30, prefill_ms=39) == "queueing"
    assert kind(queue_ms=20, engine_queue_ms=40, prefill_ms=40) == "engine_queue"
    assert kind(queue_ms=10, engine_queue_ms=30, prefill_ms=40, decode_ms=20) == "prefill"
    assert kind(engine_queue_ms=10, prefill_ms=10, decode_ms=80) == "decode"
    assert kind(prefill_ms=10, backend_other_ms=90) is None  # mostly unsplit: two-part
    assert kind() == "unknown"
    assert kind(queue_ms=1, prefill_ms=1, gateway_in_path_ms=5) == "gateway"


def test_slots_say_why_there_is_no_figure() -> None:
    alone = engine_run(
        [2.0 * i for i in range(10)], gateway_slots=2, engine_slots=2, prefill_s=0.1, decode_s=0.1
    )
    for line in alone:  # the engine is busy with someone else's work: it queues everyone
        line["engine_queue_ms"] = 500.0
    slots = backend_slots(alone)["b0"]
    assert slots["first_queued_in_flight"] == 1 and slots["advised_max_concurrency"] is None
    assert "even when sent alone" in slots["note"]
    calm = engine_run(BURSTS, gateway_slots=4, engine_slots=4, prefill_s=0.1, decode_s=1.0)
    slots = backend_slots(calm)["b0"]
    assert slots["advised_max_concurrency"] is None
    assert slots["note"] == "no in-flight count queued in the engine"


def test_bands_split_the_ranking_and_the_top_one_is_the_tail() -> None:
    lines = engine_run(BURSTS, gateway_slots=8, engine_slots=4, prefill_s=0.1, decode_s=1.0)
    tail = analyze(lines)["lanes"]["interactive"]["tail"]
    bands = {band["band"]: band for band in tail["bands"]}
    assert [bands[b]["requests"] for b in ("<P50", "P50-P90", "P90-P99", "≥P99")] == [80, 64, 14, 2]
    assert bands["<P50"]["engine_queue_ms"] == 0.0 and bands["<P50"]["prefill_ms"] == 100.0
    assert bands["≥P99"]["engine_queue_ms"] == 900.0
    assert bands["≥P99"]["requests"] == tail["size"]


def test_the_decode_step_under_way_is_not_an_engine_queue() -> None:
    """llama.cpp on a CPU starts a new prompt at the next step: ~one decode step of wait."""
    step = {"prefill_ms": 400.0, "tpot_ms": 110.0}
    assert queued_in_engine({**step, "engine_queue_ms": 95.0}) is False
    assert queued_in_engine({**step, "engine_queue_ms": 200.0}) is True
    assert queued_in_engine({"prefill_ms": 400.0, "engine_queue_ms": 95.0}) is True
    assert queued_in_engine({"prefill_ms": 400.0}) is None


def test_what_the_engine_ran_says_how_many_it_batches_when_every_send_queued() -> None:
    """A closed loop of 8 over 4 seats: after the first wave every request is sent at
    8 in flight and seated in waves of 4 (the first of a wave alone for a moment)."""
    spans = []
    for wave in range(6):
        for seat in range(4):
            start = max(0.0, wave - 1.0)  # sent when the wave before the last one ended
            waited_ms = (wave - start) * 1000.0 + seat  # seated a millisecond apart
            record = {"engine_queue_ms": waited_ms, "prefill_ms": 50.0, "tpot_ms": 10.0}
            spans.append((start, wave + 1.0, record))
    assert engine_ran(spans) == 4
    assert engine_ran(spans[:6]) is None  # two queued requests: too few to judge


def stream_line(index: int, tpot_ms: float) -> dict[str, object]:
    """A served stream of the interactive lane that waited 5 s in the gateway's queue."""
    return {
        "event": "request",
        "request_id": f"r{index}",
        "lane": "interactive",
        "outcome": "ok",
        "stream": True,
        "backend": "b0",
        "timestamp": f"2025-12-31T23:43:{index:02d}.000Z",
        "queue_ms": 5000.0,
        "backend_ttft_ms": 100.0,
        "ttft_ms": 5100.0,
        "tpot_ms": tpot_ms,
        "e2e_ms": 5100.0 + 31 * tpot_ms,
        "completion_tokens": 32,
    }


def test_a_queueing_tail_behind_stalled_decode_says_so() -> None:
    """A tenth of the streams decode at 4x the others' TPOT: the slots ahead were held longer."""
    stalled = [stream_line(i, 400.0 if i % 10 == 0 else 100.0) for i in range(40)]
    lane = analyze(stalled)["lanes"]["interactive"]
    assert lane["tail"]["verdict"] == "queueing"
    stall = lane["tail"]["decode_stall"]
    assert stall["stalled"] and stall["tpot_p95_over_p50"] == 4.0
    assert "decode stalled: TPOT P95 400.0 ms is 4.0x its P50" in format_report(analyze(stalled))
    steady = [stream_line(i, 110.0 if i % 10 == 0 else 100.0) for i in range(40)]
    assert not analyze(steady)["lanes"]["interactive"]["tail"]["decode_stall"]["stalled"]
    assert "decode stalled" not in format_report(analyze(steady))


def chunked_engine_spans(with_long_prompts: bool) -> list[tuple[float, float, dict[str, object]]]:
    """A chunked-prefill engine of 16 seats, never full: every 2 s a 3000-token prompt
    prefills for 0.6 s, and the short prompts sent meanwhile wait out its chunks."""
    spans: list[tuple[float, float, dict[str, object]]] = []
    for second in range(0, 40, 2):
        if with_long_prompts:
            long = {"prompt_tokens": 3000, "backend_ttft_ms": 600.0, "prefill_ms": 600.0,
                    "engine_queue_ms": 0.0, "tpot_ms": 12.0}  # fmt: skip
            spans.append((float(second), second + 6.0, long))
        else:  # a full engine instead: a running request ends as the waiting ones are seated
            done = {"prompt_tokens": 50, "backend_ttft_ms": 20.0, "prefill_ms": 20.0,
                    "engine_queue_ms": 0.0, "tpot_ms": 12.0}  # fmt: skip
            spans.append((second - 1.0, second + 0.6, done))
        for k in range(4):  # sent 0.1-0.4 s into the long prefill, at 2..5 in flight
            at = second + 0.1 * (k + 1)
            waited = (second + 0.6 - at) * 1000.0
            short = {"prompt_tokens": 50, "backend_ttft_ms": waited + 20.0, "prefill_ms": 20.0,
                     "engine_queue_ms": waited, "tpot_ms": 12.0}  # fmt: skip
            spans.append((at, at + 1.0, short))
    return spans


def test_a_wait_behind_a_long_prefill_is_prefill_interference_not_too_many_slots() -> None:
    """On vLLM-style chunked prefill the analyzer said "it batches 6: max_concurrency 6"
    of an engine of 16, whose short requests waited for a long prompt's chunks."""
    slots = _slots(chunked_engine_spans(with_long_prompts=True))
    assert slots["advised_max_concurrency"] is None
    assert slots["behind_prefill"] == 80
    assert "prefill interference" in slots["note"] and slots["engine_queue_cause"] == "prefill"
    # The same waits with no long prompt in prefill: a queue for a batch place.
    slots = _slots(chunked_engine_spans(with_long_prompts=False))
    assert slots["behind_prefill"] == 0 and slots["first_queued_in_flight"] is not None


def test_a_tail_behind_long_prefills_gets_one_advice_and_it_is_not_fewer_slots() -> None:
    """#51: the headline said "engine-queue-bound → lower max_concurrency" above the
    backend's line saying "prefill interference, not too many slots". Both now come from
    one decision: the backend's reading of why its engine queued."""
    analysis = analyze(prefill_interference_log())
    backend = analysis["backends"]["b0"]
    assert backend["engine_queue_cause"] == "prefill" and backend["behind_prefill"] == 80
    assert backend["advised_max_concurrency"] is None
    tail = analysis["lanes"]["interactive"]["tail"]
    assert tail["verdict"] == "engine_queue"  # where the time went: the engine's queue ...
    assert tail["engine_queue_cause"] == "prefill"  # ... and why: not the slots
    [advice] = tail["engine_queue_advice"]
    assert advice["cause"] == "prefill" and advice["note"] == backend["note"]
    assert tail["verdict_text"] == ENGINE_QUEUE_TEXT["prefill"]

    report = format_report(analysis)
    assert max(len(line) for line in report.splitlines()) <= 100
    prose = " ".join(report.split())
    assert "lower max_concurrency" not in prose and "set its max_concurrency" not in prose
    headline = (
        "interactive: engine-queue-bound behind other prompts' prefill → prefill interference, "
        "not too many slots: keep max_concurrency"
    )
    detail = "b0: up to 9 in flight when requests were sent; no figure: 80 requests waited"
    assert headline in prose and detail in prose
    assert prose.index(headline) < prose.index(detail)
    assert "prefill interference, not too many slots" in prose[prose.index(detail) :]


def test_only_a_queue_for_a_batch_place_asks_for_fewer_slots() -> None:
    """Every cause of an engine queue has its headline, and only one of them lowers the slots."""
    assert set(ENGINE_QUEUE_TEXT) == set(ENGINE_QUEUE_CAUSES)
    lowering = [c for c, text in ENGINE_QUEUE_TEXT.items() if "lower max_concurrency" in text]
    assert lowering == ["batch"]


def test_a_burst_that_waits_a_few_steps_in_an_idle_engine_is_not_a_full_batch() -> None:
    """60 streams at once to two identical 8-sequence engines read "max_concurrency 1" for
    one and 8 for the other: the first of a burst wait a few steps for their prefills
    (40-55 ms beside 9 ms decode steps) while nothing there ends, so no seat was waited
    for."""
    spans: list[tuple[float, float, dict[str, object]]] = []
    for burst in (0.0, 15.0):
        for k in range(7):
            waited = 55.0 - 3.0 * k
            line = {"prompt_tokens": 14, "backend_ttft_ms": waited + 12.0, "prefill_ms": 12.0,
                    "engine_queue_ms": waited, "tpot_ms": 9.0}  # fmt: skip
            spans.append((burst + 0.0001 * k, burst + 0.4, line))
    slots = _slots(spans)
    assert slots["first_queued_in_flight"] is None and slots["advised_max_concurrency"] is None
    assert slots["no_seat_freed"] == 14
    assert "while none there ended" in slots["note"]
    assert slots["engine_queue_cause"] == "steps"


@pytest.mark.parametrize("engine", ["vllm", "llama.cpp", None])
def test_the_engine_setting_that_measured_better_is_named_for_its_engine_only(
    engine: str | None,
) -> None:
    """Behind other prompts' prefill the door can do no more; on vLLM a cap on a long
    prompt's share of a step measured better (docs/benchmarks.md), on llama.cpp no
    batch size did: named for vLLM, with its figure; nothing for the others."""
    log = [{**line, "engine": engine} for line in prefill_interference_log()]
    tail = analyze(log)["lanes"]["interactive"]["tail"]
    [advice] = tail["engine_queue_advice"]
    report = " ".join(format_report(analyze(log)).split())
    if engine == "vllm":
        assert advice["engine_setting"] == "--long-prefill-token-threshold 128"
        assert "0.96 s" in advice["engine_setting_measured"]
        assert tail["verdict_text"].startswith(ENGINE_QUEUE_TEXT["prefill"])
        assert "vllm --long-prefill-token-threshold 128" in tail["verdict_text"]
        assert "Its engine (vllm) can do what the door cannot" in report
    else:
        assert advice["engine"] == engine and advice["engine_setting"] is None
        assert tail["verdict_text"] == ENGINE_QUEUE_TEXT["prefill"]
        assert "threshold" not in report and "ubatch" not in report
    assert max(len(line) for line in format_report(analyze(log)).splitlines()) <= 100
