"""The `analyze` command line: files, stdin, JSON, usage errors, and a real overloaded gateway.

The integration test overloads a real gateway in front of the simulator and
checks the analyzer calls it what it is: queueing.
"""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import aiohttp
import pytest

from gateway.config import LaneSettings
from gateway.tools.analyze import (
    analyze,
    load_records,
)
from tests.conftest import StartGateway, StartSimulator, chat
from tests.tools.analyze.support import (
    fair_log,
    lane_with_slow_tail,
    run_cli,
    unfair_log,
    write_log,
)


def test_cli_reads_a_file_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    log = write_log(tmp_path / "gw.log", lane_with_slow_tail("interactive", 900.0, 100.0))
    code, out, _ = run_cli([str(log), "--json", str(tmp_path / "out.json")], capsys)
    assert code == 0
    assert out.startswith("gateway analyze: 100 requests in 1 lane(s), 1 other line(s) skipped")
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["requests"] == 100 and data["skipped_lines"] == 1
    assert data["lanes"]["interactive"]["tail"]["verdict"] == "queueing"


def test_cli_reads_stdin_and_json_to_stdout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    text = "".join(json.dumps(r) + "\n" for r in lane_with_slow_tail("x", 10.0, 900.0))
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    code, out, _ = run_cli(["--json", "-"], capsys)
    assert code == 0
    assert json.loads(out)["lanes"]["x"]["tail"]["verdict"] == "backend"


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, _, err = run_cli([str(tmp_path / "missing.log")], capsys)
    assert code == 2 and "cannot read" in err
    empty = tmp_path / "empty.log"
    empty.write_text("nothing to see\n")
    code, out, _ = run_cli([str(empty)], capsys)
    assert code == 1 and "no request lines" in out
    code, _, err = run_cli([str(empty), "--tail-percent", "0"], capsys)
    assert code == 2 and "--tail-percent" in err


async def test_overloaded_interactive_lane_is_diagnosed_as_queueing(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    """Eight short streams through one slot: the last waits for seven others, so it queued."""
    sim = await start_simulator_at()
    gateway = await start_gateway(
        [sim],
        max_concurrency=1,
        lanes=[
            LaneSettings(
                name="interactive",
                max_prompt_tokens=1024,
                max_output_tokens=256,
                queue_timeout_s=10,
                reject_predicted_wait=False,
            ),
            LaneSettings(name="bulk"),
        ],
    )
    sent = 8
    async with aiohttp.ClientSession() as http:

        async def one(i: int) -> int:
            body = chat(f"Short question number {i}?", stream=True, max_tokens=40)
            async with http.post(gateway.url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                return resp.status

        statuses = await asyncio.gather(*(one(i) for i in range(sent)))
    assert statuses == [200] * sent
    for _ in range(200):  # each line is written as its request finishes; wait for the last
        if len(gateway.request_lines()) == sent:
            break
        await asyncio.sleep(0.01)

    # The log as it would be captured: the simulator's banner mixed into the same stream.
    text = "simulator listening on " + sim + "\n" + gateway.log.getvalue()
    records, skipped = load_records(text.splitlines())
    assert len(records) == sent and skipped >= 1
    analysis = analyze(records, skipped=skipped)
    lane = analysis["lanes"]["interactive"]
    assert list(analysis["lanes"]) == ["interactive"]
    assert lane["requests"] == sent
    assert lane["outcomes"]["ok"]["count"] == sent
    assert lane["outcomes"]["ok"]["latency"]["ttft_ms"]["count"] == sent
    assert lane["failures"] == []
    tail = lane["tail"]
    assert tail["measures"] == {"ttft_ms": 1}
    # ~7 requests × ~40 tokens ahead of it vs one prefill: seconds against milliseconds.
    assert tail["verdict"] == "queueing", tail
    assert tail["queue_vs_backend"] > 0.7
    assert tail["mean_queue_ms"] > 500

    # The same through the command line, on the file as an operator would have it.
    log = tmp_path / "gateway.log"
    log.write_text(text)
    code, out, _ = run_cli([str(log), "--json", str(tmp_path / "a.json")], capsys)
    assert code == 0
    assert "interactive: queueing-bound → scheduling (lanes, slots, fail-fast)" in out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert json.loads((tmp_path / "a.json").read_text()) == analysis
    print(out)  # shown with -s: what on-call would read


def test_cli_fairness_window_option(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    log = write_log(tmp_path / "gw.log", fair_log())
    code, out, _ = run_cli([str(log), "--json", str(tmp_path / "ten.json")], capsys)
    assert code == 0 and "Jain's J over 10 s windows" in out
    fairness = json.loads((tmp_path / "ten.json").read_text())["tenants"]["fairness"]
    assert fairness["window_s"] == 10.0 and fairness["lanes"]["interactive"]["jain"] == [1.0]

    code, out, _ = run_cli(
        [str(log), "--fairness-window", "5", "--json", str(tmp_path / "five.json")], capsys
    )
    assert code == 0 and "Jain's J over 5 s windows" in out
    fairness = json.loads((tmp_path / "five.json").read_text())["tenants"]["fairness"]
    assert fairness["window_s"] == 5.0 and fairness["full_windows"] == 2
    assert fairness["lanes"]["interactive"]["jain"] == [1.0, 1.0]
    assert fairness["windows"] == 2

    for bad in ("0", "-3", "nan", "inf"):
        code, _, err = run_cli([str(log), "--fairness-window", bad], capsys)
        assert code == 2, bad
        assert "--fairness-window must be a positive number of seconds" in err


def test_cli_json_has_the_tenant_figures(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    log = write_log(tmp_path / "gw.log", unfair_log())
    code, out, _ = run_cli([str(log), "--json", "-"], capsys)
    assert code == 0
    tenants = json.loads(out)["tenants"]
    assert tenants["table"]["a"]["weighted_service"] == 1650.0
    lane = tenants["fairness"]["lanes"]["interactive"]
    assert lane["min_jain"] == 0.8 and lane["gap"]["max_gap"] == 1150.0
    assert lane["gap"]["bound"] == 300.0


def test_the_gateways_sizing_warnings_are_repeated_beside_the_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A tail the queue's order cannot fix was named by the gateway at run time, in the
    same stream: the report repeats the latest warning of each kind per lane."""
    warning = {
        "event": "lane_tail_needs_every_slot",
        "level": "warning",
        "lane": "interactive",
        "slots": 8,
        "tail_slots": 8,
        "headroom_slots": 6,
        "demand_slots": 3.1,
        "hint": "give the engine more slots (vLLM --max-num-seqs)",
    }
    earlier = {**warning, "demand_slots": 2.4}
    log = write_log(tmp_path / "gw.log", lane_with_slow_tail("interactive", 900.0, 100.0))
    with log.open("a") as stream:
        for said in (earlier, warning, {"event": "gateway_started", "level": "info"}):
            stream.write(json.dumps(said) + "\n")
    code, out, _ = run_cli([str(log), "--json", str(tmp_path / "out.json")], capsys)
    assert code == 0
    assert out.index("VERDICT") < out.index("THE GATEWAY SAID") < out.index("LATENCY")
    words = " ".join(out.split())  # the lines are wrapped to the report's width
    assert "interactive: lane_tail_needs_every_slot (slots 8, tail_slots 8" in words
    assert "demand_slots 3.1" in words and "--max-num-seqs" in words
    said = json.loads((tmp_path / "out.json").read_text())["gateway_said"]
    assert [line["demand_slots"] for line in said] == [3.1]
    # A log without such lines keeps its shape.
    plain = write_log(tmp_path / "plain.log", lane_with_slow_tail("interactive", 900.0, 100.0))
    run_cli([str(plain), "--json", str(tmp_path / "plain.json")], capsys)
    assert "gateway_said" not in json.loads((tmp_path / "plain.json").read_text())
