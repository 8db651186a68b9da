"""The loop-lag histogram: a blocked event loop shows up as lag, an idle one does not."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from prometheus_client import CollectorRegistry

from gateway.observability.loop_lag import LoopLagMonitor
from tests.conftest import StartGateway, StartSimulator


def lag_samples(registry: CollectorRegistry, le: str) -> float:
    value = registry.get_sample_value("gateway_event_loop_lag_seconds_bucket", {"le": le})
    return value or 0.0


async def test_a_blocked_loop_is_measured_as_lag() -> None:
    registry = CollectorRegistry()
    monitor = LoopLagMonitor(registry, interval_s=0.01)
    await monitor.start()
    try:
        await asyncio.sleep(0.05)  # a few idle ticks
        idle = registry.get_sample_value("gateway_event_loop_lag_seconds_count") or 0.0
        assert idle >= 2
        assert lag_samples(registry, "0.025") == idle  # idle ticks are not late
        time.sleep(0.2)  # noqa: ASYNC251 - the point: block the loop
        await asyncio.sleep(0.03)
    finally:
        await monitor.stop()
    total = registry.get_sample_value("gateway_event_loop_lag_seconds_count") or 0.0
    assert total - lag_samples(registry, "0.1") >= 1  # the blocked tick came >= 0.1 s late
    assert (registry.get_sample_value("gateway_event_loop_lag_seconds_sum") or 0.0) >= 0.15


async def test_the_gateway_exports_its_loop_lag(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await start_gateway([await start_simulator_at()])
    await asyncio.sleep(0.3)
    async with http.get(gateway.url + "/metrics") as response:
        text = await response.text()
    assert "gateway_event_loop_lag_seconds_bucket" in text
    assert "gateway_event_loop_lag_seconds_count" in text
