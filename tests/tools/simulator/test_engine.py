"""The simulator's engine: head-of-line blocking, the batch cap, aborts, FCFS chunked prefill.

Most tests go through real HTTP on 127.0.0.1, because what matters is what a
client (the gateway) sees. Timing assertions compare effects of seconds against
milliseconds, so they hold on a busy 2-core machine.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gateway.tools.simulator import SimulatorConfig
from gateway.tools.simulator.engine import Engine
from gateway.tools.simulator.prefix_cache import prompt_blocks
from tests.tools.simulator.support import (
    LONG_PROMPT,
    SHORT_PROMPT,
    StartSim,
    chat_body,
    stats,
    stream_ttft,
    wait_for_stats,
)


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


async def test_whole_prompt_engine_prefills_in_steps_of_its_own():
    """TGI's batching: whole prompts, first come first served, while they fit in the step's
    budget; the batch's decoding waits for a step that prefills."""
    config = SimulatorConfig(
        prefill="whole", prefill_tokens_per_step=1000, step_base_ms=1, prefill_ms_per_token=0
    )
    engine = Engine(config)
    decoding = engine.submit(10, 5)
    await engine.step()  # its prompt alone, whole
    assert (decoding.prefilled, decoding.generated) == (10, 1)
    long_seq = engine.submit(900, 1)
    short_seq = engine.submit(50, 1)
    over = engine.submit(200, 1)  # 900 + 50 + 200 is over the budget: next step
    await engine.step()
    assert long_seq.state == short_seq.state == "completed"  # prefilled together
    assert over.prefilled == 0
    assert decoding.generated == 1  # nobody decodes in a prefill step
    await engine.step()
    assert over.state == "completed" and decoding.generated == 1
    await engine.step()  # nothing left to prefill: the batch decodes
    assert decoding.generated == 2


async def test_whole_prompt_engine_takes_a_prompt_over_its_budget_alone():
    config = SimulatorConfig(
        prefill="whole", prefill_tokens_per_step=100, step_base_ms=1, prefill_ms_per_token=0
    )
    engine = Engine(config)
    big, small = engine.submit(500, 1), engine.submit(5, 1)
    await engine.step()
    assert big.state == "completed" and small.prefilled == 0  # nobody overtakes it
    await engine.step()
    assert small.state == "completed"


async def test_a_token_bounded_batch_admits_first_come_first_served_while_it_fits():
    """TGI's `max_batch_total_tokens`: each sequence holds its prompt and its whole
    max_tokens from admission; the next in line waits, and nobody overtakes it."""
    config = SimulatorConfig(
        max_batch=16, max_batch_tokens=1000, step_base_ms=1, prefill_ms_per_token=0
    )
    engine = Engine(config)
    first = engine.submit(300, 300)  # holds 600
    big = engine.submit(300, 200)  # 500 more: over 1000
    small = engine.submit(10, 10)  # would fit, but waits behind `big`
    await engine.step()
    assert first.state == "running" and big.state == small.state == "waiting"
    engine.abort(first)
    await engine.step()
    assert big.state == small.state == "running"  # 520 of 1000

    alone = Engine(config)
    huge = alone.submit(900, 900)  # over all of it: it goes when nothing else runs
    await alone.step()
    assert huge.state == "running"


@pytest.mark.parametrize("keep", [False, True])
async def test_a_prompt_aborted_mid_prefill_leaves_its_blocks_only_when_configured(
    keep: bool,
) -> None:
    """vLLM 0.32 (measured): a prompt aborted before its prefill ends and sent again finds
    none of it cached; `keep_aborted_prefill` models an engine that keeps what it did."""
    config = SimulatorConfig(
        prefill_tokens_per_step=400, step_base_ms=1, prefill_ms_per_token=0,
        block_tokens=16, keep_aborted_prefill=keep,
    )  # fmt: skip
    engine = Engine(config)
    blocks = prompt_blocks(list(range(1000)), 16)
    first = engine.submit(1000, 1, blocks)
    await engine.step()
    await engine.step()  # 800 of 1000 prefilled: 50 blocks filled
    engine.abort(first)
    again = engine.submit(1000, 1, blocks)
    await engine.step()
    assert again.cached_tokens == (800 if keep else 0)
    # A prompt aborted after its prefill (answering) leaves it all, either way.
    done = engine.submit(1000, 2, prompt_blocks(list(range(5000, 6000)), 16))
    while done.first_token is None:
        await engine.step()
    engine.abort(done)
    assert engine.submit(1000, 1, prompt_blocks(list(range(5000, 6000)), 16)).cached_tokens == 0
    await engine.step()
    assert engine.stats()["prefix_cache_hits"] >= 992
