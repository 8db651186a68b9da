"""What the gateway said about its lanes while the log ran: its sizing warnings.

A tail the order of the queue cannot fix is one the gateway already named at run
time, with the figures: a lane whose own demand is more than its backends hold
(`lane_demand_over_capacity`), one whose P99 wait fits its allowance only with
every slot kept from the lanes below (`lane_tail_needs_every_slot`: the engine
needs more places), a written deadline under the measured engine floor
(`lane_deadline_below_engine_floor`). Those lines share the stream with the request
lines; the report repeats the latest of each kind per lane beside its verdict, so
the reader of the report sees the lever without the rest of the stream.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.tools.analyze.analyzer import json_line

#: The warnings the report repeats (each names a fix no scheduling order gives).
SIZING_WARNINGS = (
    "lane_demand_over_capacity",
    "lane_tail_needs_every_slot",
    "lane_deadline_below_engine_floor",
)


def sizing_warnings(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The latest line of each sizing warning per lane, in the order first said."""
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for line in lines:
        if "lane_" not in line:  # cheap: most lines are requests
            continue
        said = json_line(line)
        if said is None or said.get("event") not in SIZING_WARNINGS:
            continue
        latest[(str(said["event"]), str(said.get("lane")))] = said
    return list(latest.values())
