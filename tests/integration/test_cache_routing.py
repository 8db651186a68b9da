"""Cache-aware routing against real simulators with their prefix cache on.

Three simulators on 127.0.0.1 behind one in-process gateway. A conversation's
turns land on the backend that served its first turn and hit that backend's
cache (the simulator reports `cached_tokens`); with that backend gone they
move and the conversation still works; a hot prefix under load spreads over
the backends instead of piling onto one.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import aiohttp
from msgspec.structs import replace

from gateway.config import RoutingSettings, Settings
from tests.conftest import RunningGateway, StartGateway, StartSimulator

ROUTE = "/v1/chat/completions"
SYSTEM = "You are a helpful assistant who answers with care and precision. " * 40


def quiet(routing: RoutingSettings | None = None) -> Any:
    def configure(settings: Settings) -> Settings:
        return replace(
            settings,
            health=replace(settings.health, interval_s=60),
            routing=routing or settings.routing,
        )

    return configure


async def three_backends(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, **gateway: Any
) -> tuple[RunningGateway, list[str]]:
    urls = [await start_simulator_at(prefill_ms_per_token=0.2) for _ in range(3)]
    running = await start_gateway(urls, configure=quiet(**gateway))
    return running, urls


async def turn(
    http: aiohttp.ClientSession,
    gateway: RunningGateway,
    messages: list[dict[str, str]],
    **extra: Any,
) -> dict[str, Any]:
    body = {"model": "sim-model", "messages": messages, "max_tokens": 8, **extra}
    async with http.post(gateway.url + ROUTE, json=body) as response:
        assert response.status == 200, await response.text()
        answer: dict[str, Any] = await response.json()
    return answer


async def converse(
    http: aiohttp.ClientSession, gateway: RunningGateway, opening: str, turns: int
) -> list[dict[str, Any]]:
    """A conversation: each turn resends the history plus the reply and a new question."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening}]
    answers = []
    for index in range(turns):
        answer = await turn(http, gateway, messages)
        answers.append(answer)
        messages.append(
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
        )
        messages.append({"role": "user", "content": f"And what about point {index}?"})
    return answers


def lines_of(gateway: RunningGateway) -> list[dict[str, Any]]:
    return [line for line in gateway.request_lines() if line["route"] == ROUTE]


async def test_a_conversation_stays_on_its_backend_and_hits_its_cache(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    gateway, _ = await three_backends(start_gateway, start_simulator_at)
    await converse(http, gateway, "Tell me about tides.", 4)
    lines = lines_of(gateway)
    assert len({line["backend"] for line in lines}) == 1
    first, *later = lines
    assert first["cached_tokens"] == 0 and first["cached_tokens_expected"] == 0
    for line in later:
        assert line["routed_by"] == "prefix"
        # The backend served most of the prompt from its cache, as routing expected.
        assert line["cached_tokens"] > 0.5 * line["backend_prompt_tokens"]
        assert line["cached_tokens_expected"] > 0
        assert line["cached_tokens"] >= 0.8 * line["cached_tokens_expected"]


async def test_least_load_routing_spreads_turns_and_misses_the_cache(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    off = RoutingSettings(prefix_affinity=False, session_affinity=False)
    gateway, _ = await three_backends(start_gateway, start_simulator_at, routing=off)
    # Two conversations interleaved: least load keeps moving them.
    await asyncio.gather(
        converse(http, gateway, "Tell me about tides.", 3),
        converse(http, gateway, "Tell me about stars.", 3),
    )
    lines = lines_of(gateway)
    assert all(line["routed_by"] == "load" for line in lines)
    assert len({line["backend"] for line in lines}) > 1


async def test_with_its_backend_gone_a_conversation_moves_and_goes_on(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    gateway, urls = await three_backends(start_gateway, start_simulator_at)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}]
    await turn(http, gateway, messages)
    home = lines_of(gateway)[-1]["backend"]
    backend = next(b for b in gateway.state.pool.backends if b.name == home)
    gateway.state.pool.set_health(backend, False)  # as a failed health check does
    messages += [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More."}]
    await turn(http, gateway, messages)
    moved = lines_of(gateway)[-1]
    assert moved["backend"] != home and moved["status"] == 200
    assert moved["cached_tokens_expected"] == 0  # nobody else was sent this prefix
    # And it sticks to its new home from then on.
    messages += [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Go on."}]
    await turn(http, gateway, messages)
    assert lines_of(gateway)[-1]["backend"] == moved["backend"]
    assert lines_of(gateway)[-1]["routed_by"] == "prefix"


async def test_a_hot_prefix_under_load_spreads_over_the_backends(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    gateway, _ = await three_backends(start_gateway, start_simulator_at)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Same question"}]

    async def one(index: int) -> None:
        await turn(http, gateway, messages, max_tokens=48, user=f"u{index}")

    await asyncio.gather(*(one(index) for index in range(24)))
    per_backend = Counter(line["backend"] for line in lines_of(gateway))
    assert len(per_backend) == 3, per_backend
    assert max(per_backend.values()) <= 2 * min(per_backend.values()) + 2, per_backend


async def test_a_session_id_keeps_first_turns_together(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    gateway, _ = await three_backends(start_gateway, start_simulator_at)
    for index in range(6):  # different prompts, one session: one backend
        body = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": f"Unrelated question {index} " * 30}],
            "max_tokens": 4,
        }
        async with http.post(
            gateway.url + ROUTE, json=body, headers={"x-session-id": "tenant-7"}
        ) as response:
            assert response.status == 200
    lines = lines_of(gateway)
    assert {line["routed_by"] for line in lines} == {"session"}
    assert len({line["backend"] for line in lines}) == 1


async def test_the_metrics_count_decisions_and_cached_tokens(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    gateway, _ = await three_backends(start_gateway, start_simulator_at)
    await converse(http, gateway, "Tell me about tides.", 3)
    async with http.get(gateway.url + "/metrics") as response:
        text = await response.text()
    assert 'gateway_routing_decisions_total{backend="' in text
    assert 'reason="prefix"' in text
    cached = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("gateway_backend_cached_tokens_total{")
    ]
    assert sum(cached) > 0


async def test_the_prefix_memory_is_bounded_by_the_engines_kv_cache(
    start_gateway: StartGateway, start_simulator_at: StartSimulator
) -> None:
    # 1000 blocks of 16 tokens, which the simulator says in vLLM's cache_config_info.
    url = await start_simulator_at(prefix_cache_blocks=1000)

    def configure(settings: Settings) -> Settings:
        return replace(settings, health=replace(settings.health, interval_s=0.1))

    gateway = await start_gateway([url], configure=configure)
    backend = gateway.state.pool.backends[0]
    for _ in range(100):
        if backend.prefixes.capacity_tokens == 16_000:
            break
        await asyncio.sleep(0.05)
    assert backend.prefixes.capacity_tokens == 16_000
