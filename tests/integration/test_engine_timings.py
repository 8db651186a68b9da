"""Where the backend time went, per request: the gateway in front of simulators that tell it
the way llama.cpp (a `timings` object), TGI (headers) and vLLM (histograms) do, or not at all.

Each test reads the gateway's log line and checks it against what the simulator sent
(the answer's `timings`, its TGI headers) or what its engine did (`/sim/requests`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import msgspec
import pytest

from gateway.config import HealthSettings, Settings
from tests.conftest import StartGateway, StartSimulator, chat, sse_events


def fast_health(settings: Settings) -> Settings:
    """Scrapes every 0.2 s, so the histogram windows follow within a second."""
    return msgspec.structs.replace(
        settings, health=HealthSettings(interval_s=0.2, timeout_s=0.15, probe_on_start=False)
    )


def words(n: int, seed: int) -> str:
    """About n tokens, the opening unique (no prefix cache hit between requests)."""
    return f"{seed}:" + " hello" * n


async def sim_requests(http: aiohttp.ClientSession, url: str) -> dict[str, dict[str, Any]]:
    async with http.get(url + "/sim/requests") as resp:
        return {r["request_id"]: r for r in (await resp.json())["requests"]}


def lines_by_id(gateway: Any) -> dict[str, dict[str, Any]]:
    return {line["request_id"]: line for line in gateway.request_lines()}


async def test_llamacpp_timings_are_the_logged_prefill_and_decode_and_teach_the_rate(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_simulator_at(timings="llamacpp")
    gateway = await start_gateway([sim])
    sent: dict[str, dict[str, Any]] = {}
    for i in range(3):
        body = chat(
            words(400, i), max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
        async with http.post(
            gateway.url + "/v1/chat/completions", json=body, headers={"x-request-id": f"s{i}"}
        ) as resp:
            assert resp.status == 200
            events = sse_events(await resp.read())
        # The client gets the stream as the engine sent it: its timings on the last chunk.
        assert events[-1] == "[DONE]" and "usage" in events[-2]
        sent[f"s{i}"] = events[-2]["timings"]
        async with http.post(
            gateway.url + "/v1/chat/completions",
            json=chat(words(400, 10 + i), max_tokens=5),
            headers={"x-request-id": f"w{i}"},
        ) as resp:
            assert resp.status == 200
            sent[f"w{i}"] = (await resp.json())["timings"]
    lines = lines_by_id(gateway)
    for request_id, timings in sent.items():
        line = lines[request_id]
        assert line["timing_source"] == "engine", line
        assert line["prefill_ms"] == pytest.approx(timings["prompt_ms"], abs=1e-3)
        assert line["prefill_estimate_ms"] > 0  # the learned model's, beside it
        assert line["decode_ms"] == pytest.approx(timings["predicted_ms"], abs=1e-3)
        if line["stream"]:  # llama.cpp has no queue time: the TTFT beyond its prefill
            expected = max(0.0, line["backend_ttft_ms"] - timings["prompt_ms"])
            assert line["engine_queue_ms"] == pytest.approx(expected, abs=0.01)
        else:  # a whole answer: its backend time beyond prefill and decode
            assert 0 <= line["engine_queue_ms"] < 50
    # Whole answers taught the prefill rate too (a TTFT sample needs a stream): 6 samples.
    async with http.get(gateway.url + "/debug/backends") as resp:
        learned = (await resp.json())["backends"][0]["learned"]
    assert learned["prefill_samples"] == 6
    # The simulator prefills ~2000 tokens/s at its defaults (512 per 5 + 256 ms step).
    assert 1000 < learned["prefill_tokens_per_s"] < 3000, learned


async def test_the_engines_queue_is_told_apart_from_its_prefill(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    # One batch place, three requests let through at once: two wait inside the engine.
    sim = await start_simulator_at(timings="llamacpp", max_batch=1)
    gateway = await start_gateway([sim], max_concurrency=3)

    async def one(i: int) -> None:
        body = chat(words(100, i), max_tokens=30, stream=True)
        async with http.post(
            gateway.url + "/v1/chat/completions", json=body, headers={"x-request-id": f"q{i}"}
        ) as resp:
            assert resp.status == 200
            await resp.read()

    await asyncio.gather(*(one(i) for i in range(3)))
    lines, engine = lines_by_id(gateway), await sim_requests(http, sim)
    queued = 0
    for request_id, line in lines.items():
        assert line["timing_source"] == "engine"
        # What the engine's own clock says it waited for its batch place.
        assert line["engine_queue_ms"] == pytest.approx(engine[request_id]["queue_ms"], abs=30)
        queued += line["engine_queue_ms"] > 100
    assert queued == 2
    async with http.get(gateway.url + "/metrics") as resp:
        text = await resp.text()
    assert 'gateway_engine_queue_seconds_count{lane="interactive"} 3.0' in text
    assert 'gateway_prefill_seconds_count{lane="interactive"} 3.0' in text


async def test_tgi_headers_give_the_engines_queue_and_inference_time(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_simulator_at(max_batch=1)
    gateway = await start_gateway([sim], max_concurrency=3)

    async def one(i: int) -> None:
        body = {"inputs": words(100, i), "parameters": {"max_new_tokens": 20}}
        async with http.post(
            gateway.url + "/generate", json=body, headers={"x-request-id": f"t{i}"}
        ) as resp:
            assert resp.status == 200
            await resp.read()

    await asyncio.gather(*(one(i) for i in range(3)))
    lines, engine = lines_by_id(gateway), await sim_requests(http, sim)
    queued = 0
    for request_id, line in lines.items():
        seen = engine[request_id]
        assert line["timing_source"] == "engine", line
        # TGI's headers are whole ms: queue (with validation) and inference, each truncated.
        assert line["engine_queue_ms"] == pytest.approx(seen["queue_ms"], abs=2.0)
        inference_ms = (seen["end"] - seen["admitted"]) * 1000
        assert line["prefill_ms"] + line["decode_ms"] == pytest.approx(inference_ms, abs=1.0)
        assert line["prefill_ms"] > 0 and line["decode_ms"] > 0
        queued += line["engine_queue_ms"] > 100
    assert queued == 2


async def test_vllm_histograms_split_requests_by_the_engines_window(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_simulator_at(max_batch=1)  # vLLM's way: histograms, nothing per answer
    gateway = await start_gateway([sim], max_concurrency=3, configure=fast_health)

    async def burst(start: int) -> None:
        async def one(i: int) -> None:
            body = chat(words(100, i), max_tokens=30, stream=True)
            async with http.post(
                gateway.url + "/v1/chat/completions", json=body, headers={"x-request-id": f"v{i}"}
            ) as resp:
                assert resp.status == 200
                await resp.read()

        await asyncio.gather(*(one(start + i) for i in range(3)))

    await burst(0)
    await asyncio.sleep(1.0)  # scrapes on both sides of the burst's end: a window, kept while idle
    await burst(3)
    lines = [line for line in gateway.request_lines() if line["request_id"] >= "v3"]
    engine = await sim_requests(http, sim)
    assert len(lines) == 3
    queued = 0
    for line in lines:
        assert line["timing_source"] == "engine_window", line
        parts = line["engine_queue_ms"] + line["prefill_ms"]
        assert parts == pytest.approx(line["backend_ttft_ms"], abs=0.01)
        assert line["decode_ms"] == pytest.approx(line["e2e_ms"] - line["ttft_ms"], abs=0.01)
        # A window's mean does not say which of its requests queued; the engine's mean
        # prefill, set against this prompt, does: the rest of its TTFT is the queue.
        assert line["engine_queue_ms"] == pytest.approx(
            engine[line["request_id"]]["queue_ms"], abs=30
        )
        queued += line["engine_queue_ms"] > 100
    assert queued == 2
    async with http.get(gateway.url + "/debug/backends") as resp:
        window = (await resp.json())["backends"][0]["engine_window"]
    assert window["requests"] >= 1 and window["prefill_ms"] > 0, window


async def test_an_engine_that_tells_nothing_gets_the_learned_estimate(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_simulator_at(timings="none")
    gateway = await start_gateway([sim], configure=fast_health)
    for i in range(3):
        body = chat(words(300, i), max_tokens=8, stream=True)
        async with http.post(gateway.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            await resp.read()
        await asyncio.sleep(0.3)  # scrapes in between say nothing of time
    async with http.post(
        gateway.url + "/v1/chat/completions", json=chat("hi", max_tokens=4)
    ) as resp:
        assert resp.status == 200
    for line in gateway.request_lines():
        assert line["timing_source"] == "estimate", line
        assert line["prefill_ms"] > 0 and line["engine_queue_ms"] >= 0 and line["decode_ms"] >= 0
        if line["stream"]:
            parts = line["engine_queue_ms"] + line["prefill_ms"]
            assert parts == pytest.approx(line["backend_ttft_ms"], abs=0.01)
    # A refusal reached no engine: nothing known, null.
    async with http.post(gateway.url + "/v1/chat/completions", json={"messages": 3}) as resp:
        assert resp.status == 400
    refused = gateway.request_lines()[-1]
    assert refused["timing_source"] is None and refused["prefill_ms"] is None
    assert json.dumps(refused)  # a plain JSON line
