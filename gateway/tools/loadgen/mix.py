"""What the load generator sends and when: traffic classes and seeded schedules.

A schedule is decided entirely up front from a seed, so two targets (the gateway
and the backend behind it, say) see the very same arrivals and sizes and their
tables can be compared line by line. Prompt sizes are what the gateway counts
(see `prompts`), so a class's bounds line up with its lane thresholds.
"""

from __future__ import annotations

import csv
import math
import random
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeGuard

from gateway.config import default_lanes
from gateway.tools.loadgen.prompts import PromptBuilder


@dataclass(slots=True)
class TrafficClass:
    """A named slice of traffic; `share` is a relative weight (shares are normalized).

    `max_tokens` is one value or an inclusive `(min, max)` range drawn per
    request, because real outputs vary: code completion asks for 8 to 60 tokens,
    not always 60, and a fixed value would make every decode the same length.
    """

    name: str
    share: float
    prompt_tokens: tuple[int, int]
    max_tokens: int | tuple[int, int]

    @property
    def max_tokens_bounds(self) -> tuple[int, int]:
        """`max_tokens` as an inclusive `(min, max)` range (a fixed value is min == max)."""
        if isinstance(self.max_tokens, int):
            return (self.max_tokens, self.max_tokens)
        return self.max_tokens

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a traffic class needs a name")
        if not (self.share > 0 and math.isfinite(self.share)):
            raise ValueError(f"class {self.name!r}: share must be > 0, got {self.share}")
        low, high = self.prompt_tokens
        if not 1 <= low <= high:
            raise ValueError(
                f"class {self.name!r}: prompt_tokens must be 1 <= min <= max, got {low}-{high}"
            )
        out_low, out_high = self.max_tokens_bounds
        if not 1 <= out_low <= out_high:
            raise ValueError(
                f"class {self.name!r}: max_tokens must be >= 1 (a range min <= max), "
                f"got {self.max_tokens}"
            )


DEFAULT_MIX: list[TrafficClass] = [
    TrafficClass("short", 0.8, (40, 60), 64),
    TrafficClass("long", 0.2, (2800, 3200), 512),
]

#: Code-completion-like traffic: long prompts (the file around the cursor), short outputs,
#: so the backend's time goes to prefill, not decode. A production trace of it has a
#: median prompt of ~1500 tokens, a median output of ~13 and 60% of prompts over 1024;
#: these uniform ranges are a little heavier (median prompt ~2300, output ~29, 75% over
#: 1024), which makes the prefill effect larger, not different. The long class starts
#: above the first default lane's 1024-token limit so that a class is a lane, as in the
#: default mix.
PREFILL_HEAVY_MIX: list[TrafficClass] = [
    TrafficClass("short", 0.25, (50, 400), (8, 32)),
    TrafficClass("long", 0.75, (1025, 5000), (8, 60)),
]

#: The mixes `--mix NAME` accepts wherever it also accepts a TOML file.
NAMED_MIXES: dict[str, list[TrafficClass]] = {
    "default": DEFAULT_MIX,
    "prefill-heavy": PREFILL_HEAVY_MIX,
}


@dataclass(slots=True)
class PlannedRequest:
    """One request of a schedule; `at_s` is its arrival offset from the start of the run."""

    index: int
    at_s: float
    cls: str
    prompt_tokens: int
    max_tokens: int
    prompt: str
    #: A multi-turn conversation's id (its session) and 1-based turn; None for one request
    #: of its own. A turn's messages are built as it runs (see `conversations`).
    conversation: str | None = None
    turn: int | None = None


# --------------------------------------------------------------------------- mixes


def parse_class(spec: str) -> TrafficClass:
    """`name:share:min-max:max_tokens` (N for a fixed size, min-max for a range), `--class`."""
    parts = spec.split(":")
    if len(parts) != 4:
        raise ValueError(f"--class {spec!r}: expected name:share:min-max:max_tokens")
    name, share, size, max_tokens = parts
    try:
        low, _, high = size.partition("-")
        bounds = (int(low), int(high or low))
        out_low, dash, out_high = max_tokens.partition("-")
        output: int | tuple[int, int] = (int(out_low), int(out_high)) if dash else int(out_low)
        return TrafficClass(name, float(share), bounds, output)
    except ValueError as exc:
        raise ValueError(f"--class {spec!r}: {exc}") from None


def resolve_mix(spec: str | Path) -> list[TrafficClass]:
    """The classes of `--mix`: a named mix (`default`, `prefill-heavy`) or a TOML file.

    A name wins over a file of the same name in the working directory; write
    `./default` to mean the file.
    """
    named = NAMED_MIXES.get(str(spec))
    if named is not None:
        return list(named)
    path = Path(spec)
    if not path.is_file():
        names = ", ".join(NAMED_MIXES)
        raise ValueError(f"--mix {spec}: neither a mix file nor a named mix ({names})")
    return load_mix(path)


def load_mix(path: str | Path) -> list[TrafficClass]:
    """Read `[[class]]` tables (name, share; prompt_tokens and max_tokens = N or [min, max])."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    entries = data.get("class")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected one or more [[class]] tables")
    mix = [_class_from_toml(entry, f"{path}: class[{i}]") for i, entry in enumerate(entries)]
    names = [c.name for c in mix]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: class names must be unique, got {names}")
    return mix


def _class_from_toml(entry: Any, where: str) -> TrafficClass:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: must be a table")
    unknown = set(entry) - {"name", "share", "prompt_tokens", "max_tokens"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    size = entry.get("prompt_tokens")
    if type(size) is int:
        bounds = (size, size)
    elif _is_range(size):
        bounds = (size[0], size[1])
    else:
        raise ValueError(f"{where}: prompt_tokens must be an integer or [min, max]")
    name, share, max_tokens = entry.get("name"), entry.get("share"), entry.get("max_tokens")
    if not isinstance(name, str):
        raise ValueError(f"{where}: name must be a string")
    if not isinstance(share, int | float) or isinstance(share, bool):
        raise ValueError(f"{where}: share must be a number")
    output: int | tuple[int, int]
    if type(max_tokens) is int:
        output = max_tokens
    elif _is_range(max_tokens):
        output = (max_tokens[0], max_tokens[1])
    else:
        raise ValueError(f"{where}: max_tokens must be an integer or [min, max]")
    try:
        return TrafficClass(name, float(share), bounds, output)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _is_range(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)


def _validate_mix(mix: Sequence[TrafficClass]) -> None:
    if not mix:
        raise ValueError("the traffic mix is empty")


# --------------------------------------------------------------------------- schedules


def _pick(rng: random.Random, mix: Sequence[TrafficClass], weights: list[float]) -> TrafficClass:
    return rng.choices(mix, cum_weights=weights)[0]


def _cumulative(mix: Sequence[TrafficClass]) -> list[float]:
    total, out = 0.0, []
    for cls in mix:
        total += cls.share
        out.append(total)
    return out


def _plan_from_mix(
    mix: Sequence[TrafficClass], arrivals: Sequence[float], seed: int
) -> list[PlannedRequest]:
    _validate_mix(mix)
    rng = random.Random(f"loadgen-mix-{seed}")
    weights = _cumulative(mix)
    drawn = []
    for _ in arrivals:
        cls = _pick(rng, mix, weights)
        size = rng.randint(*cls.prompt_tokens)
        low, high = cls.max_tokens_bounds
        # Only a range draws: fixed-output mixes keep the schedules they always had.
        drawn.append((cls, size, rng.randint(low, high) if low < high else low))
    builder = PromptBuilder(max((size for _, size, _ in drawn), default=1), seed)
    plan = []
    for index, (at_s, (cls, size, output)) in enumerate(zip(arrivals, drawn, strict=True)):
        prompt, real = builder.build(index, size)
        plan.append(PlannedRequest(index, at_s, cls.name, real, output, prompt))
    return plan


def poisson_schedule(
    mix: Sequence[TrafficClass], rate: float, duration_s: float, seed: int
) -> list[PlannedRequest]:
    """Open-loop arrivals: exponential gaps of mean 1/rate until `duration_s`."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be > 0, got {rate}")
    if not duration_s > 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    rng = random.Random(f"loadgen-arrivals-{seed}")
    arrivals: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        arrivals.append(t)
        t += rng.expovariate(rate)
    return _plan_from_mix(mix, arrivals, seed)


def closed_schedule(mix: Sequence[TrafficClass], requests: int, seed: int) -> list[PlannedRequest]:
    """`requests` requests with no arrival times: workers send the next as soon as they can."""
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    return _plan_from_mix(mix, [0.0] * requests, seed)


def trace_class(prompt_tokens: int, max_tokens: int) -> str:
    """`short` when the gateway's first default lane admits the request, else `long`."""
    first = default_lanes()[0]
    if first.max_prompt_tokens is not None and prompt_tokens > first.max_prompt_tokens:
        return "long"
    if first.max_output_tokens is not None and max_tokens > first.max_output_tokens:
        return "long"
    return "short"


def trace_schedule(
    path: str | Path,
    *,
    speedup: float,
    prompt_scale: float,
    output_scale: float,
    start: int = 0,
    limit: int | None = None,
    seed: int = 0,
) -> list[PlannedRequest]:
    """Replay a `TIMESTAMP,ContextTokens,GeneratedTokens` CSV (the Azure LLM inference trace)."""
    for name, value in (
        ("speedup", speedup),
        ("prompt_scale", prompt_scale),
        ("output_scale", output_scale),
    ):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be > 0, got {value}")
    if start < 0 or (limit is not None and limit < 1):
        raise ValueError("trace start must be >= 0 and limit >= 1")
    rows = _read_trace(path, start, limit)
    if not rows:
        raise ValueError(f"{path}: no rows in the requested window (start {start})")
    first = min(stamp for stamp, _, _ in rows)
    sizes = [
        (max(1, round(ctx * prompt_scale)), max(1, round(gen * output_scale)))
        for _, ctx, gen in rows
    ]
    builder = PromptBuilder(max(p for p, _ in sizes), seed)
    plan = []
    for index, ((stamp, _, _), (prompt_tokens, max_tokens)) in enumerate(
        zip(rows, sizes, strict=True)
    ):
        prompt, real = builder.build(index, prompt_tokens)
        at_s = max(0.0, (stamp - first).total_seconds() / speedup)
        plan.append(
            PlannedRequest(index, at_s, trace_class(real, max_tokens), real, max_tokens, prompt)
        )
    plan.sort(key=lambda p: p.at_s)
    return plan


def _read_trace(path: str | Path, start: int, limit: int | None) -> list[tuple[datetime, int, int]]:
    rows: list[tuple[datetime, int, int]] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing columns {sorted(missing)}")
        for number, row in enumerate(reader):
            if number < start:
                continue
            if limit is not None and len(rows) >= limit:
                break
            try:
                stamp = datetime.fromisoformat(row["TIMESTAMP"].strip())
                rows.append((stamp, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}: line {number + 2}: {exc}") from None
    return rows
