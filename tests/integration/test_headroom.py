"""Headroom on a real gateway and simulator: a burst of short requests finds free slots.

The simulator's steps are slowed so that a long request holds its slot for seconds
and a short one for about a second: a burst that queued behind the long requests
would wait a short request's time or more; with headroom it starts at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import msgspec
import pytest

from gateway.config import HealthSettings, Settings
from tests.conftest import StartGateway, StartSimulator, chat


def fast_health(settings: Settings) -> Settings:
    return msgspec.structs.replace(
        settings, health=HealthSettings(interval_s=0.2, timeout_s=0.15, probe_on_start=False)
    )


async def streamed(http: aiohttp.ClientSession, url: str, body: dict[str, Any], rid: str) -> int:
    headers = {"x-request-id": rid}
    async with http.post(
        url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers
    ) as resp:
        await resp.read()
        return resp.status


async def steady_shorts(http: aiohttp.ClientSession, url: str, every_s: float) -> None:
    """Short chats, one every `every_s`, until cancelled (the interactive lane's demand)."""
    sent = []
    try:
        for index in range(1000):
            sent.append(
                asyncio.create_task(streamed(http, url, chat(max_tokens=40), f"steady-{index}"))
            )
            await asyncio.sleep(every_s)
    finally:
        for task in sent:
            with contextlib.suppress(Exception):
                await task


@pytest.mark.slow
@pytest.mark.serial  # its shorts' first tokens are timed: alone, after the parallel part
async def test_a_burst_of_shorts_while_longs_arrive_starts_at_once(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    backend = await start_simulator_at(max_batch=8, step_base_ms=20.0)
    gateway = await start_gateway([backend], max_concurrency=8, configure=fast_health)
    steady = asyncio.create_task(steady_shorts(http, gateway.url, 0.5))
    await asyncio.sleep(4.0)  # the interactive lane's demand is measured: ~2 slots
    long_body = chat("long " * 1500, max_tokens=300)  # bulk; holds its slot ~7 s
    longs = [
        asyncio.create_task(streamed(http, gateway.url, long_body, f"long-{i}")) for i in range(6)
    ]
    await asyncio.sleep(5.5)  # first come, all six would run by now (one prefill each)
    async with http.get(gateway.url + "/debug/backends") as resp:
        lanes = {lane["lane"]: lane for lane in json.loads(await resp.read())["lanes"]}
    headroom = lanes["interactive"]["headroom"]
    assert headroom["headroom_slots"] >= 3 and headroom["wait_probability"] == 0.1, headroom
    assert lanes["bulk"]["headroom"]["may_hold"] == 8 - headroom["headroom_slots"]
    burst = [
        asyncio.create_task(streamed(http, gateway.url, chat(max_tokens=8), f"burst-{i}"))
        for i in range(3)
    ]
    assert await asyncio.gather(*burst) == [200] * 3
    steady.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await steady
    assert await asyncio.gather(*longs) == [200] * 6
    lines = {line["request_id"]: line for line in gateway.request_lines()}
    ttfts = [lines[f"burst-{i}"]["ttft_ms"] for i in range(3)]
    waits = [lines[f"burst-{i}"]["queue_ms"] for i in range(3)]
    # All three start at once, within the floor: one long prefill ahead (the prefill
    # budget lets only one run) plus their own. First come (the code before headroom),
    # the longs held every free slot and the burst went one by one as steady shorts
    # ended: waits of ~0.1, 0.3 and 0.55 s measured.
    assert max(waits) - min(waits) < 150, waits
    prefill_ms = max(lines[f"long-{i}"]["backend_ttft_ms"] for i in range(6))
    assert max(ttfts) < prefill_ms + 400, (ttfts, prefill_ms)
    long_waits = sorted(lines[f"long-{i}"]["queue_ms"] for i in range(6))
    assert long_waits[-1] > 1000, long_waits  # some longs waited for the headroom
    async with http.get(gateway.url + "/metrics") as resp:
        text = await resp.text()
    assert 'gateway_lane_headroom_slots{lane="interactive"}' in text


async def test_a_lane_whose_own_demand_exceeds_the_backend_is_warned_about(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    backend = await start_simulator_at(max_batch=2, step_base_ms=20.0)
    gateway = await start_gateway([backend], max_concurrency=2, configure=fast_health)
    steady = asyncio.create_task(steady_shorts(http, gateway.url, 0.25))  # ~3.5 slots
    await asyncio.sleep(4.0)
    steady.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await steady
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line]
    warned = [e for e in events if e.get("event") == "lane_demand_over_capacity"]
    assert warned and warned[-1]["lane"] == "interactive", events
    # Both slots: the default bulk lane keeps no floor below it.
    assert warned[-1]["demand_slots"] > warned[-1]["usable_slots"] == 2


async def test_a_tail_that_needs_every_slot_is_warned_about(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """~2 slots of demand on a backend of 4: it fits, but its P99 wait within half the
    engine floor needs all four; the operator is told, with the lever."""
    backend = await start_simulator_at(max_batch=4, step_base_ms=20.0)
    gateway = await start_gateway([backend], max_concurrency=4, configure=fast_health)
    steady = asyncio.create_task(steady_shorts(http, gateway.url, 0.5))
    await asyncio.sleep(4.0)
    steady.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await steady
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line]
    assert not [e for e in events if e.get("event") == "lane_demand_over_capacity"], events
    warned = [e for e in events if e.get("event") == "lane_tail_needs_every_slot"]
    assert warned and warned[-1]["lane"] == "interactive", events
    assert warned[-1]["tail_slots"] == warned[-1]["slots"] == 4
    assert 0 < warned[-1]["demand_slots"] < 4 and "--max-num-seqs" in warned[-1]["hint"]
