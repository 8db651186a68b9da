"""Every written bound on a size, a queue or a share is the one in force (issue #51):
fresh, learned or restarted, in front of a fast engine or a slow one.

- `[limits] max_prompt_tokens`: a prompt one token over gets 413, one at it is served;
- `[[lanes]] max_queue_depth`: with the slot taken and the queue full, the next arrival
  gets 429 `queue_full` at once, and the engine never sees it;
- `[[lanes]] max_slots`: on a backend of three slots, a lane of one never holds two;
- `[[api_keys]] requests_per_minute`: the request over it gets 429 `quota_exceeded`.
"""

from __future__ import annotations

import asyncio
from itertools import pairwise
from typing import Any

import aiohttp
import pytest

from tests.conftest import StartSimulator, chat, encoding
from tests.contract.conftest import ADMIN_KEY, ENGINES, KNOWLEDGE, StartWritten, sim_requests

ROUTE = "/v1/chat/completions"
#: The written prompt cap.
PROMPT_CAP = 200


def engine_with_slots(engine: str, slots: int) -> dict[str, Any]:
    return {**ENGINES[engine], "max_batch": slots}


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str | None = None
) -> tuple[int, dict[str, Any]]:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    async with http.post(url + ROUTE, json=body, headers=headers) as resp:
        return resp.status, (await resp.json() if resp.status != 200 else {})


def prompt_of(tokens: int) -> str:
    """A user message the gateway counts as `tokens` prompt tokens: its content's tokens
    plus a message's framing (3), its role (1) and the reply's priming (3)."""
    content = encoding().encode_ordinary("".join(f" w{i}" for i in range(tokens)))
    return encoding().decode(content[: tokens - 7])


@pytest.mark.parametrize("knowledge", KNOWLEDGE)
@pytest.mark.parametrize("engine", sorted(ENGINES))
async def test_written_bounds_hold(
    engine: str,
    knowledge: str,
    start_simulator_at: StartSimulator,
    start_written: StartWritten,
    http: aiohttp.ClientSession,
) -> None:
    sim = await start_simulator_at(**engine_with_slots(engine, 3))
    gateway = await start_written(
        f"[limits]\nmax_prompt_tokens = {PROMPT_CAP}\n\n"
        f'[[backends]]\nurl = "{sim}"\nmax_concurrency = 3\n\n'
        '[[lanes]]\nname = "only"\nmax_slots = 1\nmax_queue_depth = 2\nqueue_timeout_s = 30\n\n'
        '[[api_keys]]\nkey = "key-limited"\nrequests_per_minute = 4\n'
        '[[api_keys]]\nkey = "key-free-0"\n'
        f'[[api_keys]]\nkey = "{ADMIN_KEY}"\nadmin = true\n',
        knowledge,
    )
    url = gateway.url

    # The prompt cap: one token over it is refused at the door, one at it is served.
    status, body = await post(
        http, url, chat(prompt_of(PROMPT_CAP + 1), max_tokens=1), "key-free-0"
    )
    assert (status, body["error"]["code"]) == (413, "prompt_too_long"), body
    at_cap = chat(prompt_of(PROMPT_CAP), max_tokens=1)
    headers = {"Authorization": "Bearer key-free-0"}
    async with http.post(url + ROUTE, json=at_cap, headers=headers) as resp:
        assert resp.status == 200
        assert resp.headers["x-gateway-prompt-tokens"] == str(PROMPT_CAP)

    # The lane's one slot and its queue of two: three slow answers, then a fourth arrival.
    seen = len(await sim_requests(http, sim))
    slow = chat("slow", max_tokens=60, ignore_eos=True)  # 60 steps of 20 ms: over a second
    running = [asyncio.create_task(post(http, url, slow, "key-free-0")) for _ in range(3)]
    await asyncio.sleep(0.3)
    status, body = await post(http, url, chat("one too many", max_tokens=1), "key-free-0")
    assert (status, body["error"]["code"]) == (429, "queue_full"), body
    statuses = [status for status, _ in await asyncio.gather(*running)]
    assert statuses == [200, 200, 200]
    # max_slots = 1: the engine, which has three, never ran two of them at once.
    received = (await sim_requests(http, sim))[seen:]
    assert len(received) == 3, received
    ends = sorted((r["arrival"], r.get("end") or 0.0) for r in received)
    assert all(later[0] >= earlier[1] - 0.05 for earlier, later in pairwise(ends)), ends

    # The key's quota: its fifth request in the minute is refused.
    answers = [await post(http, url, chat("q", max_tokens=1), "key-limited") for _ in range(5)]
    assert [status for status, _ in answers] == [200, 200, 200, 200, 429], answers
    assert answers[-1][1]["error"]["code"] == "quota_exceeded"
