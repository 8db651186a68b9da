"""Several gateway replicas as one: slot leases in a real Redis.

Two gateways (in this process, each with its own pool and scheduler) or
gateway processes share a real `redis-server` and one simulator. The
simulator's own peak count of requests held at once is the witness: with
leases it never goes over the backend's `max_concurrency`, without them it
does. Redis stopped mid-run costs no request; a replica killed with SIGKILL
gives its slots back within the lease TTL. With two models, each model's pool
leases its own backend's slots (two processes, two simulators).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from msgspec.structs import replace
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import RedisSettings, Settings
from gateway.tools.simulator import SimulatorConfig, start_simulator
from tests.conftest import (
    RunningGateway,
    StartGateway,
    StartSimulator,
    chat,
    free_port,
    wait_ready,
)
from tests.helpers import eventually
from tests.redis_server import RedisServer

ROUTE = "/v1/chat/completions"
SLOTS = 2
ROOT = Path(__file__).resolve().parents[2]


def shared(url: str | None, **redis: Any) -> Any:
    def configure(settings: Settings) -> Settings:
        settings = replace(settings, health=replace(settings.health, interval_s=60))
        if url is None:
            return settings
        return replace(settings, redis=RedisSettings(url=url, **redis))

    return configure


async def two_replicas(
    start_gateway: StartGateway, backend: str, redis_url: str | None, **redis: Any
) -> list[RunningGateway]:
    return [
        await start_gateway([backend], max_concurrency=SLOTS, configure=shared(redis_url, **redis))
        for _ in range(2)
    ]


async def sim_stats(http: aiohttp.ClientSession, backend: str) -> dict[str, Any]:
    async with http.get(backend + "/sim/stats") as response:
        stats: dict[str, Any] = await response.json()
    return stats


async def stream(http: aiohttp.ClientSession, url: str, max_tokens: int = 40) -> int:
    body = chat("Tell me a story.", stream=True, max_tokens=max_tokens)
    async with http.post(url + ROUTE, json=body) as response:
        await response.read()
        return response.status


async def burst(
    http: aiohttp.ClientSession, replicas: list[RunningGateway], count: int
) -> list[int]:
    return list(
        await asyncio.gather(*(stream(http, replicas[i % len(replicas)].url) for i in range(count)))
    )


async def test_leases_hold_the_backends_slots_across_replicas(
    redis_server: RedisServer,
    start_gateway: StartGateway,
    start_simulator_at: StartSimulator,
    http: aiohttp.ClientSession,
) -> None:
    backend = await start_simulator_at()
    replicas = await two_replicas(start_gateway, backend, redis_server.url)
    statuses = await burst(http, replicas, 12)
    assert statuses == [200] * 12
    stats = await sim_stats(http, backend)
    assert stats["in_flight_peak"] <= SLOTS, stats
    assert stats["completed"] == 12
    lines = [line for r in replicas for line in r.request_lines()]
    assert all(line["lease_ms"] is not None for line in lines)
    # Both replicas served (the queue of each waited for the other's slots).
    assert all(r.request_lines() for r in replicas)
    for replica in replicas:
        assert replica.state.in_flight == 0
        assert all(b.free_slots >= 0 for b in replica.state.pool.backends)
    client = aioredis.Redis.from_url(redis_server.url)

    async def every_lease_given_back() -> bool:
        # Given back in the background once the answer ended: on a loaded machine it
        # may land just after the client read its last byte.
        return await client.zcard(f"llmgw:slots:{backend}") == 0

    try:
        await eventually(every_lease_given_back, within_s=5.0)
    finally:
        await client.aclose()


async def test_without_redis_the_replicas_overshoot(
    start_gateway: StartGateway,
    start_simulator_at: StartSimulator,
    http: aiohttp.ClientSession,
) -> None:
    """The control: each replica believes it owns every slot."""
    backend = await start_simulator_at()
    replicas = await two_replicas(start_gateway, backend, None)
    assert await burst(http, replicas, 12) == [200] * 12
    assert (await sim_stats(http, backend))["in_flight_peak"] == 2 * SLOTS


async def test_redis_stopped_mid_run_costs_no_request(
    redis_server: RedisServer,
    start_gateway: StartGateway,
    start_simulator_at: StartSimulator,
    http: aiohttp.ClientSession,
) -> None:
    backend = await start_simulator_at()
    replicas = await two_replicas(
        start_gateway, backend, redis_server.url, lease_ttl_s=1.0, tick_s=0.2
    )
    running = asyncio.ensure_future(burst(http, replicas, 8))
    await asyncio.sleep(0.2)
    redis_server.kill()
    during = await burst(http, replicas, 8)
    assert await running == [200] * 8
    assert during == [200] * 8
    for replica in replicas:
        fleet = replica.state.fleet
        assert fleet is not None and fleet.leases is not None
        assert not fleet.store.up and fleet.leases.local
        # With two replicas seen... or none: its share is at least one slot.
        assert replica.state.pool.backends[0].free_slots >= 1
        async with http.get(replica.url + "/metrics") as response:
            assert "gateway_redis_up 0.0" in await response.text()
    warnings = [
        line for r in replicas for line in r.log_lines() if line.get("event") == "redis_unavailable"
    ]
    assert not warnings, "lifecycle events go to stderr, not the request log"
    redis_server.start()
    await eventually(
        lambda: all(r.state.fleet is not None and r.state.fleet.store.up for r in replicas)
    )
    await asyncio.sleep(0.3)
    async with http.post(backend + "/sim/stats/reset-peaks") as response:
        assert response.status == 200
    assert await burst(http, replicas, 12) == [200] * 12
    assert (await sim_stats(http, backend))["in_flight_peak"] <= SLOTS


def gateway_process(config: Path, port: int, stdout: Any = subprocess.DEVNULL) -> Any:
    """A gateway process (`stdout`: where its request log lines go)."""
    return subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", str(port)],
        cwd=ROOT,
        stdout=stdout,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


async def test_a_killed_replica_gives_its_slots_back_within_the_ttl(
    redis_server: RedisServer,
    start_simulator_at: StartSimulator,
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    backend = await start_simulator_at(step_base_ms=20.0)
    config = tmp_path / "gateway.toml"
    config.write_text(
        f"""
[[backends]]
url = "{backend}"
max_concurrency = {SLOTS}

[health]
probe_on_start = false

[redis]
url = "{redis_server.url}"
lease_ttl_s = 1.5
"""
    )
    port = free_port()
    process = gateway_process(config, port)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_ready(http, url, timeout_s=20)
        streams = [asyncio.ensure_future(stream(http, url, max_tokens=400)) for _ in range(SLOTS)]
        key = f"llmgw:slots:{backend}"

        async def all_leased() -> bool:
            return bool(await client.zcard(key) == SLOTS)

        await eventually(all_leased)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=5)
        killed = time.monotonic()
        while await client.zcard(key) and time.monotonic() - killed < 5:
            # Expired leases leave the set when someone looks (a replica's tick, a lease).
            seconds, micros = await client.time()  # Redis time: what the leases expire by
            await client.zremrangebyscore(key, "-inf", seconds * 1000 + micros // 1000)
            await asyncio.sleep(0.05)
        back_after = time.monotonic() - killed
        assert await client.zcard(key) == 0
        assert back_after <= 1.5 + 0.2, back_after
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=5)
        await client.aclose()


async def chat_stream(
    http: aiohttp.ClientSession, url: str, model: str, max_tokens: int
) -> tuple[int, float]:
    """One streamed chat for `model`: its status and how long it took (s)."""
    started = time.monotonic()
    body = {**chat("Tell me a story.", stream=True, max_tokens=max_tokens), "model": model}
    async with http.post(url + ROUTE, json=body) as response:
        await response.read()
        return response.status, time.monotonic() - started


async def test_each_models_pool_holds_its_slots_across_gateway_processes(
    redis_server: RedisServer,
    start_simulator_at: StartSimulator,
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    """Two gateway processes, one Redis, two models (alpha the default pool, beta not):
    beta's engine never runs more than its slots across both replicas, and alpha full
    (long answers, a line behind them) does not delay beta's short request."""
    alpha = await start_simulator_at(model="alpha", strict_model=True, decode_ms_per_seq=20.0)
    beta = await start_simulator_at(model="beta", strict_model=True, step_base_ms=20.0)
    config = tmp_path / "gateway.toml"
    config.write_text(
        f"""
[[backends]]
url = "{alpha}"
models = ["alpha"]
max_concurrency = {SLOTS}

[[backends]]
url = "{beta}"
models = ["beta"]
max_concurrency = {SLOTS}

[health]
probe_on_start = false
interval_s = 60

[redis]
url = "{redis_server.url}"
"""
    )
    ports = [free_port(), free_port()]
    logs = [tmp_path / f"replica{i}.log" for i in range(2)]
    processes = []
    for port, log in zip(ports, logs, strict=True):
        with log.open("wb") as out:  # the request log lines
            processes.append(gateway_process(config, port, stdout=out))
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    longs: list[asyncio.Future[tuple[int, float]]] = []
    try:
        for url in urls:
            await wait_ready(http, url, timeout_s=30)
        # beta, the non-default pool: a burst over both replicas, each of which alone
        # would fill both slots (the control above: 2 x SLOTS without shared leases).
        beta_burst = await asyncio.gather(
            *(chat_stream(http, urls[i % 2], "beta", 10) for i in range(10))
        )
        assert [status for status, _ in beta_burst] == [200] * 10
        stats = await sim_stats(http, beta)
        assert stats["completed"] == 10
        assert stats["in_flight_peak"] <= SLOTS, stats
        # alpha full: long answers on both slots and a line behind them, from both replicas.
        longs = [
            asyncio.ensure_future(chat_stream(http, urls[i % 2], "alpha", 100)) for i in range(6)
        ]

        async def alpha_full() -> bool:
            return bool((await sim_stats(http, alpha))["in_flight"] == SLOTS)

        await eventually(alpha_full, within_s=10)
        await asyncio.sleep(0.3)  # the rest are queued in the replicas
        for url in urls:
            status, took = await chat_stream(http, url, "beta", 2)
            assert status == 200
            assert took < 1.5, f"beta waited {took:.2f} s behind alpha's line"
        finished = await asyncio.gather(*longs)
        assert any(took > 3.0 for _, took in finished), "alpha was never full"
        assert (await sim_stats(http, alpha))["in_flight_peak"] <= SLOTS
        # /debug/backends: each pool's backends with their fleet part (in Redis).
        async with http.get(urls[0] + "/debug/backends") as response:
            described = {b["url"]: b for b in (await response.json())["backends"]}
        for backend in (alpha, beta):
            assert described[backend]["fleet"]["shared_state"] == "redis", described[backend]
        client = aioredis.Redis.from_url(redis_server.url)
        try:

            async def all_given_back() -> bool:
                counts = [await client.zcard(f"llmgw:slots:{b}") for b in (alpha, beta)]
                return counts == [0, 0]

            await eventually(all_given_back, within_s=5)
        finally:
            await client.aclose()
    finally:
        for future in longs:
            future.cancel()
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
    lines = [json.loads(line) for log in logs for line in log.read_text().splitlines()]
    beta_lines = [x for x in lines if x.get("event") == "request" and x.get("pool") == "beta"]
    assert len(beta_lines) == 12, "every beta request logged"
    assert all(line["lease_ms"] is not None for line in beta_lines), "leased in Redis"


async def test_a_retry_moved_within_a_non_default_pool_is_leased_there(
    redis_server: RedisServer,
    start_gateway: StartGateway,
    start_simulator_at: StartSimulator,
    http: aiohttp.ClientSession,
) -> None:
    """beta's first backend dies while idle: the request moves to beta's other backend
    before any byte, and that slot is leased in Redis while it runs (beta's leases)."""
    alpha = await start_simulator_at(model="alpha")
    runner, port = await start_simulator(SimulatorConfig(model="beta"))
    dead = f"http://127.0.0.1:{port}"
    live = await start_simulator_at(model="beta", decode_ms_per_seq=20.0)
    served = [["alpha"], ["beta"], ["beta"]]

    def configure(settings: Settings) -> Settings:
        backends = [replace(b, models=m) for b, m in zip(settings.backends, served, strict=True)]
        return replace(shared(redis_server.url)(settings), backends=backends)

    gateway = await start_gateway([alpha, dead, live], max_concurrency=SLOTS, configure=configure)
    await runner.cleanup()  # the gateway still thinks it is fine
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        body = {**chat("Tell me a story.", stream=True, max_tokens=100), "model": "beta"}
        async with http.post(gateway.url + ROUTE, json=body) as response:
            assert response.status == 200
            await response.content.readline()  # the first event: it runs on `live` now
            assert await client.zcard(f"llmgw:slots:{live}") == 1, "the moved slot is leased"
            await response.read()
        (line,) = gateway.request_lines()
        assert line["attempts"] == 2 and line["backend"] == "b2" and line["outcome"] == "ok"

        async def given_back() -> bool:
            return bool(await client.zcard(f"llmgw:slots:{live}") == 0)

        await eventually(given_back, within_s=5)
        assert gateway.state.in_flight == 0
    finally:
        await client.aclose()


def fleet_in_flight(text: str) -> dict[str, float]:
    """`gateway_fleet_in_flight` summed over lanes, by its `pool` label."""
    by_pool: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "gateway_fleet_in_flight":
            for sample in family.samples:
                pool = sample.labels["pool"]
                by_pool[pool] = by_pool.get(pool, 0.0) + sample.value
    return by_pool


async def test_each_replica_exports_every_model_pool_s_fleet_figures(
    redis_server: RedisServer,
    start_gateway: StartGateway,
    start_simulator_at: StartSimulator,
    http: aiohttp.ClientSession,
) -> None:
    """A beta stream on one replica: the other's /metrics has it in beta's fleet figures,
    under the pool label `gateway_pool_*` uses, and none in alpha's."""
    alpha = await start_simulator_at(model="alpha")
    beta = await start_simulator_at(model="beta", decode_ms_per_seq=50.0)
    served = [["alpha"], ["beta"]]

    def configure(settings: Settings) -> Settings:
        backends = [replace(b, models=m) for b, m in zip(settings.backends, served, strict=True)]
        return replace(shared(redis_server.url, tick_s=0.2)(settings), backends=backends)

    x, y = [
        await start_gateway([alpha, beta], max_concurrency=SLOTS, configure=configure)
        for _ in range(2)
    ]
    body = {**chat("Tell me a story.", stream=True, max_tokens=100), "model": "beta"}
    async with http.post(x.url + ROUTE, json=body) as response:
        assert response.status == 200
        await response.content.readline()  # running on beta's backend, for ~5 s

        async def y_sees_it() -> bool:
            async with http.get(y.url + "/metrics") as metrics:
                return fleet_in_flight(await metrics.text()) == {"alpha": 0.0, "beta": 1.0}

        await eventually(y_sees_it, within_s=3)
        await response.read()
