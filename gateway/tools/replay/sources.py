"""What to replay: arrivals with their sizes, from our own request log or the Azure trace CSV.

Both become the same plain list of `Arrival`s (seconds from the first arrival), so the
runs never know where the traffic came from. Our log also carries what the engines did
(prefill, decode, time per output token), which `calibration` turns into an engine model.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from gateway.tools.loadgen.mix import _read_trace


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    prompt_tokens: int
    max_tokens: int
    #: The lane the source says it took (our log); None: the lanes' rules decide.
    lane: str | None = None
    #: The model it asked for (our log): its pool; None: the default pool.
    model: str | None = None


@dataclass(frozen=True, slots=True)
class Source:
    arrivals: list[Arrival]
    #: Engine figures measured in the source (our log): tpot_ms and prefill ms per token.
    tpot_ms: float | None = None
    prefill_ms_per_token: float | None = None


def load_source(path: str | Path) -> Source:
    """A `.csv` is the Azure trace; anything else is our JSON-lines request log."""
    if str(path).endswith(".csv"):
        return Source(azure_trace(path))
    return request_log(path)


def azure_trace(path: str | Path) -> list[Arrival]:
    rows = _read_trace(path, 0, None)
    if not rows:
        raise ValueError(f"{path}: no rows")
    first = min(stamp for stamp, _, _ in rows)
    arrivals = [
        Arrival((stamp - first).total_seconds(), max(1, ctx), max(1, gen))
        for stamp, ctx, gen in rows
    ]
    return sorted(arrivals, key=lambda a: a.at_s)


def request_log(path: str | Path) -> Source:
    """Our log: a line's `timestamp` is its end, so arrival = timestamp - e2e_ms."""
    starts: list[tuple[float, int, int, str | None, str | None]] = []
    tpots: list[float] = []
    rates: list[float] = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                fields = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}: line {number}: {exc}") from None
            prompt, stamp = fields.get("prompt_tokens"), fields.get("timestamp")
            if not isinstance(prompt, int) or not isinstance(stamp, str):
                continue  # not a request line (an event, a refused malformed body)
            end = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
            at = end - (fields.get("e2e_ms") or 0.0) / 1000.0
            output = fields.get("completion_tokens") or fields.get("max_tokens") or 1
            model = fields.get("model")
            starts.append(
                (
                    at,
                    max(1, prompt),
                    max(1, int(output)),
                    fields.get("lane"),
                    model if isinstance(model, str) else None,
                )
            )
            if isinstance(fields.get("tpot_ms"), int | float):
                tpots.append(float(fields["tpot_ms"]))
            prefill = fields.get("prefill_ms")
            if isinstance(prefill, int | float) and prompt >= 256:
                rates.append(float(prefill) / prompt)
    if not starts:
        raise ValueError(f"{path}: no request lines with prompt_tokens and timestamp")
    first = min(s[0] for s in starts)
    arrivals = sorted(
        (Arrival(at - first, p, m, lane, model) for at, p, m, lane, model in starts),
        key=lambda a: a.at_s,
    )
    return Source(
        arrivals,
        tpot_ms=statistics.median(tpots) if tpots else None,
        prefill_ms_per_token=statistics.median(rates) if rates else None,
    )


def time_slice(arrivals: list[Arrival], start_s: float, duration_s: float | None) -> list[Arrival]:
    """The arrivals in [start, start + duration), re-based to start at 0."""
    end = float("inf") if duration_s is None else start_s + duration_s
    return [replace(a, at_s=a.at_s - start_s) for a in arrivals if start_s <= a.at_s < end]
