"""Tenants in the log: what each got, and whether a lane's fair share was fair by weight.

A module of its own because the question is of another kind than the lane
analysis in `analyzer`: that one looks at requests one at a time (was this one
slow in the queue or in the model?), fair share is about pairs of tenants over
time (who was waiting while whom was served), with definitions of its own
(backlogged, windows, weighted service) and a bound to hold the log against.

What the gateway does (`gateway/scheduling/fairness.py`): inside each lane the
next request is the oldest of the backlogged tenant whose counter (tokens served
over its weight) is lowest, a Virtual Token Counter (Sheng et al., "Fairness in
Serving Large Language Models", OSDI '24). Backlogged tenants are then served in
proportion to their weights, and the paper proves that for two tenants both
backlogged over an interval, their weighted service differs by at most 2·U, U
being the largest weighted cost of one request. The log has what it takes to
check both: each request's `tenant`, `tenant_weight` and `cost_tokens` (what the
counter was charged), and its queue interval.

The definitions, one place for all of them (the reports print them):

- **Backlogged**: a tenant is backlogged in a lane while one of its requests is
  queued there, from its arrival (end − e2e_ms) to arrival + queue_ms; requests
  that left the queue unserved (queue timeout, client gone) were queued too.
- **Service** is attributed to the moment of dispatch (arrival + queue_ms), whole:
  `cost_tokens` when the line has it, else, for a request that was served (an
  older log), its uncached prompt plus completion tokens (the output weight is
  not in the log, so 1). Weighted service is cost / the request's weight.
- **Windows**: the log's time from its first arrival cut into windows of
  `window_s` (10 s); the last, partial window is left out, its shares would rest
  on a fraction of the time. In each window and lane, the tenants backlogged for
  at least `backlog_share` (80%) of it that were also dispatched in it are the
  ones compared: Jain's index J = (Σx)² / (n·Σx²) of their weighted service, 1.0
  when served exactly by weight. A window with fewer than two such tenants is
  not counted (nothing was contended). 80% rather than 100% so that a tenant
  whose queue emptied for an instant (its last request dispatched just before
  the next arrived) still counts as contending.
- **Gap**: over each interval in which two tenants were both continuously
  backlogged in a lane, the largest |W_f/w_f − W_g/w_g| accumulated over any
  sub-interval, evaluated at dispatch events (exact for service attributed at
  dispatch: the difference only moves there), next to VTC's 2·U with U the
  largest cost / weight of one request of the tenants compared, in that lane.
  The gateway charges a request's output tokens when the request ends, so a
  request in flight is service its counter has not seen yet and adds up to its
  own cost to the gap; `in_flight_max` is the most weighted cost one tenant of the
  pair had dispatched and not ended at once, the margin that lag can explain.

Plain functions over plain dicts, like the rest of the analyzer.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.tools.analyze.fields import (
    NO_LANE,
    Record,
    arrival_s,
    end_s,
    iso_utc,
    lane_of,
    number,
    rounded,
    was_served,
)
from gateway.tools.stats import percentile

#: The one tenant of a log written before the gateway had tenants (no `tenant` field).
NO_TENANT = "(none)"
#: Width of the windows in which the tenants' fair share is judged, seconds.
FAIRNESS_WINDOW_S = 10.0
#: A tenant backlogged for at least this share of a window contends in it.
BACKLOG_SHARE = 0.8
#: Where a request's charge came from: the gateway's own `cost_tokens`, or the
#: fallback for older logs (uncached prompt + completion tokens).
COST_LOGGED = "cost_tokens"
COST_FALLBACK = "uncached_prompt_plus_completion"
#: A weight missing from the line (older logs) counts as 1, the gateway's default.
DEFAULT_WEIGHT = 1.0

#: Kinds of a lane's events, in the order they apply at one instant: a dispatch at
#: the moment a backlog ends belongs to it, one at the moment it starts does not.
DISPATCH, BACKLOG_ENDS, BACKLOG_STARTS = 0, 1, 2

Interval = tuple[float, float]


def fairness_rule(window_s: float = FAIRNESS_WINDOW_S, backlog_share: float = BACKLOG_SHARE) -> str:
    """The fairness windows' definitions in one sentence, as the reports print them."""
    return (
        f"Windows of {window_s:g} s from the first arrival (the last, partial one left out). "
        "A tenant is backlogged in a lane while a request of it is queued there (arrival to "
        f"arrival + queue_ms); in each window and lane the tenants backlogged for "
        f"≥ {backlog_share:.0%} of it and dispatched in it are compared by weighted service "
        "x = Σ cost / weight of their requests dispatched in the window (attributed at "
        "dispatch, arrival + queue_ms); Jain's J = (Σx)² / (n·Σx²), 1.0 = served exactly by "
        "weight; windows with fewer than two such tenants are not counted"
    )


GAP_RULE = (
    "Gap: over each interval where two tenants were both continuously backlogged in a lane, "
    "the largest |W_f/w_f − W_g/w_g| accumulated over any sub-interval, evaluated at dispatch "
    "events; VTC's bound (Sheng et al., OSDI '24) is 2·U, U = the largest cost / weight of one "
    "request of those tenants in the lane. The gateway charges output tokens when a request "
    "ends, so a request in flight adds up to its own cost to the gap; in flight = the most "
    "weighted cost one tenant of the pair had dispatched and not yet ended at once"
)


# ----------------------------------------------------------------------------- one request


def tenant_of(record: Record) -> str:
    """The request's tenant; NO_TENANT for a line without one (a log from before tenants)."""
    tenant = record.get("tenant")
    return tenant if isinstance(tenant, str) and tenant else NO_TENANT


def weight_of(record: Record) -> float | None:
    """The tenant's weight as the line says it; None when absent or not a positive number."""
    weight = number(record, "tenant_weight")
    return weight if weight is not None and weight > 0 else None


def charge_of(record: Record) -> tuple[float, str] | None:
    """What the request cost its tenant's counter, and which figure that is (COST_*).

    `cost_tokens` is what the gateway charged and wins whenever it is there. A
    log written before it has none: a served request then costs its uncached
    prompt plus its completion tokens (the output weight is not logged, so 1).
    None: not charged (refused, timed out in the queue), or nothing to count.
    """
    cost = number(record, "cost_tokens")
    if cost is not None and cost >= 0:
        return cost, COST_LOGGED
    if not was_served(record):
        return None
    prompt = number(record, "prompt_tokens")
    completion = number(record, "completion_tokens")
    if prompt is None and completion is None:
        return None
    uncached = max(0.0, (prompt or 0.0) - (number(record, "cached_tokens") or 0.0))
    return uncached + max(0.0, completion or 0.0), COST_FALLBACK


def dispatch_s(record: Record) -> float | None:
    """When the request left its lane's queue (epoch seconds): arrival + queue_ms."""
    arrival = arrival_s(record)
    queue = number(record, "queue_ms")
    if arrival is None or queue is None:
        return None
    return arrival + queue / 1000.0


# ----------------------------------------------------------------------------- arithmetic


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index (Σx)² / (n·Σx²): 1.0 when all equal, 1/n when one got all."""
    squares = sum(v * v for v in values)
    if not values or squares <= 0:
        return None
    return sum(values) ** 2 / (len(values) * squares)


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of [start, end) intervals, sorted; touching ones join, empty ones go."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


# ----------------------------------------------------------------------------- per tenant


def tenant_weights(records: Iterable[Record]) -> dict[str, float]:
    """Each tenant's weight, the last the log says (a config reload may change it)."""
    weights: dict[str, float] = {}
    for record in records:
        weight = weight_of(record)
        if weight is not None:
            weights[tenant_of(record)] = weight
    return weights


def weighted_cost(record: Record, weights: dict[str, float]) -> float | None:
    """The request's charge over its weight (its own line's, else its tenant's, else 1)."""
    charge = charge_of(record)
    return None if charge is None else charge[0] / _weight(record, weights)


def _weight(record: Record, weights: dict[str, float]) -> float:
    return weight_of(record) or weights.get(tenant_of(record), DEFAULT_WEIGHT)


def tenant_table(records: Sequence[Record]) -> dict[str, dict[str, Any]]:
    """Per tenant, most requests first: what it sent, what it got served, how long it waited.

    Tokens served are prompt + completion tokens of the served requests (what the
    engine did for it); `cost_tokens` and `weighted_service` are what its
    counter was charged, and that over its weight. TTFT and queue wait are over
    every request with a value (queue_ms: every request that entered a queue).
    """
    weights = tenant_weights(records)
    by_tenant: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        by_tenant[tenant_of(record)].append(record)
    order = sorted(by_tenant, key=lambda t: (t == NO_TENANT, -len(by_tenant[t]), t))
    table: dict[str, dict[str, Any]] = {}
    for tenant in order:
        mine = by_tenant[tenant]
        served = [r for r in mine if was_served(r)]
        charges = [c[0] for c in map(charge_of, mine) if c is not None]
        weighted = [w for r in mine if (w := weighted_cost(r, weights)) is not None]
        ttft = [v for r in mine if (v := number(r, "ttft_ms")) is not None]
        queue = [v for r in mine if (v := number(r, "queue_ms")) is not None]
        refusals = Counter(
            code for r in mine if isinstance(code := r.get("error_code"), str) and code
        )
        table[tenant] = {
            "requests": len(mine),
            "served": len(served),
            "tokens_served": int(
                sum(
                    (number(r, "prompt_tokens") or 0.0) + (number(r, "completion_tokens") or 0.0)
                    for r in served
                )
            ),
            "weight": weights.get(tenant),
            "cost_tokens": rounded(sum(charges)),
            "weighted_service": rounded(sum(weighted)),
            "ttft_ms": {"p50": rounded(percentile(ttft, 50)), "p99": rounded(percentile(ttft, 99))},
            "queue_ms": {
                "p50": rounded(percentile(queue, 50)),
                "p99": rounded(percentile(queue, 99)),
            },
            "refusals": dict(sorted(refusals.items(), key=lambda item: (-item[1], item[0]))),
        }
    return table


# ----------------------------------------------------------------------------- per lane


@dataclass(slots=True)
class TenantInLane:
    """One tenant's life in one lane: when it was backlogged and what it was served when."""

    #: Union of its requests' queued intervals, sorted.
    backlogged: list[Interval] = field(default_factory=list)
    #: Each charged request's dispatch time, sorted, and its weighted cost (same order).
    dispatch_times: list[float] = field(default_factory=list)
    dispatch_weighted: list[float] = field(default_factory=list)
    #: The most weighted cost it had dispatched and not yet ended at once.
    in_flight_max: float = 0.0
    #: Weighted service before each dispatch: served_before[i] = sum(dispatch_weighted[:i]).
    served_before: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.served_before = [0.0, *itertools.accumulate(self.dispatch_weighted)]

    @property
    def largest_request(self) -> float:
        """The largest weighted cost of one of its requests here (VTC's U)."""
        return max(self.dispatch_weighted, default=0.0)

    def span(self, start: float, end: float) -> tuple[int, int]:
        """Indices of its dispatches in (start, end]."""
        return (
            bisect.bisect_right(self.dispatch_times, start),
            bisect.bisect_right(self.dispatch_times, end),
        )

    def served(self, low: int, high: int) -> float:
        """Weighted service of its dispatches low..high-1."""
        return self.served_before[high] - self.served_before[low]


def tenants_in_lanes(
    records: Sequence[Record], weights: dict[str, float]
) -> tuple[dict[str, dict[str, TenantInLane]], Counter[str]]:
    """Each lane's tenants as TenantInLane, and how many charges came from which figure."""
    queued: dict[tuple[str, str], list[Interval]] = defaultdict(list)
    dispatched: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    in_flight: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    sources: Counter[str] = Counter()
    for record in records:
        lane = lane_of(record)
        if lane == NO_LANE:  # refused before a lane: never queued, never charged
            continue
        key = (lane, tenant_of(record))
        arrival, left = arrival_s(record), dispatch_s(record)
        if arrival is None or left is None:
            continue
        queued[key].append((arrival, left))
        charge = charge_of(record)
        if charge is None:
            continue
        sources[charge[1]] += 1
        weighted = charge[0] / _weight(record, weights)
        dispatched[key].append((left, weighted))
        ended = end_s(record)
        if ended is not None and ended > left:
            in_flight[key] += [(left, weighted), (ended, -weighted)]
    lanes: dict[str, dict[str, TenantInLane]] = defaultdict(dict)
    for key in sorted(queued):
        lane, tenant = key
        events = sorted(dispatched.get(key, []))
        lanes[lane][tenant] = TenantInLane(
            backlogged=merge_intervals(queued[key]),
            dispatch_times=[moment for moment, _ in events],
            dispatch_weighted=[weighted for _, weighted in events],
            in_flight_max=_peak(in_flight.get(key, [])),
        )
    return dict(lanes), sources


def _peak(changes: list[tuple[float, float]]) -> float:
    """The highest running sum of (time, change) steps; ends before starts at one instant."""
    level = peak = 0.0
    for _, change in sorted(changes, key=lambda item: (item[0], item[1])):
        level += change
        peak = max(peak, level)
    return peak


def _per_window(
    intervals: Sequence[Interval], origin: float, width: float, count: int
) -> dict[int, float]:
    """Seconds of `intervals` that fall in each full window (index → seconds)."""
    out: dict[int, float] = defaultdict(float)
    for start, end in intervals:
        first = max(0, math.floor((start - origin) / width))
        last = min(count - 1, math.floor((end - origin) / width))
        for k in range(first, last + 1):
            low = max(start, origin + k * width)
            high = min(end, origin + (k + 1) * width)
            if high > low:
                out[k] += high - low
    return out


def lane_windows(
    tenants: dict[str, TenantInLane],
    *,
    origin: float,
    width: float,
    count: int,
    backlog_share: float = BACKLOG_SHARE,
) -> dict[str, Any]:
    """Jain's index of one lane's contended windows (see the module docstring).

    `jain` lists the index of every counted window in time order; `worst_window` is
    the least fair one, with its tenants' weighted service; `backlogged_unserved`
    counts the times a contending tenant got nothing in a window in which another
    was served (a starved share that J, over served tenants only, cannot show).
    """
    needed = backlog_share * width - 1e-9
    backlog = {t: _per_window(data.backlogged, origin, width, count) for t, data in tenants.items()}
    service: dict[str, dict[int, float]] = {}
    for tenant, data in tenants.items():
        served: dict[int, float] = defaultdict(float)
        for moment, weighted in zip(data.dispatch_times, data.dispatch_weighted, strict=True):
            k = math.floor((moment - origin) / width)
            if 0 <= k < count:
                served[k] += weighted
        service[tenant] = served
    indices: list[float] = []
    worst: dict[str, Any] | None = None
    worst_index = math.inf
    one_tenant = unserved = 0
    for k in sorted({k for seconds in backlog.values() for k in seconds}):
        contending = sorted(t for t in tenants if backlog[t].get(k, 0.0) >= needed)
        served_here = [t for t in contending if service[t].get(k, 0.0) > 0]
        if served_here:
            unserved += len(contending) - len(served_here)
        if len(served_here) == 1:
            one_tenant += 1
        if len(served_here) < 2:
            continue
        shares = [service[t][k] for t in served_here]
        index = jain_index(shares)
        if index is None:
            continue
        indices.append(index)
        if index < worst_index:
            worst_index = index
            worst = {
                "start": iso_utc(origin + k * width),
                "jain": rounded(index, 4),
                "weighted_service": {t: rounded(service[t][k]) for t in served_here},
            }
    return {
        "windows": len(indices),
        "windows_one_tenant": one_tenant,
        "backlogged_unserved": unserved,
        "min_jain": rounded(min(indices), 4) if indices else None,
        "median_jain": rounded(percentile(indices, 50), 4),
        "worst_window": worst,
        "jain": [rounded(j, 4) for j in indices],
    }


def largest_gap(first: TenantInLane, second: TenantInLane, start: float, end: float) -> float:
    """The largest |ΔW_f/w_f − ΔW_g/w_g| over sub-intervals of (start, end].

    The difference of two tenants' weighted service since `start` is a step
    function that moves only at their dispatches, so its largest swing over any
    sub-interval is its maximum less its minimum (0 included, at `start`).
    Dispatches at one instant are applied together: no sub-interval splits them.
    """
    f_low, f_high = first.span(start, end)
    g_low, g_high = second.span(start, end)
    if f_low == f_high or g_low == g_high:  # one of them only: the difference is monotone
        return first.served(f_low, f_high) + second.served(g_low, g_high)
    f_times, f_weighted = first.dispatch_times, first.dispatch_weighted
    g_times, g_weighted = second.dispatch_times, second.dispatch_weighted
    i, j = f_low, g_low
    difference = highest = lowest = 0.0
    while i < f_high or j < g_high:
        moment = min(f_times[i] if i < f_high else math.inf, g_times[j] if j < g_high else math.inf)
        while i < f_high and f_times[i] == moment:
            difference += f_weighted[i]
            i += 1
        while j < g_high and g_times[j] == moment:
            difference -= g_weighted[j]
            j += 1
        highest = max(highest, difference)
        lowest = min(lowest, difference)
    return highest - lowest


def lane_gap(tenants: dict[str, TenantInLane]) -> dict[str, Any] | None:
    """The largest weighted-service gap of two co-backlogged tenants, against VTC's 2·U.

    One sweep of the lane in time order (dispatches, then the ends, then the starts
    of backlogged intervals at one instant) keeps each tenant's running service, so
    an interval in which two tenants were both backlogged costs two lookups when
    it opens and closes; only one whose service could be over the bound or the
    largest gap so far is replayed dispatch by dispatch (`largest_gap`). With a
    tenant per end user a lane can hold many tenants, and the pairs that really
    overlapped are what this costs. None when no two tenants of the lane were
    ever backlogged at once.
    """
    events: list[tuple[float, int, str, float]] = []
    for name, data in tenants.items():
        events += [
            (t, DISPATCH, name, w)
            for t, w in zip(data.dispatch_times, data.dispatch_weighted, strict=True)
        ]
        for start, end in data.backlogged:
            events += [(end, BACKLOG_ENDS, name, 0.0), (start, BACKLOG_STARTS, name, 0.0)]
    events.sort(key=lambda event: (event[0], event[1]))
    compared = _compared(events)
    if not compared:
        return None
    largest_request = max(tenants[t].largest_request for t in compared)
    bound = 2 * largest_request
    served = dict.fromkeys(tenants, 0.0)
    backlogged: dict[str, None] = {}  # an ordered set
    opened: dict[tuple[str, str], tuple[float, float, float]] = {}
    intervals = over_bound = 0
    best: tuple[float, str, str, float, float] | None = None
    for moment, kind, name, weighted in events:
        if kind == DISPATCH:
            served[name] += weighted
            continue
        if kind == BACKLOG_STARTS:
            for other in backlogged:
                f, g = (name, other) if name < other else (other, name)
                opened[(f, g)] = (moment, served[f], served[g])
            backlogged[name] = None
            continue
        del backlogged[name]
        for other in backlogged:
            f, g = (name, other) if name < other else (other, name)
            start, f_before, g_before = opened.pop((f, g))
            intervals += 1
            # The gap is at most all the service in the interval: when that can be
            # neither over the bound nor above the largest gap so far, it is settled.
            ceiling = served[f] - f_before + served[g] - g_before
            if best is not None and ceiling <= min(best[0], bound):
                continue
            gap = largest_gap(tenants[f], tenants[g], start, moment)
            over_bound += gap > bound + 1e-9
            if best is None or gap > best[0]:
                best = (gap, f, g, start, moment)
    assert best is not None  # a tenant compared closed an interval with another
    gap, f, g, start, end = best
    in_flight = max(tenants[f].in_flight_max, tenants[g].in_flight_max)
    if gap <= bound + 1e-9:
        judged = "within_bound"
    elif gap <= bound + in_flight + 1e-9:
        judged = "within_bound_plus_in_flight"
    else:
        judged = "over_bound"
    return {
        "pair_intervals": intervals,
        "intervals_over_bound": over_bound,
        "max_gap": rounded(gap),
        "pair": [f, g],
        "start": iso_utc(start),
        "end": iso_utc(end),
        "largest_request": rounded(largest_request),
        "bound": rounded(bound),
        "in_flight_max": rounded(in_flight),
        "verdict": judged,
    }


def _compared(events: Sequence[tuple[float, int, str, float]]) -> set[str]:
    """The tenants that were backlogged at the same time as another (whose U counts)."""
    compared: set[str] = set()
    backlogged: set[str] = set()
    for _, kind, name, _ in events:
        if kind == BACKLOG_ENDS:
            backlogged.discard(name)
        elif kind == BACKLOG_STARTS:
            if backlogged:
                compared.add(name)
                compared.update(backlogged)
            backlogged.add(name)
    return compared


# ----------------------------------------------------------------------------- the analysis


def tenant_analysis(
    records: Sequence[Record],
    *,
    window_s: float = FAIRNESS_WINDOW_S,
    backlog_share: float = BACKLOG_SHARE,
) -> dict[str, Any]:
    """The tenant section of the analysis: the per-tenant table and the fairness per lane."""
    if not window_s > 0 or not math.isfinite(window_s):
        raise ValueError(f"window_s must be a positive number of seconds, got {window_s}")
    table = tenant_table(records)
    weights = tenant_weights(records)
    lanes, sources = tenants_in_lanes(records, weights)
    starts = [t for t in map(arrival_s, records) if t is not None]
    ends = [t for t in map(end_s, records) if t is not None]
    origin = min(starts + ends) if ends else 0.0
    count = math.floor(round((max(ends) - origin) / window_s, 9)) if ends else 0
    per_lane: dict[str, Any] = {}
    for lane in sorted(lanes):
        tenants = lanes[lane]
        if len(tenants) < 2:
            continue
        windows = lane_windows(
            tenants, origin=origin, width=window_s, count=count, backlog_share=backlog_share
        )
        per_lane[lane] = {"tenants": len(tenants), **windows, "gap": lane_gap(tenants)}
    indices = [j for data in per_lane.values() for j in data["jain"]]
    return {
        "count": len(table),
        "tagged": any(tenant_of(r) != NO_TENANT for r in records),
        "table": table,
        "cost_source": {COST_LOGGED: sources[COST_LOGGED], COST_FALLBACK: sources[COST_FALLBACK]},
        "fairness": {
            "window_s": window_s,
            "full_windows": count,
            "backlog_share": backlog_share,
            "rule": fairness_rule(window_s, backlog_share),
            "gap_rule": GAP_RULE,
            "windows": len(indices),
            "min_jain": rounded(min(indices), 4) if indices else None,
            "median_jain": rounded(percentile(indices, 50), 4),
            "lanes": per_lane,
        },
    }
