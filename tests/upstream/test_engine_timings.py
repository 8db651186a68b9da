"""Reading each engine's timing format, and the arithmetic of the three-way split."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gateway.upstream.engine_timings import (
    ENGINE,
    ENGINE_WINDOW,
    ESTIMATE,
    EngineReport,
    EngineTimings,
    RequestTimeTotals,
    Totals,
    WindowSplit,
    estimated,
    from_report,
    from_window,
    llamacpp_timings,
    prefill_scale,
    tgi_headers,
    time_totals,
    window_split,
)
from gateway.upstream.sse import OpenAIStreamWatcher
from gateway.upstream.telemetry import parse_engine_metrics

#: A real llama-server answer's `timings` (docs/simulator.md, Gemma 3 270M).
LLAMACPP = {
    "cache_n": 554,
    "prompt_n": 1,
    "prompt_ms": 42.652,
    "prompt_per_token_ms": 42.652,
    "prompt_per_second": 23.44,
    "predicted_n": 4,
    "predicted_ms": 61.5,
    "predicted_per_token_ms": 15.375,
    "predicted_per_second": 65.04,
}


def close(
    timings: EngineTimings | None,
    queue: float | None,
    prefill: float,
    decode: float | None,
    source: str,
) -> None:
    assert timings is not None
    assert timings.source == source
    for got, want in (
        (timings.engine_queue_s, queue),
        (timings.prefill_s, prefill),
        (timings.decode_s, decode),
    ):
        if want is None:
            assert got is None, timings
        else:
            assert got == pytest.approx(want, abs=1e-9), timings


# ----------------------------------------------------------------------------- llama.cpp


def test_llamacpp_timings_give_prefill_decode_and_the_tokens() -> None:
    report = llamacpp_timings(LLAMACPP)
    assert report == EngineReport(
        prefill_s=0.042652, decode_s=0.0615, prefilled_tokens=1, cached_tokens=554
    )


def test_llamacpp_queue_is_the_ttft_beyond_the_prefill() -> None:
    report = llamacpp_timings(LLAMACPP)
    assert report is not None
    stream = from_report(report, backend_ttft_s=0.5, backend_s=0.6, prefill_estimate_s=9.0)
    close(stream, 0.5 - 0.042652, 0.042652, 0.0615, ENGINE)
    # A whole answer: what its backend time has beyond prefill and decode.
    whole = from_report(report, backend_ttft_s=None, backend_s=1.0, prefill_estimate_s=None)
    close(whole, 1.0 - 0.042652 - 0.0615, 0.042652, 0.0615, ENGINE)
    # Never below zero (a clock that disagrees by a millisecond), unknown without a time.
    fast = from_report(report, backend_ttft_s=0.04, backend_s=None, prefill_estimate_s=None)
    close(fast, 0.0, 0.042652, 0.0615, ENGINE)
    alone = from_report(report, backend_ttft_s=None, backend_s=None, prefill_estimate_s=None)
    close(alone, None, 0.042652, 0.0615, ENGINE)


@pytest.mark.parametrize(
    "garbage",
    [
        None,
        "timings",
        [LLAMACPP],
        {},
        {"prompt_ms": "42"},
        {"prompt_ms": True, "predicted_ms": None},
        {"prompt_ms": -1.0},
        {"prompt_ms": math.nan, "predicted_ms": math.inf},
    ],
)
def test_llamacpp_garbage_is_none(garbage: Any) -> None:
    assert llamacpp_timings(garbage) is None


def test_llamacpp_half_a_report_keeps_what_it_says() -> None:
    report = llamacpp_timings({"prompt_ms": 10, "prompt_n": "many", "cache_n": -3})
    assert report == EngineReport(prefill_s=0.01)


def test_a_streams_last_chunk_carries_the_timings_past_the_watcher_unchanged() -> None:
    """llama.cpp's server puts `timings` on the stream's last event, the usage chunk."""
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    token = b'data: {"choices":[{"index":0,"delta":{"content":"word "}}]}\n\n'
    # A token whose text says "timings" is not a timings key.
    tricky = b'data: {"choices":[{"index":0,"delta":{"content":"\\"timings\\": 1"}}]}\n\n'
    usage = (
        b'data: {"choices":[],"usage":{"prompt_tokens":555,"completion_tokens":4},'
        b'"timings":{"cache_n":554,"prompt_n":1,"prompt_ms":42.652,"predicted_n":4,'
        b'"predicted_ms":61.5}}\n\n'
    )
    stream = role + token + tricky + token * 200 + usage + b"data: [DONE]\n\n"
    for size in (1, 17, 4096, len(stream)):
        watcher = OpenAIStreamWatcher(strip_usage=False)
        out = b"".join(watcher.feed(stream[i : i + size]) for i in range(0, len(stream), size))
        assert out + watcher.flush() == stream
        report = llamacpp_timings(watcher.timings)
        assert report is not None and report.prefill_s == pytest.approx(0.042652)
        assert report.decode_s == pytest.approx(0.0615) and report.cached_tokens == 554


def test_a_stream_without_timings_has_none() -> None:
    watcher = OpenAIStreamWatcher(strip_usage=True)
    watcher.feed(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')
    watcher.feed(b'data: {"choices":[],"usage":{"completion_tokens":1}}\n\ndata: [DONE]\n\n')
    assert watcher.timings is None and watcher.completion_tokens == 1


# ----------------------------------------------------------------------------- TGI


def tgi(**values: str) -> dict[str, str]:
    return {f"x-{name.replace('_', '-')}": value for name, value in values.items()}


def test_tgi_headers_give_queue_and_inference_in_ms() -> None:
    headers = tgi(
        total_time="1510",
        validation_time="2",
        queue_time="800",
        inference_time="700",
        time_per_token="70",
        prompt_tokens="500",
        generated_tokens="10",
    )
    report = tgi_headers(headers)
    assert report == EngineReport(queue_s=0.802, inference_s=0.7)
    # TGI does not split its inference time: the learned prefill does, within it.
    assert report is not None
    close(
        from_report(report, backend_ttft_s=None, backend_s=1.52, prefill_estimate_s=0.25),
        0.802,
        0.25,
        0.45,
        ENGINE,
    )
    longer = from_report(report, backend_ttft_s=None, backend_s=1.52, prefill_estimate_s=3.0)
    close(longer, 0.802, 0.7, 0.0, ENGINE)
    # Without an estimate: the engine's queue, and nothing made up.
    close(
        from_report(report, backend_ttft_s=None, backend_s=1.52, prefill_estimate_s=None),
        0.802,
        None,
        None,
        ENGINE,
    )


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"content-type": "application/json"},
        tgi(queue_time="soon"),
        tgi(queue_time="-5", inference_time="nan"),
        tgi(time_per_token="10", generated_tokens="3"),
    ],
)
def test_tgi_garbage_or_absent_headers_are_none(headers: dict[str, str]) -> None:
    assert tgi_headers(headers) is None


def test_tgi_headers_are_read_case_insensitively_from_aiohttp() -> None:
    from multidict import CIMultiDict

    headers = CIMultiDict({"X-Queue-Time": "12", "X-Inference-Time": "30"})
    assert tgi_headers(headers) == EngineReport(queue_s=0.012, inference_s=0.03)


# ----------------------------------------------------------------------------- windows


VLLM_METRICS = """\
# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="m",engine="0"}} 0.0
vllm:num_requests_waiting{{model_name="m",engine="1"}} 1.0
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{{model_name="m",engine="0",le="+Inf"}} {n0}
vllm:request_queue_time_seconds_sum{{model_name="m",engine="0"}} {q0}
vllm:request_queue_time_seconds_count{{model_name="m",engine="0"}} {n0}
vllm:request_queue_time_seconds_bucket{{model_name="m",engine="1",le="+Inf"}} {n1}
vllm:request_queue_time_seconds_sum{{model_name="m",engine="1"}} {q1}
vllm:request_queue_time_seconds_count{{model_name="m",engine="1"}} {n1}
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{{model_name="m",engine="0",le="+Inf"}} {n}
vllm:request_prefill_time_seconds_sum{{model_name="m",engine="0"}} {p}
vllm:request_prefill_time_seconds_count{{model_name="m",engine="0"}} {n}
# TYPE vllm:request_decode_time_seconds histogram
vllm:request_decode_time_seconds_bucket{{model_name="m",engine="0",le="+Inf"}} {n}
vllm:request_decode_time_seconds_sum{{model_name="m",engine="0"}} {d}
vllm:request_decode_time_seconds_count{{model_name="m",engine="0"}} {n}
"""


def vllm(n0: int, q0: float, n1: int, q1: float, p: float, d: float) -> RequestTimeTotals:
    load = parse_engine_metrics(
        VLLM_METRICS.format(n0=n0, q0=q0, n1=n1, q1=q1, n=n0 + n1, p=p, d=d)
    )
    assert load is not None and load.engine == "vllm" and load.waiting == 1.0
    assert load.times is not None
    return load.times


def test_vllm_histogram_deltas_over_a_window_are_the_mean_split() -> None:
    before = vllm(n0=10, q0=1.0, n1=10, q1=1.0, p=4.0, d=40.0)
    # 4 requests ended: 6 s of queue between them (summed over both engines), 2 s of
    # prefill, 20 s of decode.
    after = vllm(n0=12, q0=4.0, n1=12, q1=4.0, p=6.0, d=60.0)
    assert after.queue == Totals(8.0, 24.0)
    window = window_split(before, after)
    assert window == WindowSplit(queue_s=1.5, prefill_s=0.5, decode_s=5.0, requests=4.0)


def test_a_window_in_which_nothing_ended_or_the_engine_restarted_says_nothing() -> None:
    totals = vllm(n0=10, q0=1.0, n1=10, q1=1.0, p=4.0, d=40.0)
    assert window_split(totals, totals) is None
    restarted = vllm(n0=1, q0=0.1, n1=0, q1=0.0, p=0.1, d=1.0)
    assert window_split(totals, restarted) is None
    queue_only = RequestTimeTotals(queue=Totals(1.0, 2.0))
    assert window_split(queue_only, RequestTimeTotals(queue=Totals(3.0, 4.0))) is None


def test_sglang_prefill_and_decode_come_from_its_ttft_and_end_to_end() -> None:
    text = """\
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{model_name="m"}} 0
# TYPE sglang:queue_time_seconds histogram
sglang:queue_time_seconds_sum{{model_name="m"}} {q}
sglang:queue_time_seconds_count{{model_name="m"}} {n}
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{{model_name="m"}} {t}
sglang:time_to_first_token_seconds_count{{model_name="m"}} {n}
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_sum{{model_name="m"}} {e}
sglang:e2e_request_latency_seconds_count{{model_name="m"}} {n}
"""
    loads = [
        parse_engine_metrics(text.format(q=q, t=t, e=e, n=n))
        for q, t, e, n in ((1.0, 2.0, 10.0, 5), (3.0, 5.0, 20.0, 7))
    ]
    assert loads[0] is not None and loads[1] is not None and loads[0].engine == "sglang"
    assert loads[0].times is not None and loads[1].times is not None
    window = window_split(loads[0].times, loads[1].times)
    # Two requests: queue 1 s each, TTFT 1.5 s (prefill 0.5 s), end-to-end 5 s (decode 3.5 s).
    assert window == WindowSplit(queue_s=1.0, prefill_s=0.5, decode_s=3.5, requests=2.0)


def test_time_totals_skip_what_is_not_a_known_histogram_sum_or_count() -> None:
    assert time_totals([("vllm:request_queue_time_seconds_bucket", 3.0)]) is None
    assert time_totals([("vllm:request_queue_time_seconds_sum", 3.0)]) is None  # no count
    assert (
        time_totals(
            [
                ("vllm:request_queue_time_seconds_sum", math.nan),
                ("vllm:request_queue_time_seconds_count", 1.0),
            ]
        )
        is None
    )
    assert parse_engine_metrics("vllm:num_requests_running 1\n") is not None


def test_a_windows_prefill_scale_is_the_engines_mean_over_the_gateways_estimate() -> None:
    window = WindowSplit(queue_s=1.5, prefill_s=0.5, decode_s=5.0, requests=4)
    # The gateway estimates the mean prompt of the window's requests at 0.25 s of prefill.
    assert prefill_scale(window, 0.25) == pytest.approx(2.0)
    assert prefill_scale(window, 0.0) is None
    assert prefill_scale(window, 1000.0) == 0.1  # bounded
    assert prefill_scale(window, 0.001) == 10.0


def test_a_window_scales_the_requests_own_prefill_estimate_and_the_rest_is_queue() -> None:
    # A stream: an estimate of 0.1 s at scale 2 in a TTFT of 0.8 s: 0.6 s of engine queue.
    close(
        from_window(
            2.0,
            prefill_estimate_s=0.1,
            backend_ttft_s=0.8,
            backend_s=2.0,
            decode_estimate_s=None,
        ),
        0.6,
        0.2,
        1.2,
        ENGINE_WINDOW,
    )
    # A whole answer: prefill, then the decode estimate, the queue what is left.
    close(
        from_window(
            0.5,
            prefill_estimate_s=1.0,
            backend_ttft_s=None,
            backend_s=3.0,
            decode_estimate_s=2.0,
        ),
        0.5,
        0.5,
        2.0,
        ENGINE_WINDOW,
    )
    assert (
        from_window(
            1.0,
            prefill_estimate_s=1.0,
            backend_ttft_s=None,
            backend_s=None,
            decode_estimate_s=None,
        )
        is None
    )


# ----------------------------------------------------------------------------- estimate


def test_the_estimate_is_the_learned_prefill_and_the_rest_of_the_ttft_is_queue() -> None:
    close(
        estimated(
            prefill_estimate_s=0.2, backend_ttft_s=1.0, backend_s=3.0, decode_estimate_s=None
        ),
        0.8,
        0.2,
        2.0,
        ESTIMATE,
    )
    # A prefill predicted slower than it was: all of the TTFT is prefill, no queue.
    close(
        estimated(
            prefill_estimate_s=2.0, backend_ttft_s=1.0, backend_s=None, decode_estimate_s=None
        ),
        0.0,
        1.0,
        None,
        ESTIMATE,
    )


def test_a_whole_answers_estimate_fills_prefill_then_decode_and_the_queue_is_left() -> None:
    close(
        estimated(
            prefill_estimate_s=0.2, backend_ttft_s=None, backend_s=1.0, decode_estimate_s=0.5
        ),
        0.3,
        0.2,
        0.5,
        ESTIMATE,
    )
    close(
        estimated(
            prefill_estimate_s=0.8, backend_ttft_s=None, backend_s=1.0, decode_estimate_s=0.5
        ),
        0.0,
        0.8,
        0.2,
        ESTIMATE,
    )
    close(
        estimated(
            prefill_estimate_s=0.2, backend_ttft_s=None, backend_s=1.0, decode_estimate_s=None
        ),
        None,
        0.2,
        None,
        ESTIMATE,
    )
    assert (
        estimated(prefill_estimate_s=0.2, backend_ttft_s=None, backend_s=None, decode_estimate_s=1)
        is None
    )
