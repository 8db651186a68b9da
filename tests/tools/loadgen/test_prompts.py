"""Prompts of an exact size: the gateway counts what the schedule planned, and no two match."""

from __future__ import annotations

from gateway.tools.loadgen import (
    DEFAULT_MIX,
    TrafficClass,
    closed_schedule,
)
from gateway.tools.loadgen.prompts import with_run_tag
from tests.tools.loadgen.support import gateway_count


def test_prompt_sizes_are_exact_with_the_gateways_count() -> None:
    mix = [
        TrafficClass("tiny", 1, (1, 30), 4),
        TrafficClass("short", 1, (40, 60), 4),
        TrafficClass("long", 1, (2800, 3200), 4),
    ]
    schedule = closed_schedule(mix, 150, seed=2)
    minimum = gateway_count(schedule[0].prompt.split(".")[0] + ".")
    for p in schedule:
        assert gateway_count(p.prompt) == p.prompt_tokens
        # The run tag the client writes in never changes the size.
        assert gateway_count(with_run_tag(p.prompt, "987654")) == p.prompt_tokens
        low, high = next(c.prompt_tokens for c in mix if c.name == p.cls)
        assert max(low, minimum - 2) <= p.prompt_tokens <= max(high, minimum + 2)
    long_one = next(p for p in schedule if p.cls == "long")
    assert long_one.prompt.count(" ") > 1500  # words, not one token repeated


def test_openings_are_unique() -> None:
    schedule = closed_schedule(DEFAULT_MIX, 300, seed=4)
    openings = [p.prompt.split(".")[0] for p in schedule]
    assert len(set(openings)) == len(openings)
    other_seed = closed_schedule(DEFAULT_MIX, 300, seed=5)
    assert not {p.prompt.split(".")[0] for p in other_seed} & set(openings)
    tagged = with_run_tag(schedule[0].prompt, "123456")
    assert tagged != schedule[0].prompt and tagged.startswith("Session 123456 ")
