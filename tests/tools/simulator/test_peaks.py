"""The simulator's own peak of requests held at once: the witness for "never more than
`max_concurrency` on a backend" (bench_replicas), counted by the server, not the gateway."""

from __future__ import annotations

import asyncio

import aiohttp

from gateway.tools.simulator import SimulatorConfig
from gateway.tools.simulator.engine import Engine
from tests.tools.simulator.support import StartSim, chat_body, stats, wait_for_stats


async def test_engine_peaks_count_queued_and_batched_sequences():
    """Pure engine: 3 submitted with a batch of 2 is a peak of 3 held, 2 running."""
    engine = Engine(SimulatorConfig(max_batch=2, step_base_ms=1))
    seqs = [engine.submit(10, 2) for _ in range(3)]
    assert (engine.in_flight_peak, engine.running_peak) == (3, 0)
    await engine.step()
    assert (engine.in_flight_peak, engine.running_peak) == (3, 2)
    while not all(seq.finished for seq in seqs):
        await engine.step()
    assert engine.in_flight == 0
    assert (engine.stats()["in_flight_peak"], engine.stats()["running_peak"]) == (3, 2)

    assert engine.reset_peaks() == {"in_flight_peak": 3, "running_peak": 2}
    assert (engine.in_flight_peak, engine.running_peak) == (0, 0)
    engine.submit(10, 1)
    await engine.step()
    assert (engine.in_flight_peak, engine.running_peak) == (1, 1)


async def test_peak_over_http_outlives_the_burst_and_resets(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim(max_batch=2)
    body = chat_body(max_tokens=40)

    async def post() -> None:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            await resp.read()

    await asyncio.gather(*(post() for _ in range(5)))
    snapshot = await stats(session, url)
    assert snapshot["in_flight"] == 0
    # All five were held at once (two in the batch, three queued) and the peak remembers it.
    assert (snapshot["in_flight_peak"], snapshot["running_peak"]) == (5, 2)

    async with session.post(f"{url}/sim/stats/reset-peaks") as resp:
        assert resp.status == 200
        assert await resp.json() == {"in_flight_peak": 5, "running_peak": 2}
    snapshot = await stats(session, url)
    assert (snapshot["in_flight_peak"], snapshot["running_peak"]) == (0, 0)

    # A reset during load starts from what is held now, not from zero.
    task = asyncio.create_task(post())
    await wait_for_stats(session, url, lambda s: s["running"] == 1)
    async with session.post(f"{url}/sim/stats/reset-peaks") as resp:
        assert await resp.json() == {"in_flight_peak": 1, "running_peak": 1}
    assert (await stats(session, url))["in_flight_peak"] == 1
    await task
