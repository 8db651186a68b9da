"""Lane choice: the first lane in priority order whose token budget admits the request."""

from __future__ import annotations

import pytest

from gateway.admission.lanes import choose_lane
from gateway.config import LaneSettings, default_lanes


def lane_name(lanes: list[LaneSettings], prompt_tokens: int, output_tokens: int) -> str | None:
    lane = choose_lane(lanes, prompt_tokens, output_tokens)
    return None if lane is None else lane.name


@pytest.mark.parametrize(
    ("prompt_tokens", "output_tokens", "expected"),
    [
        pytest.param(1, 1, "interactive", id="tiny"),
        pytest.param(1024, 256, "interactive", id="both-at-the-limit"),
        pytest.param(1024, 1, "interactive", id="prompt-at-the-limit"),
        pytest.param(1, 256, "interactive", id="output-at-the-limit"),
        pytest.param(1025, 256, "bulk", id="prompt-one-over"),
        pytest.param(1024, 257, "bulk", id="output-one-over"),
        pytest.param(1025, 257, "bulk", id="both-over"),
        pytest.param(100_000, 100_000, "bulk", id="huge"),
    ],
)
def test_default_lanes(prompt_tokens: int, output_tokens: int, expected: str) -> None:
    assert lane_name(default_lanes(), prompt_tokens, output_tokens) == expected


def test_the_returned_lane_is_the_configured_object() -> None:
    lanes = default_lanes()
    assert choose_lane(lanes, 10, 10) is lanes[0]
    assert choose_lane(lanes, 5000, 10) is lanes[1]


THREE_LANES = [
    LaneSettings(name="chat", max_prompt_tokens=512, max_output_tokens=128),
    LaneSettings(name="agent", max_prompt_tokens=8192, max_output_tokens=1024),
    LaneSettings(name="batch"),
]


@pytest.mark.parametrize(
    ("prompt_tokens", "output_tokens", "expected"),
    [
        (512, 128, "chat"),
        (513, 128, "agent"),
        (512, 129, "agent"),
        (8192, 1024, "agent"),
        (8193, 1, "batch"),
        (1, 1025, "batch"),
    ],
)
def test_custom_three_lanes(prompt_tokens: int, output_tokens: int, expected: str) -> None:
    assert lane_name(THREE_LANES, prompt_tokens, output_tokens) == expected


def test_a_lane_bounded_on_one_dimension_only() -> None:
    lanes = [
        LaneSettings(name="short-output", max_output_tokens=64),
        LaneSettings(name="short-prompt", max_prompt_tokens=100),
        LaneSettings(name="rest"),
    ]
    assert lane_name(lanes, 50_000, 64) == "short-output"
    assert lane_name(lanes, 100, 65) == "short-prompt"
    assert lane_name(lanes, 101, 65) == "rest"


def test_priority_order_wins_over_a_tighter_fit() -> None:
    lanes = [LaneSettings(name="wide"), LaneSettings(name="narrow", max_prompt_tokens=10)]
    assert lane_name(lanes, 5, 5) == "wide"


def test_none_when_no_lane_admits() -> None:
    lanes = [
        LaneSettings(name="a", max_prompt_tokens=100, max_output_tokens=100),
        LaneSettings(name="b", max_prompt_tokens=1000, max_output_tokens=200),
    ]
    assert choose_lane(lanes, 1001, 1) is None
    assert choose_lane(lanes, 1, 201) is None
    assert choose_lane(lanes, 1000, 200) is lanes[1]


def test_none_when_there_are_no_lanes() -> None:
    assert choose_lane([], 1, 1) is None
