"""`gateway replay` is faithful: a trace slice replayed in virtual time through the gateway's
own scheduler gets the P99 TTFT, per lane, that the real gateway process gets in real time
in front of real simulator processes (within 10 %)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: 30 s of the Azure conversation trace from its second 600 (tests/data/README.md).
TRACE = ROOT / "tests" / "data" / "azure_conv_600s_30s.csv"


@pytest.mark.timeout(120)
def test_virtual_and_real_time_agree_on_each_lanes_p99(tmp_path: Path) -> None:
    out = tmp_path / "fidelity.json"
    subprocess.run(
        [
            sys.executable,
            "scripts/bench_replay.py",
            "--trace",
            str(TRACE),
            "--seconds",
            "8",
            "--start",
            "0",
            "--loads",
            "0.8",
            "--backends",
            "2",
            "--no-hour",
            "--json",
            str(out),
        ],  # fmt: skip
        cwd=ROOT,
        check=True,
        timeout=110,
    )
    (run,) = json.loads(out.read_text())["fidelity"]
    assert run["rows"] >= 20
    classes = run["classes"]
    assert {"interactive", "bulk"} <= set(classes)
    for cls, row in classes.items():
        assert row["virtual"] is not None, cls
        assert row["real"]["completed"] == row["virtual"]["completed"], cls
        assert abs(row["gap"]) <= 0.10, (cls, row)
    assert run["virtual_wall_s"] < run["real_wall_s"] / 5
