"""Inside the backend's time: the engine's own queue, prefill and decode, and the slots it batches.

`backend_ttft_ms` is two things added together: the time a request sat in the
*engine's* queue and its prefill. They call for opposite fixes. An engine given
more requests than it batches (TGI's `max_batch_total_tokens`, vLLM preempting
with its KV cache full, llama.cpp's deferred requests) queues them itself, out
of the gateway's sight, and the fix is fewer slots for it (`max_concurrency`),
so that the wait happens in the gateway's queue, where lanes and fail-fast
apply. A slow prefill is the model being slow for the prompt's size (capacity,
shorter prompts, the prefix cache); a long decode is long outputs. The log line
carries the split (`engine_queue_ms`, `prefill_ms`, `decode_ms`, and where it
came from: `timing_source`); a log from before it has none of these fields and
the lane verdict stays the two-part one (queue vs backend).

The parts of one request's measure (TTFT, or e2e without a first token):
gateway queue (`queue_ms`) + engine queue + prefill + decode + backend other
(the backend time the engine did not account for: network, relay, the part of
a request with no split) + gateway (admission, refusal). Decode is counted only
in an e2e measure: a first token comes before it. Where the engine's parts add
up to more than the backend time the gateway measured (an estimate's rounding),
they are scaled down to it, so the parts always add up to the measure.

The figure for `max_concurrency` comes from the log alone: each request's
dispatch (arrival + ttft_ms − backend_ttft_ms) and end give, per backend, how
many requests were in flight when each one was sent. Requests sent while few
were in flight start at once; past what the engine batches, they wait in it.
The advice is the highest in-flight count still queue-free below the lowest one
at which requests queued in the engine. A request whose engine wait was another,
bigger prompt's prefill (`behind_prefill`: chunked prefill makes a short prompt wait
for a long one's chunks) did not queue for a batch place and does not count.

Plain functions over plain dicts, like the rest of the analyzer.
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from gateway.tools.analyze.fields import Record, dispatched_s, end_s, number, rounded
from gateway.tools.stats import percentile

#: The log fields of the engine's split; a log with none of them predates it.
ENGINE_FIELDS: tuple[str, ...] = ("engine_queue_ms", "prefill_ms", "decode_ms")
#: A request's parts, in the order the reports show (and stack) them.
PARTS: tuple[str, ...] = (
    "queue_ms",
    "engine_queue_ms",
    "prefill_ms",
    "decode_ms",
    "backend_other_ms",
    "gateway_ms",
)
PART_TEXT = {
    "queue_ms": "gateway queue",
    "engine_queue_ms": "engine queue",
    "prefill_ms": "prefill",
    "decode_ms": "decode",
    "backend_other_ms": "backend other",
    "gateway_ms": "gateway",
}
#: A request saw no engine queue when it waited there at most this long, this share of
#: its prefill, or this many of its own decode steps (`tpot_ms`), whichever is more: an
#: engine's bookkeeping between steps is not a queue, and neither is the step under way
#: when it arrived (on a CPU engine a decode step of four streams takes ~100 ms, and
#: llama.cpp starts a new prompt only at the next one).
NO_QUEUE_MS = 20.0
NO_QUEUE_SHARE = 0.1
NO_QUEUE_STEPS = 1.5
#: Ends this close to a dispatch count as before it: the gateway frees a slot, then
#: gives it to the next request; the two moments, derived from two lines' timestamps
#: (µs) and durations (µs), may tie or cross by a rounding.
HANDOVER_S = 1e-5
#: An in-flight count is judged once this many requests were sent at it ...
SLOT_MIN_SAMPLES = 3
#: ... and counts as queueing when more than this share of them queued in the engine.
SLOT_QUEUED_SHARE = 0.1
#: A request waited behind another prompt's prefill, not for a batch place, when a
#: bigger prompt sent before it was in prefill for this share of its engine-queue time.
BEHIND_PREFILL_SHARE = 0.5
#: A prompt that holds others up in its prefill: this many tokens, and this many times
#: the waiting request's own.
LONG_PROMPT_TOKENS = 256
BIGGER_PROMPT = 2.0
#: The bands of the per-percentile bars: (label, from, to) in percent of a lane's
#: requests ranked by their measure; the last is the tail the default verdict reads.
BANDS: tuple[tuple[str, float, float], ...] = (
    ("<P50", 0, 50),
    ("P50-P90", 50, 90),
    ("P90-P99", 90, 99),
    ("≥P99", 99, 100),
)
#: Why a backend's requests waited in its engine, as its in-flight counts tell (each
#: backend's `engine_queue_cause`): for a place in its batch (more slots than it
#: batches), behind other prompts' prefill (chunked prefill: prefill interference), for
#: its steps while no request there ended, even when sent alone (an engine shared with
#: other clients?), or no in-flight count queued at all. Only "batch" calls for fewer
#: slots (`max_concurrency`).
ENGINE_QUEUE_CAUSES: tuple[str, ...] = ("batch", "prefill", "steps", "alone", "none")
SLOT_RULE = (
    f"in flight = the backend's requests dispatched (arrival + ttft_ms − backend_ttft_ms, "
    f"else + queue_ms) and not ended when each was sent, itself included; a request queued "
    f"in the engine when engine_queue_ms > {NO_QUEUE_MS:g} ms, > {NO_QUEUE_SHARE:.0%} of "
    f"its prefill and > {NO_QUEUE_STEPS:g} of its decode steps (tpot_ms), and not for a "
    f"step (no request there ended meanwhile) nor mostly behind a bigger prompt's prefill; "
    f"a count is judged with ≥ {SLOT_MIN_SAMPLES} requests and queues when more "
    f"than {SLOT_QUEUED_SHARE:.0%} of them did; advised max_concurrency = the highest "
    f"queue-free count below the lowest queueing one"
)


def has_engine_fields(records: Iterable[Record]) -> bool:
    """Whether the log carries the engine split at all (null values count: the field is there)."""
    return any(field in record for record in records for field in ENGINE_FIELDS)


def engine_parts(record: Record, measure: str, backend_ms: float) -> dict[str, Any]:
    """The backend's share of one request's measure, split as the engine accounted for it."""
    parts = {
        "engine_queue_ms": number(record, "engine_queue_ms") or 0.0,
        "prefill_ms": number(record, "prefill_ms") or 0.0,
        "decode_ms": (number(record, "decode_ms") or 0.0) if measure == "e2e_ms" else 0.0,
    }
    known = sum(parts.values())
    if known > backend_ms:
        scale = backend_ms / known
        parts = {part: value * scale for part, value in parts.items()}
    source = record.get("timing_source")
    return {
        **parts,
        "backend_other_ms": max(0.0, backend_ms - sum(parts.values())),
        "timing_source": source if isinstance(source, str) and source else None,
    }


def four_part_verdict(sums: dict[str, float], threshold: float) -> str | None:
    """The verdict from the four parts, or None when most backend time has no split.

    The seed's order of questions: first whether the delay is waiting (either
    queue) or work (prefill, decode); then which queue, or which work. The
    gateway's own time comes first, as in the two-part verdict.
    """
    queue, engine_queue = sums["queue_ms"], sums["engine_queue_ms"]
    prefill, decode, other = sums["prefill_ms"], sums["decode_ms"], sums["backend_other_ms"]
    backend = engine_queue + prefill + decode + other
    gateway = sums.get("gateway_in_path_ms", 0.0)
    if gateway > 0 and gateway > queue and gateway > backend:
        return "gateway"
    total = queue + backend
    if total <= 0:
        return "unknown"
    if other > engine_queue + prefill + decode:
        return None
    if (queue + engine_queue) / total > threshold:
        return "queueing" if queue >= engine_queue else "engine_queue"
    return "prefill" if prefill >= decode else "decode"


def band_splits(ranked: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The mean parts of the requests in each percentile band (ranked slowest first)."""
    ordered = list(reversed(ranked))
    n = len(ordered)
    out = []
    for label, low, high in BANDS:
        start = int(n * low / 100)
        stop = n if high >= 100 else int(n * high / 100)
        band = ordered[start:stop]
        if not band:
            continue
        row: dict[str, Any] = {
            "band": label,
            "from_pct": low,
            "to_pct": high,
            "requests": len(band),
        }
        row["mean_total_ms"] = rounded(sum(b["total_ms"] for b in band) / len(band))
        for part in (*PARTS, "backend_ms"):
            row[part] = rounded(sum(b[part] for b in band) / len(band))
        out.append(row)
    return out


def sources(items: Iterable[dict[str, Any] | Record]) -> dict[str, int]:
    """How many of these came with each timing_source ("none" for null), most first."""
    counts = Counter(
        s if isinstance(s := item.get("timing_source"), str) and s else "none" for item in items
    )
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


# ----------------------------------------------------------------------------- slots


def queued_in_engine(record: Record) -> bool | None:
    """Whether it waited in the engine's queue (beyond bookkeeping); None when unknown."""
    wait = number(record, "engine_queue_ms")
    if wait is None:
        return None
    return wait > _no_queue_ms(record)


def _no_queue_ms(record: Record) -> float:
    """The engine wait that is bookkeeping or the step under way, not a queue."""
    return max(
        NO_QUEUE_MS,
        NO_QUEUE_SHARE * (number(record, "prefill_ms") or 0.0),
        NO_QUEUE_STEPS * (number(record, "tpot_ms") or 0.0),
    )


def backend_slots(records: Sequence[Record]) -> dict[str, dict[str, Any]]:
    """Per backend: requests by how many were in flight when each was sent, and the advice."""
    spans: dict[str, list[tuple[float, float, Record]]] = defaultdict(list)
    for record in records:
        backend, start, stop = record.get("backend"), dispatched_s(record), end_s(record)
        if isinstance(backend, str) and start is not None and stop is not None and stop >= start:
            spans[backend].append((start, stop, record))
    return {backend: _slots(spans[backend]) for backend in sorted(spans)}


def behind_prefill(spans: list[tuple[float, float, Record]]) -> set[int]:
    """The requests (by `id`) whose engine-queue time is another prompt's prefill: for at
    least `BEHIND_PREFILL_SHARE` of their wait in the engine, a long prompt (at least
    `LONG_PROMPT_TOKENS`, `BIGGER_PROMPT` times theirs) was in its prefill there. An engine that chunks its prefill (vLLM, SGLang)
    makes a short prompt wait for a long one's remaining chunks: that is prefill
    interference, which the gateway's prefill budget bounds, not a batch too small for
    its slots (fewer slots there would cut its throughput and not that wait)."""
    prefills = []
    for start, _, record in spans:
        backend_ttft, prefill = number(record, "backend_ttft_ms"), number(record, "prefill_ms")
        tokens = number(record, "prompt_tokens") or 0.0
        if backend_ttft is not None and prefill and tokens >= LONG_PROMPT_TOKENS:
            first = start + backend_ttft / 1000.0
            prefills.append((first - prefill / 1000.0, first, tokens))
    found: set[int] = set()
    for start, _, record in spans:
        wait = (number(record, "engine_queue_ms") or 0.0) / 1000.0
        if wait <= 0 or not queued_in_engine(record):
            continue
        own = number(record, "prompt_tokens") or 0.0
        until = start + wait
        covered = _covered(
            [
                (max(start, p_start), min(until, p_end))
                for p_start, p_end, tokens in prefills
                if p_end > start and p_start < until and tokens >= BIGGER_PROMPT * own
            ]
        )
        if covered >= BEHIND_PREFILL_SHARE * wait:
            found.add(id(record))
    return found


def no_seat_freed(spans: list[tuple[float, float, Record]]) -> set[int]:
    """The requests (by `id`) that queued in the engine while no request there ended: an
    engine seats a waiting request only when a running one ends, so a wait with no end in
    it was for a step, not for a place in the batch. A burst sent at once to an idle
    8-sequence engine waits a few steps for its prefills (40-55 ms beside 9 ms decode
    steps), and read as a batch place that advice was "max_concurrency 1" for one of two
    identical engines and 8 for the other."""
    ends = sorted(stop for _, stop, _ in spans)
    found: set[int] = set()
    for start, _, record in spans:
        if not queued_in_engine(record):
            continue
        seated = start + (number(record, "engine_queue_ms") or 0.0) / 1000.0
        slack = _no_queue_ms(record) / 1000.0
        first = bisect.bisect_left(ends, start + HANDOVER_S)
        if first >= len(ends) or ends[first] > seated + slack:
            found.add(id(record))
    return found


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of these intervals."""
    total, reach = 0.0, float("-inf")
    for low, high in sorted(i for i in intervals if i[1] > i[0]):
        if high <= reach:
            continue
        total += high - max(low, reach)
        reach = high
    return total


def _slots(spans: list[tuple[float, float, Record]]) -> dict[str, Any]:
    starts = sorted(start for start, _, _ in spans)
    stops = sorted(stop for _, stop, _ in spans)
    interference = behind_prefill(spans)
    unseated = no_seat_freed(spans) - interference
    by_count: dict[int, list[Record]] = defaultdict(list)
    for start, _, record in spans:
        # Sent before or with it and not ended by then, itself included. A request that
        # ended as this one was sent (to the µs the log keeps) handed its slot over.
        in_flight = bisect.bisect_right(starts, start) - bisect.bisect_right(
            stops, start + HANDOVER_S
        )
        by_count[max(1, in_flight)].append(record)
    table: dict[int, dict[str, Any]] = {}
    for count in sorted(by_count):
        known = [r for r in by_count[count] if queued_in_engine(r) is not None]
        queued = sum(
            bool(queued_in_engine(r)) and id(r) not in interference and id(r) not in unseated
            for r in known
        )
        waits = [w for r in known if (w := number(r, "engine_queue_ms")) is not None]
        table[count] = {
            "requests": len(by_count[count]),
            "with_engine_queue_ms": len(known),
            "queued": queued,
            "p90_engine_queue_ms": rounded(percentile(waits, 90)),
        }
    judged = {c: row for c, row in table.items() if row["with_engine_queue_ms"] >= SLOT_MIN_SAMPLES}
    queueing = [
        c
        for c, row in judged.items()
        if row["queued"] > SLOT_QUEUED_SHARE * row["with_engine_queue_ms"]
    ]
    first_queued = min(queueing) if queueing else None
    # A full batch admits no more without a queue: requests sent at a higher count that
    # all started at once say the queue was not for a place in it (vLLM on an H100,
    # prefill-heavy: 3 of 16 queued at 28 in flight behind prefill chunks, 0 of 5 at 29).
    unqueued_above = [
        c for c, row in judged.items() if first_queued is not None and c > first_queued
        and not row["queued"]
    ]  # fmt: skip
    free = [c for c in judged if first_queued is not None and c < first_queued]
    advised = max(free) if free and not unqueued_above else None
    ran = None
    if first_queued is not None and not unqueued_above:
        ran = engine_ran(spans, interference | unseated)
    basis = None
    if advised is not None:
        basis = f"none queued in the engine at ≤ {advised} in flight, queued from {first_queued}"
    elif ran is not None:
        # A steady overload sends nearly every request at a count that queues, so the
        # counts below it have too few samples; what the engine ran when a queued
        # request got its seat still says how many it batches.
        advised = ran
        basis = f"the engine ran {ran} at once while requests waited in it"
    # The cause and the note are decided together: the note is the backend's line in the
    # reports and the cause the tail's verdict (`analyzer.tail_verdict`), so they agree.
    if first_queued is None and interference:
        cause = "prefill"
        note = (
            f"{len(interference)} requests waited in the engine behind a bigger prompt's "
            "prefill (chunked prefill: prefill interference, not too many slots; the "
            "gateway's prefill budget bounds it), none for a batch place"
        )
    elif first_queued is None and unseated:
        cause = "steps"
        note = (
            f"{len(unseated)} requests waited in the engine while none there ended (for "
            "its steps, not for a place in its batch), none for a batch place"
        )
    elif first_queued is None:
        cause, note = "none", "no in-flight count queued in the engine"
    elif unqueued_above:
        cause = "prefill"
        note = (
            f"requests queued in the engine at {first_queued} in flight but none at "
            f"{min(unqueued_above)}: not for a place in its batch (behind other prompts' "
            "prefill)"
        )
    elif advised is None and first_queued == 1:
        cause = "alone"
        note = "requests queued in the engine even when sent alone (is it shared with others?)"
    elif advised is None:
        cause = "batch"
        note = f"too few requests sent at fewer than {first_queued} in flight to judge"
    else:
        cause, note = "batch", None
    return {
        "requests": len(spans),
        "max_in_flight": max(table) if table else None,
        "first_queued_in_flight": first_queued,
        "advised_max_concurrency": advised,
        "basis": basis,
        "note": note,
        "engine_queue_cause": cause,
        "behind_prefill": len(interference),
        "no_seat_freed": len(unseated),
        "by_in_flight": {str(c): row for c, row in table.items()},
    }


def engine_ran(
    spans: list[tuple[float, float, Record]],
    not_seat_waits: frozenset[int] | set[int] = frozenset(),
) -> int | None:
    """How many requests the engine ran at once while others waited in it: the median,
    over the requests that queued there, of those running (seated: dispatched plus their
    engine queue, and not ended) halfway through each one's run, itself included. A
    request queued, so the engine was full when it got its seat; halfway through its
    run the seats that freed with it were taken again (requests seated in one step are
    all running by then). None with fewer than SLOT_MIN_SAMPLES such requests."""
    runs = [
        (start + (number(record, "engine_queue_ms") or 0.0) / 1000.0, stop, record)
        for start, stop, record in spans
    ]
    counts = [
        sum(1 for other_start, other_stop, _ in runs if other_start <= middle < other_stop)
        for seated, stop, record in runs
        if queued_in_engine(record)
        and id(record) not in not_seat_waits
        and (middle := (seated + stop) / 2.0) >= seated
    ]
    if len(counts) < SLOT_MIN_SAMPLES:
        return None
    return max(1, round(statistics.median(counts)))


#: A lane's decode is stalled when its requests' TPOT at P95 is this many times its P50
#: (over at least STALL_MIN_SAMPLES streams): more streams in a batch slow a token by a
#: fraction, a prompt prefilled in the same step by whole steps.
STALL_RATIO = 2.5
STALL_MIN_SAMPLES = 10


def decode_stall(records: Iterable[Record]) -> dict[str, Any] | None:
    """How long a lane's served streams held their slots and whether their decode stalled.

    A queueing-bound tail behind stalled decode is not fixed by ordering alone: the
    requests ahead hold their slots longer while another request's prefill runs in the
    same engine steps (a CPU llama.cpp prefills a whole micro-batch per step). None
    with too few streams to tell.
    """
    served = [r for r in records if r.get("outcome") == "ok" and number(r, "tpot_ms") is not None]
    if len(served) < STALL_MIN_SAMPLES:
        return None
    tpots = [number(r, "tpot_ms") or 0.0 for r in served]
    holds = [
        e2e - (number(r, "queue_ms") or 0.0)
        for r in served
        if (e2e := number(r, "e2e_ms")) is not None
    ]
    p50, p95 = percentile(tpots, 50), percentile(tpots, 95)
    ratio = p95 / p50 if p50 and p95 is not None else None
    return {
        "streams": len(served),
        "tpot_p50_ms": rounded(p50),
        "tpot_p95_ms": rounded(p95),
        "tpot_p95_over_p50": rounded(ratio),
        "slot_hold_p50_ms": rounded(percentile(holds, 50)),
        "slot_hold_p90_ms": rounded(percentile(holds, 90)),
        "stalled": ratio is not None and ratio >= STALL_RATIO,
    }
