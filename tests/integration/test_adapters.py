"""LoRA adapter routing against real simulators serving adapters (vLLM's shape).

Two simulators on 127.0.0.1 that serve the same adapters with `max_lora` 2 behind
one in-process gateway that checks them every 0.2 s. An adapter's requests go to
the backend running it; an adapter loaded at run time on one backend
(`POST /v1/load_lora_adapter`) gets its requests there after the next check; a
backend whose engine runs two adapters already (requests sent to it directly, seen
only through its `vllm:lora_requests_info`) is not given a third while the other
backend can take it. Which backend served what is read from each simulator's own
`/sim/requests`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from msgspec.structs import replace

from gateway.config import Settings
from tests.conftest import RunningGateway, StartGateway, StartSimulator

ROUTE = "/v1/completions"
LORA: dict[str, Any] = {"lora_adapters": "a1,a2,a3,a4", "max_lora": 2, "lora_swap_ms": 20.0}


def checked_often(settings: Settings) -> Settings:
    return replace(settings, health=replace(settings.health, interval_s=0.2))


async def complete(
    http: aiohttp.ClientSession, url: str, model: str, max_tokens: int = 2
) -> tuple[int, dict[str, Any]]:
    body = {"model": model, "prompt": "Tell me something.", "max_tokens": max_tokens}
    async with http.post(url + ROUTE, json=body) as response:
        return response.status, await response.json()


async def served(http: aiohttp.ClientSession, url: str, model: str) -> int:
    """Requests of `model` this simulator answered with 200."""
    async with http.get(f"{url}/sim/requests") as response:
        entries = (await response.json())["requests"]
    return sum(1 for e in entries if e["model"] == model and e["status"] == 200)


async def two_backends(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, **knobs: Any
) -> tuple[RunningGateway, list[str]]:
    urls = [await start_simulator_at(**{**LORA, **knobs}) for _ in range(2)]
    gateway = await start_gateway(urls, configure=checked_often)
    await asyncio.sleep(0.5)  # the first checks: what each lists
    return gateway, urls


async def test_an_adapters_requests_go_to_the_backend_running_it(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    gateway, urls = await two_backends(start_gateway, start_simulator_at)
    first = asyncio.create_task(complete(http, gateway.url, "a1", max_tokens=150))  # ~0.8 s
    await asyncio.sleep(0.1)
    async with http.get(f"{urls[0]}/sim/stats") as response:
        home_url = urls[0] if (await response.json())["running"] == 1 else urls[1]
    rest = await asyncio.gather(*(complete(http, gateway.url, "a1") for _ in range(6)))
    assert [status for status, _ in rest] == [200] * 6
    assert (await first)[0] == 200
    assert await served(http, home_url, "a1") == 7
    assert await served(http, next(u for u in urls if u != home_url), "a1") == 0
    lines = [line for line in gateway.request_lines() if line["model"] == "a1"]
    assert len(lines) == 7 and {line["routed_by"] for line in lines} <= {
        "adapter", "adapter_room", "prefix",
    }  # fmt: skip


async def test_an_adapter_loaded_at_run_time_gets_its_requests_after_the_next_check(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    gateway, urls = await two_backends(start_gateway, start_simulator_at)
    async with http.post(
        f"{urls[1]}/v1/load_lora_adapter", json={"lora_name": "a9", "lora_path": "/lora/a9"}
    ) as response:
        assert response.status == 200
    await asyncio.sleep(0.6)  # a check or more
    results = await asyncio.gather(*(complete(http, gateway.url, "a9") for _ in range(8)))
    assert [status for status, _ in results] == [200] * 8
    assert results[0][1]["model"] == "a9"
    assert (await served(http, urls[1], "a9"), await served(http, urls[0], "a9")) == (8, 0)


async def test_a_backend_at_max_lora_is_not_given_a_new_adapter_while_the_other_can_take_it(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    gateway, urls = await two_backends(start_gateway, start_simulator_at)
    busy, other = urls
    # The busy backend runs a1 and a2 for ~1.5 s, sent to it directly: the gateway knows
    # only what its engine reports.
    direct = [asyncio.create_task(complete(http, busy, a, max_tokens=280)) for a in ("a1", "a2")]
    await asyncio.sleep(0.6)  # a scrape or more
    results = await asyncio.gather(*(complete(http, gateway.url, "a3") for _ in range(6)))
    assert [status for status, _ in results] == [200] * 6
    assert (await served(http, other, "a3"), await served(http, busy, "a3")) == (6, 0)
    # An adapter the busy backend runs still goes there.
    assert (await complete(http, gateway.url, "a1"))[0] == 200
    await asyncio.gather(*direct)
    assert await served(http, busy, "a1") == 2
