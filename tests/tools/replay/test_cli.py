"""`python -m gateway replay`: the command's output and its JSON's shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main


def _trace(path: Path) -> Path:
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(40):
        prompt = 6000 if i % 4 == 0 else 60
        rows.append(f"2023-11-16 18:15:{i:02d}.000000,{prompt},{20 + i}")
    path.write_text("\n".join(rows) + "\n")
    return path


def test_replay_prints_both_runs_and_writes_their_classes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "replay.json"
    trace = _trace(tmp_path / "t.csv")
    code = main(["replay", str(trace), "--load", "1.2", "--backends", "1", "--slots", "4",
                 "--target-p99", "interactive=1.5s", "--json", str(out), "--html", str(tmp_path / "r.html")])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "engine model: 4 slots (flag)" in printed
    assert "smallest fleet meeting interactive" in printed
    result = json.loads(out.read_text())
    for run in ("direct", "gateway"):
        classes = result[run]["classes"]
        assert set(classes) == {"interactive", "bulk"}
        for fig in classes.values():
            assert set(fig["ttft_ms"]) == {"p50", "p95", "p99"}
            assert fig["completed"] + fig["refused"] <= 40
    assert result["direct"]["classes"]["interactive"]["completed"] == 30
    assert isinstance(result["sweep"]["backends"], int)
    page = (tmp_path / "r.html").read_text()
    assert page.count("<tr>") == 5 and "Smallest fleet meeting interactive" in page


@pytest.mark.parametrize(
    "flags", [["--target-p99", "interactive"], ["--duration", "1", "--start", "999"]]
)
def test_bad_flags_or_an_empty_slice_exit_2(
    tmp_path: Path, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", str(_trace(tmp_path / "t.csv")), *flags]) == 2
    assert "replay:" in capsys.readouterr().err


def test_a_missing_source_exits_2(tmp_path: Path) -> None:
    assert main(["replay", str(tmp_path / "nope.log")]) == 2


def test_the_gateway_runs_log_reads_in_the_analyzer_on_the_virtual_clock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "replay.jsonl"
    trace = _trace(tmp_path / "t.csv")
    assert main(["replay", str(trace), "--load", "1.2", "--slots", "4", "--log", str(log)]) == 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    requests = [line for line in lines if line.get("event") == "request"]
    assert len(requests) == 40
    # Stamped with the virtual clock: 40 s of trace at 1.2x load, not the replay's 0.1 s.
    stamps = sorted(line["timestamp"] for line in requests)
    assert stamps[0].startswith("2026-01-01T00:00:") and stamps[-1] > "2026-01-01T00:00:20"
    capsys.readouterr()
    assert main(["analyze", str(log)]) == 0
    assert "ENGINE SLOTS per backend" in capsys.readouterr().out
