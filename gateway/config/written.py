"""What the operator wrote, and what that decides: a written value is a contract.

An SRE writes `queue_timeout_s = 2.0` to bound what a client can suffer in the queue.
The gateway adapts what was left unset (a default lane's deadline is fitted to the
engine it finds, and given room while that engine is unlearned), but a value written in
the file, in a `GATEWAY_*` variable or as a flag is in force exactly, from the first
request, learned or not. Where a written value looks wrong for the engine, the gateway
keeps it and warns with the figure (`upstream/sizing.py`).

Settings are plain frozen data, so what was written is settled here, once, while the
sources are at hand: a lane whose `queue_timeout_s` was written and whose
`fit_timeout_to_engine` was not gets `fit_timeout_to_engine = false`. Writing
`fit_timeout_to_engine = true` opts a written deadline into fitting again.
"""

from __future__ import annotations

from typing import Any

from gateway.config.settings import Origins

#: The lane keys whose written value turns off the adaptation of that value, and the
#: key that adapts it.
ADAPTED_BY = {"queue_timeout_s": "fit_timeout_to_engine"}


def written_lane_keys(raw: dict[str, Any], origins: Origins, index: int) -> set[str]:
    """The keys of lane `index` the operator wrote: in the file's `[[lanes]]` entry (when
    the file has lanes) or by a `GATEWAY_LANES_*` variable."""
    keys: set[str] = set()
    file_lanes = raw.get("lanes")
    if isinstance(file_lanes, list) and index < len(file_lanes):
        entry = file_lanes[index]
        if isinstance(entry, dict):
            keys.update(entry)
    keys.update(
        str(path[2])
        for path in origins
        if len(path) == 3 and path[0] == "lanes" and path[1] == index
    )
    return keys


def settle_written(data: dict[str, Any], raw: dict[str, Any], origins: Origins) -> None:
    """Turn off the adaptation of each lane value the operator wrote (see the module)."""
    lanes = data.get("lanes")
    if not isinstance(lanes, list):
        return
    for index, lane in enumerate(lanes):
        if not isinstance(lane, dict):
            continue
        written = written_lane_keys(raw, origins, index)
        for key, adapter in ADAPTED_BY.items():
            if key in written and adapter not in written:
                lane[adapter] = False
