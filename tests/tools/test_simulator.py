"""The simulator over real HTTP on 127.0.0.1: API shapes, head-of-line blocking, batch cap, aborts.

Timing assertions compare effects of seconds against milliseconds, so they hold on
a busy 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.admission.tokens import TokenCounter, chat_prompt_parts, load_encoding
from gateway.tools.sim_engine import Engine
from gateway.tools.simulator import (
    SimulatorConfig,
    add_arguments,
    config_from_args,
)

StartSim = Callable[..., Awaitable[str]]
LONG_PROMPT = "hello " * 4000  # ~4000 tokens: ~2 s of prefill with the defaults
SHORT_PROMPT = "hello " * 45  # ~50 tokens: tens of ms
REPO_ROOT = Path(__file__).resolve().parents[2]


def chat_body(prompt: str = "Say something.", **extra: Any) -> dict[str, Any]:
    return {"model": "test-model", "messages": [{"role": "user", "content": prompt}], **extra}


def parse_sse(raw: str) -> list[Any]:
    """Events of an SSE body; `[DONE]` stays a string, the rest is parsed JSON."""
    assert raw.endswith("\n\n")
    events: list[Any] = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def stats(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/sim/stats") as resp:
        return await resp.json()


async def wait_for_stats(
    session: aiohttp.ClientSession,
    url: str,
    check: Callable[[dict[str, Any]], bool],
    within_s: float = 1.0,
) -> dict[str, Any]:
    """Poll `/sim/stats` until `check` holds; return the last snapshot either way."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        snapshot = await stats(session, url)
        if check(snapshot) or loop.time() > deadline:
            return snapshot
        await asyncio.sleep(0.02)


async def stream_ttft(session: aiohttp.ClientSession, url: str, prompt: str) -> float:
    """Seconds from sending a streamed chat request to its first content token."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    first: float | None = None
    body = chat_body(prompt, stream=True, max_tokens=4)
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if first is None and line.startswith(b"data: {") and b'"content":"' in line:
                event = json.loads(line[len(b"data: ") :])
                if event["choices"][0]["delta"].get("content"):
                    first = loop.time()
    assert first is not None
    return first - start


# --------------------------------------------------------------------------- API shapes


async def test_chat_stream_shape_with_usage(start_sim: StartSim, session: aiohttp.ClientSession):
    url = await start_sim()
    body = chat_body(stream=True, max_tokens=5, stream_options={"include_usage": True})
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = parse_sse(await resp.text())

    assert events[-1] == "[DONE]"
    role, *tokens, usage_chunk, _ = events
    assert role["object"] == "chat.completion.chunk"
    assert role["id"].startswith("chatcmpl-")
    assert role["model"] == "test-model"
    assert role["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert len(tokens) == 5
    for chunk in tokens:
        assert chunk["id"] == role["id"]
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["choices"][0]["delta"]["content"].endswith(" ")
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 4 + ["length"]
    assert usage_chunk["choices"] == []
    assert usage_chunk["id"] == role["id"]
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5


async def test_stream_without_include_usage_has_no_usage_chunk(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim()
    for options in (None, {"include_usage": False}):
        extra: dict[str, Any] = {"stream_options": options} if options is not None else {}
        body = chat_body(stream=True, max_tokens=3, **extra)
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            events = parse_sse(await resp.text())
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert len(chunks) == 1 + 3
        assert all("usage" not in c and c["choices"] for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_completions_stream_shape(start_sim: StartSim, session: aiohttp.ClientSession):
    url = await start_sim()
    body = {"prompt": "Once upon a time", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        events = parse_sse(await resp.text())
    assert events[-1] == "[DONE]"
    *tokens, usage_chunk, _ = events
    assert len(tokens) == 4
    for chunk in tokens:
        assert chunk["object"] == "text_completion"
        assert chunk["id"].startswith("cmpl-")
        assert chunk["model"] == "sim-model"  # the request named none
        assert chunk["choices"][0]["text"].endswith(" ")
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["object"] == "text_completion"
    assert usage_chunk["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}


async def test_non_stream_usage_matches_the_gateway_tokenizer(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim(default_max_tokens=7)
    prompt = "How many tokens does this sentence have, counted the gateway's way?"
    counter = TokenCounter(load_encoding("cl100k_base"))
    expected_prompt = counter.count(chat_prompt_parts([{"role": "user", "content": prompt}]))
    counter.close()

    async with session.post(f"{url}/v1/chat/completions", json=chat_body(prompt)) as resp:
        assert resp.status == 200
        data = await resp.json()
    assert data["object"] == "chat.completion"
    assert data["id"].startswith("chatcmpl-")
    assert data["model"] == "test-model"
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 7  # default_max_tokens
    assert choice["finish_reason"] == "length"
    assert data["usage"] == {
        "prompt_tokens": expected_prompt,
        "completion_tokens": 7,
        "total_tokens": expected_prompt + 7,
    }

    # max_completion_tokens is honoured like max_tokens (and wins over it, as in vLLM).
    body = {"prompt": "a b c", "max_tokens": 9, "max_completion_tokens": 2}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        data = await resp.json()
    assert data["object"] == "text_completion"
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


@pytest.mark.parametrize(
    ("route", "raw", "param"),
    [
        ("chat/completions", b"{not json", None),
        ("chat/completions", b"[1, 2]", None),
        ("chat/completions", b'{"model": "m"}', "messages"),
        ("chat/completions", b'{"messages": []}', "messages"),
        ("chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}',
         "messages[0].role"),
        ("chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
         "max_tokens"),
        ("chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
         "stream"),
        ("chat/completions",
         b'{"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}}',
         "stream_options"),
        ("completions", b'{"model": "m"}', "prompt"),
        ("completions", b'{"prompt": [1.5]}', "prompt"),
        ("completions", b'{"prompt": "x", "max_tokens": 40000}', "max_tokens"),
    ],
    ids=["invalid-json", "not-an-object", "no-messages", "empty-messages", "bad-role",
         "max-tokens-0", "stream-not-bool", "stream-options-without-stream", "no-prompt",
         "bad-prompt", "context-length"],
)  # fmt: skip
async def test_bad_bodies_get_a_400_in_the_openai_envelope(
    start_sim: StartSim, session: aiohttp.ClientSession, route: str, raw: bytes, param: str | None
):
    url = await start_sim()
    headers = {"Content-Type": "application/json"}
    async with session.post(f"{url}/v1/{route}", data=raw, headers=headers) as resp:
        assert resp.status == 400
        data = await resp.json()
    assert set(data) == {"error"}
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] in ("invalid_request", "context_length_exceeded")
    assert error["message"]
    snapshot = await stats(session, url)
    assert (snapshot["received"], snapshot["rejected"], snapshot["running"]) == (1, 1, 0)


async def test_models_and_health(start_sim: StartSim, session: aiohttp.ClientSession):
    url = await start_sim(model="my-sim")
    async with session.get(f"{url}/health") as resp:
        assert resp.status == 200
    async with session.get(f"{url}/v1/models") as resp:
        data = await resp.json()
    assert data["object"] == "list"
    assert data["data"][0]["id"] == "my-sim"
    assert data["data"][0]["object"] == "model"
    assert data["data"][0]["owned_by"] == "simulator"


# --------------------------------------------------------------------------- engine behaviour


async def test_short_request_waits_behind_a_long_prefill(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim()  # defaults: the effect must exist without tuning
    alone = await stream_ttft(session, url, SHORT_PROMPT)

    long_task = asyncio.create_task(stream_ttft(session, url, LONG_PROMPT))
    await wait_for_stats(session, url, lambda s: s["running"] == 1)
    behind = await stream_ttft(session, url, SHORT_PROMPT)
    long_ttft = await long_task

    assert alone < 0.5
    assert long_ttft > 1.0
    assert behind > 5 * alone
    assert behind > 0.5  # it waited for most of the long prompt's ~2 s prefill


async def test_batch_cap_makes_the_third_request_wait(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim(max_batch=2)
    body = chat_body(max_tokens=60)  # ~60 steps of ~6 ms: a few hundred ms each

    async def post(rid: str) -> None:
        headers = {"x-request-id": rid}
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
            await resp.read()

    tasks = [asyncio.create_task(post(f"r{i}")) for i in range(3)]
    snapshot = await wait_for_stats(session, url, lambda s: s["received"] == 3, within_s=2.0)
    assert (snapshot["running"], snapshot["waiting"]) == (2, 1)
    await asyncio.gather(*tasks)

    async with session.get(f"{url}/sim/requests") as resp:
        records = {r["request_id"]: r for r in (await resp.json())["requests"]}
    assert all(r["outcome"] == "completed" for r in records.values())
    ordered = sorted(records.values(), key=lambda r: r["admitted"])
    # The last one admitted only got in once one of the first two had finished.
    assert ordered[2]["admitted"] >= min(ordered[0]["end"], ordered[1]["end"])
    snapshot = await stats(session, url)
    assert (snapshot["running"], snapshot["waiting"], snapshot["completed"]) == (0, 0, 3)


async def test_disconnect_mid_stream_aborts_the_sequence(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim()
    body = chat_body(stream=True, max_tokens=2000)  # ~11 s if it ran to the end
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        seen = 0
        async for line in resp.content:
            if line.startswith(b"data: "):
                seen += 1
            if seen >= 5:
                break
        resp.close()  # drop the connection mid-stream

    snapshot = await wait_for_stats(session, url, lambda s: s["aborted"] == 1 and not s["running"])
    assert snapshot["aborted"] == 1
    assert (snapshot["running"], snapshot["waiting"], snapshot["completed"]) == (0, 0, 0)
    async with session.get(f"{url}/sim/requests") as resp:
        (record,) = (await resp.json())["requests"]
    assert record["outcome"] == "aborted"
    assert 4 <= record["completion_tokens"] < 2000


async def test_disconnect_while_waiting_aborts_before_any_byte(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim(max_batch=1)
    hog_body = chat_body(stream=True, max_tokens=2000)
    async with session.post(f"{url}/v1/chat/completions", json=hog_body) as hog:
        await hog.content.readline()  # the hog holds the only batch slot

        # Non-stream: no byte is written until it completes, so only handler cancellation
        # can tell the server that this client gave up.
        timeout = aiohttp.ClientTimeout(total=0.3)
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(
                f"{url}/v1/chat/completions", json=chat_body(max_tokens=5), timeout=timeout
            ) as resp:
                await resp.read()
        snapshot = await wait_for_stats(session, url, lambda s: s["aborted"] == 1)
        assert (snapshot["aborted"], snapshot["running"], snapshot["waiting"]) == (1, 1, 0)
        hog.close()

    snapshot = await wait_for_stats(session, url, lambda s: s["aborted"] == 2 and not s["running"])
    assert (snapshot["aborted"], snapshot["running"], snapshot["waiting"]) == (2, 0, 0)
    assert snapshot["completed"] == 0
    async with session.get(f"{url}/sim/requests") as resp:
        records = (await resp.json())["requests"]
    waiter = next(r for r in records if not r["stream"])
    assert waiter["outcome"] == "aborted"
    assert waiter["admitted"] is None and waiter["first_token"] is None


async def test_disconnect_while_prefilling_frees_the_slot(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim()
    timeout = aiohttp.ClientTimeout(total=0.3)
    with pytest.raises(asyncio.TimeoutError):
        body = chat_body(LONG_PROMPT, max_tokens=5)
        async with session.post(f"{url}/v1/chat/completions", json=body, timeout=timeout) as resp:
            await resp.read()
    snapshot = await wait_for_stats(session, url, lambda s: s["aborted"] == 1 and not s["running"])
    assert (snapshot["aborted"], snapshot["running"], snapshot["waiting"]) == (1, 0, 0)
    # The prefill stopped with the client: far fewer prompt tokens than the 4000 were processed.
    assert snapshot["prefilled_tokens"] < 3000


async def test_request_log_records_what_was_received(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim(default_max_tokens=3)
    headers = {"x-request-id": "req-abc-123"}
    body = chat_body(stream=True, stream_options={"include_usage": True})
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        await resp.read()
    async with session.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}) as resp:
        await resp.read()

    async with session.get(f"{url}/sim/requests") as resp:
        first, second = (await resp.json())["requests"]
    assert first["request_id"] == "req-abc-123"
    assert first["route"] == "chat"
    assert first["stream"] is True
    assert first["include_usage"] is True
    assert first["max_tokens"] == 3
    assert first["prompt_tokens"] > 0
    assert first["outcome"] == "completed"
    assert first["arrival"] <= first["admitted"] <= first["first_token"] <= first["end"]
    assert first["ttft_ms"] >= 0
    # Times are on the loop clock the test runs on.
    assert first["end"] <= asyncio.get_running_loop().time()
    assert second["request_id"] is None
    assert (second["route"], second["stream"], second["max_tokens"]) == ("completions", False, 2)
    assert second["include_usage"] is False


async def test_engine_prefills_first_come_first_served_in_chunks():
    """Pure engine: a 1000-token prompt takes the budget before a 10-token one behind it."""
    config = SimulatorConfig(prefill_tokens_per_step=400, step_base_ms=1, prefill_ms_per_token=0)
    engine = Engine(config)
    long_seq = engine.submit(1000, 1)
    short_seq = engine.submit(10, 1)
    await engine.step()
    assert (long_seq.prefilled, short_seq.prefilled) == (400, 0)
    await engine.step()
    assert (long_seq.prefilled, short_seq.prefilled) == (800, 0)
    await engine.step()  # 200 left for the long one, 10 for the short: both done this step
    assert long_seq.state == short_seq.state == "completed"
    assert long_seq.first_token == short_seq.first_token
    assert engine.stats()["completed"] == 2


# --------------------------------------------------------------------------- CLI


def test_cli_flags_cover_every_knob():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--max-batch", "3", "--prefill-tokens-per-step", "64", "--step-base-ms", "2.5",
         "--port", "0", "--model", "x"]
    )  # fmt: skip
    config = config_from_args(args)
    assert (config.max_batch, config.prefill_tokens_per_step, config.step_base_ms) == (3, 64, 2.5)
    assert config.model == "x"
    assert config.decode_ms_per_seq == SimulatorConfig().decode_ms_per_seq
    assert (args.host, args.port) == ("127.0.0.1", 0)
    with pytest.raises(ValueError):
        config_from_args(parser.parse_args(["--max-batch", "0"]))


async def test_cli_main_serves_until_sigterm(session: aiohttp.ClientSession):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.tools.simulator", "--port", "0", "--max-batch", "2",
        stdout=asyncio.subprocess.PIPE, cwd=REPO_ROOT, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()
        assert "listening on http://127.0.0.1:" in line
        url = line.split()[3]
        async with session.get(f"{url}/health") as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
