"""Which backend gets a LoRA adapter's request: where the adapter already runs.

An engine serving LoRA adapters (vLLM's `--enable-lora`) runs at most `max_lora`
distinct adapters in one batch and keeps as many loaded; a request whose adapter is
not loaded waits until one of those places frees, then stalls a step while its
adapter is loaded (a swap). A model-blind balancer spreads every adapter over every
backend, so each engine keeps swapping; keeping an adapter's requests on the backends
that run it makes swaps rare and lets each engine batch its adapters' requests.

So, among the backends that list the adapter (`/v1/models`, `parent` = their base
model) and could take the request now:

1. one that runs it now (its requests in the batch or the engine's queue: no load),
   or has it probably still loaded (among the last `max_lora` adapters it ran) and
   room to run it; among those the adapter's last backend (sticky), so its requests
   stay together;
2. else one with room for one more adapter (fewer than `max_lora` active), the one
   whose loaded adapters it would evict fewest of first, so adapters spread over
   the backends before any has to swap one out;
3. else, only then, one at `max_lora` (its engine will queue the request and swap).

But while a backend that runs the adapter is merely full (no free slot), the request
waits for it (the pool defers it, within the wait budget it gives deferrals) rather
than load the adapter where that would unload another: one such spill makes that
adapter's requests swap on the other engine, whose own adapters then swap back, and
the backends' slots fill with requests waiting inside the engines for an adapter
place. Loading it where a place is free costs one swap and nobody else's.

An engine keeps `max_lora` adapters loaded, least recently used out, and a gap
between two requests of an adapter does not unload it: so the gateway remembers
the adapters each backend ran last, not only those running, or an adapter whose
requests come one at a time would wander between backends and be loaded each time.

A backend that does not list the adapter never gets its requests (it would answer
404). Which adapters run comes from the engine's `vllm:lora_requests_info`; scrapes
lag, so the gateway adds what it sent itself and still has in flight, and forgets an
adapter the scrape showed once its own last request of it ended after that scrape.

Plain functions and one small record per backend, with the clock passed in.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: Why a tier of backends was preferred (the routing metric's `reason` label).
BY_ADAPTER_RUNNING, BY_ADAPTER_ROOM, BY_ADAPTER_FULL = "adapter", "adapter_room", "adapter_full"
#: No candidate now: better wait for the full backend that runs it.
WAIT_FOR_ADAPTER = "adapter_wait"


@dataclass(slots=True)
class BackendAdapters:
    """What the gateway knows of one backend's adapters: listed, and active now."""

    #: Adapters it lists (`/v1/models` entries with a `parent`).
    listed: frozenset[str] = frozenset()
    #: Distinct adapters one batch may run (None: the engine did not say).
    max_lora: int | None = None
    #: The engine's running and waiting adapters at the last scrape, and when that was.
    engine_running: frozenset[str] = frozenset()
    engine_waiting: frozenset[str] = frozenset()
    scraped_at: float = -math.inf
    #: Requests of each adapter this gateway sent there that have not ended.
    ours: dict[str, int] = field(default_factory=dict)
    #: When this gateway's last request of an adapter ended there.
    ended_at: dict[str, float] = field(default_factory=dict)
    #: Adapters it ran (sent by us, or running at a scrape), least recently first.
    recent: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def note_listed(self, adapters: Iterable[str]) -> None:
        self.listed = frozenset(adapters)

    def note_scrape(
        self,
        running: Iterable[str],
        waiting: Iterable[str],
        max_lora: int | None,
        now: float,
    ) -> None:
        """The engine's `lora_requests_info` as scraped at `now`."""
        self.engine_running, self.engine_waiting = frozenset(running), frozenset(waiting)
        self.max_lora = max_lora
        self.scraped_at = now
        for adapter in self.engine_running - frozenset(self.ours):
            self._ran(adapter)

    def dispatched(self, adapter: str) -> None:
        self.ours[adapter] = self.ours.get(adapter, 0) + 1
        self._ran(adapter)

    def _ran(self, adapter: str) -> None:
        self.recent.pop(adapter, None)
        self.recent[adapter] = None
        while len(self.recent) > 64:  # a bound; only the last max_lora ones matter
            self.recent.popitem(last=False)

    def loaded(self) -> frozenset[str]:
        """Adapters its engine probably has loaded: the last `max_lora` it ran (the last
        one when its engine does not say)."""
        keep = self.max_lora or 1
        return frozenset(list(self.recent)[-keep:])

    def ended(self, adapter: str, now: float) -> None:
        left = self.ours.get(adapter, 0) - 1
        if left > 0:
            self.ours[adapter] = left
        else:
            self.ours.pop(adapter, None)
            self.ended_at[adapter] = now

    def active(self) -> frozenset[str]:
        """Adapters running or queued there now: ours in flight, and the scrape's, less
        those whose last request of ours ended after the scrape (it ran ours, not others')."""
        seen = self.engine_running | self.engine_waiting
        stale = {a for a in seen if self.ended_at.get(a, -math.inf) > self.scraped_at}
        return frozenset(self.ours) | (seen - stale)


@dataclass(frozen=True, slots=True)
class AdapterCandidate:
    """One backend that could take the request now, as the adapter choice sees it."""

    name: str
    lists: bool
    active: frozenset[str]
    max_lora: int | None
    #: Adapters its engine probably has loaded (`BackendAdapters.loaded`).
    loaded: frozenset[str] = frozenset()

    def room(self) -> float:
        """Adapters it may still start (infinite when its engine does not say)."""
        if self.max_lora is None:
            return math.inf
        return self.max_lora - len(self.active)

    def free_places(self) -> float:
        """Adapters it may load without unloading one it probably still has loaded."""
        if self.max_lora is None:
            return math.inf
        return self.max_lora - len(self.active | self.loaded)


def preferred_backends(
    adapter: str,
    candidates: Sequence[AdapterCandidate],
    sticky: str | None,
    runs_elsewhere: bool = False,
) -> tuple[list[str], str | None]:
    """The names of the candidates `adapter`'s request should choose among (the pool's load
    ranking decides between them), and why; ([], None) when none lists it.

    `runs_elsewhere`: a backend that is no candidate (no free slot) runs it now; then,
    when no candidate runs it or has a free place for it, ([], WAIT_FOR_ADAPTER).
    """
    serving = [c for c in candidates if c.lists]
    running = [c for c in serving if adapter in c.active or (adapter in c.loaded and c.room() > 0)]
    if running:
        if any(c.name == sticky for c in running):
            return [c.name for c in running if c.name == sticky], BY_ADAPTER_RUNNING
        return [c.name for c in running], BY_ADAPTER_RUNNING
    roomy = [c for c in serving if c.room() > 0]
    if runs_elsewhere and not any(c.free_places() > 0 for c in roomy):
        return [], WAIT_FOR_ADAPTER
    if roomy:
        most = max(c.free_places() for c in roomy)
        return [c.name for c in roomy if c.free_places() == most], BY_ADAPTER_ROOM
    if serving:
        return [c.name for c in serving], BY_ADAPTER_FULL
    return [], None
