"""Fair share between tenants inside one lane: which tenant's request goes next.

A lane's queue served first come lets the heaviest sender decide everyone's wait:
a tenant flooding the lane puts its whole backlog ahead of a light tenant's next
request. So each lane orders its queue by a Virtual Token Counter (Sheng et al.,
"Fairness in Serving Large Language Models", OSDI '24):

- every tenant has a counter: the work it was served in this lane, over its weight;
- the next request is the oldest of the backlogged tenant with the lowest counter
  (ties: the tenant with fewer requests running, then the one served longest ago),
  so two backlogged tenants are served in proportion to their weights, whatever
  their rates, and a tenant that just started waiting goes before an equal one that
  was just served;
- work is what the engine pays: a request is charged its prompt tokens when it is
  dispatched, and when it ends its charge is settled to its uncached prompt plus its
  output tokens times the output weight (`TokenCost`);
- a tenant that starts waiting again is lifted to the lowest counter of those
  waiting (or, when none waits, to the counter of the last one served): idleness
  banks no credit, so a tenant back after a minute gets its share, not a burst.

With one tenant the order is first come, exactly as without tenants. Requests that
were granted a slot they could not use go back in front of everyone (`push_front`).

Plain data and arithmetic: no clock, no I/O. The scheduler owns one per lane.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

#: Tenants remembered per lane while idle (their counters still above the floor).
MAX_IDLE_TENANTS = 1024
#: Weight of the newest request in a tenant's mean cost per request (for places).
COST_EWMA_ALPHA = 0.2
#: The output weight before any backend is learned: the paper's 2 (an output token
#: costs two prompt tokens), until the engines say what it really is.
DEFAULT_OUTPUT_WEIGHT = 2.0
#: A learned output weight is kept within these bounds.
OUTPUT_WEIGHT_BOUNDS = (1.0, 1000.0)


class Queued(Protocol):
    """What the queue needs of a waiting request."""

    tenant: str
    enqueued_at: float
    prompt_tokens: int


W = TypeVar("W", bound=Queued)


@dataclass(slots=True)
class TokenCost:
    """What a request costs the engine, in prompt-token equivalents."""

    #: One output token against one prompt token: what the engine prefills in the time
    #: one output token holds a slot (set from the learned backends), or configured.
    output_weight: float = DEFAULT_OUTPUT_WEIGHT

    def of(self, uncached_prompt_tokens: int, output_tokens: int) -> float:
        return max(0, uncached_prompt_tokens) + self.output_weight * max(0, output_tokens)


def learned_output_weight(prefill_tokens_per_s: float, tpot_s: float) -> float:
    """Prompt tokens prefilled in the time one output token holds its slot, bounded."""
    low, high = OUTPUT_WEIGHT_BOUNDS
    return min(high, max(low, prefill_tokens_per_s * tpot_s))


@dataclass(slots=True)
class TenantShare(Generic[W]):
    """One tenant's place in a lane: its counter, its queued and its running requests."""

    name: str
    weight: float = 1.0
    #: Work served over weight (prompt-token equivalents).
    counter: float = 0.0
    queue: deque[W] = field(default_factory=deque)
    in_flight: int = 0
    #: Its mean charge per request (settled), for the place of its next one in line.
    mean_cost: float | None = None
    #: When it was served last, in dispatches of this lane (ties go to the longest ago).
    served_at: int = -1

    @property
    def idle(self) -> bool:
        return not self.queue and not self.in_flight


class FairQueue(Generic[W]):
    """A lane's queue, ordered fairly between tenants (see the module docstring)."""

    def __init__(self, fair: bool = True) -> None:
        #: Off: every request is one tenant's, so the order is first come.
        self.fair = fair
        self._tenants: dict[str, TenantShare[W]] = {}
        #: Tenants with requests queued (a subset of `_tenants`).
        self._backlogged: dict[str, TenantShare[W]] = {}
        self._front: deque[W] = deque()
        self._size = 0
        #: The counter of the tenant served last: where a tenant is lifted to when it
        #: starts waiting while nobody else waits.
        self._last_served = 0.0
        self._dispatches = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def key(self, tenant: str) -> str:
        return tenant if self.fair else ""

    def share(self, tenant: str, weight: float | None = None) -> TenantShare[W]:
        """The tenant's share of this lane, made on first sight (its weight as given)."""
        key = self.key(tenant)
        share = self._tenants.get(key)
        if share is None:
            share = self._tenants[key] = TenantShare(key)
        if weight is not None and self.fair:
            share.weight = weight
        return share

    def tenants(self) -> list[TenantShare[W]]:
        return list(self._tenants.values())

    # -- joining and leaving ------------------------------------------------------

    def push(self, waiter: W, weight: float = 1.0) -> None:
        """Queue `waiter` behind its tenant's other requests."""
        share = self.share(waiter.tenant, weight)
        if not share.queue:
            share.counter = max(share.counter, self._floor())
            self._backlogged[share.name] = share
        share.queue.append(waiter)
        self._size += 1

    def push_front(self, waiter: W, weight: float = 1.0) -> None:
        """Queue `waiter` before everyone (it was granted a slot it could not use)."""
        self.share(waiter.tenant, weight)
        self._front.appendleft(waiter)
        self._size += 1

    def remove(self, waiter: W) -> bool:
        """Take `waiter` out of the line (it timed out, went away or was dispatched)."""
        try:
            self._front.remove(waiter)
        except ValueError:
            share = self._tenants.get(self.key(waiter.tenant))
            if share is None:
                return False
            try:
                share.queue.remove(waiter)
            except ValueError:
                return False
            if not share.queue:
                del self._backlogged[share.name]
                self._forget_if_idle(share)
        self._size -= 1
        return True

    def pop_all(self) -> list[W]:
        """Everyone in line, emptied (shutdown)."""
        waiters = list(self._front)
        for share in self._backlogged.values():
            waiters.extend(share.queue)
            share.queue.clear()
        self._front.clear()
        self._backlogged.clear()
        self._size = 0
        return waiters

    # -- service ------------------------------------------------------------------

    def started(self, tenant: str, prompt_tokens: int, weight: float | None = None) -> float:
        """A request of `tenant` got its slot: its tenant is charged its prompt (returned:
        the charge, to be settled when it ends)."""
        share = self.share(tenant, weight)
        if not share.queue:  # it did not wait: it starts level with those who do
            share.counter = max(share.counter, self._floor())
        share.in_flight += 1
        charge = float(prompt_tokens)
        share.counter += charge / share.weight
        self._last_served = share.counter
        share.served_at = self._dispatches
        self._dispatches += 1
        return charge

    def dispatched(self, waiter: W) -> float:
        """`waiter` got its slot: out of the line, and `started`."""
        charge = self.started(waiter.tenant, waiter.prompt_tokens)  # first: keeps the share
        self.remove(waiter)
        return charge

    def settle(self, tenant: str, charged: float, cost: float) -> None:
        """A request of `tenant` charged `charged` at dispatch ended costing `cost`."""
        share = self._tenants.get(self.key(tenant))
        if share is None:  # cannot happen: a tenant with a request running is kept
            return
        share.counter += (cost - charged) / share.weight
        share.in_flight -= 1
        share.mean_cost = (
            cost
            if share.mean_cost is None
            else share.mean_cost + COST_EWMA_ALPHA * (cost - share.mean_cost)
        )
        self._forget_if_idle(share)

    def refund(self, tenant: str, charged: float) -> None:
        """A request of `tenant` gave back the slot it was charged `charged` for unused
        (it waits again, and is charged again when dispatched)."""
        share = self._tenants.get(self.key(tenant))
        if share is not None:
            share.counter -= charged / share.weight
            share.in_flight -= 1

    def order(self, limit: int) -> Iterator[W]:
        """The first `limit` requests in the order they will be served, as things stand
        (each tenant's counter moved on by the prompts of its requests before)."""
        count = 0
        for waiter in self._front:
            if count == limit:
                return
            yield waiter
            count += 1
        backlogged = list(self._backlogged.values())
        if len(backlogged) == 1:
            for waiter in backlogged[0].queue:
                if count == limit:
                    return
                yield waiter
                count += 1
            return
        heap = [(s.counter, s.in_flight, s.served_at, i) for i, s in enumerate(backlogged)]
        heapq.heapify(heap)
        taken = [0] * len(backlogged)
        dispatches = self._dispatches
        while heap and count < limit:
            counter, running, _, index = heapq.heappop(heap)
            share = backlogged[index]
            waiter = share.queue[taken[index]]
            yield waiter
            count += 1
            taken[index] += 1
            if taken[index] < len(share.queue):
                counter += waiter.prompt_tokens / share.weight
                heapq.heappush(heap, (counter, running + 1, dispatches, index))
                dispatches += 1

    def oldest_enqueued_at(self) -> float | None:
        """When the longest-waiting request in line joined it (for promotion)."""
        heads = [self._front[0].enqueued_at] if self._front else []
        heads += [s.queue[0].enqueued_at for s in self._backlogged.values()]
        return min(heads) if heads else None

    # -- predictions --------------------------------------------------------------

    def place_for(self, tenant: str, weight: float, cost: float) -> int:
        """Requests served before one of `tenant` (costing about `cost`) joining now,
        plus one: its own tenant's queue, and of each other tenant's, the requests whose
        turn comes before its counter gets there."""
        if not self.fair or len(self._backlogged) <= (self.key(tenant) in self._backlogged):
            return self._size + 1
        share = self._tenants.get(tenant)
        own = share.queue if share is not None else ()
        counter = self._floor() if share is None or not own else share.counter
        if share is not None and not own:
            counter = max(counter, share.counter)
        mean = cost if share is None or share.mean_cost is None else share.mean_cost
        start = counter + len(own) * mean / weight
        ahead = len(self._front) + len(own)
        for other in self._backlogged.values():
            if other.name == tenant:
                continue
            if other.counter >= start:
                continue
            other_cost = other.mean_cost or float(other.queue[0].prompt_tokens) or 1.0
            turns = math.ceil((start - other.counter) * other.weight / max(other_cost, 1e-9))
            ahead += min(len(other.queue), turns)
        return ahead + 1

    def queued_of(self, tenant: str) -> int:
        share = self._tenants.get(self.key(tenant))
        return 0 if share is None else len(share.queue)

    def displaced_by(self, tenant: str, weight: float, depth: int) -> W | None:
        """The full line's request that an arrival of `tenant` takes the place of: the
        newest of the tenant holding the most of the line for its weight, when the
        arrival's tenant holds less than its fair share of `depth` and that one more
        than its own. None: the arrival is the one refused."""
        if not self.fair:
            return None
        key = self.key(tenant)
        present = dict(self._backlogged)
        total_weight = sum(s.weight for s in present.values() if s.name != key) + weight
        mine = self.queued_of(tenant)
        if mine + 1 > depth * weight / total_weight:
            return None
        heaviest = max(
            (s for s in present.values() if s.name != key),
            key=lambda s: len(s.queue) / s.weight,
            default=None,
        )
        if heaviest is None or len(heaviest.queue) <= depth * heaviest.weight / total_weight:
            return None
        return heaviest.queue[-1]

    # -- bookkeeping --------------------------------------------------------------

    def _floor(self) -> float:
        """Where a tenant starting to wait is lifted to: the lowest counter of those
        waiting, else the counter of the last one served."""
        if self._backlogged:
            return min(s.counter for s in self._backlogged.values())
        return self._last_served

    def _forget_if_idle(self, share: TenantShare[W]) -> None:
        """Drop an idle tenant the floor has caught up with (it would be lifted to the
        floor anyway); keep at most MAX_IDLE_TENANTS idle ones that still owe."""
        if not share.idle:
            return
        if share.counter <= self._floor():
            del self._tenants[share.name]
            return
        if len(self._tenants) - len(self._backlogged) > MAX_IDLE_TENANTS:
            for name, other in list(self._tenants.items()):
                if other.idle:
                    del self._tenants[name]
                    break
