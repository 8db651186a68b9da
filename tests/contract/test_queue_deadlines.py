"""A written queue deadline is the one in force: fresh, learned or restarted, fast engine
or slow (issue #51).

One backend of one slot, one lane with `queue_timeout_s = 1.0`. A 4-second answer holds
the slot; two requests arrive behind it, the second with a client's own longer deadline
(`x-request-deadline-ms: 10000`). Each gets 503 `queue_timeout` at 1.0 s, or 429
`wait_too_long` at once when the gateway can tell the wait is longer (the slot's prompt
still has seconds of prefill left), and the backend never sees either: the client's
longer deadline changes nothing, the shorter one holds.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from tests.conftest import StartSimulator, chat
from tests.contract.conftest import ENGINES, KNOWLEDGE, StartWritten, sim_requests

pytestmark = pytest.mark.serial  # timings of 0.1 s: alone, on a quiet machine

#: How far from the written deadline a queue timeout may come (the loop's timer and a
#: busy 2-core machine).
SLACK_S = 0.15


def one_lane(sim: str, timeout_s: float) -> str:
    return (
        f'[[backends]]\nurl = "{sim}"\nmax_concurrency = 1\n\n'
        f'[[lanes]]\nname = "only"\nqueue_timeout_s = {timeout_s}\n'
    )


async def timed_post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, float, dict[str, Any], str | None]:
    """Status, seconds to the answer's head, the error body, and Retry-After."""
    start = time.monotonic()
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        took = time.monotonic() - start
        payload = await resp.json() if resp.status != 200 else {}
        return resp.status, took, payload, resp.headers.get("Retry-After")


async def hold_the_slot(
    http: aiohttp.ClientSession, url: str, sim: str, prompt_words: int
) -> asyncio.Task[None]:
    """A streamed answer of 200 tokens (about 4 s of 20-ms steps, after the prompt's
    prefill) that takes the one slot: sent, and read to its end in a task of its own,
    returned once the engine has it (its head comes only with its first token)."""
    body = chat("hold " * prompt_words, max_tokens=200, stream=True, ignore_eos=True)
    before = len(await sim_requests(http, sim))

    async def read() -> None:
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            await resp.read()

    task = asyncio.create_task(read())
    for _ in range(100):
        if len(await sim_requests(http, sim)) > before:
            return task
        await asyncio.sleep(0.02)
    task.cancel()
    raise AssertionError("the holder never reached the engine")


@pytest.mark.parametrize("knowledge", KNOWLEDGE)
@pytest.mark.parametrize("engine", sorted(ENGINES))
async def test_a_written_queue_timeout_is_exact(
    engine: str,
    knowledge: str,
    start_simulator_at: StartSimulator,
    start_written: StartWritten,
    http: aiohttp.ClientSession,
) -> None:
    sim = await start_simulator_at(**ENGINES[engine])
    gateway = await start_written(one_lane(sim, 1.0), knowledge)
    # On the slow engine the holder's prompt is long: seconds of prefill, then its answer.
    holder = await hold_the_slot(http, gateway.url, sim, 1500 if engine == "slow" else 5)
    try:
        await asyncio.sleep(0.3)
        seen = len(await sim_requests(http, sim))
        answers = await asyncio.gather(
            timed_post(http, gateway.url, chat("short 0"), {}),
            timed_post(http, gateway.url, chat("short 1"), {"x-request-deadline-ms": "10000"}),
        )
        for status, took, payload, retry_after in answers:
            code = payload["error"]["code"]
            assert (status, code) in {(503, "queue_timeout"), (429, "wait_too_long")}, payload
            if status == 503:
                assert abs(took - 1.0) <= SLACK_S, took
            else:
                assert took < 0.5, took
            assert retry_after is not None and int(retry_after) >= 1
        assert len(await sim_requests(http, sim)) == seen, "a refused request reached the engine"
    finally:
        holder.cancel()
    for line in await gateway.lines_of(2, route="/v1/chat/completions", stream=False):
        assert line["deadline_ms"] == pytest.approx(1000.0, abs=1), line
        assert line["predicted_wait_ms"] is not None, line


@pytest.mark.parametrize("knowledge", ("fresh", "learned"))
async def test_a_knowable_wait_is_refused_at_arrival_with_the_time_it_needs(
    knowledge: str,
    start_simulator_at: StartSimulator,
    start_written: StartWritten,
    http: aiohttp.ClientSession,
) -> None:
    """The slow engine's one slot holds a 1500-token prompt: about 6 s of prefill. A chat
    turn behind it with a 2 s lane cannot be served in time: once the engine's rate is
    measured it is told so at once, with a Retry-After near what is left of that prefill;
    before, it waits its 2 s exactly, never more."""
    sim = await start_simulator_at(**ENGINES["slow"])
    gateway = await start_written(one_lane(sim, 2.0), knowledge)
    holder = await hold_the_slot(http, gateway.url, sim, 1500)
    try:
        await asyncio.sleep(0.3)
        status, took, payload, retry_after = await timed_post(
            http, gateway.url, chat("Say hello."), {}
        )
    finally:
        holder.cancel()
    if knowledge == "fresh":
        assert (status, payload["error"]["code"]) == (503, "queue_timeout"), payload
        assert abs(took - 2.0) <= SLACK_S, took
        return
    assert (status, payload["error"]["code"]) == (429, "wait_too_long"), payload
    assert took < 0.5, took
    assert retry_after is not None and 2 <= int(retry_after) <= 8, retry_after
    (line,) = await gateway.lines_of(1, outcome="rejected_wait_too_long")
    assert line["predicted_wait_ms"] > 2000, line
