"""The gateway in front of the simulator, on 127.0.0.1, with real HTTP clients.

Timings use effects of seconds against milliseconds and generous bounds, so they
hold on a busy 2-core machine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from typing import Any

import aiohttp
import openai
from msgspec.structs import replace

from gateway.config import LaneSettings, Settings
from tests.conftest import (
    DOCUMENTED_LOG_FIELDS,
    RunningGateway,
    StartGateway,
    StartSimulator,
    chat,
    sse_events,
)
from tests.helpers import eventually

LONG_PROMPT = "hello " * 3000  # ~3000 tokens: ~1.5 s of prefill in the simulator
SHORT_PROMPT = "Hi, how are you today?"


def strip_ids(events: list[Any]) -> list[Any]:
    """Events without the fields that differ between any two generations."""
    out = []
    for event in events:
        if isinstance(event, dict):
            event = {k: v for k, v in event.items() if k not in ("id", "created")}
        out.append(event)
    return out


async def read_stream(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[aiohttp.ClientResponse, bytes]:
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        raw = await resp.read()
    return resp, raw


async def sim_requests(http: aiohttp.ClientSession, sim: str) -> list[dict[str, Any]]:
    async with http.get(sim + "/sim/requests") as resp:
        return (await resp.json())["requests"]


async def sim_stats(http: aiohttp.ClientSession, sim: str) -> dict[str, Any]:
    async with http.get(sim + "/sim/stats") as resp:
        return await resp.json()


def lane_gauge(gateway: RunningGateway, lane: str) -> tuple[int, int]:
    state = gateway.state.scheduler.lane(lane)
    return state.in_flight, len(state.queue)


# ----------------------------------------------------------------------------- streaming


async def test_stream_through_gateway_carries_the_same_events_as_direct(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    direct_sim = await start_simulator_at()
    proxied_sim = await start_simulator_at()
    gateway = await start_gateway([proxied_sim])
    for usage in (False, True):
        body = chat(SHORT_PROMPT, stream=True, max_tokens=12)
        if usage:
            body["stream_options"] = {"include_usage": True}
        _, direct = await read_stream(http, direct_sim, body)
        resp, proxied = await read_stream(http, gateway.url, body)
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert strip_ids(sse_events(proxied)) == strip_ids(sse_events(direct))
        assert sse_events(proxied)[-1] == "[DONE]"
        has_usage_chunk = any(isinstance(e, dict) and e.get("usage") for e in sse_events(proxied))
        assert has_usage_chunk is usage
    # The gateway asked the backend for usage both times (to learn completion_tokens).
    received = await sim_requests(http, proxied_sim)
    assert [r["include_usage"] for r in received] == [True, True]
    lines = gateway.request_lines()
    assert [line["completion_tokens"] for line in lines] == [12, 12]


async def test_stream_bytes_are_forwarded_unchanged(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    direct_sim = await start_simulator_at()
    proxied_sim = await start_simulator_at()
    gateway = await start_gateway([proxied_sim])
    body = chat(SHORT_PROMPT, stream=True, max_tokens=8, stream_options={"include_usage": True})
    _, direct = await read_stream(http, direct_sim, body)
    _, proxied = await read_stream(http, gateway.url, body)
    # Same bytes apart from the per-generation id and timestamp.
    normalise = [json.dumps(e) if isinstance(e, dict) else e for e in strip_ids(sse_events(direct))]
    assert len(proxied) == len(direct)
    assert [
        json.dumps(e) if isinstance(e, dict) else e for e in strip_ids(sse_events(proxied))
    ] == normalise


async def test_openai_sdk_streams_through_the_gateway(
    start_simulator_at: StartSimulator, start_gateway: StartGateway
) -> None:
    gateway = await start_gateway([await start_simulator_at()])
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="not-needed", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": SHORT_PROMPT}],
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage:
                usage = chunk.usage
        assert len(text.split()) == 10
        assert usage is not None and usage.completion_tokens == 10
        completion = await client.completions.create(
            model="sim-model", prompt="Once upon", max_tokens=5
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 5
        models = await client.models.list()
        assert [m.id for m in models.data] == ["sim-model"]
    finally:
        await client.close()


async def test_non_stream_answer_passes_through_with_headers(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_simulator_at()
    gateway = await start_gateway([sim])
    async with http.post(
        gateway.url + "/v1/chat/completions",
        json=chat(SHORT_PROMPT, max_tokens=7),
        headers={"x-request-id": "trace-abc-123"},
    ) as resp:
        body = await resp.json()
    assert resp.status == 200
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] == 7
    assert resp.headers["x-request-id"] == "trace-abc-123"
    assert resp.headers["x-gateway-lane"] == "interactive"
    assert resp.headers["x-gateway-max-tokens"] == "7"
    assert int(resp.headers["x-gateway-prompt-tokens"]) == body["usage"]["prompt_tokens"]
    assert float(resp.headers["x-gateway-queue-ms"]) >= 0
    assert resp.headers["Server-Timing"].startswith("queue;dur=")
    # The request id reached the backend for correlation.
    received = await sim_requests(http, sim)
    assert received[-1]["request_id"] == "trace-abc-123"


async def test_request_ids_the_gateway_makes_are_unpredictable(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """A counter gave `<prefix>…0002`, `…0003`: anyone who saw one id knew the next."""
    sim = await start_simulator_at()
    gateway = await start_gateway([sim])
    ids = []
    for _ in range(4):
        async with http.post(
            gateway.url + "/v1/chat/completions", json=chat(SHORT_PROMPT, max_tokens=1)
        ) as resp:
            assert resp.status == 200
            ids.append(resp.headers["x-request-id"])
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids), ids
    # 128 random bits: two ids share their first 8 hex digits once in 4 billion pairs.
    for a, b in itertools.combinations(ids, 2):
        assert len(os.path.commonprefix([a, b])) < 8, ids
        assert int(a, 16) - int(b, 16) not in (-1, 1), ids


async def test_missing_max_tokens_is_defaulted_and_too_big_is_clamped(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_simulator_at()
    gateway = await start_gateway(
        [sim],
        configure=lambda s: replace(
            s, limits=replace(s.limits, default_max_tokens=9, max_output_tokens=20)
        ),
    )
    async with http.post(gateway.url + "/v1/chat/completions", json=chat(SHORT_PROMPT)) as resp:
        assert resp.status == 200
        assert resp.headers["x-gateway-max-tokens"] == "9"
        assert "x-gateway-max-tokens-clamped-from" not in resp.headers
        assert (await resp.json())["usage"]["completion_tokens"] == 9
    async with http.post(
        gateway.url + "/v1/chat/completions", json=chat(SHORT_PROMPT, max_tokens=500)
    ) as resp:
        assert resp.status == 200
        assert resp.headers["x-gateway-max-tokens"] == "20"
        assert resp.headers["x-gateway-max-tokens-clamped-from"] == "500"
        assert (await resp.json())["usage"]["completion_tokens"] == 20
    assert [r["max_tokens"] for r in await sim_requests(http, sim)] == [9, 20]


# ----------------------------------------------------------------------------- refusals


async def test_prompt_over_the_cap_gets_413_before_any_backend_work(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_simulator_at()
    gateway = await start_gateway(
        [sim], configure=lambda s: replace(s, limits=replace(s.limits, max_prompt_tokens=100))
    )
    async with http.post(
        gateway.url + "/v1/chat/completions", json=chat("word " * 300, stream=True)
    ) as resp:
        body = await resp.json()
    assert resp.status == 413
    assert body["error"]["code"] == "prompt_too_long"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert int(resp.headers["x-gateway-prompt-tokens"]) > 100
    assert (await sim_stats(http, sim))["received"] == 0


async def test_malformed_bodies_get_400_in_the_envelope(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await start_gateway([await start_simulator_at()])
    for raw in (
        b"{not json",
        b"[1, 2]",
        b'{"messages": "hi"}',
        b'{"messages": [], "max_tokens": 5}',
        json.dumps(chat(max_tokens="10")).encode(),
        json.dumps(chat(stream="yes")).encode(),
    ):
        async with http.post(
            gateway.url + "/v1/chat/completions",
            data=raw,
            headers={"Content-Type": "application/json"},
        ) as resp:
            body = await resp.json()
        assert resp.status == 400, raw
        assert body["error"]["code"] == "invalid_request"
    async with http.get(gateway.url + "/v1/chat/completions") as resp:
        assert resp.status == 405 and (await resp.json())["error"]["code"] == "method_not_allowed"
    assert gateway.state.scheduler.lane("interactive").in_flight == 0


async def test_full_queue_gets_429_at_once_with_retry_after(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_simulator_at()
    lanes = [LaneSettings(name="only", max_queue_depth=1, queue_timeout_s=30)]
    gateway = await start_gateway([sim], max_concurrency=1, lanes=lanes)
    slow = chat(SHORT_PROMPT, max_tokens=300)  # ~1.7 s on the backend
    running = asyncio.create_task(http.post(gateway.url + "/v1/chat/completions", json=slow))
    await eventually(lambda: _async(lane_gauge(gateway, "only") == (1, 0)))
    queued = asyncio.create_task(http.post(gateway.url + "/v1/chat/completions", json=slow))
    await eventually(lambda: _async(lane_gauge(gateway, "only") == (1, 1)))
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with http.post(gateway.url + "/v1/chat/completions", json=slow) as resp:
        body = await resp.json()
    elapsed = loop.time() - started
    assert resp.status == 429
    assert body["error"]["code"] == "queue_full"
    assert int(resp.headers["Retry-After"]) >= 1
    assert resp.headers["x-gateway-lane"] == "only"
    assert elapsed < 0.5, f"the refusal took {elapsed:.3f} s"
    for task in (running, queued):
        response = await task
        assert response.status == 200
        response.release()


async def _async(value: bool) -> bool:
    return value


async def test_queue_timeout_gets_503_with_retry_after(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_simulator_at()
    # The configured deadline itself (on one slot, one fitted to the engine is a whole
    # answer ahead: seconds).
    lanes = [
        LaneSettings(
            name="only",
            queue_timeout_s=0.4,
            reject_predicted_wait=False,
            fit_timeout_to_engine=False,
        )
    ]
    gateway = await start_gateway([sim], max_concurrency=1, lanes=lanes)
    running = asyncio.create_task(
        http.post(gateway.url + "/v1/chat/completions", json=chat(SHORT_PROMPT, max_tokens=400))
    )
    await eventually(lambda: _async(lane_gauge(gateway, "only")[0] == 1))
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with http.post(
        gateway.url + "/v1/chat/completions", json=chat(SHORT_PROMPT, max_tokens=5)
    ) as resp:
        body = await resp.json()
    waited = loop.time() - started
    assert resp.status == 503
    assert body["error"]["code"] == "queue_timeout"
    assert int(resp.headers["Retry-After"]) >= 1
    assert 0.35 < waited < 1.5
    assert float(resp.headers["x-gateway-queue-ms"]) >= 350
    (await running).release()
    line = [entry for entry in gateway.request_lines() if entry["status"] == 503][0]
    assert line["outcome"] == "queue_timeout" and line["queue_ms"] >= 350


async def test_backend_that_went_down_gives_502(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    from gateway.tools.simulator import SimulatorConfig, start_simulator

    runner, port = await start_simulator(SimulatorConfig())
    gateway = await start_gateway(
        [f"http://127.0.0.1:{port}"],
        configure=lambda s: replace(s, health=replace(s.health, interval_s=60)),
    )
    async with http.post(gateway.url + "/v1/chat/completions", json=chat(max_tokens=2)) as resp:
        assert resp.status == 200  # it was up and checked healthy
    await runner.cleanup()  # and now it is gone, between two health checks
    for stream in (False, True):
        async with http.post(
            gateway.url + "/v1/chat/completions", json=chat(stream=stream)
        ) as resp:
            body = await resp.json()
        assert resp.status == 502
        assert body["error"]["code"] == "backend_error"
    assert gateway.state.scheduler.lane("interactive").in_flight == 0
    outcomes = [line["outcome"] for line in gateway.request_lines()]
    assert outcomes == ["ok", "backend_error", "backend_error"]


async def test_no_healthy_backend_gives_503_no_backend_at_once(
    start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    gateway = await start_gateway([f"http://127.0.0.1:{port}"])
    await eventually(lambda: _async(not gateway.state.pool.has_available()))
    async with http.get(gateway.url + "/readyz") as resp:
        assert resp.status == 503
    async with http.post(gateway.url + "/v1/chat/completions", json=chat(stream=True)) as resp:
        body = await resp.json()
    assert resp.status == 503 and body["error"]["code"] == "no_backend"
    assert int(resp.headers["Retry-After"]) >= 1
    assert gateway.request_lines()[0]["outcome"] == "no_backend"


# ----------------------------------------------------------------------------- scheduling


async def test_short_request_is_served_before_queued_long_ones(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_simulator_at()
    gateway = await start_gateway([sim], max_concurrency=2)  # bulk may hold 1 of the 2 slots
    loop = asyncio.get_running_loop()

    async def send(prompt: str, max_tokens: int, request_id: str) -> float:
        started = loop.time()
        async with http.post(
            gateway.url + "/v1/chat/completions",
            json=chat(prompt, max_tokens=max_tokens, stream=True),
            headers={"x-request-id": request_id},
        ) as resp:
            assert resp.status == 200
            await resp.read()
        return loop.time() - started

    longs = []
    for index in range(3):
        longs.append(asyncio.create_task(send(str(index) + LONG_PROMPT, 16, f"long-{index}")))
        await asyncio.sleep(0.05)
    await eventually(lambda: _async(lane_gauge(gateway, "bulk") == (1, 2)))
    short_e2e = await send(SHORT_PROMPT, 8, "short")
    long_e2e = await asyncio.gather(*longs)
    order = [r["request_id"] for r in await sim_requests(http, sim)]
    # The short one reached the backend before the queued long ones, not after them.
    assert order.index("short") < order.index("long-1") < order.index("long-2"), order
    # It waited at most for the one long prefill already running, not for all three.
    assert short_e2e < max(long_e2e) / 2, (short_e2e, long_e2e)
    short_line = next(line for line in gateway.request_lines() if line["request_id"] == "short")
    assert short_line["lane"] == "interactive" and short_line["queue_ms"] < 100


# ----------------------------------------------------------------------------- disconnects


async def test_disconnect_mid_stream_aborts_the_backend_and_frees_the_slot(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_simulator_at()
    gateway = await start_gateway([sim])
    resp = await http.post(
        gateway.url + "/v1/chat/completions", json=chat(SHORT_PROMPT, max_tokens=1000, stream=True)
    )
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    resp.close()  # the client goes away mid-stream

    async def aborted() -> bool:
        stats = await sim_stats(http, sim)
        return stats["aborted"] == 1 and stats["running"] == 0

    took = await eventually(aborted, within_s=2)
    assert took < 1.0
    await eventually(lambda: _async(lane_gauge(gateway, "interactive") == (0, 0)))
    assert gateway.state.pool.backends[0].in_flight == 0
    await eventually(lambda: _async(len(gateway.request_lines()) == 1))
    line = gateway.request_lines()[0]
    assert line["outcome"] == "client_disconnected"


async def test_disconnect_before_the_first_byte_aborts_the_backend_at_once(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_simulator_at()
    gateway = await start_gateway([sim])
    prompt = "hello " * 6000  # ~3 s of prefill: no byte for a long while
    task = asyncio.create_task(
        http.post(
            gateway.url + "/v1/chat/completions", json=chat(prompt, max_tokens=10, stream=True)
        )
    )

    async def running() -> bool:
        return (await sim_stats(http, sim))["running"] == 1

    await eventually(running)
    loop = asyncio.get_running_loop()
    started = loop.time()
    task.cancel()  # the client closes its connection while the backend prefills

    async def aborted() -> bool:
        stats = await sim_stats(http, sim)
        return stats["aborted"] == 1 and stats["running"] == 0

    await eventually(aborted, within_s=2, step_s=0.005)
    took = loop.time() - started
    assert took < 0.5, f"the backend kept the sequence {took:.3f} s after the client left"
    await eventually(lambda: _async(lane_gauge(gateway, "bulk") == (0, 0)))
    print(f"backend sequence aborted {took * 1000:.0f} ms after the client disconnected")


async def test_disconnect_while_queued_leaves_the_queue_at_once(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_simulator_at()
    lanes = [LaneSettings(name="only", queue_timeout_s=30)]
    gateway = await start_gateway([sim], max_concurrency=1, lanes=lanes)
    running = asyncio.create_task(
        http.post(gateway.url + "/v1/chat/completions", json=chat(SHORT_PROMPT, max_tokens=200))
    )
    await eventually(lambda: _async(lane_gauge(gateway, "only")[0] == 1))
    waiting = asyncio.create_task(
        http.post(gateway.url + "/v1/chat/completions", json=chat(SHORT_PROMPT))
    )
    await eventually(lambda: _async(lane_gauge(gateway, "only") == (1, 1)))
    waiting.cancel()
    took = await eventually(
        lambda: _async(lane_gauge(gateway, "only") == (1, 0)), within_s=2, step_s=0.005
    )
    assert took < 0.5
    (await running).release()
    await eventually(lambda: _async(len(gateway.request_lines()) == 2))
    outcomes = sorted(line["outcome"] for line in gateway.request_lines())
    assert outcomes == ["client_disconnected", "ok"]
    # It never reached the backend.
    assert (await sim_stats(http, sim))["received"] == 1


# ----------------------------------------------------------------------------- records


async def test_each_request_leaves_exactly_one_complete_log_line(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await start_gateway(
        [await start_simulator_at()],
        configure=lambda s: replace(s, limits=replace(s.limits, max_prompt_tokens=500)),
    )
    sent = {
        "stream-ok": chat(SHORT_PROMPT, max_tokens=6, stream=True),
        "plain-ok": chat(SHORT_PROMPT, max_tokens=6),
        "too-long": chat("word " * 800),
    }
    for request_id, body in sent.items():
        async with http.post(
            gateway.url + "/v1/chat/completions", json=body, headers={"x-request-id": request_id}
        ) as resp:
            await resp.read()
    lines = {line["request_id"]: line for line in gateway.request_lines()}
    assert len(gateway.request_lines()) == 3 and set(lines) == set(sent)
    fields = DOCUMENTED_LOG_FIELDS - {"event"}
    for line in lines.values():
        assert fields <= set(line), fields - set(line)
        assert line["event"] == "request"
        assert "content" not in json.dumps(line) and "word word" not in json.dumps(line)
    stream = lines["stream-ok"]
    assert stream["outcome"] == "ok" and stream["status"] == 200 and stream["stream"] is True
    assert stream["completion_tokens"] == 6 and stream["max_tokens"] == 6
    assert stream["backend"] == "b0" and stream["lane"] == "interactive"
    for key in ("queue_ms", "backend_ttft_ms", "ttft_ms", "tpot_ms", "e2e_ms"):
        assert isinstance(stream[key], float), key
    assert stream["queue_ms"] <= stream["ttft_ms"] <= stream["e2e_ms"]
    assert stream["backend_ttft_ms"] <= stream["ttft_ms"]
    plain = lines["plain-ok"]
    assert plain["outcome"] == "ok" and plain["completion_tokens"] == 6 and plain["ttft_ms"] is None
    too_long = lines["too-long"]
    assert too_long["status"] == 413 and too_long["outcome"] == "rejected_prompt_too_long"
    assert too_long["queue_ms"] is None and too_long["backend"] is None
    assert too_long["prompt_tokens"] is None or too_long["prompt_tokens"] > 500


async def test_metrics_report_lanes_and_requests(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await start_gateway([await start_simulator_at()])
    async with http.post(
        gateway.url + "/v1/chat/completions", json=chat(SHORT_PROMPT, max_tokens=4, stream=True)
    ) as resp:
        await resp.read()
    async with http.get(gateway.url + "/metrics") as resp:
        text = await resp.text()
    assert 'gateway_requests_total{lane="interactive",outcome="ok",status="200"} 1.0' in text
    assert 'gateway_queue_wait_seconds_count{lane="interactive"} 1.0' in text
    assert 'gateway_ttft_seconds_count{lane="interactive"} 1.0' in text
    assert 'gateway_queue_depth{lane="bulk"} 0.0' in text
    assert 'gateway_lane_slot_limit{lane="bulk"} 8.0' in text  # work-conserving: every slot
    async with http.get(gateway.url + "/readyz") as resp:
        assert resp.status == 200
    async with http.get(gateway.url + "/healthz") as resp:
        assert resp.status == 200


def _settings_type_check(settings: Settings) -> None:  # keeps the import used for typing
    _ = settings


async def test_prefill_budget_keeps_long_prompts_from_stacking_up_in_the_engine(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_simulator_at()
    gateway = await start_gateway([sim])  # default budget: 4096 prompt tokens in prefill

    async def send(prompt: str, request_id: str) -> None:
        async with http.post(
            gateway.url + "/v1/chat/completions",
            json=chat(prompt, max_tokens=4, stream=True),
            headers={"x-request-id": request_id},
        ) as resp:
            assert resp.status == 200
            await resp.read()

    async def short_later() -> None:
        await asyncio.sleep(0.3)  # both long ones are in the gateway by now
        await send(SHORT_PROMPT, "short")

    await asyncio.gather(
        send("a" + LONG_PROMPT, "long-a"), send("b" + LONG_PROMPT, "long-b"), short_later()
    )
    seen = {r["request_id"]: r for r in await sim_requests(http, sim)}
    first, second = sorted((seen["long-a"], seen["long-b"]), key=lambda r: r["arrival"])
    # The second long prompt reached the engine only once the first had finished prefill...
    assert second["arrival"] >= first["first_token"] - 0.005
    # ...while the short one was not held back by the budget.
    assert first["arrival"] < seen["short"]["arrival"] < first["first_token"]
