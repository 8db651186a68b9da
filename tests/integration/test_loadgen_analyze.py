"""loadgen against gateway + simulator, then analyze on the log that run produced.

The analyzer must count exactly the requests loadgen sent, and its verdict for a
deliberately overloaded short lane must say "queueing".
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import LaneSettings
from gateway.tools.analyze import analyze, load_records
from gateway.tools.loadgen import TrafficClass, poisson_schedule, run_open_loop, summarize_run
from tests.conftest import StartGateway, StartSimulator

#: A load generator run whose queue the analyzer must find: it runs alone, after the
#: parallel part of `make test` (the `serial` marker), so the queue is the gateway's.
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]


async def test_loadgen_then_analyze_agree_and_find_the_queue(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, tmp_path: Path
) -> None:
    sim = await start_simulator_at()
    lanes = [
        LaneSettings(
            name="interactive",
            max_prompt_tokens=1024,
            max_output_tokens=256,
            queue_timeout_s=20,
            reject_predicted_wait=False,
        ),
        LaneSettings(name="bulk"),
    ]
    # One slot for ~12 short requests a second that each hold it ~0.2 s: a queue builds.
    gateway = await start_gateway([sim], max_concurrency=1, lanes=lanes)
    mix = [TrafficClass("short", 1.0, (40, 60), 32)]
    schedule = poisson_schedule(mix, rate=12, duration_s=3, seed=7)
    run = await run_open_loop(gateway.url, schedule, timeout_s=60)
    summary = summarize_run(run)
    assert summary["all"]["ok"] == len(schedule)

    log = tmp_path / "gateway.log"
    log.write_text(gateway.log.getvalue() + "a line that is not JSON\n")
    records, skipped = load_records(log.read_text().splitlines())
    assert len(records) == len(schedule) and skipped == 1
    report = analyze(records, skipped=skipped)
    lane = report["lanes"]["interactive"]
    assert lane["requests"] == len(schedule)
    assert lane["tail"]["verdict"] == "queueing"

    # The same through the command line, as an on-call engineer would run it.
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "gateway", "analyze", str(log), "--json", "-"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["lanes"]["interactive"]["tail"]["verdict"] == "queueing"
