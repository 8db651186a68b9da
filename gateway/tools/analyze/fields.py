"""What one request line says: its fields read defensively, and its moments in time.

Shared by the lane analysis (`analyzer`) and the tenant analysis (`tenants`),
which look at the same lines from two sides; a module below both keeps either
from importing the other's readers (and so from importing in a cycle).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

#: Label for requests refused before a lane was chosen (e.g. prompt_too_long).
NO_LANE = "(no lane)"

Record = dict[str, Any]


def number(record: Record, field: str) -> float | None:
    """A finite numeric field, else None: a hand-edited or foreign line must not crash us."""
    value = record.get(field)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def lane_of(record: Record) -> str:
    lane = record.get("lane")
    return lane if isinstance(lane, str) and lane else NO_LANE


def outcome_of(record: Record) -> str:
    outcome = record.get("outcome")
    return outcome if isinstance(outcome, str) and outcome else "unknown"


def end_s(record: Record) -> float | None:
    """The request's end as epoch seconds (the log line is written when it ends)."""
    stamp = record.get("timestamp")
    if not isinstance(stamp, str):
        return None
    try:
        moment = datetime.fromisoformat(stamp)
    except ValueError:
        return None
    if moment.tzinfo is None:  # the gateway logs UTC; a naive stamp is UTC too
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def arrival_s(record: Record) -> float | None:
    """Arrival as epoch seconds: the end minus e2e_ms; None when either is missing."""
    end = end_s(record)
    e2e = number(record, "e2e_ms")
    if end is None or e2e is None:
        return None
    return end - e2e / 1000.0


def dispatched_s(record: Record) -> float | None:
    """When the request was sent to its backend (epoch seconds); None if it never was.

    The exact moment is the first token less `backend_ttft_ms` (arrival + ttft_ms −
    backend_ttft_ms); without a first token, arrival + queue_ms (admission, a few
    µs, is then counted as queue).
    """
    if record.get("backend") is None:
        return None
    arrival = arrival_s(record)
    if arrival is None:
        return None
    ttft, backend_ttft = number(record, "ttft_ms"), number(record, "backend_ttft_ms")
    if ttft is not None and backend_ttft is not None:
        return arrival + (ttft - backend_ttft) / 1000.0
    queue = number(record, "queue_ms")
    return None if queue is None else arrival + queue / 1000.0


#: The outcomes of a request that timed out in the queue: answered 503, or, when keep-alive
#: comments had started its stream, as the 200 stream's last event (older logs said
#: `queue_timeout` for both).
QUEUE_TIMEOUTS = frozenset({"queue_timeout", "queue_timeout_in_stream"})


def was_served(record: Record) -> bool:
    """Left the queue for a backend: a 200, unless the 200 was a stream already started
    (keep-alive comments) that then ended in the queue with a timeout."""
    return record.get("status") == 200 and outcome_of(record) not in QUEUE_TIMEOUTS


def iso_utc(epoch_s: float) -> str:
    """Epoch seconds as the reports print moments: ISO 8601 UTC to the millisecond."""
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


def rounded(value: float | None, digits: int = 3) -> float | None:
    """Rounded for the JSON (µs in ms fields): more digits would be noise, not precision."""
    return None if value is None else round(value, digits)
