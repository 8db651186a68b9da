"""Hand-made request lines whose answer is obvious, and a way to run the `analyze` CLI."""

from __future__ import annotations

import argparse
import itertools
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from gateway.observability.logs import render_request_line
from gateway.observability.record import RequestRecord
from gateway.outcomes import Outcome
from gateway.tools import analyze as analyzer

END = "2026-01-01T00:00:10.000000Z"  # 1767225610.0 as epoch seconds
END_S = 1767225610.0
_IDS = itertools.count(1)


def rec(
    lane: str | None = "interactive",
    outcome: str = "ok",
    queue: float | None = 1.0,
    backend: float | None = 10.0,
    *,
    stream: bool = True,
    e2e: float | None = None,
    end: str = END,
    **fields: Any,
) -> dict[str, Any]:
    """A request line as the gateway writes it; ttft = queue + backend + 0.5 ms of admission."""
    ttft = None if backend is None or not stream else (queue or 0.0) + backend + 0.5
    if e2e is None:
        e2e = (ttft or (queue or 0.0) + (backend or 0.0)) + 100.0
    line = {
        "request_id": f"req-{next(_IDS)}",
        "route": "/v1/chat/completions",
        "model": "m",
        "stream": stream,
        "lane": lane,
        "backend": None if backend is None else "b0",
        "status": 200 if outcome == "ok" else 429,
        "outcome": outcome,
        "error_code": None,
        "prompt_tokens": 10,
        "max_tokens_requested": 20,
        "max_tokens": 20,
        "completion_tokens": 20 if outcome == "ok" else None,
        "queue_ms": queue,
        "backend_ttft_ms": backend if stream else None,
        "ttft_ms": ttft,
        "tpot_ms": 5.0 if stream and outcome == "ok" else None,
        "e2e_ms": e2e,
        "event": "request",
        "level": "info",
        "timestamp": end,
    }
    line.update(fields)
    return line


def lane_with_slow_tail(lane: str, queue: float, backend: float, fast: int = 99) -> list[dict]:
    """`fast` quick requests and one slow one split queue/backend as given."""
    return [rec(lane, queue=1.0, backend=10.0) for _ in range(fast)] + [
        rec(lane, queue=queue, backend=backend, request_id=f"{lane}-slowest")
    ]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    analyzer.add_arguments(parser)
    code = analyzer.main(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write_log(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("banner\n" + "".join(json.dumps(r) + "\n" for r in records))
    return path


# ----------------------------------------------------------------------------- tenants

#: The epoch second that tenant logs count their times from (`at=0.0`).
ORIGIN_S = END_S - 1000.0


def _stamp(at: float) -> str:
    moment = datetime.fromtimestamp(ORIGIN_S + at, UTC)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def tenant_line(
    tenant: str | None,
    weight: float | None,
    *,
    arrive: float,
    dispatch: float | None,
    end: float,
    cost: float | None = None,
    lane: str = "interactive",
    prompt: int = 100,
    completion: int | None = 20,
    cached: int | None = None,
    ttft_after_dispatch: float = 0.05,
    refusal: str | None = None,
) -> dict[str, Any]:
    """A request line as the gateway writes it (RequestRecord + render_request_line).

    Times are seconds after ORIGIN_S. `dispatch=None` with a `refusal` code: refused
    at the door (never queued); otherwise it queued from `arrive` to `dispatch`.
    """
    record = RequestRecord(
        request_id=f"req-{next(_IDS)}",
        route="/v1/chat/completions",
        arrival=arrive,
        model="m",
        tenant=tenant,
        tenant_weight=weight,
        cost_tokens=cost,
        stream=True,
        lane=lane,
        prompt_tokens=prompt,
        max_tokens_requested=64,
        max_tokens=64,
        end=end,
    )
    if refusal is None:
        assert dispatch is not None
        record.enqueued, record.dispatched = arrive, dispatch
        record.first_token = dispatch + ttft_after_dispatch
        record.backend, record.status, record.outcome = "b0", 200, Outcome.OK
        record.completion_tokens, record.cached_tokens = completion, cached
    else:
        record.status, record.error_code = 429, refusal
        record.outcome = Outcome(f"rejected_{refusal}")
        if dispatch is not None:  # displaced from a full queue: it did wait
            record.enqueued = arrive
    line = json.loads(render_request_line(record))
    line["timestamp"] = _stamp(end)
    return line


def backlogged_pair(
    first: tuple[str, float, list[float], float],
    second: tuple[str, float, list[float], float],
    *,
    arrive: float = 0.0,
    service_s: float = 0.3,
) -> list[dict[str, Any]]:
    """Two tenants whose requests all arrive at `arrive` and leave at the given times.

    Each tenant is (name, weight, dispatch times, cost of each request); every
    request is then in the backend for `service_s`. Until its last dispatch a
    tenant is backlogged the whole time.
    """
    lines = []
    for name, weight, dispatches, cost in (first, second):
        for at in dispatches:
            lines.append(
                tenant_line(name, weight, arrive=arrive, dispatch=at, end=at + service_s, cost=cost)
            )
    return sorted(lines, key=lambda line: line["timestamp"])


def fair_log() -> list[dict[str, Any]]:
    """a (weight 2) gets 200-token requests, b (weight 1) 100-token ones, one each a second.

    Both queue everything at t=0. In [0, 10): a is dispatched at 0.5 … 9.5 (10 × 200 / 2 =
    1000 weighted), b at 0.25 … 9.25 (10 × 100 / 1 = 1000): served 2:1 in tokens, 1:1 by
    weight. One more each after the window (a at 10.5, b at 10.2) keeps both backlogged
    through it.
    """
    a = [0.5 + i for i in range(10)] + [10.5]
    b = [0.25 + i for i in range(10)] + [10.2]
    return backlogged_pair(("a", 2.0, a, 200.0), ("b", 1.0, b, 100.0))


def unfair_log() -> list[dict[str, Any]]:
    """a (weight 2) gets a 300-token request every second, b (weight 1) a 100-token one every 2 s.

    In [0, 10): a 10 × 300 / 2 = 1500, b 5 × 100 = 500, so J = 2000² / (2 · (1500² + 500²))
    = 0.8.
    """
    a = [0.5 + i for i in range(11)]
    b = [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
    return backlogged_pair(("a", 2.0, a, 300.0), ("b", 1.0, b, 100.0))


# ----------------------------------------------------------------------------- engine split


def engine_run(
    arrivals: list[float],
    *,
    gateway_slots: int,
    engine_slots: int,
    prefill_s: float,
    decode_s: float,
    backend: str = "b0",
    lane: str = "interactive",
    stream: bool = True,
    source: str | None = "engine",
) -> list[dict[str, Any]]:
    """The log of a gateway with `gateway_slots` in front of an engine that batches `engine_slots`.

    Both serve first come first served; each request then prefills for `prefill_s`
    and decodes for `decode_s`. What the gateway sends beyond what the engine
    batches waits in the engine's queue: `engine_queue_ms`. Times are seconds after
    ORIGIN_S; admission takes 0.5 ms, as in `rec`.
    """
    admission = 0.0005
    gateway_free = [0.0] * gateway_slots  # when each gateway slot is next free
    engine_free = [0.0] * engine_slots
    lines = []
    for arrive in sorted(arrivals):
        enqueued = arrive + admission
        slot = min(range(gateway_slots), key=gateway_free.__getitem__)
        dispatch = max(enqueued, gateway_free[slot])
        seat = min(range(engine_slots), key=engine_free.__getitem__)
        start = max(dispatch, engine_free[seat])
        first_token = start + prefill_s
        end = first_token + decode_s
        gateway_free[slot] = engine_free[seat] = end
        line = rec(
            lane,
            queue=round((dispatch - enqueued) * 1000, 3),
            backend=round((first_token - dispatch) * 1000, 3),
            stream=stream,
            e2e=round((end - arrive) * 1000, 3),
            end=_stamp(end),
        )
        line.update(
            backend=backend,
            engine_queue_ms=round((start - dispatch) * 1000, 3),
            prefill_ms=round(prefill_s * 1000, 3),
            decode_ms=round(decode_s * 1000, 3),
            timing_source=source,
        )
        if not stream:  # the first token is not seen, only the end
            line.update(ttft_ms=None, backend_ttft_ms=None, tpot_ms=None)
        lines.append(line)
    return lines


def bursts(count: int, size: int, *, every_s: float, spacing_s: float) -> list[float]:
    """`count` bursts of `size` arrivals `spacing_s` apart, a burst every `every_s` seconds."""
    return [b * every_s + i * spacing_s for b in range(count) for i in range(size)]


# ----------------------------------------------------------------------------- retries


def retry_line(
    client: str,
    at: float,
    *,
    took_s: float = 0.05,
    refused: str | None = None,
    retry_after: float | None = None,
    queue: float | None = 1.0,
    earlier: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A request of `client` arriving at `at` (s after ORIGIN_S), ending `took_s` later.

    `earlier`: the line it retries; the retry fields are then filled as the
    gateway writes them (its id, the gap from its end, what it got).
    """
    line = rec(
        "interactive" if refused != "prompt_too_long" else None,
        outcome="ok" if refused is None else f"rejected_{refused}",
        queue=queue if refused is None else None,
        backend=10.0 if refused is None else None,
        e2e=took_s * 1000.0,
        end=_stamp(at + took_s),
        client=client,
        tenant=client,
        error_code=refused,
        retry_after_s=retry_after,
        retry_of=None,
        retry_gap_ms=None,
        retried_outcome=None,
    )
    if earlier is not None:
        earlier_end = END_S - 1000.0 + _seconds_after_origin(earlier["timestamp"])
        line.update(
            retry_of=earlier["request_id"],
            retry_gap_ms=round((ORIGIN_S + at - earlier_end) * 1000.0, 3),
            retried_outcome=earlier["error_code"] or earlier["outcome"],
        )
    return line


def _seconds_after_origin(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp() - ORIGIN_S


def storm_log() -> list[dict[str, Any]]:
    """A minute of traffic with a retry storm in [20, 30) s.

    - "calm" sends one request a second for 60 s, each served after 1 ms queued.
    - "polite" is refused at 5 s (wait_too_long, Retry-After 2 s) and retries 2.5 s
      later, served: one retry, told and honoured.
    - "rush" sends ten requests, at 20 … 29 s; each is refused (Retry-After 2 s) and
      retried 100 ms after each refusal, three times: the first two retries are
      refused again, the third is served after 400 ms in the queue. 30 retries, all
      faster than told, ten of them a third retry (over the seed's two).
    Window [20, 30): 10 calm + 40 rush = 50 requests, 30 retries (60%): a storm.
    Window [0, 10): 12 requests, 1 retry (8%): not one.
    Queue: 60 + 1 + 10 × 400 = 4061 ms, 4001 of it retries'; refusals: 31, 20 retries.
    """
    lines = [retry_line("calm", float(t)) for t in range(60)]
    first = retry_line("polite", 5.0, took_s=0.001, refused="wait_too_long", retry_after=2.0)
    lines += [first, retry_line("polite", 5.001 + 2.5, earlier=first)]
    for i in range(10):
        at = 20.0 + i
        line = retry_line("rush", at, took_s=0.001, refused="wait_too_long", retry_after=2.0)
        lines.append(line)
        for attempt in range(3):
            at += 0.001 + 0.1
            last = attempt == 2
            line = retry_line(
                "rush",
                at,
                took_s=0.45 if last else 0.001,
                refused=None if last else "wait_too_long",
                retry_after=None if last else 2.0,
                queue=400.0,
                earlier=line,
            )
            lines.append(line)
    return sorted(lines, key=lambda line: line["timestamp"])


# ----------------------------------------------------------------------------- prefill interference


def prefill_interference_log() -> list[dict[str, Any]]:
    """A chunked-prefill engine that is never full (at most 9 in flight): every 2 s a
    3000-token prompt of the batch lane prefills for 0.6 s, and the interactive prompts
    sent meanwhile wait out its chunks in the engine's queue (`engine_queue_ms`).

    The interactive lane's tail is engine-queue time, but not for a place in the batch:
    fewer slots would cut the engine's throughput and not that wait (#51). `at` is a
    request's arrival in seconds after ORIGIN_S.
    """

    def line(
        lane: str, at: float, tokens: int, waited_s: float, prefill_s: float
    ) -> dict[str, Any]:
        decode_s = 5.4 if lane == "batch" else 0.38
        backend = (waited_s + prefill_s) * 1000.0
        e2e = 0.9 + backend + decode_s * 1000.0  # 0.4 ms queued, 0.5 ms admission
        out = rec(lane, queue=0.4, backend=backend, e2e=e2e, end=_stamp(at + e2e / 1000.0))
        out.update(
            prompt_tokens=tokens,
            engine_queue_ms=round(waited_s * 1000.0, 3),
            prefill_ms=prefill_s * 1000.0,
            decode_ms=decode_s * 1000.0,
            tpot_ms=12.0,
            timing_source="engine",
        )
        return out

    lines = []
    for second in range(0, 40, 2):
        lines.append(line("batch", second, 3000, 0.0, 0.6))
        for k in range(1, 5):  # sent 0.1-0.4 s into the long prefill: seated when it ends
            lines.append(line("interactive", second + 0.1 * k, 50, 0.5 - 0.1 * (k - 1), 0.02))
        for k in range(6):  # sent after it: seated at once
            lines.append(line("interactive", second + 0.8 + 0.15 * k, 50, 0.0, 0.02))
    return lines
