"""Backends without `models` in the config serve what their engines list (`upstream/served.py`).

Simulators on 127.0.0.1 posing as the engines met in the field (`pose_as`): "vllm"
lists its model on /v1/models and answers 404 for any other (so a misrouted request
shows as a 404), "tgi" says its model only as /info `model_id`, "llama.cpp" lists its
model file and answers any name. No `[[backends]]` entry names a model. What each
engine was sent is read from its own `/sim/stats` `by_model`; the client is the real
`openai` SDK.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from msgspec.structs import replace

from gateway.config import BackendSettings, Settings
from gateway.tools.simulator import SimulatorConfig
from gateway.tools.simulator.server import start_simulator
from tests.conftest import RunningGateway, StartGateway, StartSimulator, free_port, wait_ready
from tests.helpers import eventually


async def sent(http: aiohttp.ClientSession, url: str) -> dict[str, int]:
    """What the engine at `url` was asked for, by model."""
    async with http.get(url + "/sim/stats") as response:
        stats: dict[str, Any] = await response.json()
    return stats["by_model"]


def client(gateway: RunningGateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="not-needed", max_retries=0)


async def ask(sdk: openai.AsyncOpenAI, model: str) -> str:
    answer = await sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    return answer.model


def checks_every(interval_s: float) -> Callable[[Settings], Settings]:
    def configure(settings: Settings) -> Settings:
        return replace(settings, health=replace(settings.health, interval_s=interval_s))

    return configure


async def ready_gateway(
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
    backends: list[str],
    configure: Callable[[Settings], Settings] | None = None,
) -> RunningGateway:
    gateway = await start_gateway(backends, configure=configure)
    await wait_ready(http, gateway.url)  # not ready before the engines' lists are read
    return gateway


async def test_two_engines_listing_different_models_each_get_only_their_own(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    alpha = await start_simulator_at(model="alpha", pose_as="vllm")
    beta = await start_simulator_at(model="beta", pose_as="vllm")
    gateway = await ready_gateway(start_gateway, http, [alpha, beta])
    assert all(not b.models for b in gateway.state.settings.backends)
    sdk = client(gateway)
    answered = await asyncio.gather(*(ask(sdk, model) for model in ["alpha", "beta"] * 6))
    assert answered == ["alpha", "beta"] * 6
    assert await sent(http, alpha) == {"alpha": 6}
    assert await sent(http, beta) == {"beta": 6}
    routes = {(line["model"], line["backend"], line["status"]) for line in gateway.request_lines()}
    assert routes == {("alpha", "b0", 200), ("beta", "b1", 200)}

    # A model neither lists: the OpenAI 404 at the door, nothing counted, nothing sent.
    with pytest.raises(openai.NotFoundError) as refused:
        await ask(sdk, "gamma")
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "model_not_found"
    assert error["param"] == "model" and "alpha, beta" in error["message"]
    line = gateway.request_lines()[-1]
    assert line["outcome"] == "rejected_model_not_found" and line["prompt_tokens"] is None
    assert await sent(http, alpha) == {"alpha": 6} and await sent(http, beta) == {"beta": 6}
    assert gateway.state.in_flight == 0

    # The gateway's own list is what the engines list.
    listed = await sdk.models.list()
    assert {"alpha", "beta"} <= {m.id for m in listed.data}
    async with http.get(gateway.url + "/metrics") as response:
        text = await response.text()
    assert 'gateway_backend_models_listed{backend="b0",pool="*"} 1.0' in text
    async with http.get(gateway.url + "/debug/backends") as response:
        described = (await response.json())["backends"]
    assert described[0]["serves"] == {
        "from": "engine",
        "models": ["alpha"],
        "any_name": False,
        "engine": "vllm",
        "listing_failing": False,
    }


async def test_a_models_queue_does_not_hold_another_models_idle_engine(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    """The engines share the catch-all pool's queues: 30 long requests for alpha wait for
    its two slots, and beta's request behind them goes to its idle engine at once (they
    held it ~30 s when a lane looked only 16 requests past a deferred head)."""
    alpha = await start_simulator_at(model="alpha", pose_as="vllm", decode_ms_per_seq=20.0)
    beta = await start_simulator_at(model="beta", pose_as="vllm")

    def two_slots(settings: Settings) -> Settings:
        backends = [replace(b, max_concurrency=2) for b in settings.backends]
        return replace(settings, backends=backends)

    gateway = await ready_gateway(start_gateway, http, [alpha, beta], two_slots)
    sdk = client(gateway)

    async def long_alpha() -> None:
        await sdk.chat.completions.create(
            model="alpha", messages=[{"role": "user", "content": "Hi"}], max_tokens=60
        )

    waiting = [asyncio.create_task(long_alpha()) for _ in range(30)]
    try:
        lanes = gateway.state.scheduler.lanes
        await eventually(lambda: sum(len(lane.queue) for lane in lanes) >= 20, within_s=5.0)
        started = asyncio.get_running_loop().time()
        assert await ask(sdk, "beta") == "beta"
        assert asyncio.get_running_loop().time() - started < 1.0
        assert await sent(http, beta) == {"beta": 1}
    finally:
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)


async def test_a_tgi_engine_is_routed_by_its_info_model_id(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    """TGI lists no /v1/models: its /info model_id is what it serves. It ignores `model`
    (its clients send "tgi"), so it also takes a name nobody lists."""
    tgi = await start_simulator_at(model="bigscience/bloom-560m", pose_as="tgi")
    vllm = await start_simulator_at(model="alpha", pose_as="vllm")
    gateway = await ready_gateway(start_gateway, http, [tgi, vllm])
    sdk = client(gateway)
    for _ in range(3):
        await ask(sdk, "bigscience/bloom-560m")
        await ask(sdk, "alpha")
    await ask(sdk, "tgi")
    assert await sent(http, tgi) == {"bigscience/bloom-560m": 3, "tgi": 1}
    assert await sent(http, vllm) == {"alpha": 3}


async def test_a_llamacpp_engine_stays_catch_all(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    """llama.cpp lists its model file and answers any name: names nobody else lists go there,
    a name the vLLM beside it lists goes only to that vLLM."""
    llama = await start_simulator_at(model="/models/qwen2.5-0.5b-q4_k_m.gguf", pose_as="llama.cpp")
    vllm = await start_simulator_at(model="alpha", pose_as="vllm")
    gateway = await ready_gateway(start_gateway, http, [llama, vllm])
    sdk = client(gateway)
    for model in ["gpt-4o-mini", "alpha", "anything", "alpha"]:
        await ask(sdk, model)
    assert await sent(http, llama) == {"gpt-4o-mini": 1, "anything": 1}
    assert await sent(http, vllm) == {"alpha": 2}
    listed = [model.id for model in (await sdk.models.list()).data]
    assert listed == ["/models/qwen2.5-0.5b-q4_k_m.gguf", "alpha"]  # each engine's, once


async def test_replicas_of_one_model_are_listed_once(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    """Two engines serving the same model share its requests; /v1/models asks one of them."""
    one = await start_simulator_at(model="alpha", pose_as="vllm")
    two = await start_simulator_at(model="alpha", pose_as="vllm")
    gateway = await ready_gateway(start_gateway, http, [one, two])
    sdk = client(gateway)
    await asyncio.gather(*(ask(sdk, "alpha") for _ in range(8)))
    first, second = await sent(http, one), await sent(http, two)
    assert first["alpha"] + second["alpha"] == 8 and first["alpha"] and second["alpha"]
    assert [model.id for model in (await sdk.models.list()).data] == ["alpha"]


async def test_an_engine_restarted_with_another_model_is_followed(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    """The lists are read again on every health check: a model removed is a 404 and the
    model that replaced it is routed, from the next check on."""
    port = free_port()
    runner, _ = await start_simulator(SimulatorConfig(model="alpha", pose_as="vllm"), port=port)
    url = f"http://127.0.0.1:{port}"
    beta = await start_simulator_at(model="beta", pose_as="vllm")
    try:
        gateway = await ready_gateway(start_gateway, http, [url, beta], checks_every(0.2))
        sdk = client(gateway)
        assert await ask(sdk, "alpha") == "alpha"
        await runner.cleanup()
        runner, _ = await start_simulator(SimulatorConfig(model="delta", pose_as="vllm"), port=port)
        b0 = gateway.state.pools.default.pool.backends[0]
        await eventually(lambda: b0.served.names == {"delta"}, within_s=5.0)
        assert await ask(sdk, "delta") == "delta"
        with pytest.raises(openai.NotFoundError):
            await ask(sdk, "alpha")
        assert await sent(http, url) == {"delta": 1}
    finally:
        await runner.cleanup()


ASKED = web.AppKey("asked", list)


@dataclass
class Listing:
    """How a test engine's listing answers: a 500 (`fails`), or not until `answering` is
    set (cleared: it hangs)."""

    fails: bool = False
    answering: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.answering.set()


def flaky_listing_engine(model: str) -> tuple[web.Application, Listing]:
    """A tiny OpenAI-compatible engine (vLLM's card, its 404 for other names) whose
    /v1/models (and /info) can be made to fail or to hang (`Listing`)."""
    listing = Listing()
    asked: list[str] = []

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def models(request: web.Request) -> web.Response:
        await listing.answering.wait()  # until the test lets it go (or the client gives up)
        if listing.fails:
            return web.Response(status=500, text="Internal Server Error")
        return web.json_response({"data": [{"id": model, "owned_by": "vllm"}]})

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        asked.append(body["model"])
        if body["model"] != model:
            return web.json_response({"error": {"code": "model_not_found"}}, status=404)
        message = {"role": "assistant", "content": "Hello"}
        return web.json_response(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            }
        )

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/info", models)  # as slow as /v1/models when it hangs
    app.router.add_post("/v1/chat/completions", chat)
    app[ASKED] = asked
    return app, listing


async def test_a_failed_listing_keeps_the_last_list(
    start_gateway: StartGateway,
    start_simulator_at: StartSimulator,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An engine up whose listing stops answering keeps routing by the list read before,
    with one warning line and a metric, never a failed request."""
    app, listing = flaky_listing_engine("alpha")
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    beta = await start_simulator_at(model="beta", pose_as="vllm")
    try:
        url = str(server.make_url("")).rstrip("/")
        gateway = await ready_gateway(start_gateway, http, [url, beta], checks_every(0.2))
        listing.fails = True
        b0 = gateway.state.pools.default.pool.backends[0]
        await eventually(lambda: b0.served.failures >= 2, within_s=5.0)
        assert b0.served.names == {"alpha"} and b0.available(gateway.state.pool.clock())
        sdk = client(gateway)
        assert [await ask(sdk, "alpha"), await ask(sdk, "beta")] == ["alpha", "beta"]
        assert app[ASKED] == ["alpha"]
        events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line]
        failed = [e for e in events if e.get("event") == "models_listing_failed"]
        assert len(failed) == 1 and failed[0]["kept"] == ["alpha"]
        async with http.get(gateway.url + "/metrics") as response:
            text = await response.text()
        assert 'gateway_backend_model_listing_failures_total{backend="b0",pool="*"}' in text
    finally:
        listing.answering.set()
        await server.close()


async def test_a_listing_that_hangs_fails_within_the_checks_timeout(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    """A listing that never answers (/v1/models, then /info) costs one check's timeout in
    all, not one per route asked: the round, and the other backends' results, go on."""
    app, listing = flaky_listing_engine("alpha")
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    beta = await start_simulator_at(model="beta", pose_as="vllm")

    def configure(settings: Settings) -> Settings:
        health = replace(settings.health, interval_s=1.0, timeout_s=0.5)
        return replace(settings, health=health)

    try:
        url = str(server.make_url("")).rstrip("/")
        gateway = await ready_gateway(start_gateway, http, [url, beta], configure)
        listing.answering.clear()
        b0 = gateway.state.pools.default.pool.backends[0]
        monitor = gateway.state.pools.default.health
        started = asyncio.get_running_loop().time()
        await monitor.read_models(b0)
        took = asyncio.get_running_loop().time() - started
        assert 0.45 < took < 0.9  # one timeout (0.5 s), not two (1.0 s: /v1/models, /info)
        assert b0.served.failing and b0.served.names == {"alpha"}
        assert await ask(client(gateway), "alpha") == "alpha"
    finally:
        listing.answering.set()
        await server.close()


async def test_not_ready_until_the_first_listings_are_read(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    """A gateway rolled out behind a load balancer takes traffic only once it knows where
    each model is: /readyz is 503 while an engine's first listing is still being read, at
    most one check's timeout."""
    app, listing = flaky_listing_engine("alpha")
    listing.answering.clear()  # its first listing takes the whole check timeout
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    beta = await start_simulator_at(model="beta", pose_as="vllm")

    def configure(settings: Settings) -> Settings:
        return replace(settings, health=replace(settings.health, timeout_s=1.0))

    try:
        url = str(server.make_url("")).rstrip("/")
        gateway = await start_gateway([url, beta], configure=configure)
        async with http.get(gateway.url + "/readyz") as response:
            assert response.status == 503
            assert (await response.json())["reason"] == "reading what the backends serve"
        waited = await eventually(lambda: gateway.state.pools.default.health.checked, 3.0)
        assert 0.5 < waited < 2.0  # the round ended at the hanging listing's timeout (1 s)
        async with http.get(gateway.url + "/readyz") as response:
            assert response.status == 200  # ready: an engine that does not say costs 1 s
    finally:
        listing.answering.set()
        await server.close()


async def test_a_backend_that_joins_at_run_time_is_read_at_once(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    """A reload or a DNS name's new address adds a backend: what it serves is read as it
    joins, not at the next health round (5 s), so beta's requests find it at once."""
    alpha = await start_simulator_at(model="alpha", pose_as="vllm")
    beta = await start_simulator_at(model="beta", pose_as="vllm")
    gateway = await ready_gateway(start_gateway, http, [alpha])
    state = gateway.state
    wanted = [*state.settings.backends, BackendSettings(url=beta, name="b1")]
    changes = await state.reloader.membership.apply(state.settings, wanted)
    assert changes.joined == ["b1"]
    b1 = next(b for b in state.pools.default.pool.backends if b.name == "b1")
    await eventually(lambda: b1.served.names == {"beta"}, within_s=1.0)
    sdk = client(gateway)
    assert [await ask(sdk, "alpha"), await ask(sdk, "beta")] == ["alpha", "beta"]
    assert await sent(http, alpha) == {"alpha": 1} and await sent(http, beta) == {"beta": 1}
