"""Retry storms in the log: how much of the traffic was the same requests again, whose, at what cost.

The seed's troubleshooting table spots a retry storm by the same request
reappearing in the gateway's log. The gateway marks them: a request it took for
a retry of an earlier one (same client and body within its retry window, or a
reused `x-request-id`) carries `retry_of` (the earlier one's `request_id`),
`retry_gap_ms` (the earlier one's end to this one's arrival) and
`retried_outcome` (what the earlier one got: its outcome, or its error code when
refused). A storm is overload feeding itself: refused requests come back at
once, take places in the queue and are refused again, and new work waits behind
copies. Its fix is on the clients' side: the seed's "at most two retries with
exponential backoff", honouring the `Retry-After` a refusal carries.

The definitions (the reports print them):

- **Share of retries**: retries / requests, over the whole log, per client
  (`client`, else `tenant`, else "(none)"), and in windows of `window_s` (10 s)
  from the first arrival, by arrival time. A window is a **storm** when more
  than `threshold` (20%) of its requests were retries, and it had at least
  `STORM_MIN_REQUESTS`: two requests of which one is a retry are no storm.
- **Faster than told**: the earlier request (found by joining `retry_of` to a
  `request_id`: the latest line of that id that ended before the retry
  arrived) carried a `retry_after_s`, and the retry came sooner
  (`retry_gap_ms` < retry_after_s × 1000; Retry-After's header is that figure
  rounded up, so this is the lenient reading). A retry whose earlier request
  is not in the log (rotated out) is not judged.
- **Chain**: a retry of a retry is the second retry of one request; a chain
  longer than the seed's two retries is counted per client.
- **Damped**: retries the gateway itself refused at once for coming before their
  Retry-After (`retry_damped`): they never took a place in the queue.
- **Cost**: the retries' share of all `queue_ms` (the queue they held, which
  new requests waited behind) and of the gateway's refusals (`rejected_*`
  outcomes).

Plain functions over plain dicts, like the rest of the analyzer.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from gateway.tools.analyze.fields import (
    Record,
    arrival_s,
    end_s,
    iso_utc,
    number,
    outcome_of,
    rounded,
)
from gateway.tools.stats import percentile

#: The log fields of a retry; a log with none of them predates retry detection.
RETRY_FIELDS: tuple[str, ...] = ("retry_of", "retry_gap_ms", "retried_outcome")
#: A window is a storm when more than this share of its requests were retries ...
STORM_SHARE = 0.2
#: ... of at least this many requests.
STORM_MIN_REQUESTS = 10
STORM_WINDOW_S = 10.0
#: The seed's client policy: at most this many retries, with exponential backoff.
MAX_RETRIES = 2
NO_CLIENT = "(none)"
#: Clients listed in the JSON's storm figures, most retries first.
CLIENTS_LISTED = 50

VERDICT_TEXT = {
    "storm": "retry storm → client backoff: at most two retries with exponential backoff, "
    "honouring Retry-After",
    "retries": "retries below the storm threshold → nothing to do; clients that retry "
    "faster than told should honour Retry-After",
    "none": "no retries in the log",
}


def retry_rule(window_s: float, threshold: float) -> str:
    return (
        f"a retry is a line with retry_of; a storm window ({window_s:g} s, by arrival) has "
        f"≥ {STORM_MIN_REQUESTS} requests of which more than {threshold:.0%} were retries; "
        "faster than told: retry_gap_ms below the retry_after_s the earlier request (its "
        "retry_of) was given; chain: retries of one request, the seed allows "
        f"{MAX_RETRIES}; queue and refusals: the retries' share of all queue_ms and of "
        "rejected_* outcomes"
    )


def is_retry(record: Record) -> bool:
    earlier = record.get("retry_of")
    return isinstance(earlier, str) and bool(earlier)


def client_of(record: Record) -> str:
    """Who retried: the API key's name, else the tenant, else "(none)"."""
    for field in ("client", "tenant"):
        value = record.get(field)
        if isinstance(value, str) and value:
            return value
    return NO_CLIENT


def is_refusal(record: Record) -> bool:
    return outcome_of(record).startswith("rejected_")


def retry_analysis(
    records: Sequence[Record],
    *,
    window_s: float = STORM_WINDOW_S,
    threshold: float = STORM_SHARE,
) -> dict[str, Any]:
    """Every figure of the RETRIES section; `tagged` False for a log from before retry_of."""
    rule = retry_rule(window_s, threshold)
    if not any(field in record for record in records for field in RETRY_FIELDS):
        return {"tagged": False, "rule": rule}
    retries = [i for i, record in enumerate(records) if is_retry(record)]
    earlier = _earlier(records, retries)
    depth = _depths(retries, earlier)
    clients = _clients(records, retries, earlier, depth)
    origin = min((at for r in records if (at := arrival_s(r)) is not None), default=None)
    windows = _windows(records, origin, window_s, threshold)
    storms = {k for k, w in enumerate(windows) if w["storm"]}
    in_storm = Counter(
        client_of(records[i])
        for i in retries
        if origin is not None
        and (at := arrival_s(records[i])) is not None
        and _index(at, origin, window_s, len(windows)) in storms
    )
    queue_all = sum(number(r, "queue_ms") or 0.0 for r in records)
    queue_retries = sum(number(records[i], "queue_ms") or 0.0 for i in retries)
    refusals = sum(is_refusal(r) for r in records)
    refusals_retries = sum(is_refusal(records[i]) for i in retries)
    faster = {
        name: row["faster_than_told"] for name, row in clients.items() if row["faster_than_told"]
    }
    kind = "storm" if storms else "retries" if retries else "none"
    return {
        "tagged": True,
        "rule": rule,
        "window_s": window_s,
        "threshold": threshold,
        "requests": len(records),
        "retries": len(retries),
        "share": _share(len(retries), len(records)),
        "retried_outcomes": dict(
            Counter(str(records[i].get("retried_outcome")) for i in retries).most_common()
        ),
        "earlier_found": sum(e is not None for e in earlier.values()),
        "judged_against_retry_after": sum(row["told"] for row in clients.values()),
        "faster_than_told": sum(faster.values()),
        "clients_faster_than_told": dict(sorted(faster.items(), key=lambda kv: (-kv[1], kv[0]))),
        "over_max_retries": sum(d > MAX_RETRIES for d in depth.values()),
        # Refused at once by the gateway's damping, for coming before their Retry-After.
        "damped": sum(records[i].get("retry_damped") is True for i in retries),
        "queue_ms": {
            "total": rounded(queue_all),
            "retries": rounded(queue_retries),
            "share": _share(queue_retries, queue_all),
        },
        "refusals": {
            "total": refusals,
            "retries": refusals_retries,
            "share": _share(refusals_retries, refusals),
        },
        "windows": windows,
        "storm_windows": len(storms),
        "storm_clients": dict(in_storm.most_common(CLIENTS_LISTED)),
        "clients": clients,
        "verdict": kind,
        "verdict_text": VERDICT_TEXT[kind],
    }


#: How far past a retry's arrival the line it retried may seem to end: a line's
#: timestamp is taken as it is written, a moment after the request's end.
JOIN_SLACK_S = 1e-3


def _earlier(records: Sequence[Record], retries: list[int]) -> dict[int, int | None]:
    """For each retry, the line it retried: the latest of that id that ended before it arrived."""
    ends_by_id: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for i, record in enumerate(records):
        rid, end = record.get("request_id"), end_s(record)
        if isinstance(rid, str) and end is not None:
            ends_by_id[rid].append((end, i))
    index: dict[str, tuple[list[tuple[float, int]], list[float]]] = {}
    for rid, pairs in ends_by_id.items():
        pairs.sort()
        index[rid] = (pairs, [end for end, _ in pairs])
    out: dict[int, int | None] = {}
    for i in retries:
        pairs, ends = index.get(records[i]["retry_of"], ([], []))
        at = arrival_s(records[i])
        k = len(pairs) if at is None else bisect.bisect_right(ends, at + JOIN_SLACK_S)
        while k > 0 and pairs[k - 1][1] == i:  # a reused id: never the retry itself
            k -= 1
        out[i] = pairs[k - 1][1] if k else None
    return out


def _depths(retries: list[int], earlier: dict[int, int | None]) -> dict[int, int]:
    """How many retries deep each retry is: 1 for a retry of a first attempt."""
    depth: dict[int, int] = {}
    for i in retries:
        seen = {i}
        n, cursor = 1, earlier.get(i)
        while cursor is not None and cursor in earlier and cursor not in seen:
            seen.add(cursor)
            n += 1
            cursor = earlier.get(cursor)
        depth[i] = n
    return depth


def _faster_than_told(records: Sequence[Record], i: int, before: int | None) -> bool | None:
    """Whether retry `i` came before the Retry-After its earlier request was given."""
    if before is None:
        return None
    told = number(records[before], "retry_after_s")
    if told is None or told <= 0:
        return None
    gap = number(records[i], "retry_gap_ms")
    if gap is None:
        at, end = arrival_s(records[i]), end_s(records[before])
        if at is None or end is None:
            return None
        gap = (at - end) * 1000.0
    return gap < told * 1000.0


def _clients(
    records: Sequence[Record],
    retries: list[int],
    earlier: dict[int, int | None],
    depth: dict[int, int],
) -> dict[str, dict[str, Any]]:
    requests = Counter(client_of(r) for r in records)
    by_client: dict[str, list[int]] = defaultdict(list)
    for i in retries:
        by_client[client_of(records[i])].append(i)
    out = {}
    for name in sorted(requests, key=lambda n: (-len(by_client[n]), -requests[n], n)):
        mine = by_client[name]
        judged = [f for i in mine if (f := _faster_than_told(records, i, earlier[i])) is not None]
        gaps = [g for i in mine if (g := number(records[i], "retry_gap_ms")) is not None]
        out[name] = {
            "requests": requests[name],
            "retries": len(mine),
            "share": _share(len(mine), requests[name]),
            "told": len(judged),
            "faster_than_told": sum(judged),
            "median_gap_ms": rounded(percentile(gaps, 50)),
            "longest_chain": max((depth[i] for i in mine), default=0),
            "over_max_retries": sum(depth[i] > MAX_RETRIES for i in mine),
            "refused": sum(is_refusal(records[i]) for i in mine),
        }
    return out


def _index(at: float, origin: float, window_s: float, count: int) -> int:
    return min(count - 1, int((at - origin) / window_s))


def _windows(
    records: Sequence[Record], origin: float | None, window_s: float, threshold: float
) -> list[dict[str, Any]]:
    """Requests and retries per window of arrival time from `origin`; the last may be partial."""
    arrivals = [(at, is_retry(r)) for r in records if (at := arrival_s(r)) is not None]
    if origin is None or not arrivals:
        return []
    count = max(1, math.floor((max(at for at, _ in arrivals) - origin) / window_s) + 1)
    totals, retried = [0] * count, [0] * count
    for at, retry in arrivals:
        k = _index(at, origin, window_s, count)
        totals[k] += 1
        retried[k] += retry
    out = []
    for k in range(count):
        share = retried[k] / totals[k] if totals[k] else 0.0
        out.append(
            {
                "start": iso_utc(origin + k * window_s),
                "requests": totals[k],
                "retries": retried[k],
                "share": rounded(share, 4),
                "storm": totals[k] >= STORM_MIN_REQUESTS and share > threshold,
            }
        )
    return out


def _share(part: float, whole: float) -> float | None:
    return rounded(part / whole, 4) if whole > 0 else None
