"""Streams whose 200 and headers went out early (keep-alive) tell the truth in-band.

The gateway and the simulator run as processes on 127.0.0.1; the clients are real
(raw aiohttp to see the bytes, the `openai` SDK and `huggingface_hub` to prove they
parse). One slot, held by a slow request, makes the next one queue; the keep-alive
interval is short (0.25 s) and the lane's queue timeout 1.5 s, so the tests take
seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import huggingface_hub as hub
import openai
import pytest

from tests.conftest import chat, free_port, wait_ready

ROOT = Path(__file__).resolve().parents[2]
ROUTE = "/v1/chat/completions"
QUEUE_TIMEOUT_S = 1.5
QUEUE_TIME = re.compile(rb"^: x-gateway-queue-ms (\d+\.\d)\n\n", re.MULTILINE)


def environment() -> dict[str, str]:
    """This environment without GATEWAY_* (the config file says what is tested)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}


@contextlib.asynccontextmanager
async def process(*args: str) -> AsyncIterator[None]:
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        *args,
        cwd=ROOT,
        env=environment(),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        child.kill()  # our own child, by its handle
        await child.wait()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    timeout = aiohttp.ClientTimeout(total=30)
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        yield session


@pytest.fixture
async def gateway(tmp_path: Path, http: aiohttp.ClientSession) -> AsyncIterator[str]:
    """A gateway process with one slot and one lane, in front of a slow simulator
    process (~50 ms a decode step: a 60-token answer holds the slot for ~3 s)."""
    sim_port, port = free_port(), free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(
        "[server]\nsse_keepalive_s = 0.25\n\n"
        "[health]\nprobe_on_start = false\n\n"
        f'[[backends]]\nurl = "http://127.0.0.1:{sim_port}"\nmax_concurrency = 1\n\n'
        f'[[lanes]]\nname = "only"\nqueue_timeout_s = {QUEUE_TIMEOUT_S}\n'
        "reject_predicted_wait = false\nfit_timeout_to_engine = false\n"
    )
    async with (
        process("simulate", "--port", str(sim_port), "--step-base-ms", "50"),
        process("serve", "--config", str(config), "--port", str(port)),
    ):
        url = f"http://127.0.0.1:{port}"
        await wait_ready(http, url, timeout_s=30)
        yield url


async def hold_slot(http: aiohttp.ClientSession, url: str, max_tokens: int) -> asyncio.Task[None]:
    """A slow stream on the only slot; returns once its first bytes came (it runs)."""
    started = asyncio.Event()

    async def run() -> None:
        body = chat("hold the slot", max_tokens=max_tokens, stream=True)
        async with http.post(url + ROUTE, json=body) as response:
            assert response.status == 200
            async for _ in response.content.iter_any():
                started.set()

    task = asyncio.create_task(run())
    async with asyncio.timeout(10):
        await started.wait()
    return task


def data_events(raw: bytes) -> list[object]:
    """The data events, comments dropped (as every SSE client does)."""
    return [
        "[DONE]" if block == b"data: [DONE]" else json.loads(block.removeprefix(b"data: "))
        for block in raw.split(b"\n\n")
        if block.startswith(b"data: ")
    ]


async def stream_errors(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    async with http.get(url + "/metrics") as response:
        text = await response.text()
    found = {}
    for match in re.finditer(
        r'^gateway_stream_errors_total\{code="([^"]+)",lane="([^"]+)"\} (\S+)$', text, re.M
    ):
        found[(match[1], match[2])] = float(match[3])
    return found


async def test_a_queue_timeout_after_early_headers_carries_retry_after_and_queue_ms(
    gateway: str, http: aiohttp.ClientSession
) -> None:
    assert await stream_errors(http, gateway) == {}
    holder = await hold_slot(http, gateway, max_tokens=80)
    async with http.post(gateway + ROUTE, json=chat("too late", max_tokens=8, stream=True)) as r:
        assert r.status == 200
        assert "x-gateway-queue-ms" not in r.headers  # the headers left before the wait ended
        raw = await r.read()
    assert raw.startswith(b": queued\n\n")
    error = data_events(raw)[-1]["error"]  # type: ignore[index]
    assert error["code"] == "queue_timeout"
    assert set(error) >= {"message", "type", "param", "code"}  # the OpenAI envelope kept
    # The Retry-After a 503 would have carried, in whole seconds, and the time it queued.
    assert isinstance(error["retry_after"], int) and error["retry_after"] >= 1
    assert QUEUE_TIMEOUT_S * 1000 * 0.9 <= error["queue_ms"] < QUEUE_TIMEOUT_S * 1000 * 3
    # Status-based monitoring counts a 200; this counter counts the error.
    assert await stream_errors(http, gateway) == {("queue_timeout", "only"): 1.0}

    # The openai SDK raises it as an APIError whose body is the error object.
    client = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "too late too"}],
            max_tokens=8,
            stream=True,
        )
        with pytest.raises(openai.APIError) as info:
            async for _ in stream:
                pass
    finally:
        await client.close()
    body = info.value.body
    assert isinstance(body, dict)
    assert body["code"] == "queue_timeout"
    assert body["retry_after"] >= 1 and body["queue_ms"] >= QUEUE_TIMEOUT_S * 1000 * 0.9
    assert await stream_errors(http, gateway) == {("queue_timeout", "only"): 2.0}
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)


async def test_an_early_stream_says_its_queue_time_in_a_comment_the_sdk_skips(
    gateway: str, http: aiohttp.ClientSession
) -> None:
    holder = await hold_slot(http, gateway, max_tokens=20)  # ~1 s: under the queue timeout
    async with http.post(gateway + ROUTE, json=chat("queued", max_tokens=6, stream=True)) as r:
        assert r.status == 200
        raw = await r.read()
    await holder
    assert raw.startswith(b": queued\n\n")
    said = QUEUE_TIME.findall(raw)
    assert len(said) == 1, raw[:400]
    assert 300 < float(said[0]) < QUEUE_TIMEOUT_S * 1000
    # Said before the first event: a client that stops reading early still got it.
    assert raw.index(b": x-gateway-queue-ms") < raw.index(b"data: ")
    assert data_events(raw)[-1] == "[DONE]"

    holder = await hold_slot(http, gateway, max_tokens=20)
    client = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "Tell me something."}],
            max_tokens=6,
            stream=True,
        )
        chunks = [chunk async for chunk in stream]
    finally:
        await client.close()
    await holder
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert await stream_errors(http, gateway) == {}


async def test_a_tgi_stream_carries_the_same_hint_and_huggingface_hub_still_raises(
    gateway: str, http: aiohttp.ClientSession
) -> None:
    holder = await hold_slot(http, gateway, max_tokens=80)
    body = {"inputs": "too late", "parameters": {"max_new_tokens": 4}, "stream": True}
    async with http.post(gateway + "/generate_stream", json=body) as r:
        assert r.status == 200
        raw = await r.read()
    event = data_events(raw)[-1]
    assert isinstance(event, dict)
    assert event["error_type"] == "queue_timeout"
    assert event["retry_after"] >= 1 and event["queue_ms"] >= QUEUE_TIMEOUT_S * 1000 * 0.9

    client = hub.AsyncInferenceClient(base_url=gateway)
    with pytest.raises(Exception, match="(?i)queue"):
        async for _ in await client.text_generation("too late", max_new_tokens=4, stream=True):
            pass
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)
