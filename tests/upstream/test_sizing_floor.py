"""The engine floor behind a lane's fitted deadline, on one slot and on several.

On a backend of one slot no slot can be kept for short requests: one that arrives just
after a long request took the slot waits for that request's whole answer. A deadline
fitted to the prefill alone refused a third of the short requests on a one-slot
llama.cpp server in the engine matrix, requests the engine served a moment later.
"""

from __future__ import annotations

import io

import msgspec

from gateway.app import build_pools
from gateway.config import BackendSettings, load_settings
from gateway.observability.logs import make_logger


def sizer_with_slots(slots: int):  # type: ignore[no-untyped-def]
    settings = load_settings(None)
    backend = BackendSettings(url="http://floor.invalid", name="b0", max_concurrency=slots)
    settings = msgspec.structs.replace(settings, backends=[backend])
    router = build_pools(settings, make_logger(io.StringIO(), "error"), clock_of=lambda: 0.0)
    return router.default.sizer, router.default.scheduler


def test_one_slot_floor_is_a_whole_long_answer_not_only_its_prefill() -> None:
    one, _ = sizer_with_slots(1)
    two, _ = sizer_with_slots(2)
    short = one.settings.lanes[0]
    one_floor = one.floor_s(short.name, short.max_prompt_tokens)
    two_floor = two.floor_s(short.name, short.max_prompt_tokens)
    # The prior's long answer: 256 tokens at the prior TPOT, beside the same prefills.
    assert one_floor > two_floor + 256 * 0.9 * 0.02


def test_one_slot_floor_follows_the_lower_lanes_measured_hold() -> None:
    sizer, scheduler = sizer_with_slots(1)
    short, bulk = sizer.settings.lanes[0], sizer.settings.lanes[-1]
    scheduler.lane(bulk.name).hold_ewma_s = 30.0
    assert sizer.floor_s(short.name, short.max_prompt_tokens) > 30.0
    sizer.refit()
    assert scheduler.lane(short.name).deadline_s >= 1.5 * 30.0
