"""Tenant quotas across two gateway replicas: one real Redis, one simulator, real clients.

The witnesses are the answers (statuses, envelopes, x-ratelimit-* headers counting down
across both replicas), the `openai` SDK's own exception, and the quota's hash in Redis
after the requests ended (what they really used, once the unused part came back).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from typing import Any

import aiohttp
import openai
import redis.asyncio as aioredis
from msgspec.structs import replace

from gateway.config import ApiKeySettings, RedisSettings, Settings
from tests.conftest import RunningGateway, StartGateway, StartSimulator, chat
from tests.helpers import eventually
from tests.redis_server import RedisServer

ROUTE = "/v1/chat/completions"
FREE = ApiKeySettings(name="free", key="free-secret-key")
#: Go's duration format, as OpenAI writes its resets: 850ms, 59.2s, 1m0s.
OPENAI_DURATION = re.compile(r"^(?:\d+ms|(?:\d+m)?\d+(?:\.\d+)?s)$")


def metered(
    requests_per_minute: int | None = None, tokens_per_minute: int | None = None
) -> ApiKeySettings:
    return ApiKeySettings(
        name="metered",
        key="metered-secret",
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
    )


def fleet(redis_url: str, *keys: ApiKeySettings) -> Any:
    def configure(settings: Settings) -> Settings:
        return replace(
            settings,
            redis=RedisSettings(url=redis_url),
            api_keys=list(keys),
            health=replace(settings.health, interval_s=60),
        )

    return configure


async def two_replicas(
    start_gateway: StartGateway, backend: str, redis_url: str, *keys: ApiKeySettings
) -> list[RunningGateway]:
    return [await start_gateway([backend], configure=fleet(redis_url, *keys)) for _ in range(2)]


async def a_fresh_minute(margin_s: float = 8.0) -> None:
    """Wait for the next minute when this one ends too soon (Redis runs on this host, so
    its TIME is this clock): a test's requests must fall in one quota window."""
    left = 60.0 - time.time() % 60.0
    if left < margin_s:
        await asyncio.sleep(left + 0.05)


def auth(client: ApiKeySettings) -> dict[str, str]:
    return {"Authorization": f"Bearer {client.key}"}


async def post(
    http: aiohttp.ClientSession, gateway: RunningGateway, client: ApiKeySettings, **body: Any
) -> tuple[int, dict[str, str], Any]:
    async with http.post(gateway.url + ROUTE, json=chat(**body), headers=auth(client)) as response:
        return response.status, dict(response.headers), await response.json()


def reset_s(text: str) -> float:
    assert OPENAI_DURATION.match(text), text
    if text.endswith("ms"):
        return int(text[:-2]) / 1000
    minutes, _, seconds = text[:-1].rpartition("m")
    return int(minutes or 0) * 60 + float(seconds)


async def quota_hash(redis_url: str, name: str) -> dict[str, int]:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        raw = await client.hgetall(f"llmgw:quota:{name}")
    finally:
        await client.aclose()
    return {str(k): int(v) for k, v in raw.items()}


def metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def redis_warnings(replicas: list[RunningGateway]) -> list[dict[str, Any]]:
    """What the replicas logged about Redis: why a replica ran on its local share."""
    return [
        line
        for gateway in replicas
        for line in gateway.log_lines()
        if str(line.get("event", "")).startswith("redis_")
    ]


async def test_two_replicas_share_one_request_quota_and_say_so_in_headers(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    redis_server: RedisServer,
    http: aiohttp.ClientSession,
) -> None:
    backend = await start_simulator_at()
    client = metered(requests_per_minute=6)
    replicas = await two_replicas(start_gateway, backend, redis_server.url, client, FREE)
    await a_fresh_minute()

    answers = [await post(http, replicas[i % 2], client, max_tokens=3) for i in range(10)]
    free = await asyncio.gather(
        *(post(http, replicas[i % 2], FREE, max_tokens=3) for i in range(10))
    )

    # Six in all, whichever replica they went to (each alone would have admitted six).
    assert [status for status, _, _ in answers] == [200] * 6 + [429] * 4
    assert [h["x-ratelimit-remaining-requests"] for _, h, _ in answers[:6]] == [
        "5", "4", "3", "2", "1", "0",
    ]  # fmt: skip
    for _, headers, body in answers[6:]:
        assert body == {
            "error": {
                "message": body["error"]["message"],
                "type": "rate_limit_error",
                "param": None,
                "code": "quota_exceeded",
            }
        }
        assert "6 requests per minute" in body["error"]["message"]
        assert headers["x-gateway-refusal"] == "quota_exceeded"
        assert headers["x-ratelimit-limit-requests"] == "6"
        assert headers["x-ratelimit-remaining-requests"] == "0"
        reset = reset_s(headers["x-ratelimit-reset-requests"])
        assert 0 < reset <= 60
        assert int(headers["Retry-After"]) == max(1, math.ceil(reset))
        assert "x-ratelimit-limit-tokens" not in headers  # this key has no token quota
    # A key without a quota is never refused and gets no x-ratelimit headers.
    assert [status for status, _, _ in free] == [200] * 10
    assert not any(name.startswith("x-ratelimit") for _, h, _ in free for name in h)

    lines = [line for gateway in replicas for line in gateway.request_lines()]
    mine = [line for line in lines if line["client"] == "metered"]
    assert sorted(line["outcome"] for line in mine) == ["ok"] * 6 + ["rejected_quota_exceeded"] * 4
    assert all(line["quota_tokens"] > 3 for line in mine if line["outcome"] == "ok")
    assert all(line["quota_tokens"] is None for line in lines if line["client"] == "free")
    refused = 0.0
    for gateway in replicas:
        async with http.get(gateway.url + "/metrics") as response:
            text = await response.text()
        refused += metric(text, "gateway_quota_refusals_total", client="metered", limit="requests")
        assert metric(text, "gateway_quota_fallback_total") == 0
    assert refused == 4


async def test_the_openai_sdk_sees_a_rate_limit_error_with_the_headers(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    redis_server: RedisServer,
) -> None:
    backend = await start_simulator_at()
    key = metered(requests_per_minute=2, tokens_per_minute=100_000)
    replicas = await two_replicas(start_gateway, backend, redis_server.url, key)
    await a_fresh_minute()
    clients = [
        openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=key.key, max_retries=0)
        for gateway in replicas
    ]
    try:
        for sdk in clients:
            raw = await sdk.chat.completions.with_raw_response.create(
                model="sim-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
            assert raw.http_response.status_code == 200
            # The whole quota: both replicas on Redis (a replica that blamed Redis for its
            # own late loop said its local share, 50000; gateway/fleet/store.py's _within).
            assert raw.headers["x-ratelimit-limit-tokens"] == "100000", redis_warnings(replicas)
        try:
            await clients[0].chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
        except openai.RateLimitError as error:
            refusal = error
        else:
            raise AssertionError("the third request of a 2-per-minute key was admitted")
    finally:
        for sdk in clients:
            await sdk.close()
    assert refusal.status_code == 429
    assert refusal.code == "quota_exceeded"
    headers = refusal.response.headers
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert OPENAI_DURATION.match(headers["x-ratelimit-reset-requests"])
    assert OPENAI_DURATION.match(headers["x-ratelimit-reset-tokens"])
    assert int(headers["retry-after"]) >= 1


async def test_tokens_are_reserved_whole_and_what_was_not_used_comes_back(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    redis_server: RedisServer,
    http: aiohttp.ClientSession,
) -> None:
    backend = await start_simulator_at()
    quota = 5000
    client = metered(tokens_per_minute=quota)
    replicas = await two_replicas(start_gateway, backend, redis_server.url, client)
    await a_fresh_minute()

    # The simulator answers one choice whatever `n` asks (as a model that stops before
    # max_tokens): the first request reserves 4 x 50 output tokens and uses 50. The second
    # is a stream, on the other replica, whose usage arrives in its last event.
    status, first_headers, _ = await post(http, replicas[0], client, n=4, max_tokens=50)
    assert status == 200
    # Its answer's headers count its whole reservation (what it gives back comes after).
    assert int(first_headers["x-ratelimit-remaining-tokens"]) < quota - 200
    body = chat("Tell me a story.", stream=True, max_tokens=20)
    async with http.post(replicas[1].url + ROUTE, json=body, headers=auth(client)) as response:
        assert response.status == 200
        await response.read()

    def finished() -> list[dict[str, Any]]:
        return [line for gateway in replicas for line in gateway.request_lines()]

    await eventually(lambda: len(finished()) == 2)
    lines = finished()
    assert [line["completion_tokens"] for line in lines] == [50, 20]
    used = sum(
        (line["backend_prompt_tokens"] or line["prompt_tokens"]) + line["completion_tokens"]
        for line in lines
    )
    reserved = sum(line["quota_tokens"] for line in lines)
    assert reserved - used >= 150  # the three choices never generated

    async def given_back() -> bool:
        return (await quota_hash(redis_server.url, "metered")).get("t") == used

    await eventually(given_back)
    # The next answer counts from what was used, not from what was reserved.
    status, headers, _ = await post(http, replicas[0], client, max_tokens=10)
    assert status == 200
    last = replicas[0].request_lines()[-1]
    assert int(headers["x-ratelimit-remaining-tokens"]) == quota - used - last["quota_tokens"]
    assert headers["x-ratelimit-limit-tokens"] == str(quota)
    assert "x-ratelimit-limit-requests" not in headers


async def test_redis_down_leaves_each_replica_its_share_and_no_request_fails(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    redis_server: RedisServer,
    http: aiohttp.ClientSession,
) -> None:
    backend = await start_simulator_at()
    client = metered(requests_per_minute=10)

    def configure(settings: Settings) -> Settings:
        settings = fleet(redis_server.url, client)(settings)
        return replace(settings, redis=replace(settings.redis, replica_share=0.5, tick_s=0.2))

    replicas = [await start_gateway([backend], configure=configure) for _ in range(2)]
    await a_fresh_minute(margin_s=15.0)
    redis_server.stop()

    answers = [await post(http, replicas[i % 2], client, max_tokens=3) for i in range(14)]

    # Each replica admits its half of the quota on its own; nobody gets a 5xx.
    assert sorted(status for status, _, _ in answers) == [200] * 10 + [429] * 4
    assert {h["x-ratelimit-limit-requests"] for _, h, _ in answers} == {"5"}
    for gateway in replicas:
        async with http.get(gateway.url + "/metrics") as response:
            text = await response.text()
        assert metric(text, "gateway_quota_fallback_total") == 7
        assert metric(text, "gateway_redis_up") == 0

    redis_server.start()

    # Each replica's fleet tick finds Redis again and rejoins (its local counts dropped).
    await eventually(
        lambda: all(g.state.fleet is not None and g.state.fleet.store.up for g in replicas),
        within_s=10.0,
    )
    remaining = []
    for gateway in replicas:
        status, headers, _ = await post(http, gateway, client, max_tokens=3)
        assert status == 200
        assert headers["x-ratelimit-limit-requests"] == "10"
        remaining.append(headers["x-ratelimit-remaining-requests"])
    assert remaining == ["9", "8"]  # both counted in Redis again
