"""Which backend gets a LoRA adapter's request: where the adapter already runs.

An engine serving LoRA adapters (vLLM's `--enable-lora`) runs at most `max_lora`
distinct adapters in one batch and keeps as many loaded; a request whose adapter is
not loaded waits until one of those places frees, then stalls a step while its
adapter is loaded (a swap). A model-blind balancer spreads every adapter over every
backend, so each engine keeps swapping; keeping an adapter's requests on the backends
that run it makes swaps rare and lets each engine batch its adapters' requests.

So, among the backends that list the adapter (`/v1/models`, `parent` = their base
model) and could take the request now:

1. one that runs it now (its requests in the batch or the engine's queue: no load);
   among those the adapter's last backend (sticky), so its requests stay together;
2. else one with room for one more adapter (fewer than `max_lora` active), the most
   room first, so adapters spread over the backends before any has to swap;
3. else, only then, one at `max_lora` (its engine will queue the request and swap).

A backend that does not list the adapter never gets its requests (it would answer
404). Which adapters run comes from the engine's `vllm:lora_requests_info`; scrapes
lag, so the gateway adds what it sent itself and still has in flight, and forgets an
adapter the scrape showed once its own last request of it ended after that scrape.

Plain functions and one small record per backend, with the clock passed in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: Why a tier of backends was preferred (the routing metric's `reason` label).
BY_ADAPTER_RUNNING, BY_ADAPTER_ROOM, BY_ADAPTER_FULL = "adapter", "adapter_room", "adapter_full"


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

    def dispatched(self, adapter: str) -> None:
        self.ours[adapter] = self.ours.get(adapter, 0) + 1

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

    def room(self) -> float:
        """Adapters it may still start (infinite when its engine does not say)."""
        if self.max_lora is None:
            return math.inf
        return self.max_lora - len(self.active)


def preferred_backends(
    adapter: str, candidates: Sequence[AdapterCandidate], sticky: str | None
) -> tuple[list[str], str | None]:
    """The names of the candidates `adapter`'s request should choose among (the pool's load
    ranking decides between them), and why; ([], None) when none lists it."""
    serving = [c for c in candidates if c.lists]
    running = [c for c in serving if adapter in c.active]
    if running:
        if any(c.name == sticky for c in running):
            return [c.name for c in running if c.name == sticky], BY_ADAPTER_RUNNING
        return [c.name for c in running], BY_ADAPTER_RUNNING
    roomy = [c for c in serving if c.room() > 0]
    if roomy:
        most = max(c.room() for c in roomy)
        return [c.name for c in roomy if c.room() == most], BY_ADAPTER_ROOM
    if serving:
        return [c.name for c in serving], BY_ADAPTER_FULL
    return [], None
