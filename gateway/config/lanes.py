"""[[lanes]]: the priority queues, their sizes, deadlines and slot shares."""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from gateway.config.constraints import NonNegative, Positive, PositiveFloat, rule


class LaneSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, rule("be set (every lane needs a name)", min_length=1)] = ""
    #: Largest prompt this lane admits; None admits any prompt within the caps.
    max_prompt_tokens: Positive | None = None
    #: Largest output budget (n x max_tokens) this lane admits; None: any.
    max_output_tokens: Positive | None = None
    #: Most slots this lane may hold at once, absolute; None: no absolute limit.
    max_slots: Positive | None = None
    #: Most slots this lane may hold, as a share of all slots (0 < share <= 1).
    max_slot_share: Annotated[float, rule("be in (0, 1]", gt=0, le=1)] = 1.0
    #: A request still queued after this long gets 503 queue_timeout.
    queue_timeout_s: PositiveFloat = 30.0
    #: A request arriving at a queue this deep gets 429 queue_full at once.
    max_queue_depth: NonNegative = 256
    #: A request queued longer than this is served before the higher lanes' requests
    #: that came since (no starvation) while its lane holds fewer than `promoted_slots`.
    promote_after_s: PositiveFloat | None = None
    #: How many slots promotion guarantees an aged lane. A lane that already runs this
    #: many is progressing, not starving, and higher lanes keep their priority.
    promoted_slots: Positive = 1
    #: Slots this lane keeps while a higher lane has requests waiting: a lower lane may
    #: use every free slot, but gives slots back as its requests end when a higher lane
    #: waits, down to this floor (so it is never starved). Never all the slots the two
    #: share: on one slot the lanes are strict priority (and promotion).
    min_slots: NonNegative = 1
    #: While this lane is active, the lanes below it leave it the slots its measured demand
    #: needs so that an arrival finds them all busy at most this often (its headroom, for
    #: bursts). Higher: fewer slots kept idle for it, more for the lanes below (their
    #: requests wait less for a slot at moderate load, this lane's bursts more); 1: none.
    #: Unset: 0.1, and adapted: enough slots too that an arrival waits longer than half
    #: the engine floor at most 1% of the time, where that leaves the lanes below a slot
    #: beyond their floors (`scheduling/headroom.py`). Written: exact, and alone.
    headroom_wait_probability: Annotated[float, rule("be in (0, 1]", gt=0, le=1)] | None = None
    #: Most requests one tenant may have queued in this lane; an arrival over it gets
    #: 429 queue_full at once. 0: no cap of its own (the lane's fair share of
    #: max_queue_depth still applies when the queue is full).
    max_queue_depth_per_tenant: NonNegative = 0
    #: Refuse at once (429 wait_too_long) when the predicted wait exceeds the deadline.
    reject_predicted_wait: bool = True
    #: Adapt queue_timeout_s to the engine: raise it to 1.5x the measured engine floor
    #: (one long prefill ahead plus the request's own) when the floor would not fit in
    #: it, and to UNLEARNED_DEADLINE_S while the engine's prefill is unlearned. Unset, it
    #: is on only while queue_timeout_s is unset too: a queue_timeout_s the operator
    #: wrote is exact (`config/written.py`; set this to true to have it fitted anyway).
    fit_timeout_to_engine: bool = True
    #: Names of the backends this lane may use; None: all of them.
    backends: Annotated[list[str], rule("name at least one backend", min_length=1)] | None = None


def default_lanes() -> list[LaneSettings]:
    return [
        LaneSettings(
            name="interactive",
            max_prompt_tokens=1024,
            max_output_tokens=256,
            queue_timeout_s=5.0,
            max_queue_depth=256,
        ),
        # No floor: while short requests wait, a freed slot goes to them, and promotion
        # alone keeps long ones from starving. A floor kept a long request running at
        # all times, and on an engine whose long prefill freezes every decode beside it
        # (llama.cpp, TGI) the short ones held their slots through each of those
        # prefills: short P99 1.5-1.9x the floor on CPU engines at 120%, 1.0x without
        # (and more long requests refused: docs/matrix.md, `chat-long-replies`).
        LaneSettings(
            name="bulk",
            queue_timeout_s=30.0,
            max_queue_depth=64,
            promote_after_s=10.0,
            min_slots=0,
        ),
    ]


def slot_limit(lane: LaneSettings, slots: int) -> int:
    """Slots a lane may hold of `slots`: its absolute and its share limit, at least one."""
    # round first: 90 * 0.7 is 62.999... in binary floating point
    by_share = math.floor(round(slots * lane.max_slot_share, 9))
    limit = by_share if lane.max_slots is None else min(lane.max_slots, by_share)
    return max(1, limit)
