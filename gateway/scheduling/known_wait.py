"""The wait the work already in sight makes: a lower bound, known at arrival.

A request that arrives to find every slot taken cannot start before one of them
frees, and the requests ahead of it in line take the first ones that do. Some of
that is known for certain the moment it arrives: a slot whose prompt is still in
prefill frees no sooner than that prefill ends (the prompts dispatched before it
there, then its own, at the engine's measured rate), and a request ahead in line
holds the slot it gets at least for its own prefill. The rest (how long each
answer decodes) is not known, and counts as nothing.

So the bound is never above the wait the request will have, as far as the
measured prefill rates are right. A request whose bound is over its deadline
cannot be served in time whatever happens next: refusing it at arrival with the
time it would take is what "fail fast" means (a 9 s prefill holds the one slot of
a CPU engine: a chat turn with a 2 s deadline is told at once, not after 2 s).
Where the rate is the prior's (nothing measured yet) a slot counts as free: no
refusal rests on a guess, and the deadline is enforced as written.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

#: Requests ahead in line looked at: each adds at most its own prefill to the bound,
#: and past these the bound is already far over any deadline or it adds nothing.
MAX_AHEAD = 64


def known_wait_s(
    idle_slots: int, busy_free_in_s: Sequence[float], ahead_holds_s: Sequence[float]
) -> float:
    """The earliest a request can get a slot, in seconds from now.

    `idle_slots`: slots that may free at any moment (free now, or whose request is past
    its prefill); `busy_free_in_s`: for each other slot, the least time until it frees;
    `ahead_holds_s`: for each request ahead in line, in order, the least time it will
    hold the slot it takes. Each request ahead takes the first slot to free, and holds
    it; this request takes the next one.
    """
    if idle_slots > len(ahead_holds_s):
        return 0.0
    slots = [0.0] * idle_slots + list(busy_free_in_s)
    if not slots:
        return 0.0
    heapq.heapify(slots)
    for hold in ahead_holds_s[:MAX_AHEAD]:
        heapq.heapreplace(slots, slots[0] + hold)
    return slots[0]
