"""Retries, seen and damped, through a real gateway in front of the simulator.

One slot and a lane with no queue: while one request holds the slot, every other is
refused with 429 queue_full and a Retry-After. A client that retries before it is
refused again at once, without queueing, and its log line names the request it
repeats; one that waits its Retry-After is served.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from msgspec.structs import replace

from gateway.config import LaneSettings, RetrySettings
from tests.conftest import StartGateway, StartSimulator, chat

ROUTE = "/v1/chat/completions"
#: A lane that queues nothing: a request finding the one slot busy gets 429 at once.
NO_QUEUE = [LaneSettings(name="only", max_queue_depth=0, queue_timeout_s=30)]


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str
) -> tuple[int, dict[str, str], Any]:
    async with http.post(url + ROUTE, json=body, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def hold_the_slot(
    http: aiohttp.ClientSession, url: str, seconds_of_work: int
) -> asyncio.Task[tuple[int, dict[str, str], Any]]:
    """A request that holds the one slot (20 ms a token) until it is done."""
    task = asyncio.create_task(
        post(http, url, chat("hold", max_tokens=50 * seconds_of_work), **{"x-request-id": "hold"})
    )
    await asyncio.sleep(0.3)
    return task


async def test_a_retry_before_retry_after_is_refused_at_once_one_that_waits_is_served(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    backend = await start_simulator_at(max_batch=1, step_base_ms=20.0)
    gateway = await start_gateway([backend], max_concurrency=1, lanes=NO_QUEUE)
    holder = await hold_the_slot(http, gateway.url, 1)
    body, mine = chat("my question", max_tokens=4), {"x-request-id": "client-req-1"}
    status, headers, first = await post(http, gateway.url, body, **mine)
    assert status == 429 and first["error"]["code"] == "queue_full"
    retry_after = int(headers["Retry-After"])
    loop = asyncio.get_running_loop()
    started = loop.time()
    status, headers, again = await post(http, gateway.url, body, **mine)
    took = loop.time() - started
    assert status == 429 and again["error"]["code"] == "queue_full" and took < 0.5
    assert headers["x-gateway-refusal"] == "queue_full"
    assert 1 <= int(headers["Retry-After"]) <= retry_after
    assert "repeats one refused" in again["error"]["message"]
    await holder
    await asyncio.sleep(retry_after)  # as told: the slot is free by then
    status, _, served = await post(http, gateway.url, body, **mine)
    assert status == 200 and served["choices"]

    lines = [line for line in gateway.request_lines() if line["request_id"] == "client-req-1"]
    assert [line["status"] for line in lines] == [429, 429, 200]
    original, damped, waited = lines
    assert original["retry_of"] is None and original["retried_outcome"] is None
    assert not original["retry_damped"]
    assert damped["retry_of"] == "client-req-1" and damped["retried_outcome"] == "queue_full"
    assert damped["retry_damped"] is True and damped["error_code"] == "queue_full"
    assert damped["retry_gap_ms"] > 0 and damped["retry_after_s"] > 0
    # It never took a place in the queue (nor was it measured): no queue time at all.
    assert damped["queue_ms"] is None and damped["prompt_tokens"] is None
    assert damped["lane"] == "only"
    assert waited["retried_outcome"] == "queue_full" and not waited["retry_damped"]
    assert waited["retry_gap_ms"] >= retry_after * 1000 - 50
    async with http.get(gateway.url + "/metrics") as resp:
        text = await resp.text()
    assert 'gateway_client_retries_total{after="queue_full",lane="only"} 2.0' in text
    assert 'gateway_client_retries_damped_total{lane="only"} 1.0' in text


async def test_the_same_body_from_an_unnamed_sender_is_seen_but_never_damped(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """No key, no tenant header, no id of its own: two people behind one proxy could send
    the same "hi", so the copy is logged as a retry but goes through the scheduler."""
    backend = await start_simulator_at(max_batch=1, step_base_ms=20.0)
    gateway = await start_gateway([backend], max_concurrency=1, lanes=NO_QUEUE)
    holder = await hold_the_slot(http, gateway.url, 1)
    body = chat("hi", max_tokens=4)
    assert (await post(http, gateway.url, body))[0] == 429
    assert (await post(http, gateway.url, body))[0] == 429
    # The same from a named tenant is damped.
    team = {"x-tenant-id": "team-a"}
    assert (await post(http, gateway.url, body, **team))[0] == 429
    assert (await post(http, gateway.url, body, **team))[0] == 429
    await holder
    lines = [line for line in gateway.request_lines() if line["request_id"] != "hold"]
    assert [line["retried_outcome"] for line in lines] == [None, "queue_full", None, "queue_full"]
    assert [line["retry_damped"] for line in lines] == [False, False, False, True]
    # The unnamed copy was admitted and measured as new work (and refused by the queue).
    assert lines[1]["prompt_tokens"] is not None and lines[1]["queue_ms"] is not None


async def test_a_copy_sent_while_the_first_is_in_flight_is_a_retry_of_it(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """A client that timed out and sent again while the gateway still serves the first."""
    backend = await start_simulator_at(max_batch=4, step_base_ms=20.0)
    gateway = await start_gateway([backend], max_concurrency=4)
    body, mine = chat("slow one", max_tokens=40), {"x-request-id": "impatient-1"}
    first = asyncio.create_task(post(http, gateway.url, body, **mine))
    await asyncio.sleep(0.3)
    assert (await post(http, gateway.url, body, **mine))[0] == 200
    assert (await first)[0] == 200
    by_end = [line for line in gateway.request_lines() if line["request_id"] == "impatient-1"]
    copy = next(line for line in by_end if line["retry_of"] is not None)
    assert copy["retried_outcome"] == "in_flight" and copy["retry_gap_ms"] is None
    assert not copy["retry_damped"]


async def test_with_damping_off_a_retry_is_counted_and_queued_as_new_work(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    backend = await start_simulator_at(max_batch=1, step_base_ms=20.0)
    gateway = await start_gateway(
        [backend],
        max_concurrency=1,
        lanes=NO_QUEUE,
        configure=lambda s: replace(s, retries=RetrySettings(damp=False)),
    )
    holder = await hold_the_slot(http, gateway.url, 1)
    body, mine = chat("q", max_tokens=4), {"x-request-id": "undamped"}
    assert (await post(http, gateway.url, body, **mine))[0] == 429
    assert (await post(http, gateway.url, body, **mine))[0] == 429
    await holder
    copy = [line for line in gateway.request_lines() if line["request_id"] == "undamped"][1]
    assert copy["retried_outcome"] == "queue_full" and not copy["retry_damped"]
    assert copy["prompt_tokens"] is not None  # it went all the way to the scheduler
