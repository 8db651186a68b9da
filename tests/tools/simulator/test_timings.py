"""What the simulator tells of where each request's time went: llama.cpp's `timings` in its
OpenAI answers, TGI's headers, vLLM's request time histograms in /metrics.

Every figure is checked against the engine's own record of the request (`/sim/requests`:
arrival, admission into the batch, first token, end).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.tools.simulator.support import SHORT_PROMPT, StartSim, chat_body, parse_sse

TIMINGS_KEYS = {
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
}


async def last_request(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/sim/requests") as resp:
        return (await resp.json())["requests"][-1]


def assert_matches_the_engine(timings: dict[str, Any], seen: dict[str, Any], tokens: int) -> None:
    assert set(timings) == TIMINGS_KEYS
    assert timings["predicted_n"] == tokens
    assert timings["prompt_n"] + timings["cache_n"] == seen["prompt_tokens"]
    prefill_ms = (seen["first_token"] - seen["admitted"]) * 1000
    decode_ms = (seen["end"] - seen["first_token"]) * 1000
    assert timings["prompt_ms"] == pytest.approx(prefill_ms, abs=0.001)
    assert timings["predicted_ms"] == pytest.approx(decode_ms, abs=0.001)
    assert timings["prompt_per_second"] == pytest.approx(
        1000 * timings["prompt_n"] / timings["prompt_ms"], rel=1e-3
    )


async def test_llamacpp_timings_ride_on_the_body_and_on_the_streams_last_event(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    url = await start_sim(timings="llamacpp")
    async with session.post(
        f"{url}/v1/chat/completions", json=chat_body(SHORT_PROMPT, max_tokens=4)
    ) as resp:
        answer = await resp.json()
    assert_matches_the_engine(answer["timings"], await last_request(session, url), 4)

    # With include_usage: on the usage chunk (llama.cpp's `deltas.back()`), not before.
    body = chat_body(
        SHORT_PROMPT, max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        events = parse_sse(await resp.text())
    *chunks, usage, done = events
    assert done == "[DONE]" and usage["choices"] == [] and "timings" in usage
    assert not any("timings" in chunk for chunk in chunks)
    seen = await last_request(session, url)
    assert_matches_the_engine(usage["timings"], seen, 5)
    assert usage["timings"]["cache_n"] == usage["usage"]["prompt_tokens_details"]["cached_tokens"]

    # Without: on the chunk with the finish reason.
    body = chat_body(SHORT_PROMPT, max_tokens=3, stream=True)
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        *chunks, last, done = parse_sse(await resp.text())
    assert last["choices"][0]["finish_reason"] == "length" and "timings" in last
    assert not any("timings" in chunk for chunk in chunks)
    assert_matches_the_engine(last["timings"], await last_request(session, url), 3)


async def test_by_default_answers_carry_no_timings(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    url = await start_sim()
    async with session.post(
        f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}
    ) as resp:
        assert "timings" not in await resp.json()
    body = {"prompt": "hi", "max_tokens": 2, "stream": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert "timings" not in await resp.text()


def histograms(text: str) -> dict[str, dict[str, float]]:
    """Each histogram family's `_sum` and `_count`, and its `+Inf` bucket."""
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        for sample in family.samples:
            suffix = sample.name[len(family.name) :]
            if suffix in ("_sum", "_count") or sample.labels.get("le") == "+Inf":
                found.setdefault(family.name, {})[suffix if suffix != "_bucket" else "+Inf"] = (
                    sample.value
                )
    return found


async def test_metrics_carry_vllms_request_time_histograms(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    url = await start_sim()
    seen = []
    for max_tokens in (3, 6):
        body = chat_body(SHORT_PROMPT, max_tokens=max_tokens)
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
        seen.append(await last_request(session, url))
    async with session.get(f"{url}/metrics") as resp:
        found = histograms(await resp.text())
    for name in (
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
    ):
        assert found[name]["_count"] == 2 and found[name]["+Inf"] == 2, name
    for name, start, end in (
        ("vllm:request_prefill_time_seconds", "admitted", "first_token"),
        ("vllm:request_decode_time_seconds", "first_token", "end"),
    ):
        total = sum(r[end] - r[start] for r in seen)
        assert found[name]["_sum"] == pytest.approx(total, abs=1e-6), name
    # Its queue starts when the engine got the sequence (after parsing), not at the HTTP
    # arrival `/sim/requests` shows: no more than that, and nothing waited here.
    queue_s = found["vllm:request_queue_time_seconds"]["_sum"]
    assert 0 <= queue_s <= sum(r["queue_ms"] for r in seen) / 1000 + 1e-6


async def test_timings_none_tells_nothing(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    url = await start_sim(timings="none")
    async with session.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=2)) as resp:
        assert "timings" not in await resp.json()
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    assert "request_queue_time" not in text and "vllm:num_requests_running" in text


async def test_tgi_generate_sends_tgis_timing_headers_in_whole_ms(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    url = await start_sim(timings="none")  # TGI's headers whatever the knob says
    body = {"inputs": SHORT_PROMPT, "parameters": {"max_new_tokens": 6}}
    async with session.post(f"{url}/generate", json=body) as resp:
        assert resp.status == 200
        headers = resp.headers
    seen = await last_request(session, url)
    assert headers["x-generated-tokens"] == "6"
    assert int(headers["x-prompt-tokens"]) == seen["prompt_tokens"]
    inference_ms = (seen["end"] - seen["admitted"]) * 1000
    assert int(headers["x-inference-time"]) == pytest.approx(inference_ms, abs=1)
    assert int(headers["x-time-per-token"]) == int(headers["x-inference-time"]) // 6
    queue_ms = int(headers["x-queue-time"]) + int(headers["x-validation-time"])
    assert queue_ms == pytest.approx(seen["queue_ms"], abs=2)
