"""The simulator's OpenAI routes over real HTTP on 127.0.0.1: shapes, usage, errors, request log.

Usage numbers are checked against the gateway's own TokenCounter: there the
gateway is the independent check on the simulator, which counts on its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from gateway.admission.tokens import TokenCounter, chat_prompt_parts, load_encoding
from tests.tools.simulator.support import StartSim, chat_body, parse_sse, stats


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
    assert usage_chunk["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 4,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},  # under one block: never cached
    }


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
        "prompt_tokens_details": {"cached_tokens": 0},
    }

    # max_completion_tokens is honoured like max_tokens (and wins over it, as in vLLM).
    body = {"prompt": "a b c", "max_tokens": 9, "max_completion_tokens": 2}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        data = await resp.json()
    assert data["object"] == "text_completion"
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


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
