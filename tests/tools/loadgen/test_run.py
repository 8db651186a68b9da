"""Open- and closed-loop runs against the real simulator on 127.0.0.1; timing bounds are loose."""

from __future__ import annotations

import aiohttp
import pytest

from gateway.tools.loadgen import (
    TrafficClass,
    closed_schedule,
    poisson_schedule,
    run_closed_loop,
    run_open_loop,
    summarize_run,
)
from tests.conftest import StartSimulator

SMALL_MIX = [
    TrafficClass("short", 0.7, (40, 60), 8),
    TrafficClass("long", 0.3, (800, 1200), 16),
]


async def test_open_loop_against_the_simulator(start_simulator_at: StartSimulator) -> None:
    url = await start_simulator_at()
    schedule = poisson_schedule(SMALL_MIX, rate=3.0, duration_s=2.5, seed=1)
    assert len(schedule) >= 3
    run = await run_open_loop(url, schedule, timeout_s=30)

    assert run.target == url
    assert [r.index for r in run.results] == [p.index for p in schedule]
    for result, plan in zip(run.results, schedule, strict=True):
        assert result.ok, result
        assert result.status == 200 and result.attempts == 1
        assert result.cls == plan.cls
        assert result.completion_tokens == plan.max_tokens == result.content_chunks
        assert result.ttft_ms is not None and result.e2e_ms is not None
        assert 0 < result.ttft_ms <= result.e2e_ms < 20_000
        assert result.tpot_ms is not None and 0 < result.tpot_ms < 2_000
        assert result.sent_ms is not None
        assert 0 <= result.sent_ms - result.scheduled_ms < 1_000
        assert result.reject_ms is None and result.error_code is None
    assert run.wall_s >= schedule[-1].at_s

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/sim/requests") as resp:
            seen = {r["request_id"]: r for r in (await resp.json())["requests"]}
    for result in run.results:
        record = seen[result.request_id]
        assert record["stream"] is True and record["include_usage"] is True
        assert record["prompt_tokens"] == result.prompt_tokens  # same count as the gateway's

    summary = summarize_run(run)
    assert list(summary)[-1] == "all"
    assert summary["all"]["count"] == summary["all"]["ok"] == len(schedule)
    tokens = sum(p.max_tokens for p in schedule)
    assert summary["all"]["completion_tokens"] == tokens
    assert summary["all"]["goodput_tok_s"] == pytest.approx(tokens / run.wall_s)
    assert summary["all"]["errors"] == {}
    assert summary["all"]["ttft_ms"]["p99"] is not None


async def test_closed_loop_keeps_concurrency(start_simulator_at: StartSimulator) -> None:
    url = await start_simulator_at()
    schedule = closed_schedule(SMALL_MIX, 8, seed=2)
    run = await run_closed_loop(url, schedule, 3, timeout_s=30)
    assert len(run.results) == 8 and all(r.ok for r in run.results)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/sim/requests") as resp:
            seen = (await resp.json())["requests"]
    assert len(seen) == 8
    in_flight = [sum(o["arrival"] <= r["arrival"] < o["end"] for o in seen) for r in seen]
    assert max(in_flight) == 3  # three workers, never more
