"""The analysis behind `python -m gateway analyze`: was P99 slow in the queue or in the model?

It reads back the gateway's own per-request JSON lines (`event == "request"`), so
an on-call engineer needs nothing but the log to decide between two different
fixes: scheduling (lanes, slots, fail-fast) when the slowest requests spent their
time in the gateway's queue, capacity or request size when they spent it in the
backend. Where the log splits the backend's time as the engine saw it (`engine`),
the backend's side says more: a wait in the engine's own queue (fewer slots for
that backend: `max_concurrency`), a slow prefill (the model for this prompt size)
or a long decode (long outputs). Anything else in the stream (lifecycle events, a
simulator's banner, broken lines) is skipped and counted, never fatal: logs are
messy at 2 a.m.

Everything here is plain functions over plain dicts so that tests and benchmarks
can use them without the CLI; what one line says (its fields, its moments) is
read in `fields`, the tenants' side of the log is `tenants`, its retries are
`retries`, and the reports that render the result live in `report_text` and
`report_html`.
"""

from __future__ import annotations

import bisect
import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from gateway.tools.analyze.engine import (
    PARTS,
    backend_slots,
    band_splits,
    decode_stall,
    engine_parts,
    four_part_verdict,
    has_engine_fields,
    sources,
)
from gateway.tools.analyze.fields import (
    NO_LANE,
    QUEUE_TIMEOUTS,
    Record,
    arrival_s,
    end_s,
    iso_utc,
    lane_of,
    number,
    outcome_of,
    rounded,
    was_served,
)
from gateway.tools.analyze.levers import lever_for
from gateway.tools.analyze.models import model_analysis
from gateway.tools.analyze.resumes import resume_analysis
from gateway.tools.analyze.retries import STORM_SHARE, STORM_WINDOW_S, retry_analysis
from gateway.tools.analyze.tenants import FAIRNESS_WINDOW_S, tenant_analysis
from gateway.tools.stats import percentile, summarize

#: Durations in the log line, in the order the report shows them.
METRICS: tuple[str, ...] = ("queue_ms", "backend_ttft_ms", "ttft_ms", "tpot_ms", "e2e_ms")
PERCENTILES: tuple[float, ...] = (50, 95, 99)
#: The tail whose time is split into queue and backend: the slowest 1% of a lane.
TAIL_FRACTION = 0.01
#: Above this share of queue + backend time spent queued, the tail is queueing-bound.
QUEUE_BOUND_SHARE = 0.5
#: How many of a lane's slowest requests the JSON lists one by one.
SLOWEST_LISTED = 20
#: The fields of a log line that say what the gateway predicted at arrival; without
#: any of them in the log there is no predictor to judge.
PREDICTOR_FIELDS: tuple[str, ...] = ("predicted_wait_ms", "deadline_ms")
#: A refusal is judged by the next admitted request of its lane arriving within this
#: many seconds after it; later ones met a different queue.
PREDICTOR_HORIZON_S = 5.0
PREDICTOR_RULE = (
    "error = |predicted_wait_ms - queue_ms| over requests that were served (status 200, "
    "not a queue timeout inside a started stream); a "
    "wait_too_long refusal would have made its deadline when the next request of its lane "
    f"admitted within {PREDICTOR_HORIZON_S:g} s after it (completed or queue-timed-out) "
    "left the queue less than the refusal's deadline_ms after the refusal arrived (in a "
    "lane's first-come order, the refused request would have left in its place)"
)

VERDICT_TEXT = {
    "queueing": "queueing-bound → scheduling (lanes, slots, fail-fast)",
    "engine_queue": "engine-queue-bound → the backend has more slots than it batches: "
    "lower max_concurrency",
    "prefill": "prefill-bound → the model is slow for this prompt size "
    "(capacity, shorter prompts, prefix cache)",
    "decode": "decode-bound → outputs are long (cap max_tokens, long answers in a lane of "
    "their own)",
    "backend": "backend-bound → capacity or request size",
    "gateway": "gateway-bound → the gateway's own work (see gateway_event_loop_lag_seconds)",
    "unknown": "no verdict → the slowest were refused at admission (see rejections)",
}
#: An engine-queue verdict's line by why its backends' engines queued (their
#: `engine_queue_cause`, one of `engine.ENGINE_QUEUE_CAUSES`, the same reading as each
#: backend's own line): fewer slots only for a queue for a place in the batch, never
#: above a line that says the slots are not what the requests waited for.
ENGINE_QUEUE_TEXT = {
    "batch": VERDICT_TEXT["engine_queue"],
    "prefill": "engine-queue-bound behind other prompts' prefill → prefill interference, not "
    "too many slots: keep max_concurrency; the prefill budget (prefill_budget_s) bounds it",
    "steps": "engine-queue-bound on the engine's steps → not too many slots: keep "
    "max_concurrency; the wait is the engine's step time (capacity)",
    "alone": "engine-queue-bound even when sent alone → fewer slots do not fix that: is the "
    "engine shared with other clients?",
    "none": "engine-queue-bound → no figure for max_concurrency: no in-flight count queued in "
    "the engine",
}
VERDICT_RULE = (
    f"A lane is queueing-bound when its slowest requests spent more than "
    f"{QUEUE_BOUND_SHARE:.0%} of their queue + backend time queued; gateway-bound when "
    f"the gateway's own time (admission, relay) was more than either. Where the log splits "
    f"the backend's time (engine_queue_ms, prefill_ms, decode_ms), waiting is the gateway's "
    f"queue + the engine's: above {QUEUE_BOUND_SHARE:.0%}, the larger queue names the "
    f"verdict (gateway queue: queueing-bound; engine queue: engine-queue-bound), else the "
    f"larger of prefill and decode does (decode counts only in an e2e measure); an engine "
    f"queue's fix is why its backend's engine queued (ENGINE SLOTS): fewer slots "
    f"(max_concurrency) only when requests queued there for a place in its batch"
)
TWO_PART_NOTE = {
    "no_fields": "two-part verdict: this log has no engine_queue_ms / prefill_ms / decode_ms "
    "(a gateway from before the engine split)",
    "no_split": "two-part verdict: most of the slowest requests' backend time has no engine "
    "split (timing_source null)",
}

# ----------------------------------------------------------------------------- reading


def json_line(line: str) -> dict[str, Any] | None:
    """The JSON object on this line, or None for anything else.

    A prefix before the first `{` is tolerated because log collectors add one
    (`kubectl logs --timestamps`, `docker compose logs`).
    """
    text = line.strip()
    start = text.find("{")
    if start < 0:
        return None
    try:
        obj = json.loads(text[start:])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def parse_line(line: str) -> Record | None:
    """The request record on this line (`json_line`), or None for anything else."""
    obj = json_line(line)
    return obj if obj is not None and obj.get("event") == "request" else None


def load_records(lines: Iterable[str]) -> tuple[list[Record], int]:
    """The request records and the number of other non-blank lines skipped."""
    records: list[Record] = []
    skipped = 0
    for line in lines:
        record = parse_line(line)
        if record is not None:
            records.append(record)
        elif line.strip():
            skipped += 1
    return records, skipped


# ----------------------------------------------------------------------------- time axis


def queue_depth_series(records: Iterable[Record]) -> list[tuple[float, int]]:
    """(epoch seconds, requests queued) after each change, from [arrival, arrival + queue_ms].

    Leaving is applied before joining at the same instant so depth never
    overstates what the scheduler held.
    """
    events: list[tuple[float, int]] = []
    for record in records:
        arrival = arrival_s(record)
        queue = number(record, "queue_ms")
        if arrival is None or queue is None:
            continue
        events.append((arrival, 1))
        events.append((arrival + queue / 1000.0, -1))
    events.sort()
    series: list[tuple[float, int]] = []
    depth = 0
    for moment, change in events:
        depth += change
        if series and series[-1][0] == moment:
            series[-1] = (moment, depth)
        else:
            series.append((moment, depth))
    return series


# ----------------------------------------------------------------------------- the tail


def breakdown(record: Record) -> dict[str, Any] | None:
    """Split the time a request's user waited into queue, backend and gateway time.

    The measure is TTFT when the request got a first token (queue_ms vs
    backend_ttft_ms); otherwise e2e, where everything after the queue counts as
    backend if the request was dispatched (a `backend` is named) and as gateway
    time if not. A missing queue_ms means the request never queued: 0.
    """
    ttft = number(record, "ttft_ms")
    e2e = number(record, "e2e_ms")
    queue = number(record, "queue_ms") or 0.0
    if ttft is not None:
        measure, total = "ttft_ms", ttft
        backend = number(record, "backend_ttft_ms") or 0.0
    elif e2e is not None:
        measure, total = "e2e_ms", e2e
        backend = max(0.0, e2e - queue) if record.get("backend") is not None else 0.0
    else:
        return None
    arrival = arrival_s(record)
    return {
        "request_id": record.get("request_id"),
        "arrival": None if arrival is None else iso_utc(arrival),
        "backend": record.get("backend"),
        "engine": record.get("engine"),
        "outcome": outcome_of(record),
        "measure": measure,
        "total_ms": total,
        "queue_ms": queue,
        "backend_ms": backend,
        "gateway_ms": max(0.0, total - queue - backend),
        **engine_parts(record, measure, backend),
    }


def tail_size(ranked: int, fraction: float = TAIL_FRACTION) -> int:
    """The slowest `fraction` of `ranked` requests, rounded up, at least one if any."""
    if ranked <= 0:
        return 0
    return min(ranked, max(1, math.ceil(round(ranked * fraction, 9))))


def slowest(records: Iterable[Record], count: int | None = None) -> list[dict[str, Any]]:
    """Breakdowns of the slowest requests, slowest first (all of them when count is None)."""
    ranked = [b for b in map(breakdown, records) if b is not None]
    ranked.sort(key=lambda b: b["total_ms"], reverse=True)
    return ranked if count is None else ranked[:count]


def verdict(
    queue_ms: float,
    backend_ms: float,
    threshold: float = QUEUE_BOUND_SHARE,
    gateway_ms: float = 0.0,
) -> str:
    """'queueing' when the queue holds more than `threshold` of queue + backend time.

    'gateway' first, when the gateway's own time is more than the queue's and the
    backend's (the gateway itself is the delay: a busy loop); otherwise 'backend';
    'unknown' when nothing took any time (e.g. the tail is requests refused at the
    door), because guessing would send on-call the wrong way.
    """
    if gateway_ms > 0 and gateway_ms > queue_ms and gateway_ms > backend_ms:
        return "gateway"
    both = queue_ms + backend_ms
    if both <= 0:
        return "unknown"
    return "queueing" if queue_ms / both > threshold else "backend"


def tail_analysis(
    records: Sequence[Record],
    fraction: float = TAIL_FRACTION,
    *,
    slots: dict[str, dict[str, Any]] | None = None,
    split: bool | None = None,
) -> dict[str, Any]:
    """How the slowest `fraction` of these requests split their time, and the verdict.

    Four parts (gateway queue, engine queue, prefill, decode) where the log has
    the engine's split (`split`, default: whether these lines carry its fields),
    else the two-part verdict (queue vs backend), saying why. `slots` is
    `engine.backend_slots` of the whole log: an engine-queue verdict names the
    max_concurrency it supports for each backend the tail queued in.
    """
    split = has_engine_fields(records) if split is None else split
    ranked = slowest(records)
    tail = ranked[: tail_size(len(ranked), fraction)]
    sums = {part: sum(b[part] for b in tail) for part in ("total_ms", "backend_ms", *PARTS)}
    both = sums["queue_ms"] + sums["backend_ms"]
    size = len(tail)

    def mean(part: str) -> float | None:
        return rounded(sums[part] / size) if size else None

    def share(part: str) -> float | None:
        return rounded(sums[part] / sums["total_ms"], 4) if sums["total_ms"] > 0 else None

    decided = tail_verdict(tail, sums, split=split, slots=slots or {})
    return {
        "fraction": fraction,
        "size": size,
        "ranked": len(ranked),
        "measures": dict(Counter(b["measure"] for b in tail)),
        "cutoff_ms": rounded(tail[-1]["total_ms"]) if tail else None,
        "max_ms": rounded(tail[0]["total_ms"]) if tail else None,
        "mean_total_ms": mean("total_ms"),
        "mean_queue_ms": mean("queue_ms"),
        "mean_backend_ms": mean("backend_ms"),
        "mean_gateway_ms": mean("gateway_ms"),
        "queue_share": share("queue_ms"),
        "backend_share": share("backend_ms"),
        "gateway_share": share("gateway_ms"),
        "queue_vs_backend": rounded(sums["queue_ms"] / both, 4) if both > 0 else None,
        "split": "four" if split and decided["split_note"] is None else "two",
        "split_note": decided["split_note"],
        "parts": {part: {"mean_ms": mean(part), "share": share(part)} for part in PARTS},
        "timing_sources": sources(tail),
        "verdict": decided["verdict"],
        "engine_queue_cause": decided["cause"],
        "verdict_text": decided["text"],
        "engine_queue_advice": decided["advice"],
        "bands": band_splits(ranked),
        "slowest": [_rounded(b) for b in ranked[:SLOWEST_LISTED]],
    }


def tail_verdict(
    tail: Sequence[dict[str, Any]],
    sums: dict[str, float],
    *,
    split: bool,
    slots: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The tail's verdict and its advice, decided once for every line that shows them.

    Where the time went (`verdict`: the four-part one where `split` and the split
    covers the time, else queue vs backend, `split_note` saying why) and, for an
    engine-queue tail, why the engines queued (`cause`: the `engine_queue_cause` of
    the backends it waited in, weighted by its engine-queue time there). The headline
    (`text`) and the backends' lines under it (`advice`, each with its note and cause)
    are both rendered from this result: a report once said "lower max_concurrency"
    above a line saying "prefill interference, not too many slots" (#51), because the
    headline followed the time split alone. `sums` are the tail's parts added up.
    """
    # The gateway's time in the path of a first token (admission, relay), not a refusal's.
    in_path = sum(b["gateway_ms"] for b in tail if b["measure"] == "ttft_ms")
    kind = verdict(sums["queue_ms"], sums["backend_ms"], gateway_ms=in_path) if tail else None
    note = None if split else TWO_PART_NOTE["no_fields"]
    if split and tail:
        four = four_part_verdict({**sums, "gateway_in_path_ms": in_path}, QUEUE_BOUND_SHARE)
        if four is None:
            note = TWO_PART_NOTE["no_split"]
        else:
            kind = four
    advice = _engine_queue_advice(tail, slots) if kind == "engine_queue" else []
    weights: Counter[str] = Counter()
    for item in advice:
        if item["cause"] is not None:
            weights[item["cause"]] += item["tail_engine_queue_ms"]
    # Ties go to the backend the tail waited in most (advice is in that order).
    cause = weights.most_common(1)[0][0] if weights else None
    return {
        "verdict": kind,
        "cause": cause,
        "split_note": note,
        "advice": advice,
        "text": _verdict_text(kind, cause, advice),
    }


def _engine_queue_advice(
    tail: Sequence[dict[str, Any]], slots: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per backend the tail queued in (most engine queue first): its slots and the advised value."""
    waited: Counter[str] = Counter()
    engines: dict[str, str] = {}
    for item in tail:
        if isinstance(item["backend"], str) and item["engine_queue_ms"] > 0:
            waited[item["backend"]] += item["engine_queue_ms"]
            if isinstance(item.get("engine"), str):
                engines[item["backend"]] = item["engine"]
    out = []
    for backend, total in waited.most_common():
        slot = slots.get(backend, {})
        lever = lever_for(engines.get(backend), slot.get("engine_queue_cause"))
        out.append(
            {
                "backend": backend,
                "tail_engine_queue_ms": rounded(total),
                "max_in_flight": slot.get("max_in_flight"),
                "first_queued_in_flight": slot.get("first_queued_in_flight"),
                "advised_max_concurrency": slot.get("advised_max_concurrency"),
                "basis": slot.get("basis"),
                "note": slot.get("note"),
                "cause": slot.get("engine_queue_cause"),
                "engine": engines.get(backend),
                "engine_setting": None if lever is None else lever.setting,
                "engine_setting_measured": None if lever is None else lever.measured,
            }
        )
    return out


def _verdict_text(
    kind: str | None, cause: str | None, advice: Sequence[dict[str, Any]]
) -> str | None:
    """The verdict's line; an engine-queue one says what its cause calls for and, when that
    is fewer slots, names each backend and the value to set. Without the backends' slots
    (`tail_analysis` called alone) the cause is unknown and the time split speaks alone."""
    if kind is None:
        return None
    if kind == "engine_queue" and cause not in (None, "batch"):
        levers = [a for a in advice if a["cause"] == cause and a["engine_setting"] is not None]
        if not levers:
            return ENGINE_QUEUE_TEXT[cause]
        settings = sorted({(a["engine"], a["engine_setting"]) for a in levers})
        named = ", ".join(f"{engine} {setting}" for engine, setting in settings)
        return f"{ENGINE_QUEUE_TEXT[cause]}; the engine's own setting does the rest: {named}"
    figures = [
        f"{a['backend']}: {a['max_in_flight']} → {a['advised_max_concurrency']}"
        for a in advice
        if a["advised_max_concurrency"] is not None
    ]
    if not figures:
        return VERDICT_TEXT[kind]
    return VERDICT_TEXT[kind] + " (" + ", ".join(figures) + ")"


# ----------------------------------------------------------------------------- analysis


def analyze(
    records: Sequence[Record],
    *,
    skipped: int = 0,
    said: Sequence[dict[str, Any]] = (),
    tail_fraction: float = TAIL_FRACTION,
    fairness_window_s: float = FAIRNESS_WINDOW_S,
    storm_window_s: float = STORM_WINDOW_S,
    storm_share: float = STORM_SHARE,
) -> dict[str, Any]:
    """Every number the text, JSON and HTML reports show, as one JSON-ready dict.

    `fairness_window_s` is the width of the windows the tenants' fair share is
    judged in (`tenants.tenant_analysis`); `storm_window_s` and `storm_share` the
    windows retries are counted in and the share of retries that makes one a
    storm (`retries.retry_analysis`). `said`: the gateway's sizing warnings from the
    same stream (`said.sizing_warnings`), repeated in the report.
    """
    by_lane: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        by_lane[lane_of(record)].append(record)
    order = sorted(by_lane, key=lambda lane: (lane == NO_LANE, -len(by_lane[lane]), lane))
    split = has_engine_fields(records)
    slots = backend_slots(records) if split else None
    analysis: dict[str, Any] = {
        "requests": len(records),
        "skipped_lines": skipped,
        "window": _window(records),
        "tail_fraction": tail_fraction,
        "verdict_rule": VERDICT_RULE,
        "engine_split": split,
        "lanes": {lane: _lane(by_lane[lane], tail_fraction, slots, split) for lane in order},
        "tenants": tenant_analysis(records, window_s=fairness_window_s),
        "retries": retry_analysis(records, window_s=storm_window_s, threshold=storm_share),
    }
    if said:  # a log without them keeps its shape
        analysis["gateway_said"] = list(said)
    predictor = predictor_accuracy(records, lanes=order)
    if predictor is not None:  # a log from before the gateway predicted keeps its old shape
        analysis["predictor"] = predictor
    if slots is not None:  # likewise a log from before the engine split
        analysis["backends"] = slots
    resumes = resume_analysis(records)
    if resumes["tagged"]:  # and one from before answers were resumed
        analysis["resumes"] = resumes
    models = model_analysis(records, lambda rows: _lane(rows, tail_fraction, slots, split))
    if models is not None:  # a one-model log keeps its shape
        analysis["models"] = models
    return analysis


def _lane(
    records: Sequence[Record],
    tail_fraction: float,
    slots: dict[str, dict[str, Any]] | None = None,
    split: bool = False,
) -> dict[str, Any]:
    by_outcome: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        by_outcome[outcome_of(record)].append(record)
    total = len(records)
    order = sorted(by_outcome, key=lambda o: (o != "ok", -len(by_outcome[o]), o))
    outcomes = {
        outcome: {
            "count": len(by_outcome[outcome]),
            "percent": _percent(len(by_outcome[outcome]), total),
            "latency": latency(by_outcome[outcome]),
        }
        for outcome in order
    }
    failures = [
        {"reason": outcome, "count": data["count"], "percent": data["percent"]}
        for outcome, data in outcomes.items()
        if outcome != "ok"
    ]
    tail = tail_analysis(records, tail_fraction, slots=slots, split=split)
    tail["decode_stall"] = decode_stall(records)
    return {
        "requests": total,
        "outcomes": outcomes,
        "failures": failures,
        "timing_sources": sources(r for r in records if r.get("backend") is not None)
        if split
        else {},
        "tail": tail,
    }


# ----------------------------------------------------------------------------- predictor


def predictor_accuracy(
    records: Sequence[Record],
    *,
    lanes: Sequence[str] | None = None,
    horizon_s: float = PREDICTOR_HORIZON_S,
) -> dict[str, Any] | None:
    """How well the gateway's wait prediction did, per lane; None when the log has none.

    Two figures, because the prediction is used twice. `median_abs_error_ms`:
    how far the wait predicted at arrival was from the wait measured, over the
    requests that were served. `would_have_made_share`: of the requests refused as
    `wait_too_long`, the share that would have made their deadline after all,
    estimated by the next request of the same lane that was admitted soon after
    (within `horizon_s`). A lane serves its line in arrival order, so the refused
    request, had it joined, would have left the queue when that successor did:
    its wait would have been the successor's exit time less its own arrival (not
    the successor's own wait, which leaves out the gap between the two
    arrivals). `would_have_waited_share_p50`: that wait as a share of the
    deadline, the median over the judged refusals; under sustained overload a
    lane's line settles at its refusal threshold, so this says how near the
    deadline the refused requests really were.
    Refusals with no such successor (or no deadline) are left out of the share.
    """
    if not any(field in record for record in records for field in PREDICTOR_FIELDS):
        return None
    by_lane: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        by_lane[lane_of(record)].append(record)
    order = [lane for lane in (lanes if lanes is not None else sorted(by_lane)) if lane in by_lane]
    return {
        "rule": PREDICTOR_RULE,
        "horizon_s": horizon_s,
        "lanes": {lane: _lane_predictor(by_lane[lane], horizon_s) for lane in order},
    }


def _is_admitted(record: Record) -> bool:
    """Entered the queue and left it dispatched, or timed out in it: its queue_ms is a wait."""
    if number(record, "queue_ms") is None:
        return False
    return record.get("status") == 200 or outcome_of(record) in QUEUE_TIMEOUTS


def _is_wait_refusal(record: Record) -> bool:
    return (
        record.get("error_code") == "wait_too_long"
        or outcome_of(record) == "rejected_wait_too_long"
    )


def _lane_predictor(records: Sequence[Record], horizon_s: float) -> dict[str, Any]:
    errors = [
        abs(predicted - queue)
        for r in records
        if was_served(r)
        and (predicted := number(r, "predicted_wait_ms")) is not None
        and (queue := number(r, "queue_ms")) is not None
    ]
    admitted = sorted(
        (arrival, arrival + queue / 1000.0)
        for r in records
        if _is_admitted(r)
        and (arrival := arrival_s(r)) is not None
        and (queue := number(r, "queue_ms")) is not None
    )
    arrivals = [a for a, _ in admitted]
    refused = [r for r in records if _is_wait_refusal(r)]
    made = 0
    shares: list[float] = []
    for r in refused:
        at, deadline = arrival_s(r), number(r, "deadline_ms")
        if at is None or deadline is None or deadline <= 0:
            continue
        i = bisect.bisect_right(arrivals, at)
        if i == len(admitted) or admitted[i][0] - at > horizon_s:
            continue
        would_have_waited_ms = (admitted[i][1] - at) * 1000.0
        made += would_have_waited_ms < deadline
        shares.append(would_have_waited_ms / deadline)
    judged = len(shares)
    return {
        "admitted_with_prediction": len(errors),
        "median_abs_error_ms": rounded(percentile(errors, 50)),
        "p90_abs_error_ms": rounded(percentile(errors, 90)),
        "refused_wait_too_long": len(refused),
        "refusals_judged": judged,
        "would_have_made": made,
        "would_have_made_share": rounded(made / judged, 4) if judged else None,
        "would_have_waited_share_p50": rounded(percentile(shares, 50), 3),
    }


def latency(records: Sequence[Record]) -> dict[str, dict[str, float | int | None]]:
    """count (requests with a value), mean and P50/P95/P99 of each duration."""
    out: dict[str, dict[str, float | int | None]] = {}
    for metric in METRICS:
        summary = summarize((number(r, metric) for r in records), PERCENTILES)
        out[metric] = {
            key: (int(value) if key == "count" and value is not None else rounded(value))
            for key, value in summary.items()
        }
    return out


def _window(records: Sequence[Record]) -> dict[str, Any] | None:
    starts = [t for t in map(arrival_s, records) if t is not None]
    ends = [t for t in map(end_s, records) if t is not None]
    if not ends:
        return None
    start = min(starts) if starts else min(ends)
    end = max(ends)
    return {"start": iso_utc(start), "end": iso_utc(end), "seconds": rounded(end - start)}


def _percent(part: int, whole: int) -> float:
    return round(100.0 * part / whole, 2) if whole else 0.0


def _rounded(item: dict[str, Any]) -> dict[str, Any]:
    return {k: rounded(v) if isinstance(v, float) else v for k, v in item.items()}
