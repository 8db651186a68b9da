"""What the operator left unset adapts (issue #51): the built-in lanes' deadlines are
fitted to the engine the gateway finds, so a slow engine that serves a chat turn behind
one long prefill is not turned into refusals, fresh, learned or restarted.

On the slow engine (~250 prompt tokens/s, one slot) a 1500-token prompt takes about
6 s to prefill; four chat turns sent just after it wait for it in the gateway. The built-in interactive lane's 5 s would refuse them: unset, it is raised
(60 s while the engine is unmeasured, then 1.5x the measured floor), and every one is
served. The start-up lines say so, with the figures.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.conftest import StartSimulator, chat
from tests.contract.conftest import ENGINES, KNOWLEDGE, StartWritten

ROUTE = "/v1/chat/completions"


@pytest.mark.parametrize("knowledge", KNOWLEDGE)
async def test_the_built_in_lanes_fit_a_slow_engine_and_say_so(
    knowledge: str,
    start_simulator_at: StartSimulator,
    start_written: StartWritten,
    http: aiohttp.ClientSession,
) -> None:
    sim = await start_simulator_at(**ENGINES["slow"])
    gateway = await start_written(f'[[backends]]\nurl = "{sim}"\nmax_concurrency = 1\n', knowledge)

    async def send(prompt: str, max_tokens: int) -> int:
        body = chat(prompt, max_tokens=max_tokens, ignore_eos=True)
        async with http.post(gateway.url + ROUTE, json=body) as resp:
            await resp.read()
            return resp.status

    long = asyncio.create_task(send("long " * 1500, 4))
    await asyncio.sleep(0.3)
    shorts = await asyncio.gather(*(send(f"Say hello {i}.", 4) for i in range(4)))
    assert shorts == [200] * 4
    assert await long == 200
    said = [e for e in gateway.events("lane_in_force") if e["lane"] == "interactive"]
    assert said, gateway.lines[-5:]
    assert said[-1]["configured_s"] == 5.0 and said[-1]["fit_timeout_to_engine"] is True
    assert said[-1]["deadline_from"] in ("unlearned", "fitted"), said[-1]
    assert said[-1]["deadline_s"] > 5.0
