"""Many models behind one gateway, against simulators that each serve one model strictly.

Two simulators on 127.0.0.1 (`alpha`, `beta`), each answering 404 for any other
model (`strict_model`, as vLLM does), so a misrouted request would show as a 404;
what each was sent is read from its own `/sim/stats` `by_model`. The client is the
real `openai` SDK.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import pytest
from msgspec.structs import replace

from gateway.config import (
    LaneSettings,
    ModelLimits,
    ModelSettings,
    ModelTarget,
    Settings,
    default_lanes,
)
from tests.conftest import RunningGateway, StartGateway, StartSimulator


def with_models(
    models: list[list[str]], aliases: list[ModelSettings] = ()
) -> Callable[[Settings], Settings]:
    def configure(settings: Settings) -> Settings:
        backends = [
            replace(backend, models=served)
            for backend, served in zip(settings.backends, models, strict=True)
        ]
        return replace(settings, backends=backends, models=list(aliases))

    return configure


async def by_model(http: aiohttp.ClientSession, url: str) -> dict[str, int]:
    async with http.get(url + "/sim/stats") as response:
        stats: dict[str, Any] = await response.json()
    return stats["by_model"]


async def two_models(
    start_gateway: StartGateway,
    start_simulator_at: StartSimulator,
    aliases: list[ModelSettings] = (),
    *,
    lanes: list[LaneSettings] | None = None,
    **alpha_knobs: Any,
) -> tuple[RunningGateway, str, str]:
    alpha = await start_simulator_at(model="alpha", strict_model=True, **alpha_knobs)
    beta = await start_simulator_at(model="beta", strict_model=True)
    gateway = await start_gateway(
        [alpha, beta],
        max_concurrency=2,
        lanes=lanes,
        configure=with_models([["alpha"], ["beta"]], aliases),
    )
    return gateway, alpha, beta


def client(gateway: RunningGateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="not-needed", max_retries=0)


async def ask(sdk: openai.AsyncOpenAI, model: str, max_tokens: int = 4) -> str:
    answer = await sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=max_tokens
    )
    return answer.model


async def test_each_model_reaches_only_its_own_backend(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    gateway, alpha, beta = await two_models(start_gateway, start_simulator_at)
    sdk = client(gateway)
    for _ in range(3):
        assert await ask(sdk, "alpha") == "alpha"
        assert await ask(sdk, "beta") == "beta"
    assert await by_model(http, alpha) == {"alpha": 3}
    assert await by_model(http, beta) == {"beta": 3}
    pools = {(line["model"], line["pool"], line["backend"]) for line in gateway.request_lines()}
    assert pools == {("alpha", "alpha", "b0"), ("beta", "beta", "b1")}


async def test_an_unknown_model_is_a_404_that_reaches_no_backend(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    gateway, alpha, beta = await two_models(start_gateway, start_simulator_at)
    with pytest.raises(openai.NotFoundError) as refused:
        await ask(client(gateway), "nonexistent-model")
    assert refused.value.status_code == 404
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "alpha" in error["message"] and "beta" in error["message"]
    assert await by_model(http, alpha) == {} and await by_model(http, beta) == {}
    (line,) = gateway.request_lines()
    assert line["outcome"] == "rejected_model_not_found" and line["status"] == 404
    assert line["pool"] is None and line["lane"] is None and line["prompt_tokens"] is None
    assert gateway.state.in_flight == 0


async def test_a_full_pool_does_not_delay_another_models_short_request(
    start_gateway: StartGateway, start_simulator_at: StartSimulator
) -> None:
    """alpha's two slots run long answers and its queue is full (429s); beta is idle."""
    lanes = [replace(lane, max_queue_depth=2) for lane in default_lanes()]
    gateway, _, _ = await two_models(
        start_gateway, start_simulator_at, lanes=lanes, decode_ms_per_seq=20.0
    )
    sdk = client(gateway)
    longs = [asyncio.create_task(ask(sdk, "alpha", max_tokens=200)) for _ in range(8)]
    await asyncio.sleep(0.3)  # two running, two queued, the rest refused
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await ask(sdk, "beta") == "beta"
    took = loop.time() - started
    results = await asyncio.gather(*longs, return_exceptions=True)
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert refused, "alpha's queue never filled: the test proves nothing"
    assert took < 0.5, f"beta waited {took:.2f} s behind alpha's line"
    (short,) = [line for line in gateway.request_lines() if line["model"] == "beta"]
    assert short["queue_ms"] < 20


async def test_models_lists_the_union_and_the_aliases(
    start_gateway: StartGateway, start_simulator_at: StartSimulator
) -> None:
    aliases = [ModelSettings(name="chat", target="beta")]
    gateway, _, _ = await two_models(start_gateway, start_simulator_at, aliases)
    listed = [model.id for model in (await client(gateway).models.list()).data]
    assert sorted(listed) == ["alpha", "beta", "chat"]


async def test_an_alias_reaches_its_backend_as_its_target(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    aliases = [ModelSettings(name="chat", target="beta", default=True)]
    gateway, alpha, beta = await two_models(start_gateway, start_simulator_at, aliases)
    assert await ask(client(gateway), "chat") == "beta"  # the answer passes through
    assert await by_model(http, beta) == {"beta": 1} and await by_model(http, alpha) == {}
    # TGI's routes carry no model: the default one's pool.
    async with http.post(
        gateway.url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}
    ) as response:
        assert response.status == 200
    lines = gateway.request_lines()
    assert [(line["model"], line["pool"]) for line in lines] == [("chat", "beta"), (None, "beta")]


async def test_a_weighted_alias_splits_its_requests(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    alias = ModelSettings(
        name="chat",
        targets=[ModelTarget(model="alpha", weight=1.0), ModelTarget(model="beta", weight=3.0)],
    )
    gateway, alpha, beta = await two_models(start_gateway, start_simulator_at, [alias])
    sdk = client(gateway)
    answers = await asyncio.gather(*(ask(sdk, "chat", max_tokens=1) for _ in range(80)))
    to_beta = (await by_model(http, beta)).get("beta", 0)
    assert to_beta + (await by_model(http, alpha)).get("alpha", 0) == 80
    assert answers.count("beta") == to_beta
    assert 44 <= to_beta <= 74  # 60 expected; outside this is p < 0.001


async def sent_max_tokens(http: aiohttp.ClientSession, url: str) -> list[int | None]:
    async with http.get(url + "/sim/requests") as response:
        return [seen["max_tokens"] for seen in (await response.json())["requests"]]


async def test_a_model_s_own_caps_apply_to_it_alone(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    """alpha admits prompts of 40 tokens, defaults to 7 output tokens and clamps at 50;
    beta keeps [limits] (32768, 256, 1024); `chat`, an alias of alpha and the default
    model (TGI's routes), inherits alpha's caps."""
    small = ModelLimits(max_prompt_tokens=40, default_max_tokens=7, max_output_tokens=50)
    aliases = [
        ModelSettings(name="alpha", limits=small),
        ModelSettings(name="chat", target="alpha", default=True),
    ]
    gateway, alpha, beta = await two_models(start_gateway, start_simulator_at, aliases)
    sdk = client(gateway)
    prompt = [{"role": "user", "content": "word " * 100}]  # ~100 tokens
    for model in ("alpha", "chat"):
        with pytest.raises(openai.APIStatusError) as refused:
            await sdk.chat.completions.create(model=model, messages=prompt, max_tokens=4)
        assert refused.value.status_code == 413
        error = refused.value.body
        assert isinstance(error, dict) and error["code"] == "prompt_too_long"
        assert "at most 40" in error["message"]
    answer = await sdk.chat.completions.create(model="beta", messages=prompt, max_tokens=4)
    assert answer.model == "beta"
    assert await by_model(http, alpha) == {}  # the refusals reached no backend
    # No max_tokens: each backend is sent its model's default.
    short = [{"role": "user", "content": "Hi"}]
    await sdk.chat.completions.create(model="alpha", messages=short)
    await sdk.chat.completions.create(model="chat", messages=short)
    await sdk.chat.completions.create(model="beta", messages=short)
    # Over the output cap: alpha's clamps at its 50, beta's [limits] 1024 lets 100 by.
    for model, sent in (("alpha", "50"), ("beta", "100")):
        body = {"model": model, "messages": short, "max_tokens": 100}
        async with http.post(gateway.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            assert response.headers["x-gateway-max-tokens"] == sent
    # TGI's route carries no model: the default entry's caps (chat's, alpha's).
    async with http.post(gateway.url + "/generate", json={"inputs": "Hi"}) as response:
        assert response.status == 200
    assert await sent_max_tokens(http, alpha) == [7, 7, 50, 7]
    assert await sent_max_tokens(http, beta) == [4, 256, 100]
    lines = gateway.request_lines()
    assert [(line["model"], line["status"], line["max_tokens"]) for line in lines] == [
        ("alpha", 413, None),
        ("chat", 413, None),
        ("beta", 200, 4),
        ("alpha", 200, 7),
        ("chat", 200, 7),
        ("beta", 200, 256),
        ("alpha", 200, 50),
        ("beta", 200, 100),
        (None, 200, 7),
    ]
    assert gateway.state.in_flight == 0


async def test_each_pool_fits_its_own_engine_s_context_under_the_model_s_own(
    start_gateway: StartGateway, start_simulator_at: StartSimulator, http: aiohttp.ClientSession
) -> None:
    """alpha's engine says its context is 512 tokens, beta's 32768 (the simulator's
    default); `chat` (beta, with context_window = 300) is capped by its own entry."""

    def fast_sizing(settings: Settings) -> Settings:
        health = replace(settings.health, interval_s=0.2, timeout_s=0.15)
        return replace(with_models([["alpha"], ["beta"]], aliases)(settings), health=health)

    aliases = [ModelSettings(name="chat", target="beta", limits=ModelLimits(context_window=300))]
    alpha = await start_simulator_at(model="alpha", strict_model=True, max_model_len=512)
    beta = await start_simulator_at(model="beta", strict_model=True)
    gateway = await start_gateway([alpha, beta], configure=fast_sizing)
    await asyncio.sleep(0.6)  # a sizing round has read both engines
    sdk = client(gateway)
    prompt = [{"role": "user", "content": "word " * 250}]  # ~250 tokens
    for model, window in (("alpha", 512), ("chat", 300)):
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.chat.completions.create(model=model, messages=prompt, max_tokens=280)
        error = refused.value.body
        assert isinstance(error, dict) and error["code"] == "context_length_exceeded"
        assert f"context window is {window} tokens" in error["message"]
    answer = await sdk.chat.completions.create(model="beta", messages=prompt, max_tokens=280)
    assert answer.model == "beta"
    assert await by_model(http, alpha) == {} and await by_model(http, beta) == {"beta": 1}
