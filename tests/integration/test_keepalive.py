"""A stream that waits long gets its headers early and SSE comments, and still parses.

Real gateway (in-process) in front of a real simulator on 127.0.0.1, real
clients: raw aiohttp to see the bytes, the `openai` SDK and `huggingface_hub`
to prove that comment lines do not disturb their parsers. A slot is held by a
slow request so that the next one queues; the keep-alive interval is short
(0.25 s) so the tests take seconds.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import huggingface_hub as hub
import openai
import pytest
from msgspec.structs import replace

from gateway.config import LaneSettings, Settings
from tests import helpers
from tests.conftest import RunningGateway, StartGateway, StartSimulator, chat
from tests.conftest import sse_events as strict_sse_events

ROUTE = "/v1/chat/completions"
KEEPALIVE_S = 0.25
#: ~50 ms per decode step: a 40-token answer holds its slot for about 2 s.
SLOW = {"step_base_ms": 50.0}


def sse_events(raw: bytes) -> list[object]:
    """The data events, after dropping the comment blocks (what every SSE client does)."""
    blocks = [block for block in raw.split(b"\n\n") if block and not block.startswith(b":")]
    return strict_sse_events(b"\n\n".join(blocks) + b"\n\n")


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """No pooled connections left open after a test: they would count as leftovers."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        yield session


def one_lane(queue_timeout_s: float = 10.0) -> list[LaneSettings]:
    return [
        LaneSettings(
            name="only",
            queue_timeout_s=queue_timeout_s,
            reject_predicted_wait=False,
            fit_timeout_to_engine=False,
        )
    ]


def keepalive(interval_s: float) -> object:
    def configure(settings: Settings) -> Settings:
        return replace(
            settings,
            server=replace(settings.server, sse_keepalive_s=interval_s),
            # pooled backend connections close soon after (else they count as leftovers)
            timeouts=replace(settings.timeouts, pool_idle_s=0.5),
        )

    return configure


async def start(
    start_gateway: StartGateway,
    start_simulator_at: StartSimulator,
    *,
    interval_s: float = KEEPALIVE_S,
    queue_timeout_s: float = 10.0,
    **simulator: float,
) -> RunningGateway:
    backend = await start_simulator_at(**{**SLOW, **simulator})
    return await start_gateway(
        [backend],
        max_concurrency=1,
        lanes=one_lane(queue_timeout_s),
        configure=keepalive(interval_s),  # type: ignore[arg-type]
    )


async def hold_slot(
    http: aiohttp.ClientSession, gateway: RunningGateway, max_tokens: int = 40
) -> asyncio.Task[bytes]:
    """A slow request on the only slot; returns once it runs."""

    async def run() -> bytes:
        async with http.post(
            gateway.url + ROUTE, json=chat("hold the slot", max_tokens=max_tokens, stream=True)
        ) as response:
            assert response.status == 200
            return await response.read()

    task = asyncio.create_task(run())
    for _ in range(200):
        if gateway.state.in_flight:
            return task
        await asyncio.sleep(0.01)
    raise AssertionError("the slot-holding request never started")


async def test_a_queued_stream_gets_comments_then_its_whole_answer(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    gateway = await start(start_gateway, start_simulator_at)
    before = helpers.baseline()
    holder = await hold_slot(http, gateway)
    loop = asyncio.get_running_loop()
    sent = loop.time()
    async with http.post(
        gateway.url + ROUTE, json=chat("queued one", max_tokens=8, stream=True)
    ) as response:
        headers_s = loop.time() - sent
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.headers["x-gateway-lane"] == "only"
        raw = await response.read()
    await holder
    # The headers came at the first keep-alive, long before the slot was free (~2 s).
    assert KEEPALIVE_S * 0.8 < headers_s < 1.5
    assert raw.startswith(b": queued\n\n")
    assert raw.count(b": queued\n\n") >= 3
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    assert "".join(
        event["choices"][0]["delta"].get("content") or ""
        for event in events[:-1]
        if event["choices"]
    )
    line = gateway.request_lines()[-1]
    assert line["status"] == 200 and line["outcome"] == "ok"
    assert line["queue_ms"] > 1000
    await helpers.assert_nothing_left(gateway, before)


async def test_comments_while_the_backend_prefills_say_waiting(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    # 40 ms per prompt token: a ~30-token prompt takes over a second before its first token.
    gateway = await start(
        start_gateway, start_simulator_at, step_base_ms=5.0, prefill_ms_per_token=40.0
    )
    async with http.post(
        gateway.url + ROUTE, json=chat("word " * 30, max_tokens=4, stream=True)
    ) as response:
        assert response.status == 200
        raw = await response.read()
    assert raw.startswith(b": waiting\n\n"), raw[:80]
    assert b": queued" not in raw
    assert sse_events(raw)[-1] == "[DONE]"


async def test_the_openai_sdk_parses_a_stream_with_comments(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    # Two gateways, each in front of its own simulator (same seed), given the same
    # requests: the queued answer read as raw bytes is what the SDK must read.
    by_sdk = await start(start_gateway, start_simulator_at)
    by_bytes = await start(start_gateway, start_simulator_at)
    client = openai.AsyncOpenAI(base_url=by_sdk.url + "/v1", api_key="unused", max_retries=0)
    holder = await hold_slot(http, by_sdk)
    stream = await client.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "Tell me something."}],
        max_tokens=12,
        stream=True,
    )
    parsed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    await holder
    await client.close()

    holder = await hold_slot(http, by_bytes)
    async with http.post(
        by_bytes.url + ROUTE, json=chat("Tell me something.", max_tokens=12, stream=True)
    ) as response:
        raw = await response.read()
    await holder
    assert raw.startswith(b": queued\n\n")
    expected = "".join(
        event["choices"][0]["delta"].get("content") or ""  # type: ignore[index]
        for event in sse_events(raw)[:-1]
    )
    assert parsed == expected
    assert parsed


async def test_huggingface_hub_parses_a_tgi_stream_with_comments(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    gateway = await start(start_gateway, start_simulator_at)
    holder = await hold_slot(http, gateway)
    client = hub.AsyncInferenceClient(base_url=gateway.url)
    tokens = [
        token async for token in await client.text_generation("Hi", max_new_tokens=6, stream=True)
    ]
    await holder
    assert len(tokens) == 6
    assert gateway.request_lines()[-1]["outcome"] == "ok"


async def test_a_queue_timeout_after_the_headers_is_an_error_event(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    gateway = await start(start_gateway, start_simulator_at, queue_timeout_s=1.0)
    before = helpers.baseline()
    holder = await hold_slot(http, gateway, max_tokens=60)
    async with http.post(
        gateway.url + ROUTE, json=chat("too late", max_tokens=8, stream=True)
    ) as response:
        assert response.status == 200
        raw = await response.read()
    assert raw.startswith(b": queued\n\n")
    last = sse_events(raw)[-1]
    assert last["error"]["code"] == "queue_timeout", raw[-300:]
    line = gateway.request_lines()[-1]
    # A broken promise, an outcome of its own (the client's 200 stream ended in it).
    assert (line["status"], line["outcome"], line["error_code"]) == (
        200,
        "queue_timeout_in_stream",
        "queue_timeout",
    )
    assert line["retry_after_s"] >= 1
    metrics = await (await http.get(gateway.url + "/metrics")).text()
    assert 'outcome="queue_timeout_in_stream",status="200"} 1.0' in metrics
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)
    await helpers.assert_nothing_left(gateway, before)


async def test_a_refusal_before_the_first_comment_keeps_its_status(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    gateway = await start(start_gateway, start_simulator_at, interval_s=5.0, queue_timeout_s=0.5)
    holder = await hold_slot(http, gateway)
    async with http.post(
        gateway.url + ROUTE, json=chat("refused", max_tokens=8, stream=True)
    ) as response:
        body = json.loads(await response.read())
    assert response.status == 503
    assert response.headers["x-gateway-refusal"] == "queue_timeout"
    assert int(response.headers["Retry-After"]) >= 1
    assert body["error"]["code"] == "queue_timeout"
    await holder


async def test_a_client_that_leaves_while_getting_comments_frees_everything(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    gateway = await start(start_gateway, start_simulator_at)
    before = helpers.baseline()
    holder = await hold_slot(http, gateway)
    async with http.post(
        gateway.url + ROUTE, json=chat("leaving", max_tokens=8, stream=True)
    ) as response:
        assert await response.content.readuntil(b"\n\n") == b": queued\n\n"
    # Closed: the handler is cancelled, the waiter leaves the queue.
    for _ in range(100):
        if not gateway.state.scheduler.lane("only").queue:
            break
        await asyncio.sleep(0.02)
    assert not gateway.state.scheduler.lane("only").queue
    await holder
    await helpers.assert_nothing_left(gateway, before)
    assert gateway.request_lines()[-1]["outcome"] in ("ok", "client_disconnected")
    assert any(line["outcome"] == "client_disconnected" for line in gateway.request_lines())


async def test_a_backend_timeout_after_the_headers_is_an_error_event(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    backend = await start_simulator_at(step_base_ms=5.0, prefill_ms_per_token=100.0)

    def configure(settings: Settings) -> Settings:
        settings = keepalive(KEEPALIVE_S)(settings)  # type: ignore[operator]
        return replace(settings, timeouts=replace(settings.timeouts, first_token_s=1.0))

    gateway = await start_gateway(
        [backend], max_concurrency=1, lanes=one_lane(), configure=configure
    )
    before = helpers.baseline()
    async with http.post(
        gateway.url + ROUTE, json=chat("word " * 40, max_tokens=4, stream=True)
    ) as response:
        assert response.status == 200
        raw = await response.read()
    assert raw.startswith(b": waiting\n\n")
    assert sse_events(raw)[-1]["error"]["code"] == "backend_timeout"  # type: ignore[index]
    line = gateway.request_lines()[-1]
    assert (line["status"], line["outcome"]) == (200, "backend_timeout")
    await helpers.assert_nothing_left(gateway, before)
