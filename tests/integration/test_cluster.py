"""The gateway in front of several backends on 127.0.0.1: balancing, health, ejection, retry."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from msgspec.structs import replace

from gateway.config import LaneSettings, Settings
from gateway.tools.simulator import SimulatorConfig, start_simulator
from tests.conftest import StartGateway, StartSimulator, chat
from tests.helpers import eventually


async def sim_requests(http: aiohttp.ClientSession, sim: str) -> list[dict[str, Any]]:
    async with http.get(sim + "/sim/requests") as resp:
        return (await resp.json())["requests"]


def fast_health(settings: Settings, **health: Any) -> Settings:
    """Quick checks and short ejections; `health` changes more keys of [health]."""
    fast = {"interval_s": 0.2, "timeout_s": 0.1, "eject_base_s": 0.5, "failures_to_eject": 2}
    return replace(settings, health=replace(settings.health, **{**fast, **health}))


async def test_load_is_spread_in_proportion_to_capacity(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    big, small = await start_simulator_at(max_batch=16), await start_simulator_at(max_batch=16)

    def weights(settings: Settings) -> Settings:
        first, second = settings.backends
        return replace(
            settings,
            backends=[
                replace(first, weight=3.0, max_concurrency=12),
                replace(second, weight=1.0, max_concurrency=4),
            ],
        )

    gateway = await start_gateway([big, small], configure=weights)

    async def one(index: int) -> str:
        async with http.post(
            gateway.url + "/v1/chat/completions",
            # Long enough (over half a second each) that the 48 overlap: on a loaded machine
            # 40 tokens each arrived spread out, each onto two idle backends, 26:22.
            json=chat(f"Question {index}: how are you?", max_tokens=120, stream=True),
        ) as resp:
            assert resp.status == 200
            await resp.read()
            return resp.headers["x-request-id"]

    await asyncio.gather(*(one(i) for i in range(48)))
    per_backend = Counter(line["backend"] for line in gateway.request_lines())
    assert sum(per_backend.values()) == 48
    share = per_backend["b0"] / 48
    assert 0.6 <= share <= 0.9, per_backend  # 3:1 weights and slots: ~75%
    assert len(await sim_requests(http, big)) == per_backend["b0"]


async def test_a_killed_backend_is_ejected_and_no_unstarted_request_is_lost(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    survivor = await start_simulator_at()
    runner, port = await start_simulator(SimulatorConfig())
    victim = f"http://127.0.0.1:{port}"

    def passive_only(settings: Settings) -> Settings:
        # Only request failures can tell it died. The ejection outlasts the test: a 0.5 s
        # one had ended (the victim available again, nothing left to fail on it) before
        # the streams did on a loaded machine, and the check below waited in vain.
        return fast_health(settings, interval_s=60, eject_base_s=30)

    gateway = await start_gateway([victim, survivor], configure=passive_only)

    async def one(index: int) -> tuple[int, str]:
        async with http.post(
            gateway.url + "/v1/chat/completions",
            json=chat(f"Request {index}", max_tokens=30, stream=True),
        ) as resp:
            return resp.status, (await resp.read()).decode()

    first = [asyncio.create_task(one(i)) for i in range(8)]
    await asyncio.sleep(0.05)
    await runner.cleanup()  # killed mid-run: its streams break, new requests must not
    later = [asyncio.create_task(one(100 + i)) for i in range(16)]
    results = await asyncio.gather(*first, *later)
    victim_backend = gateway.state.pool.backends[0]
    took = await eventually(lambda: not victim_backend.available(gateway.state.pool.clock()))
    assert took < 3
    # Said in the log at the moment it happened, not only in the availability gauge.
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line]
    ejected = [line for line in events if line.get("event") == "backend_ejected"]
    assert ejected and (ejected[0]["backend"], ejected[0]["cooldown_s"]) == ("b0", 30.0)
    # Every request that had not started streaming was served by the survivor
    # (retried) — the only failures allowed are streams cut mid-way (200 + SSE error).
    for status, body in results:
        assert status == 200, body
    lines = gateway.request_lines()
    broken_mid_stream = [line for line in lines if line["outcome"] == "backend_error"]
    assert all(line["status"] == 200 and line["backend"] == "b0" for line in broken_mid_stream)
    assert len(lines) == 24
    # After ejection, new requests go to the survivor only.
    async with http.post(gateway.url + "/v1/chat/completions", json=chat(max_tokens=2)) as resp:
        assert resp.status == 200
    assert gateway.request_lines()[-1]["backend"] == "b1"


async def test_a_request_refused_by_a_dead_backend_is_retried_on_another(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    runner, port = await start_simulator(SimulatorConfig())
    survivor = await start_simulator_at()

    def passive_only(settings: Settings) -> Settings:
        # only request failures can tell it died
        return replace(settings, health=replace(settings.health, interval_s=60))

    gateway = await start_gateway([f"http://127.0.0.1:{port}", survivor], configure=passive_only)
    await runner.cleanup()  # dies while idle: the gateway still thinks it is fine
    for stream in (True, False):
        async with http.post(
            gateway.url + "/v1/chat/completions", json=chat(max_tokens=3, stream=stream)
        ) as resp:
            assert resp.status == 200
            await resp.read()
    first = gateway.request_lines()[0]
    assert first["attempts"] == 2 and first["backend"] == "b1" and first["outcome"] == "ok"
    assert gateway.state.pool.backends[0].in_flight == 0


async def test_backend_503_is_retried_elsewhere_and_passed_through_when_alone(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    async def busy(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"error": {"message": "overloaded"}}, status=503)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", busy)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        busy_url = str(server.make_url("")).rstrip("/")
        gateway = await start_gateway([busy_url, await start_simulator_at()])
        async with http.post(gateway.url + "/v1/chat/completions", json=chat(max_tokens=2)) as resp:
            assert resp.status == 200
        assert gateway.request_lines()[0]["attempts"] == 2
        alone = await start_gateway([busy_url])
        async with http.post(alone.url + "/v1/chat/completions", json=chat(max_tokens=2)) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["message"] == "overloaded"
    finally:
        await server.close()


@pytest.fixture
async def hung_backend() -> AsyncIterator[tuple[str, dict[str, int]]]:
    """Accepts requests and never answers them; its health route still answers."""
    seen = {"generation": 0}

    async def hang(request: web.Request) -> web.Response:
        seen["generation"] += 1
        await asyncio.sleep(3600)
        return web.Response()

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", hang)
    app.router.add_get("/health", health)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), seen
    await server.close()


async def test_a_hung_backend_is_ejected_by_first_token_timeouts(
    hung_backend: tuple[str, dict[str, int]],
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    hung, seen = hung_backend
    good = await start_simulator_at()

    def configure(settings: Settings) -> Settings:
        settings = fast_health(settings, eject_base_s=30)  # stays out for the rest of the test
        first, *others = settings.backends
        return replace(
            settings,
            timeouts=replace(settings.timeouts, first_token_s=0.3),
            # one request at a time on the hung one
            backends=[replace(first, max_concurrency=1), *others],
        )

    gateway = await start_gateway([hung, good], configure=configure)
    statuses = []
    for index in range(6):
        async with http.post(
            gateway.url + "/v1/chat/completions",
            json=chat(f"q{index}", max_tokens=3, stream=True),
        ) as resp:
            statuses.append(resp.status)
            await resp.read()
    hung_backend_state = gateway.state.pool.backends[0]
    assert hung_backend_state.ejections == 1
    assert seen["generation"] == 2  # two first-token timeouts, then no more traffic
    assert statuses.count(504) == 2 and statuses.count(200) == 4


async def test_a_backend_that_comes_back_is_used_again(
    start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    runner, port = await start_simulator(SimulatorConfig())
    url = f"http://127.0.0.1:{port}"
    gateway = await start_gateway([url], configure=fast_health)
    await runner.cleanup()
    await eventually(lambda: not gateway.state.pool.has_available())
    async with http.post(gateway.url + "/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 503
    runner, _ = await start_simulator(SimulatorConfig(), port=port)
    try:
        took = await eventually(gateway.state.pool.has_available)
        assert took < 3
        async with http.post(gateway.url + "/v1/chat/completions", json=chat(max_tokens=2)) as resp:
            assert resp.status == 200
    finally:
        await runner.cleanup()


async def test_lane_pinning_keeps_long_prompts_off_the_short_pool(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    dedicated, shared = await start_simulator_at(), await start_simulator_at()
    lanes = [
        LaneSettings(
            name="interactive",
            max_prompt_tokens=1024,
            max_output_tokens=256,
            queue_timeout_s=5,
            backends=["b0", "b1"],
        ),
        LaneSettings(name="bulk", max_slot_share=0.5, backends=["b1"]),
    ]
    gateway = await start_gateway([dedicated, shared], lanes=lanes)

    async def send(prompt: str) -> None:
        async with http.post(
            gateway.url + "/v1/chat/completions", json=chat(prompt, max_tokens=4, stream=True)
        ) as resp:
            assert resp.status == 200
            await resp.read()

    await asyncio.gather(
        *(send("long " * 2000 + str(i)) for i in range(3)), *(send(f"hi {i}") for i in range(6))
    )
    on_dedicated = await sim_requests(http, dedicated)
    assert on_dedicated, "the short lane never used its dedicated backend"
    assert all(r["prompt_tokens"] < 1024 for r in on_dedicated)
    by_lane = Counter((line["lane"], line["backend"]) for line in gateway.request_lines())
    assert by_lane[("bulk", "b1")] == 3 and by_lane[("bulk", "b0")] == 0


@pytest.fixture
async def header_backend() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """Records the headers and body of each request; answers a tiny completion."""
    received: list[dict[str, Any]] = []

    async def completion(request: web.Request) -> web.Response:
        received.append({"headers": dict(request.headers), "body": await request.json()})
        return web.json_response(
            {"object": "chat.completion", "choices": [], "usage": {"completion_tokens": 1}}
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completion)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/health", health)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), received
    await server.close()


async def test_backend_api_key_replaces_the_clients_and_priority_is_sent(
    header_backend: tuple[str, list[dict[str, Any]]],
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    url, received = header_backend

    def configure(settings: Settings) -> Settings:
        first, *others = settings.backends
        backend = replace(first, api_key="backend-secret", priority_field=True)
        return replace(settings, backends=[backend, *others])

    gateway = await start_gateway([url], configure=configure)
    for prompt in ("short", "long " * 1500):
        async with http.post(
            gateway.url + "/v1/chat/completions",
            json=chat(prompt, max_tokens=3),
            headers={"Authorization": "Bearer client-secret"},
        ) as resp:
            assert resp.status == 200
    assert [r["headers"]["Authorization"] for r in received] == ["Bearer backend-secret"] * 2
    assert [r["body"]["priority"] for r in received] == [0, 1]  # interactive, bulk
