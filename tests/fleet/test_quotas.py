"""Tenant quotas over a real redis-server: three `TenantQuotas` on three stores are three
replicas; bursts are concurrent reservations from all of them at once.

What must hold: no burst overshoots a quota (the Lua script checks and adds in one
step), a finished request's unused tokens come back, a window ends, and Redis going
away mid-burst costs no request (local shares) until it is back.
"""

from __future__ import annotations

import asyncio
import io
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from gateway.config import (
    ApiKeySettings,
    ConfigError,
    RedisSettings,
    Settings,
    load_settings,
    validate,
)
from gateway.fleet.quotas import (
    QuotaReservation,
    TenantQuotas,
    openai_duration,
    rate_limit_headers,
    unused,
)
from gateway.fleet.store import SharedStore
from gateway.observability.logs import make_logger
from gateway.observability.record import RequestRecord
from gateway.outcomes import Outcome, QuotaExceeded
from tests.redis_server import RedisServer

REPLICAS = 3
#: Long enough that a burst of a second never straddles two windows (checked anyway).
LONG_WINDOW_S = 3600.0


def key(
    requests_per_minute: int | None = None, tokens_per_minute: int | None = None
) -> ApiKeySettings:
    return ApiKeySettings(
        name="tenant",
        key="tenant-secret",
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
    )


class Replicas:
    """Three replicas' stores and quotas on one Redis."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.stores: list[SharedStore] = []
        self.quotas: list[TenantQuotas] = []
        self.registries: list[CollectorRegistry] = []

    async def start(self, client: ApiKeySettings, *, window_s: float = LONG_WINDOW_S) -> None:
        """Three replicas, their connections open as after a while of traffic.

        A store opens one connection per concurrent call (redis-py's pool), so a cold
        burst of 200 in one process spends over `timeout_s` setting them up and falls
        back to local; that is the store's business, not the quotas' under test here.
        """
        # A generous timeout: on a busy 2-core machine 200 calls in one event loop can
        # take over the default 0.1 s, and a burst gone local is the Redis-down test's.
        settings = RedisSettings(url=self.server.url, key_prefix="quota-test", timeout_s=2.0)
        for _ in range(REPLICAS):
            registry = CollectorRegistry()
            store = SharedStore(settings, events=make_logger(io.StringIO()), registry=registry)
            self.stores.append(store)
            self.registries.append(registry)
            self.quotas.append(
                TenantQuotas(
                    [client],
                    store=store,
                    share=lambda: 1.0 / REPLICAS,
                    registry=registry,
                    window_s=window_s,
                )
            )
        await asyncio.gather(*(store.client.ping() for store in self.stores for _ in range(70)))

    async def close(self) -> None:
        for quotas in self.quotas:
            await quotas.stop()
        for store in self.stores:
            await store.close()

    async def held_in_redis(self) -> dict[str, int]:
        client = aioredis.Redis.from_url(self.server.url, decode_responses=True)
        try:
            raw = await client.hgetall("quota-test:quota:tenant")
        finally:
            await client.aclose()
        return {str(k): int(v) for k, v in raw.items()}


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[Replicas]:
    fleet = Replicas(redis_server)
    yield fleet
    await fleet.close()


async def burst(
    replicas: Replicas,
    client: ApiKeySettings,
    sizes: list[tuple[int, int]],
    pause_s: float = 0.0,
) -> list[QuotaReservation]:
    """Every (prompt, output) size reserved at once, spread round-robin over replicas."""

    async def one(index: int, prompt: int, output: int) -> QuotaReservation:
        if pause_s:
            await asyncio.sleep(pause_s * (index // REPLICAS))
        reservation = await replicas.quotas[index % REPLICAS].reserve(client, prompt, output)
        assert reservation is not None
        return reservation

    return list(
        await asyncio.gather(*(one(i, prompt, output) for i, (prompt, output) in enumerate(sizes)))
    )


def admitted(reservations: list[QuotaReservation]) -> list[QuotaReservation]:
    return [r for r in reservations if r.refusal is None]


def served(*, completion: int | None, backend_prompt: int | None = None) -> RequestRecord:
    record = RequestRecord("r", "/v1/chat/completions", 0.0)
    record.dispatched = 0.1
    record.first_byte = 0.2
    record.outcome = Outcome.OK
    record.completion_tokens = completion
    record.backend_prompt_tokens = backend_prompt
    return record


# -------------------------------------------------------------------------- shared windows


async def test_a_burst_from_three_replicas_admits_the_token_quota_and_no_more(
    replicas: Replicas,
) -> None:
    quota = 20_000
    client = key(tokens_per_minute=quota)
    await replicas.start(client)
    rng = random.Random(11)
    sizes = [(rng.randint(20, 400), rng.choice([64, 128, 256])) for _ in range(200)]
    assert sum(p + o for p, o in sizes) > 2 * quota  # the burst asks for far more

    reservations = await burst(replicas, client, sizes)

    assert len({r.window for r in reservations}) == 1, "the burst straddled two windows"
    assert all(r.shared for r in reservations)
    taken = sum(r.tokens for r in admitted(reservations))
    largest = max(p + o for p, o in sizes)
    assert quota - largest <= taken <= quota
    assert (await replicas.held_in_redis())["t"] == taken
    refused = [r for r in reservations if r.refusal is not None]
    assert refused and all(isinstance(r.refusal, QuotaExceeded) for r in refused)
    # Every replica refused some, and counted them under the limit that refused them.
    for registry in replicas.registries:
        assert registry.get_sample_value(
            "gateway_quota_refusals_total", {"client": "tenant", "limit": "tokens"}
        )


async def test_a_burst_from_three_replicas_admits_exactly_the_request_quota(
    replicas: Replicas,
) -> None:
    client = key(requests_per_minute=50)
    await replicas.start(client)

    reservations = await burst(replicas, client, [(10, 10)] * 200)

    assert len({r.window for r in reservations}) == 1, "the burst straddled two windows"
    assert len(admitted(reservations)) == 50
    assert (await replicas.held_in_redis())["r"] == 50
    refusal = next(r.refusal for r in reservations if r.refusal is not None)
    assert refusal is not None and refusal.code == "quota_exceeded"
    assert refusal.retry_after_s is not None and refusal.retry_after_s >= 1
    assert "50 requests per minute" in refusal.message
    refused = [r for r in reservations if r.refusal is not None]
    assert all(r.headers["x-ratelimit-remaining-requests"] == "0" for r in refused)
    remaining = sorted(
        int(r.headers["x-ratelimit-remaining-requests"]) for r in admitted(reservations)
    )
    assert remaining == list(range(50))  # each admitted one saw its own place
    assert all(r.headers["x-ratelimit-limit-requests"] == "50" for r in reservations)
    assert "x-ratelimit-limit-tokens" not in refused[0].headers  # no token quota: no such headers


async def test_both_limits_are_checked_and_neither_is_added_when_one_refuses(
    replicas: Replicas,
) -> None:
    client = key(requests_per_minute=10, tokens_per_minute=1000)
    await replicas.start(client)
    quotas = replicas.quotas[0]
    big = await quotas.reserve(client, 400, 500)
    assert big is not None and big.refusal is None
    too_big = await quotas.reserve(client, 100, 100)  # 900 + 200 > 1000
    assert too_big is not None and too_big.refusal is not None
    assert "tokens per minute" in too_big.refusal.message
    # The refused reservation added no request either.
    assert await replicas.held_in_redis() == {"w": big.window, "r": 1, "t": 900}
    assert too_big.headers["x-ratelimit-remaining-tokens"] == "100"
    assert too_big.headers["x-ratelimit-remaining-requests"] == "9"
    never = await quotas.reserve(client, 1000, 100)
    assert never is not None and never.refusal is not None
    assert "more than this API key's whole quota" in never.refusal.message


async def test_what_a_request_did_not_use_comes_back(replicas: Replicas) -> None:
    client = key(requests_per_minute=100, tokens_per_minute=1000)
    await replicas.start(client)
    first, second = replicas.quotas[0], replicas.quotas[1]
    held = await first.reserve(client, 100, 400)  # 500 reserved
    other = await second.reserve(client, 100, 400)  # 1000: the quota is used up
    assert held is not None and other is not None and other.refusal is None
    refused = await second.reserve(client, 10, 10)
    assert refused is not None and refused.refusal is not None

    # The first used 100 prompt tokens (its backend said 90) and 60 completion tokens.
    first.give_back(held, served(completion=60, backend_prompt=90))
    await first.stop()  # the give-back runs in the background: let it land
    assert (await replicas.held_in_redis())["t"] == 1000 - (500 - 150)
    after = await second.reserve(client, 100, 200)  # fits in the 350 given back
    assert after is not None and after.refusal is None

    # A request the gateway refused after reserving (queue timeout) gives all of it back,
    # its request included.
    queued = RequestRecord("q", "/v1/chat/completions", 0.0)
    queued.outcome = Outcome.QUEUE_TIMEOUT
    second.give_back(after, queued)
    await second.stop()
    assert await replicas.held_in_redis() == {"w": held.window, "r": 2, "t": 650}


def test_the_unused_part_follows_what_the_backend_reported() -> None:
    reservation = QuotaReservation("tenant", 100, 400, 1, True, 0, {})
    assert unused(reservation, served(completion=50)) == (0, 350)
    assert unused(reservation, served(completion=50, backend_prompt=120)) == (0, 330)
    # More than reserved (the backend counted a longer prompt): the excess is charged.
    assert unused(reservation, served(completion=400, backend_prompt=130)) == (0, -30)
    # No count: it may have generated its whole budget, nothing comes back.
    assert unused(reservation, served(completion=None)) == (0, 0)
    # The backend answered with an error: nothing was generated, the request counts.
    rejected = served(completion=None)
    rejected.outcome = Outcome.BACKEND_REJECTED
    assert unused(reservation, rejected) == (0, 500)
    # Broke before its first byte (the gateway's 502) or never sent: all of it comes back.
    broken = served(completion=None)
    broken.outcome, broken.first_byte = Outcome.BACKEND_ERROR, None
    assert unused(reservation, broken) == (1, 500)
    queued = RequestRecord("q", "/v1/chat/completions", 0.0)
    queued.outcome = Outcome.QUEUE_TIMEOUT
    assert unused(reservation, queued) == (1, 500)


async def test_a_window_ends_and_the_quota_is_whole_again(replicas: Replicas) -> None:
    client = key(requests_per_minute=3)
    await replicas.start(client, window_s=1.0)
    quotas = replicas.quotas
    loop = asyncio.get_running_loop()
    # Start just after a window began, so that the three fit in one.
    first = await quotas[0].reserve(client, 1, 1)
    assert first is not None
    if first.refusal is None and first.headers["x-ratelimit-remaining-requests"] != "2":
        pytest.fail(f"a fresh window held other requests: {first.headers}")
    await asyncio.sleep(_reset_s(first) + 0.02)
    start = loop.time()
    taken = [await quotas[i % REPLICAS].reserve(client, 1, 1) for i in range(4)]
    assert loop.time() - start < 0.5, "too slow to stay in one 1 s window"
    assert [t is not None and t.refusal is None for t in taken] == [True, True, True, False]
    refused = taken[3]
    assert refused is not None and refused.refusal is not None
    reset_s = _reset_s(refused)
    assert 0 < reset_s <= 1.0
    assert refused.refusal.retry_after_s == 1  # whole seconds, at least 1
    await asyncio.sleep(reset_s + 0.02)
    again = await quotas[2].reserve(client, 1, 1)
    assert again is not None and again.refusal is None
    assert again.headers["x-ratelimit-remaining-requests"] == "2"


def _reset_s(reservation: QuotaReservation) -> float:
    text = reservation.headers["x-ratelimit-reset-requests"]
    return float(text[:-2]) / 1000 if text.endswith("ms") else float(text[:-1])


# ---------------------------------------------------------------------- Redis goes away


async def test_redis_stopped_mid_burst_costs_no_request_and_shares_come_back(
    replicas: Replicas,
) -> None:
    limit = 300
    client = key(requests_per_minute=limit)
    await replicas.start(client)
    local_limit = limit // REPLICAS

    async def kill_midway() -> None:
        await asyncio.sleep(0.15)
        replicas.server.kill()

    # 600 reservations paced over ~0.6 s per replica; Redis dies a quarter of the way in.
    reservations, _ = await asyncio.gather(
        burst(replicas, client, [(5, 5)] * 600, pause_s=0.003), kill_midway()
    )

    shared = [r for r in reservations if r.shared]
    local = [r for r in reservations if not r.shared]
    assert shared and local, "Redis should have died mid-burst"
    assert len(admitted(shared)) <= limit
    for index, (store, registry) in enumerate(
        zip(replicas.stores, replicas.registries, strict=True)
    ):
        mine = [r for i, r in enumerate(reservations) if i % REPLICAS == index and not r.shared]
        # Each replica admits its share at most (its local window started empty).
        assert len(admitted(mine)) == min(len(mine), local_limit)
        assert mine[-1].headers["x-ratelimit-limit-requests"] == str(local_limit)
        assert not store.up
        fallbacks = registry.get_sample_value("gateway_quota_fallback_total")
        assert fallbacks is not None and fallbacks >= len(mine)
    # Still down: decided locally at once, nothing raised.
    down = await replicas.quotas[0].reserve(client, 5, 5)
    assert down is not None and not down.shared

    replicas.server.start()
    for store in replicas.stores:
        assert await store.ping()  # what the fleet's tick does: rejoin
    back = await burst(replicas, client, [(5, 5)] * 30)
    assert all(r.shared and r.refusal is None for r in back)
    # The restarted Redis (no persistence) counts only what came after it.
    assert (await replicas.held_in_redis())["r"] == 30
    # A local reservation's give-back after the rejoin is void (its counts were dropped).
    replicas.quotas[0].give_back(down, served(completion=1))
    assert (await replicas.held_in_redis())["r"] == 30


# ---------------------------------------------------------------------- without Redis


async def test_without_redis_the_quota_is_enforced_by_the_one_gateway() -> None:
    client = key(requests_per_minute=5, tokens_per_minute=100)
    quotas = TenantQuotas([client, ApiKeySettings(name="free", key="free-secret")])
    assert await quotas.reserve(ApiKeySettings(name="free", key="free-secret"), 10**6, 1) is None
    assert await quotas.reserve(None, 10, 10) is None
    taken = [await quotas.reserve(client, 10, 10) for _ in range(6)]
    assert [t is not None and t.refusal is None for t in taken] == [True] * 5 + [False]
    refused = taken[5]
    assert refused is not None and refused.refusal is not None
    assert refused.headers["x-ratelimit-limit-requests"] == "5"  # share 1: the whole quota
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    first = taken[0]
    assert first is not None
    quotas.give_back(first, served(completion=2))  # local: at once
    again = await quotas.reserve(client, 5, 5)
    assert again is not None and again.refusal is not None  # 5 requests: still refused
    queued = RequestRecord("q", "/v1/chat/completions", 0.0)
    quotas.give_back(taken[1], queued)  # never dispatched: its request comes back
    again = await quotas.reserve(client, 5, 5)
    assert again is not None and again.refusal is None


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (0.0123, "12ms"),
        (0.9994, "999ms"),
        (1.0, "1s"),
        (59.2, "59.2s"),
        (60.0, "1m0s"),
        (360.0, "6m0s"),
        (90.125, "1m30.125s"),
        (3600.0, "1h0m0s"),
    ],
)
def test_resets_are_written_as_openai_writes_them(seconds: float, text: str) -> None:
    assert openai_duration(seconds) == text


def test_headers_name_only_the_limits_that_are_set() -> None:
    headers = rate_limit_headers((None, 1000), 3, 1200, 12.5)
    assert headers == {
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "12.5s",
    }


def test_config_takes_quotas_and_refuses_non_positive_ones() -> None:
    validate(Settings(api_keys=[key(requests_per_minute=1, tokens_per_minute=1)]))
    for bad in (key(requests_per_minute=0), key(tokens_per_minute=-5)):
        with pytest.raises(ConfigError, match=r"tokens_per_minute|requests_per_minute"):
            validate(Settings(api_keys=[bad]))


def test_quotas_are_set_by_environment_too(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text('[[api_keys]]\nname = "tenant"\nkey = "tenant-secret"\n')
    settings = load_settings(path, env={"GATEWAY_API_KEYS_0_TOKENS_PER_MINUTE": "9000"})
    assert settings.api_keys[0].tokens_per_minute == 9000
    assert settings.api_keys[0].requests_per_minute is None
