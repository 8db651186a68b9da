"""`gateway replay` is faithful: a trace slice replayed in virtual time through the gateway's
own scheduler gets the P99 TTFT, per lane, that the real gateway process gets in real time
in front of real simulator processes (within MAX_GAP: 20 %)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: Real time against virtual time: the real run's waits must be the machine's own, so it
#: runs alone, after the parallel part of `make test` (the `serial` marker).
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]
#: 30 s of the Azure conversation trace from its second 600 (tests/data/README.md).
TRACE = ROOT / "tests" / "data" / "azure_conv_600s_30s.csv"


#: How far the P99s may differ, as a share of the real one. The real processes add a cost
#: per request that the virtual clock does not model (HTTP, tokenizing, three event loops):
#: on a loaded 2-core machine a real simulator's first token came 12-16 ms after its
#: model's for a 47-token prompt and ~50 ms after for a 1407-token one, and a queue
#: compounds it. The interactive lane's P99 (~600 ms, the maximum of 15) read 11-16.5%
#: above the virtual one in six runs, on this commit and on an older one alike. A
#: scheduling difference, a short request behind a long prefill, costs about that
#: prefill: ~1 s for the simulator's 2000-token prompt, over half such a P99.
MAX_GAP = 0.20


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
        assert abs(row["gap"]) <= MAX_GAP, (cls, row)
    assert run["virtual_wall_s"] < run["real_wall_s"] / 5
