"""What the load generator sends and when: traffic classes, schedules, and prompts built to size.

A schedule is decided entirely up front from a seed, so two targets (the gateway
and the backend behind it, say) see the very same arrivals and sizes and their
tables can be compared line by line.

Prompt sizes are what the gateway counts for a one-message chat request (its
tiktoken encoding plus OpenAI's per-message overhead), so a class's bounds line
up with the gateway's lane thresholds exactly. Prompts are English text cut from
a token stream at word boundaries, which keeps the count exact without
re-encoding each prompt; each one opens with its own index, seed and a run tag
the client rewrites per run, so a prefix cache never serves one request from
another's work, nor a second target from the first one's.
"""

from __future__ import annotations

import bisect
import csv
import functools
import math
import random
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import tiktoken

from gateway.admission.tokens import (
    REPLY_PRIMING_TOKENS,
    TOKENS_PER_MESSAGE,
    load_encoding,
)
from gateway.config import default_lanes

ENCODING_NAME = "cl100k_base"
#: Six digits are always two cl100k tokens, so any run tag keeps a prompt's size.
RUN_TAG_PLACEHOLDER = "000000"
OPENING_PREFIX = "Session "
#: Tokens of body text kept beyond the longest prompt, so bodies start at varied offsets.
STREAM_MARGIN_TOKENS = 4096


@dataclass(slots=True)
class TrafficClass:
    """A named slice of traffic; `share` is a relative weight (shares are normalized)."""

    name: str
    share: float
    prompt_tokens: tuple[int, int]
    max_tokens: int

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
        if self.max_tokens < 1:
            raise ValueError(f"class {self.name!r}: max_tokens must be >= 1, got {self.max_tokens}")


DEFAULT_MIX: list[TrafficClass] = [
    TrafficClass("short", 0.8, (40, 60), 64),
    TrafficClass("long", 0.2, (2800, 3200), 512),
]


@dataclass(slots=True)
class PlannedRequest:
    """One request of a schedule; `at_s` is its arrival offset from the start of the run."""

    index: int
    at_s: float
    cls: str
    prompt_tokens: int
    max_tokens: int
    prompt: str


# --------------------------------------------------------------------------- mixes


def parse_class(spec: str) -> TrafficClass:
    """`name:share:min-max:max_tokens` (or `name:share:N:max_tokens`), the `--class` flag."""
    parts = spec.split(":")
    if len(parts) != 4:
        raise ValueError(f"--class {spec!r}: expected name:share:min-max:max_tokens")
    name, share, size, max_tokens = parts
    try:
        low, _, high = size.partition("-")
        bounds = (int(low), int(high or low))
        return TrafficClass(name, float(share), bounds, int(max_tokens))
    except ValueError as exc:
        raise ValueError(f"--class {spec!r}: {exc}") from None


def load_mix(path: str | Path) -> list[TrafficClass]:
    """Read `[[class]]` tables (name, share, prompt_tokens = [min, max] or N, max_tokens)."""
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
    if isinstance(size, int) and not isinstance(size, bool):
        bounds = (size, size)
    elif isinstance(size, list) and len(size) == 2 and all(type(v) is int for v in size):
        bounds = (size[0], size[1])
    else:
        raise ValueError(f"{where}: prompt_tokens must be an integer or [min, max]")
    name, share, max_tokens = entry.get("name"), entry.get("share"), entry.get("max_tokens")
    if not isinstance(name, str):
        raise ValueError(f"{where}: name must be a string")
    if not isinstance(share, int | float) or isinstance(share, bool):
        raise ValueError(f"{where}: share must be a number")
    if type(max_tokens) is not int:
        raise ValueError(f"{where}: max_tokens must be an integer")
    try:
        return TrafficClass(name, float(share), bounds, max_tokens)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _validate_mix(mix: Sequence[TrafficClass]) -> None:
    if not mix:
        raise ValueError("the traffic mix is empty")


# --------------------------------------------------------------------------- prompts

# Plain sentences (no digits, apostrophes or newlines) so every word boundary is a clean
# tokenizer boundary; the mix of topics reads like real chat and document traffic.
_SENTENCES = (
    "The quarterly report shows that revenue grew faster than expected in the northern region.",
    "Please summarize the main arguments of the article and list any claims that need a source.",
    "Our team moved the build pipeline to a new cluster and the average job now finishes sooner.",
    "When the river floods in early spring, farmers move their animals to the higher pastures.",
    "Write a short poem about a lighthouse keeper who waits for a ship that never arrives.",
    "The customer says the package arrived damaged and asks whether a replacement can be sent.",
    "In the old town, narrow streets wind between stone houses with red roofs and small gardens.",
    "Explain how a hash table handles collisions, and compare open addressing with chaining.",
    "The committee will meet again next week to review the budget and approve the final plan.",
    "She opened the window, listened to the rain, and decided to finish the letter tomorrow.",
    "A good onboarding guide explains where the code lives, how to run it, and who to ask.",
    "Translate the following paragraph into plain language that a new student can follow.",
    "The museum keeps a collection of maps drawn by sailors who crossed the ocean long ago.",
    "Engineers measured the latency of every request and found that the slowest ones waited.",
    "Most of the forest burned during the dry summer, but young trees are growing back fast.",
    "List the steps needed to migrate the database without losing any customer records.",
    "The recipe calls for flour, butter, sugar, and a pinch of salt, mixed slowly by hand.",
    "During the interview, the candidate described a project that failed and what it taught.",
    "The city plans to add more bicycle lanes and to plant trees along the main avenues.",
    "Describe the differences between weather and climate for a curious child at school.",
    "After the update, several users reported that the application closed without warning.",
    "The orchestra rehearsed the second movement until the strings and the horns agreed.",
    "Check whether the contract allows either party to end the agreement with short notice.",
    "Scientists collected samples of ice to learn how the air changed over many centuries.",
    "The hotel offers a quiet room with a view of the harbor and breakfast on the terrace.",
    "Give three reasons why a small business might choose to rent software instead of buying.",
    "He fixed the bicycle chain, cleaned his hands, and rode along the coast until sunset.",
    "The support ticket describes an error that appears only when the disk is almost full.",
    "Compare the two proposals and recommend the one that is cheaper to maintain over time.",
    "Children in the village walk to school together and cross the bridge near the mill.",
    "The library extended its opening hours so that students can study late before exams.",
    "Outline a training plan for a beginner who wants to run a long race next autumn.",
)


@dataclass(slots=True)
class _TokenStream:
    """Body text as tokens, with the positions where a prompt may start or end."""

    encoding: tiktoken.Encoding
    tokens: list[int]
    #: Indices of tokens that begin a word (" " + letter): cutting there keeps counts exact.
    starts: list[int]
    is_start: list[bool]


@functools.cache
def _encoding() -> tiktoken.Encoding:
    return load_encoding(ENCODING_NAME)


@functools.cache
def _sentence_tokens() -> tuple[list[int], ...]:
    encode = _encoding().encode_ordinary
    return tuple(encode(" " + sentence) for sentence in _SENTENCES)


@functools.cache
def _word_start_ids() -> frozenset[int]:
    encoding = _encoding()
    ids = {t for sentence in _sentence_tokens() for t in sentence}
    return frozenset(
        t
        for t in ids
        if (raw := encoding.decode_single_token_bytes(t))[:1] == b" " and raw[1:2].isalpha()
    )


_streams: dict[int, _TokenStream] = {}


def _token_stream(min_tokens: int) -> _TokenStream:
    """A stream of at least `min_tokens` tokens, built once and grown when a run needs more."""
    for size, stream in _streams.items():
        if size >= min_tokens:
            return stream
    rng = random.Random(20231116)  # fixed: the body text is the same for every seed
    sentences = _sentence_tokens()
    tokens: list[int] = []
    order = list(range(len(sentences)))
    while len(tokens) < min_tokens:
        rng.shuffle(order)
        for i in order:
            tokens.extend(sentences[i])
    word_starts = _word_start_ids()
    is_start = [t in word_starts for t in tokens]
    stream = _TokenStream(_encoding(), tokens, [i for i, s in enumerate(is_start) if s], is_start)
    _streams.clear()
    _streams[len(tokens)] = stream
    return stream


@functools.cache
def chat_overhead_tokens() -> int:
    """Tokens the gateway adds to a one-message user chat on top of its text."""
    return REPLY_PRIMING_TOKENS + TOKENS_PER_MESSAGE + len(_encoding().encode_ordinary("user"))


def opening(index: int, seed: int) -> str:
    """The unique first sentence of a prompt; the run tag placeholder is rewritten per run."""
    return f"{OPENING_PREFIX}{RUN_TAG_PLACEHOLDER} note {index} of set {seed}."


def with_run_tag(prompt: str, tag: str) -> str:
    """The prompt with its run tag replaced (six digits, so the token count is unchanged)."""
    if len(tag) != len(RUN_TAG_PLACEHOLDER) or not tag.isdigit():
        raise ValueError(f"run tag must be {len(RUN_TAG_PLACEHOLDER)} digits, got {tag!r}")
    head = OPENING_PREFIX + RUN_TAG_PLACEHOLDER
    if not prompt.startswith(head):
        return prompt
    return OPENING_PREFIX + tag + prompt[len(head) :]


class PromptBuilder:
    """Builds prompts of an exact chat token count; one per schedule, cheap per prompt."""

    def __init__(self, max_prompt_tokens: int, seed: int) -> None:
        self._stream = _token_stream(max_prompt_tokens + STREAM_MARGIN_TOKENS)
        self._rng = random.Random(f"loadgen-prompts-{seed}")
        self._seed = seed
        self._overhead = chat_overhead_tokens()

    def build(self, index: int, prompt_tokens: int) -> tuple[str, int]:
        """The prompt and its real size (larger than asked only below the opening's size)."""
        head = opening(index, self._seed)
        stream = self._stream
        fixed = self._overhead + len(stream.encoding.encode_ordinary(head))
        body = max(0, prompt_tokens - fixed)
        if body == 0:
            return head, fixed
        start = self._body_start(body)
        return head + stream.encoding.decode(stream.tokens[start : start + body]), fixed + body

    def _body_start(self, length: int) -> int:
        """A word start `s` such that `s + length` is a word start too (exact cut)."""
        stream = self._stream
        last = len(stream.tokens) - length - 1
        candidates = bisect.bisect_right(stream.starts, last)
        first = self._rng.randrange(candidates)
        for k in range(first, first + candidates):
            start = stream.starts[k % candidates]
            if stream.is_start[start + length]:
                return start
        raise RuntimeError(f"no exact cut of {length} tokens in the prompt text")


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
        drawn.append((cls, rng.randint(*cls.prompt_tokens)))
    builder = PromptBuilder(max((size for _, size in drawn), default=1), seed)
    plan = []
    for index, (at_s, (cls, size)) in enumerate(zip(arrivals, drawn, strict=True)):
        prompt, real = builder.build(index, size)
        plan.append(PlannedRequest(index, at_s, cls.name, real, cls.max_tokens, prompt))
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
