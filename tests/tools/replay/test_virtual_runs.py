"""The virtual clock drives the simulator's engine and the gateway's scheduler unchanged."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.tools.replay.cli import settings_for
from gateway.tools.replay.runs import classify, run_direct, run_gateway
from gateway.tools.replay.sources import Arrival
from gateway.tools.replay.vclock import run_virtual
from gateway.tools.simulator.config import SimulatorConfig
from gateway.tools.simulator.engine import Engine


def test_an_hour_of_sleeping_takes_no_time() -> None:
    async def sleeper() -> float:
        await asyncio.sleep(3600.0)
        await asyncio.wait_for(asyncio.sleep(10.0), timeout=20.0)
        return asyncio.get_running_loop().time()

    started = time.perf_counter()
    assert run_virtual(sleeper()) == pytest.approx(3610.0)
    assert time.perf_counter() - started < 1.0


def test_the_engine_times_steps_on_the_virtual_clock() -> None:
    config = SimulatorConfig(max_batch=4, step_base_ms=5.0, prefill_ms_per_token=0.5,
                             decode_ms_per_seq=0.5, prefill_tokens_per_step=512)  # fmt: skip

    async def one() -> tuple[float, float]:
        engine = Engine(config)
        engine.start()
        seq = engine.submit(100, 3)
        while (await seq.next_event()).finish_reason is None:
            pass
        await engine.stop()
        assert seq.first_token is not None and seq.end is not None
        return seq.first_token, seq.end

    first, end = run_virtual(one())
    # Prefill step: 5 + 100 x 0.5 = 55 ms; then two decode steps of 5 + 0.5 ms each.
    assert first == pytest.approx(0.055)
    assert end == pytest.approx(0.055 + 2 * 0.0055)


def test_a_lone_request_is_served_alike_direct_and_through_the_gateway() -> None:
    config = SimulatorConfig()
    settings = settings_for(None, 1, config.max_batch)
    # A minute in: the gateway's start-up probe of the engine is over.
    arrivals = [Arrival(60.0, 100, 10)]
    classes = [classify(a, settings) for a in arrivals]
    direct = run_direct(arrivals, classes, 1, config).results[0]
    gateway = run_gateway(arrivals, classes, settings, config).results[0]
    assert direct.ttft_s == pytest.approx(gateway.ttft_s) == pytest.approx(0.055)
    assert direct.arrival == gateway.arrival == 60.0


def test_the_gateway_puts_short_prompts_ahead_of_a_burst_of_long_ones() -> None:
    """Head-of-line blocking direct; the gateway's lanes keep interactive TTFT short."""
    config = SimulatorConfig()
    settings = settings_for(None, 1, config.max_batch)
    longs = [Arrival(0.001 * i, 6000, 50) for i in range(16)]
    shorts = [Arrival(0.5 + 0.01 * i, 50, 20) for i in range(4)]
    arrivals = sorted(longs + shorts, key=lambda a: a.at_s)
    classes = [classify(a, settings) for a in arrivals]
    assert set(classes) == {"interactive", "bulk"}
    direct = run_direct(arrivals, classes, 1, config)
    gateway = run_gateway(arrivals, classes, settings, config)

    def worst_short(results: list) -> float:
        return max(r.ttft_s for r in results if r.cls == "interactive")

    assert worst_short(gateway.results) < worst_short(direct.results) / 2
    assert sum(1 for r in gateway.results if r.end is not None or r.refused) == len(arrivals)


def test_requests_no_lane_admits_are_refused_by_the_gateway_only() -> None:
    config = SimulatorConfig()
    settings = settings_for(None, 1, config.max_batch)
    huge = [Arrival(0.0, 10_000_000, 10)]
    classes = [classify(a, settings) for a in huge]
    gateway = run_gateway(huge, classes, settings, config).results[0]
    assert gateway.refused is not None and gateway.first_token is None
