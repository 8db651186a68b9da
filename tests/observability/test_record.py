"""RequestRecord: every duration is computed from its timestamps, one way, and an absent
timestamp gives an absent duration (null in the log), never a made-up number.

Timestamps are plain floats in seconds (whatever the clock), durations milliseconds.
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.observability.record import RequestRecord
from gateway.upstream.engine_timings import EngineTimings

#: A streamed request, in seconds: queued 0.25 s after arrival, dispatched 0.5 s later,
#: first byte and first token 0.75 s after that, then 4 more tokens in 2 s.
ARRIVAL = 100.0
ENQUEUED = 100.25
DISPATCHED = 100.75
FIRST_BYTE = 101.25
FIRST_TOKEN = 101.5
END = 103.5


def served(**changes: Any) -> RequestRecord:
    fields: dict[str, Any] = {
        "request_id": "r-1",
        "route": "/v1/chat/completions",
        "arrival": ARRIVAL,
        "model": "sim-model",
        "stream": True,
        "lane": "interactive",
        "backend": "b0",
        "status": 200,
        "outcome": "ok",
        "prompt_tokens": 12,
        "max_tokens_requested": 64,
        "max_tokens": 64,
        "completion_tokens": 5,
        "attempts": 1,
        "enqueued": ENQUEUED,
        "dispatched": DISPATCHED,
        "first_byte": FIRST_BYTE,
        "first_token": FIRST_TOKEN,
        "end": END,
    }
    fields.update(changes)
    return RequestRecord(**fields)


def test_durations_are_computed_from_the_timestamps_in_milliseconds() -> None:
    record = served()
    assert record.queue_ms == pytest.approx(500.0)  # enqueued -> dispatched
    assert record.backend_ttft_ms == pytest.approx(750.0)  # dispatched -> first token
    assert record.ttft_ms == pytest.approx(1500.0)  # arrival -> first token
    assert record.e2e_ms == pytest.approx(3500.0)  # arrival -> end
    assert record.tpot_ms == pytest.approx(500.0)  # 2 s over the 4 tokens after the first


def test_the_user_felt_ttft_is_queue_plus_admission_plus_backend_ttft() -> None:
    record = served()
    admission_ms = (ENQUEUED - ARRIVAL) * 1000
    assert record.ttft_ms == pytest.approx(admission_ms + record.queue_ms + record.backend_ttft_ms)


def test_durations_keep_sub_millisecond_precision() -> None:
    record = served(arrival=10.0, first_token=10.0123456, end=10.5)
    assert record.ttft_ms == pytest.approx(12.346, abs=0.001)


def test_a_request_that_never_got_a_slot_waited_in_the_queue_until_its_end() -> None:
    record = served(
        status=503,
        outcome="queue_timeout",
        backend=None,
        completion_tokens=None,
        attempts=0,
        dispatched=None,
        first_byte=None,
        first_token=None,
        end=ENQUEUED + 2.0,
    )
    assert record.queue_ms == pytest.approx(2000.0)
    assert record.backend_ttft_ms is None
    assert record.ttft_ms is None
    assert record.tpot_ms is None
    assert record.e2e_ms == pytest.approx(2250.0)


def test_a_request_refused_before_the_queue_has_no_queue_time() -> None:
    record = RequestRecord(request_id="r-2", route="/v1/chat/completions", arrival=ARRIVAL)
    record.status, record.outcome, record.end = 413, "rejected_prompt_too_long", ARRIVAL + 0.01
    assert record.queue_ms is None
    assert record.backend_ttft_ms is None
    assert record.ttft_ms is None
    assert record.tpot_ms is None
    assert record.e2e_ms == pytest.approx(10.0)


def test_a_record_still_running_has_no_end_to_end_time() -> None:
    record = served(end=None)
    assert record.e2e_ms is None
    assert record.tpot_ms is None
    assert record.queue_ms == pytest.approx(500.0)  # dispatched: the queue time is known


def test_queue_time_is_none_when_neither_dispatch_nor_end_is_known() -> None:
    assert served(dispatched=None, end=None).queue_ms is None


@pytest.mark.parametrize("tokens", [None, 0, 1])
def test_tpot_needs_at_least_two_tokens(tokens: int | None) -> None:
    assert served(completion_tokens=tokens).tpot_ms is None


def test_tpot_of_two_tokens_is_the_gap_between_them() -> None:
    record = served(completion_tokens=2, first_token=101.5, end=101.75)
    assert record.tpot_ms == pytest.approx(250.0)


def test_tpot_needs_a_first_token() -> None:
    assert served(first_token=None).tpot_ms is None


def test_log_fields_carry_the_durations_and_leave_absent_values_none() -> None:
    fields = served(dispatched=None, first_token=None, completion_tokens=None).log_fields()
    assert fields["request_id"] == "r-1"
    assert fields["route"] == "/v1/chat/completions"
    assert (fields["lane"], fields["status"], fields["outcome"]) == ("interactive", 200, "ok")
    assert fields["queue_ms"] == pytest.approx((END - ENQUEUED) * 1000)
    for name in ("backend_ttft_ms", "ttft_ms", "tpot_ms", "completion_tokens", "client"):
        assert name in fields and fields[name] is None, name
    assert fields["e2e_ms"] == pytest.approx(3500.0)


def test_the_backend_time_split_is_logged_in_ms_with_its_source() -> None:
    record = RequestRecord("r", "/v1/chat/completions", arrival=1.0)
    fields = record.log_fields()
    assert [fields[k] for k in ("engine_queue_ms", "prefill_ms", "decode_ms", "timing_source")] == [
        None
    ] * 4
    record.timings = EngineTimings(0.0123456, 0.5, None, "engine_window")
    fields = record.log_fields()
    assert fields["engine_queue_ms"] == 12.346 and fields["prefill_ms"] == 500.0
    assert fields["decode_ms"] is None and fields["timing_source"] == "engine_window"
