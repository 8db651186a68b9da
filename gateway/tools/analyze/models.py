"""The log's requests split by the model they asked for, when it holds more than one.

A gateway in front of several models keeps a pool, queue and slots per model, so
"was P99 slow in the queue or in the model?" has one answer per model: a chat
model queueing behind its own long requests says nothing about a code model
whose pool was idle. This module only groups; the lane summary (outcomes,
latency, the tail's verdict) is the analyzer's own, passed in, so the per-model
tables read exactly like the gateway-wide ones.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from gateway.tools.analyze.fields import NO_LANE, Record, lane_of

#: Label for request lines that name no model (refused before the body was read).
NO_MODEL = "(no model)"


def model_of(record: Record) -> str:
    """The model as the client asked for it (an alias stays an alias)."""
    model = record.get("model")
    return model if isinstance(model, str) and model else NO_MODEL


def model_analysis(
    records: Sequence[Record], summarize_lane: Callable[[Sequence[Record]], dict[str, Any]]
) -> dict[str, Any] | None:
    """Per model: its request count, the pools it went to, and each lane's summary.

    None when the log names one model at most: the gateway-wide tables already are
    that model's, and a one-model log keeps the report it always had.
    """
    by_model: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        by_model[model_of(record)].append(record)
    if len(by_model.keys() - {NO_MODEL}) < 2:
        return None
    out = {}
    for model in sorted(by_model, key=lambda m: (m == NO_MODEL, -len(by_model[m]), m)):
        rows = by_model[model]
        by_lane: dict[str, list[Record]] = defaultdict(list)
        for record in rows:
            by_lane[lane_of(record)].append(record)
        lanes = sorted(by_lane, key=lambda lane: (lane == NO_LANE, -len(by_lane[lane]), lane))
        pools = Counter(r["pool"] for r in rows if isinstance(r.get("pool"), str))
        out[model] = {
            "requests": len(rows),
            "pools": dict(pools.most_common()),
            "lanes": {lane: summarize_lane(by_lane[lane]) for lane in lanes},
        }
    return out
