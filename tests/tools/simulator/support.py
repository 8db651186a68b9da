"""Helpers the simulator's OpenAI-route and engine tests share: bodies, SSE, `/sim/stats`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

StartSim = Callable[..., Awaitable[str]]
LONG_PROMPT = "hello " * 4000  # ~4000 tokens: ~2 s of prefill with the defaults
SHORT_PROMPT = "hello " * 45  # ~50 tokens: tens of ms


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
