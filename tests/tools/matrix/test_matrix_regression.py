"""The engine matrix's CI subset: no release gets slower on an engine nobody looked at.

Ten cells of `gateway matrix` (an engine of each kind of prefill and speed, the loads
where the promises bite), replayed in virtual time on the gateway's built-in defaults:
deterministic, so a figure moves only when the code does. Each cell's short-request P99
(as a multiple of its engine floor) and refused share are held to the figures recorded
in `baseline.json`, within `MARGIN`; a default changed for the worse fails here, with
the cell, the figure and the baseline in the message. After a change that makes the
figures better (or a trade-off said in the commit), write the baseline anew:

    MATRIX_BASELINE_WRITE=1 python -m pytest tests/tools/matrix -q

The promises themselves (`gateway/tools/matrix/cells.py`) are checked on the full
matrix by `python -m gateway matrix`, which the docs' results table is made from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from gateway.tools.matrix.cells import Cell, run_cell

BASELINE = Path(__file__).with_name("baseline.json")
#: A short P99 (over the floor) may read this much worse than its baseline...
MARGIN = 0.10
#: ...and the refused share of short requests this many points more.
REFUSED_MARGIN = 0.02
SEEDS = (1, 2)
REQUESTS = 300
CELLS = (
    Cell("vllm-chunked", "chat", 0.8),
    Cell("vllm-h100", "chat", 0.8),
    Cell("sglang-a100", "conversation", 0.8),
    Cell("tgi-a10g", "prefill-heavy", 0.8),
    Cell("llamacpp-slow-cpu", "chat", 1.2),
    Cell("llamacpp-one-slot", "chat", 0.5),
    # TGI's batch learned behind its router's limit; an H100's prefill budget refitted as
    # soon as its rate is learned.
    Cell("tgi-a10g", "chat", 1.2),
    Cell("vllm-h100", "prefill-heavy", 0.8),
    # The real llama.cpp benchmark's mix on a CPU engine in overload: the bulk lane's
    # floor and a promotion timed from its last grant held shorts behind one long prefill
    # after another (1.5x the floor).
    Cell("llamacpp-cpu", "chat-long-replies", 1.2),
    # One slot in overload: a starved long request goes after the short ones already
    # waiting when it was starved, not before them (they were frozen behind its prefill).
    Cell("llamacpp-one-slot", "chat-long-replies", 1.2),
)


def figures(cell: Cell) -> dict[str, Any]:
    result = run_cell(cell, SEEDS, REQUESTS)
    gateway = result["runs"]["gateway"]
    return {
        "short_p99_over_floor": round(gateway["short_p99_s"] / result["floor_s"], 3),
        "short_refused": round(gateway["short_refused"] / max(1, gateway["shorts"]), 3),
        "long_p99_s": gateway["long_p99_s"],
        "promises_missed": [c["check"] for c in result["checks"] if not c["passed"]],
    }


@pytest.fixture(scope="module")
def measured() -> dict[str, dict[str, Any]]:
    found = {cell.name: figures(cell) for cell in CELLS}
    if os.environ.get("MATRIX_BASELINE_WRITE"):
        BASELINE.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    return found


@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: cell.name)
def test_no_cell_got_worse_than_its_baseline(
    cell: Cell, measured: dict[str, dict[str, Any]]
) -> None:
    baseline = json.loads(BASELINE.read_text())[cell.name]
    now = measured[cell.name]
    bound = baseline["short_p99_over_floor"] * (1 + MARGIN)
    assert now["short_p99_over_floor"] <= bound, (
        f"{cell.name}: short P99 {now['short_p99_over_floor']}x the floor, baseline "
        f"{baseline['short_p99_over_floor']}x (+{MARGIN:.0%} allowed)"
    )
    refused = baseline["short_refused"] + REFUSED_MARGIN
    assert now["short_refused"] <= refused, (
        f"{cell.name}: {now['short_refused']:.1%} of short requests refused, baseline "
        f"{baseline['short_refused']:.1%}"
    )
    new_misses = set(now["promises_missed"]) - set(baseline["promises_missed"])
    assert not new_misses, f"{cell.name}: promises now missed: {sorted(new_misses)}"
