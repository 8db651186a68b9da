"""Lane choice: the first lane, in priority order, whose token budget admits the request."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.config import LaneSettings


def choose_lane(
    lanes: Sequence[LaneSettings], prompt_tokens: int, output_tokens: int
) -> LaneSettings | None:
    """Lanes are ordered by priority; None when no lane admits the request."""
    for lane in lanes:
        if lane.max_prompt_tokens is not None and prompt_tokens > lane.max_prompt_tokens:
            continue
        if lane.max_output_tokens is not None and output_tokens > lane.max_output_tokens:
            continue
        return lane
    return None
