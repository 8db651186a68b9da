"""The simulator's prefix cache over real HTTP: cached tokens in the usage, faster TTFT, metrics.

What the gateway's cache-aware routing is tested against: a repeated prompt
reports its full blocks as `usage.prompt_tokens_details.cached_tokens` and
skips their prefill; a conversation's next turn hits the blocks of the turn
before, reply included; the flag turns it all off; `/metrics` counts it under
vLLM's and llama.cpp's names. Timing checks compare two requests in one test
with a slow prefill, so they are ratios of seconds to milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp

from tests.conftest import encoding
from tests.tools.simulator.support import StartSim, stats, wait_for_stats

BLOCK = 16
#: ~1500 tokens of varied text: 1.5 s of prefill at 1 ms a token.
LONG_TEXT = " ".join(f"item{n} costs {n * 7 % 113} units" for n in range(300))
SLOW_PREFILL = {"prefill_ms_per_token": 1.0}


async def _streamed(
    session: aiohttp.ClientSession, url: str, route: str, body: dict[str, Any]
) -> tuple[float, dict[str, Any]]:
    """Seconds to the first content token of a streamed request, and its usage chunk."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    loop = asyncio.get_running_loop()
    start = loop.time()
    first: float | None = None
    usage: dict[str, Any] | None = None
    async with session.post(f"{url}{route}", json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[len(b"data: ") :])
            if event.get("usage"):
                usage = event["usage"]
            elif first is None and event["choices"]:
                choice = event["choices"][0]
                if choice.get("text") or choice.get("delta", {}).get("content"):
                    first = loop.time()
    assert first is not None and usage is not None
    return first - start, usage


async def _post(session: aiohttp.ClientSession, url: str, route: str, body: Any) -> Any:
    async with session.post(f"{url}{route}", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def _cached(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def _full_blocks(prompt_tokens: int) -> int:
    """The prompt tokens a repeat hits: its full blocks, bar the last token (vLLM's rule)."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


async def test_a_repeated_chat_prompt_hits_its_full_blocks_and_its_first_token_comes_sooner(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim(**SLOW_PREFILL)
    body = {"messages": [{"role": "user", "content": LONG_TEXT}], "max_tokens": 3}
    cold_ttft, cold = await _streamed(session, url, "/v1/chat/completions", body)
    warm_ttft, warm = await _streamed(session, url, "/v1/chat/completions", body)

    assert cold["prompt_tokens"] == warm["prompt_tokens"] > 1000
    assert _cached(cold) == 0
    assert _cached(warm) == _full_blocks(warm["prompt_tokens"])
    assert cold_ttft > 1.0  # ~1.5 s of prefill
    assert warm_ttft < cold_ttft / 5  # ~16 tokens left to prefill: tens of ms

    # The non-streamed body carries the same field.
    data = await _post(session, url, "/v1/chat/completions", body)
    assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": _cached(warm)}


async def test_completions_report_cached_tokens_and_a_whole_cached_prompt_recomputes_a_block(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim()
    unaligned = {"prompt": list(range(1000, 1100)), "max_tokens": 2}  # 100 tokens
    aligned = {"prompt": list(range(2000, 2064)), "max_tokens": 2}  # 64 tokens: 4 full blocks
    for body, expected in ((unaligned, 96), (aligned, 48)):
        first = await _post(session, url, "/v1/completions", body)
        again = await _post(session, url, "/v1/completions", body)
        assert _cached(first["usage"]) == 0
        # As in vLLM, the last prompt token is always computed: a prompt cached whole
        # hits all its full blocks but the one holding that token.
        assert _cached(again["usage"]) == expected
    _, streamed = await _streamed(session, url, "/v1/completions", unaligned)
    assert _cached(streamed) == 96

    # A shared beginning hits; a prompt that differs in its first block does not.
    longer = {"prompt": list(range(1000, 1140)), "max_tokens": 2}
    assert _cached((await _post(session, url, "/v1/completions", longer))["usage"]) == 96
    other = {"prompt": [7, *range(1001, 1100)], "max_tokens": 2}
    assert _cached((await _post(session, url, "/v1/completions", other))["usage"]) == 0


async def test_the_next_turn_hits_the_previous_turns_prompt_and_reply(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim(**SLOW_PREFILL)
    system = {"role": "system", "content": LONG_TEXT[:2000]}
    turn1 = [system, {"role": "user", "content": "What is the first item?"}]
    first = await _post(session, url, "/v1/chat/completions", {"messages": turn1, "max_tokens": 40})
    reply = first["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}]
    ttft2, usage2 = await _streamed(
        session, url, "/v1/chat/completions", {"messages": turn2, "max_tokens": 3}
    )

    prompt1 = first["usage"]["prompt_tokens"]
    reply_tokens = len(encoding().encode_ordinary(reply))
    # Turn 1's prompt ends with the priming of the assistant message that turn 2 resends,
    # so the shared prefix is turn 1's prompt and its reply, re-encoded as turn 2 sends it.
    assert _cached(usage2) == (prompt1 + reply_tokens) // BLOCK * BLOCK
    assert _cached(usage2) > prompt1 // BLOCK * BLOCK  # the reply's blocks were cached too
    assert usage2["prompt_tokens"] - _cached(usage2) < 40  # only the new message is prefilled

    # Without the cache the same turn 2 prefills the whole history.
    cold_url = await start_sim(prefix_cache=False, **SLOW_PREFILL)
    await _post(session, cold_url, "/v1/chat/completions", {"messages": turn1, "max_tokens": 40})
    cold_ttft2, cold_usage2 = await _streamed(
        session, cold_url, "/v1/chat/completions", {"messages": turn2, "max_tokens": 3}
    )
    assert _cached(cold_usage2) == 0
    assert ttft2 < cold_ttft2 / 3


async def test_with_the_cache_off_nothing_is_cached_and_nothing_gets_faster(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim(prefix_cache=False, **SLOW_PREFILL)
    body = {"messages": [{"role": "user", "content": LONG_TEXT}], "max_tokens": 3}
    first_ttft, first = await _streamed(session, url, "/v1/chat/completions", body)
    second_ttft, second = await _streamed(session, url, "/v1/chat/completions", body)
    assert _cached(first) == _cached(second) == 0
    assert second_ttft > first_ttft / 2
    text = await _metrics(session, url)
    assert 'enable_prefix_caching="False"' in text
    assert _sample(text, "vllm:prefix_cache_queries_total") == 0  # vLLM counts no lookups
    snapshot = await stats(session, url)
    assert snapshot["prefix_cache_blocks"] == 0


async def _metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


def _sample(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


async def test_metrics_count_queries_hits_and_cached_blocks(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim(prefix_cache_blocks=1000)
    before = await _metrics(session, url)
    assert _sample(before, "vllm:prefix_cache_queries_total") == 0
    assert _sample(before, "sim:prefix_cache_blocks") == 0
    assert (
        'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",'
        'num_gpu_blocks="1000"} 1.0' in before
    )
    assert "# TYPE vllm:prefix_cache_hits_total counter" in before  # as vLLM scrapes

    body = {"prompt": list(range(1000, 1100)), "max_tokens": 2}
    await _post(session, url, "/v1/completions", body)
    await _post(session, url, "/v1/completions", body)
    after = await _metrics(session, url)
    assert _sample(after, 'vllm:prefix_cache_queries_total{model_name="sim-model"}') == 200
    assert _sample(after, 'vllm:prefix_cache_hits_total{model_name="sim-model"}') == 96
    assert _sample(after, "llamacpp:prompt_tokens_cached_total") == 96
    assert _sample(after, "llamacpp:prompt_tokens_total") == 100 + 4  # computed tokens only
    assert _sample(after, 'sim:prefix_cache_blocks{model_name="sim-model"}') == 6
    assert _sample(after, "sim:prefix_cache_pinned_blocks") == 0  # nothing running

    snapshot = await stats(session, url)
    assert (snapshot["prefix_cache_queries"], snapshot["prefix_cache_hits"]) == (200, 96)
    async with session.get(f"{url}/sim/requests") as resp:
        logged = (await resp.json())["requests"]
    assert [entry["cached_tokens"] for entry in logged] == [0, 96]


async def test_blocks_of_a_running_sequence_are_pinned_and_the_lru_evicts_the_rest(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim(prefix_cache_blocks=8)
    held = {"prompt": list(range(1000, 1100)), "max_tokens": 150}  # 6 blocks, runs ~1 s
    other = {"prompt": list(range(5000, 5100)), "max_tokens": 1}  # 6 more blocks
    running = asyncio.create_task(_post(session, url, "/v1/completions", held))
    try:
        prefilled = await wait_for_stats(session, url, lambda s: s["prefilled_tokens"] >= 100)
        assert prefilled["prefix_cache_pinned_blocks"] == 6
        await _post(session, url, "/v1/completions", other)  # room for 2 of its blocks only
        snapshot = await stats(session, url)
        assert snapshot["running"] == 1, "the held request ended too soon for this test"
        assert (snapshot["prefix_cache_blocks"], snapshot["prefix_cache_pinned_blocks"]) == (8, 6)
        await running
    finally:
        running.cancel()

    again = await _post(session, url, "/v1/completions", {**held, "max_tokens": 1})
    assert _cached(again["usage"]) == 96  # none of its blocks was evicted while it ran
    partly = await _post(session, url, "/v1/completions", other)
    assert _cached(partly["usage"]) < 96  # the other prompt's blocks were not all kept
    assert (await stats(session, url))["prefix_cache_evictions"] > 0


async def test_tgi_routes_use_the_same_cache_and_report_nothing_of_it(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim()
    text = LONG_TEXT[:1500]
    body = {"inputs": text, "parameters": {"max_new_tokens": 2, "details": True}}
    async with session.post(f"{url}/generate", json=body) as resp:
        assert resp.status == 200
        raw = await resp.text()
        headers = resp.headers
    assert "cached" not in raw and not any("cache" in name.lower() for name in headers)
    async with session.post(f"{url}/generate", json=body) as resp:
        assert resp.status == 200
    # An OpenAI completion of the same text shares the TGI request's blocks.
    data = await _post(session, url, "/v1/completions", {"prompt": text, "max_tokens": 2})
    assert _cached(data["usage"]) == _full_blocks(data["usage"]["prompt_tokens"])
    async with session.get(f"{url}/sim/requests") as resp:
        logged = (await resp.json())["requests"]
    assert logged[0]["cached_tokens"] == 0
    assert logged[1]["cached_tokens"] == _cached(data["usage"]) > 0
