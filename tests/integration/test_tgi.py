"""TGI's native API through the gateway, in front of the simulator speaking it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from msgspec.structs import replace

from tests.conftest import StartGateway, StartSimulator
from tests.helpers import eventually


def tgi_events(raw: bytes) -> list[dict[str, Any]]:
    events = []
    for block in raw.decode().split("\n\n"):
        block = block.strip()
        if block.startswith("data:"):
            events.append(json.loads(block[len("data:") :]))
    return events


def without_volatile(event: dict[str, Any]) -> dict[str, Any]:
    details = event.get("details")
    if isinstance(details, dict):
        details = {k: v for k, v in details.items() if k != "seed"}
    return {**event, "details": details}


async def test_generate_stream_carries_the_same_events_as_direct(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    direct, proxied = await start_simulator_at(), await start_simulator_at()
    gateway = await start_gateway([proxied])
    body = {"inputs": "Tell me about lanes.", "parameters": {"max_new_tokens": 9, "details": True}}
    async with http.post(direct + "/generate_stream", json=body) as resp:
        expected = await resp.read()
    async with http.post(gateway.url + "/generate_stream", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["x-gateway-lane"] == "interactive"
        got = await resp.read()
    assert [without_volatile(e) for e in tgi_events(got)] == [
        without_volatile(e) for e in tgi_events(expected)
    ]
    assert len(tgi_events(got)) == 9
    line = gateway.request_lines()[0]
    assert line["outcome"] == "ok" and line["completion_tokens"] == 9
    assert line["ttft_ms"] is not None and line["route"] == "/generate_stream"


async def test_generate_caps_max_new_tokens_and_passes_info_through(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_simulator_at()

    def small_caps(settings: Any) -> Any:
        limits = replace(settings.limits, default_max_tokens=8, max_output_tokens=12)
        return replace(settings, limits=limits)

    gateway = await start_gateway([sim], configure=small_caps)
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 500, "details": True}}
    async with http.post(gateway.url + "/generate", json=body) as resp:
        answer = await resp.json()
    assert resp.status == 200
    assert resp.headers["x-gateway-max-tokens"] == "12"
    assert resp.headers["x-gateway-max-tokens-clamped-from"] == "500"
    assert answer["details"]["generated_tokens"] == 12
    assert gateway.request_lines()[0]["completion_tokens"] == 12
    async with http.get(gateway.url + "/info") as resp:
        info = await resp.json()
    assert resp.status == 200 and info["model_id"] == "sim-model"
    async with http.post(gateway.url + "/generate", json={"inputs": 5}) as resp:
        error = await resp.json()
    assert resp.status == 400 and error["error"]["param"] == "inputs"


async def test_huggingface_inference_client_streams_through_the_gateway(
    start_simulator_at: StartSimulator, start_gateway: StartGateway
) -> None:
    hub = pytest.importorskip("huggingface_hub")
    gateway = await start_gateway([await start_simulator_at()])
    client = hub.InferenceClient(base_url=gateway.url)

    def run() -> tuple[list[str], Any]:
        tokens = [
            chunk
            for chunk in client.text_generation("Once upon a time", max_new_tokens=7, stream=True)
        ]
        detailed = list(
            client.text_generation("Once upon", max_new_tokens=5, stream=True, details=True)
        )
        return tokens, detailed

    tokens, detailed = await asyncio.to_thread(run)
    assert len(tokens) == 7 and all(isinstance(t, str) for t in tokens)
    assert detailed[-1].details.generated_tokens == 5
    outcomes = [line["outcome"] for line in gateway.request_lines()]
    assert outcomes == ["ok", "ok"]
    assert [line["lane"] for line in gateway.request_lines()] == ["interactive"] * 2


async def test_no_request_is_sent_past_tgis_batch_tokens(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """TGI's /info says how many tokens its batch holds (`max_batch_total_tokens`), each
    request's prompt and max_new_tokens reserved as it joins: the gateway sends no more
    than fit, so none waits inside TGI, where no lane could put a short request first."""
    sim = await start_simulator_at(pose_as="tgi", max_batch=16, max_batch_tokens=400)
    gateway = await start_gateway([sim], max_concurrency=16)

    async def told() -> bool:
        async with http.get(gateway.url + "/debug/backends") as resp:
            return (await resp.json())["backends"][0]["batch_tokens"] == 400

    await eventually(told)
    body = {"inputs": "Tell me about lanes.", "parameters": {"max_new_tokens": 80}}

    async def generate() -> int:
        async with http.post(gateway.url + "/generate", json=body) as resp:
            await resp.read()
            return resp.status

    assert await asyncio.gather(*(generate() for _ in range(6))) == [200] * 6
    async with http.get(sim + "/sim/stats") as resp:
        stats = await resp.json()
    # ~85 tokens each: four fit in 400; the other two waited in their lane, not in TGI.
    assert stats["in_flight_peak"] == stats["running_peak"] == 4
    lines = gateway.request_lines()
    assert sum(1 for line in lines if line["queue_ms"] > 50) >= 2
