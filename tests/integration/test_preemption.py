"""Preemption on a real gateway and simulator (issue #53): a long prompt in prefill gives
the engine to a short request, and its own client gets one whole answer, once.

The simulator prefills slowly (2 ms a prompt token, 256 tokens a step: a 1500-token
prompt is ~3 s of prefill) so the long request is surely in prefill when the short one
comes; `seed` makes its words the same every time it is sent (as vLLM samples with it),
so the answer after a preemption is compared with the one to another prompt without.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import msgspec
import pytest

from gateway.config import HealthSettings, PreemptionSettings, Settings
from tests.conftest import StartGateway, StartSimulator, chat, sse_events

ENGINES = {
    "chunked": {"pose_as": "vllm"},
    "llama.cpp": {"pose_as": "llama.cpp"},
    "whole": {"prefill": "whole"},  # TGI's: a whole prompt a step
}


def long_request(word: str) -> dict[str, Any]:
    """A 1500-token prompt of `word` (another word: nothing of it in the prefix cache)."""
    return chat(f"{word} " * 1500, max_tokens=24, seed=7, stream=True, ignore_eos=True)


def preempting(settings: Settings) -> Settings:
    return msgspec.structs.replace(
        settings,
        preemption=PreemptionSettings(enabled=True),
        health=HealthSettings(interval_s=0.2, timeout_s=0.15, probe_on_start=False),
    )


async def answer(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], rid: str
) -> tuple[str, float]:
    """The streamed answer's text (its events, once each) and its first byte's time."""
    start = time.monotonic()
    async with http.post(
        url + "/v1/chat/completions", json=body, headers={"x-request-id": rid}
    ) as resp:
        assert resp.status == 200, await resp.text()
        first = None
        raw = b""
        async for chunk in resp.content.iter_any():
            if first is None and chunk.startswith(b"data:"):
                first = time.monotonic() - start
            raw += chunk
    events = sse_events(b"\n\n".join(b for b in raw.split(b"\n\n") if not b.startswith(b":")))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    text = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]
    )
    return text, first or 0.0


@pytest.mark.parametrize("engine", sorted(ENGINES))
async def test_a_long_prompt_in_prefill_gives_way_and_its_answer_comes_whole_once(
    engine: str,
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    backend = await start_simulator_at(
        max_batch=4, step_base_ms=10.0, prefill_ms_per_token=2.0, prefill_tokens_per_step=256,
        **ENGINES[engine],
    )  # fmt: skip
    gateway = await start_gateway([backend], max_concurrency=4, configure=preempting)
    alone, _ = await answer(http, gateway.url, long_request("alone"), "alone")
    long = asyncio.create_task(answer(http, gateway.url, long_request("long"), "long"))
    await asyncio.sleep(0.8)  # its prefill is under way: ~3 s of it
    short_text, short_ttft = await answer(
        http, gateway.url, chat(max_tokens=4, stream=True), "short"
    )
    text, _ = await long
    assert text == alone  # one whole answer: the same words as without a preemption
    lines = {line["request_id"]: line for line in gateway.request_lines()}
    assert lines["long"]["preempted"] == 1 and lines["long"]["outcome"] == "ok", lines["long"]
    assert lines["long"]["preempted_ms"] >= 700, lines["long"]
    assert lines["alone"]["preempted"] == 0
    assert short_text
    if engine != "whole":
        # Without the preemption the short one would wait the ~2 s of prefill left. (A
        # whole-prompt step cannot be cut short: the engine ends it, then serves the short
        # one. There preemption gains nothing once the prompt's step began.)
        assert short_ttft < 1.0, short_ttft
    async with http.get(backend + "/sim/requests") as resp:
        sent = await resp.json()
    sent = sent["requests"] if isinstance(sent, dict) else sent
    assert len(sent) == 4  # alone, long (aborted), short, long again
    async with http.get(gateway.url + "/metrics") as resp:
        assert 'gateway_preemptions_total{lane="bulk"} 1.0' in await resp.text()


async def test_a_steady_stream_of_shorts_cannot_preempt_a_long_request_forever(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    backend = await start_simulator_at(
        max_batch=4, step_base_ms=10.0, prefill_ms_per_token=2.0, prefill_tokens_per_step=256
    )
    gateway = await start_gateway([backend], max_concurrency=4, configure=preempting)
    alone, _ = await answer(http, gateway.url, long_request("alone"), "alone")
    long = asyncio.create_task(answer(http, gateway.url, long_request("long"), "long"))
    shorts = []
    for index in range(40):  # one every 0.3 s: each lands in the long prefill
        if long.done():
            break
        await asyncio.sleep(0.3)
        body = chat(max_tokens=4, stream=True)
        shorts.append(asyncio.create_task(answer(http, gateway.url, body, f"short-{index}")))
    text, _ = await asyncio.wait_for(long, 30)
    for task in shorts:
        with contextlib.suppress(Exception):
            await task
    assert text == alone
    (line,) = [line for line in gateway.request_lines() if line["request_id"] == "long"]
    max_per_request = PreemptionSettings().max_per_request
    assert line["preempted"] == max_per_request and line["outcome"] == "ok", line
