"""The analyzer's slot advice held to the engine matrix: given where following it makes
the short requests' P99 better, and nowhere else.

A request log of the gateway replayed in virtual time (its lines stamped with the
virtual clock) is read by the analyzer as a real run's. An engine that reports its
router's limit (128) while it batches 32 by count (TGI's whole-prompt engine with a
batch size it does not report, so the gateway cannot gate on its KV tokens): the
advice is 32, and the same schedule replayed with `max_concurrency = 32` has a lower
short P99. An engine whose slots are already its batch
(vLLM-style chunked prefill, 16), whose short requests wait behind long prompts' chunks,
gets no advice (fewer slots there would cut its throughput and not that wait).
"""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Any

import msgspec
import pytest

from gateway.config import Settings
from gateway.tools.analyze.engine import backend_slots
from gateway.tools.matrix.cells import (
    CAPACITY_REQUESTS,
    CAPACITY_SEED,
    Cell,
    gateway_settings,
    short_class,
)
from gateway.tools.matrix.engines import BY_NAME, EngineProfile
from gateway.tools.matrix.physics import capacity_rps
from gateway.tools.matrix.traffic import Scale, arrivals, sizes
from gateway.tools.replay.answers import ModelledEngine
from gateway.tools.replay.runs import classify, run_gateway
from gateway.tools.stats import percentile

REQUESTS = 600


#: The engine of `tgi-a10g` batching 32 by count, its KV tokens never the bound.
HIDDEN_BATCH = dataclasses.replace(
    BY_NAME["tgi-a10g"],
    name="hidden-batch",
    engine=ModelledEngine(
        dataclasses.replace(BY_NAME["tgi-a10g"].config, max_batch=32, max_batch_tokens=0),
        kind="tgi",
    ),
)


def replayed(
    cell: Cell, settings: Settings, seed: int = 1, profile: EngineProfile | None = None
) -> list[dict[str, Any]]:
    """The gateway's request lines for one seeded schedule of `cell` (on `profile`'s
    engine instead of the cell's when given), in virtual time."""
    profile = profile or cell.profile
    scale = Scale(profile.prompt_scale, profile.output_scale)
    capacity = capacity_rps(
        [profile.engine], sizes(cell.mix, CAPACITY_REQUESTS, CAPACITY_SEED, scale)
    )
    schedule = arrivals(cell.mix, cell.load * capacity, REQUESTS, seed, scale)
    log = io.StringIO()
    classes = [classify(arrival, settings) for arrival in schedule]
    run_gateway(schedule, classes, settings, [profile.engine], log)
    lines = [json.loads(line) for line in log.getvalue().splitlines()]
    return [line for line in lines if line.get("event") == "request"]


def short_p99_s(lines: list[dict[str, Any]], settings: Settings) -> float:
    short = short_class(settings)
    ttfts = [line["ttft_ms"] / 1000 for line in lines if line["lane"] == short and line["ttft_ms"]]
    p99 = percentile(ttfts, 99)
    assert p99 is not None
    return p99


def with_slots(settings: Settings, slots: int) -> Settings:
    backends = [msgspec.structs.replace(b, max_concurrency=slots) for b in settings.backends]
    return msgspec.structs.replace(settings, backends=backends)


def test_the_advice_for_a_hidden_batch_is_that_batch_and_following_it_helps() -> None:
    cell = Cell("tgi-a10g", "chat", 0.8)
    settings = gateway_settings(HIDDEN_BATCH)
    # The seed whose burst found the engine full before the gateway had learned its batch.
    lines = replayed(cell, settings, seed=3, profile=HIDDEN_BATCH)
    advice = backend_slots(lines)["matrix-0"]
    assert advice["advised_max_concurrency"] == HIDDEN_BATCH.slots == 32, advice
    advised = with_slots(settings, advice["advised_max_concurrency"])
    followed = replayed(cell, advised, seed=3, profile=HIDDEN_BATCH)
    before, after = short_p99_s(lines, settings), short_p99_s(followed, settings)
    assert after < 0.8 * before, (before, after)


@pytest.mark.parametrize(
    "cell",
    [
        Cell("vllm-chunked", "chat", 0.8),
        # Waits behind prefill chunks at a sparse count (28 of 64 in flight), none at 29.
        Cell("vllm-h100", "prefill-heavy", 0.8),
        Cell("sglang-a100", "prefill-heavy", 1.2),
    ],
    ids=str,
)
def test_no_advice_where_the_slots_are_already_the_batch(cell: Cell) -> None:
    advice = backend_slots(replayed(cell, gateway_settings(cell.profile)))["matrix-0"]
    assert advice["advised_max_concurrency"] is None, advice
    assert advice["behind_prefill"] > 0  # its waits are behind long prompts' chunks
