"""The backends, their slots and their health; the scheduler's `SlotSource`.

Each backend has `max_concurrency` slots: the most requests the gateway lets
run on it at once. Keeping that number near the engine's batch size keeps the
queue in the gateway, where lanes can order it, rather than in the engine,
which serves first-come-first-served.

Each backend also has a prefill budget (`max_prefill_tokens`): the prompt
tokens the gateway lets it prefill at once, counted from dispatch to the first
byte of the answer. Engines prefill waiting prompts in arrival order, so a
short request dispatched behind two 3000-token prompts waits for both; with the
budget, at most one long prompt is in prefill at a time and a short one waits
for at most that. Engine prefill is serial anyway, so holding the second long
prompt back costs it almost nothing. A prompt bigger than the budget still
goes, alone.

Balancing: among the available backends a lane may use that have a free slot
(and prefill room), the one with the fewest outstanding tokens per unit of
weight wins (prompt + max_tokens of its in-flight requests): token counts, not
request counts, are what fill an engine. Ties go to the fewest in-flight.

Health: a backend is available while its last active check passed and it is
not ejected. Consecutive failures (connect errors, 5xx, first-byte timeouts)
eject it for a cooldown that doubles on each repeat; it comes back by itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from gateway.config import BackendSettings, HealthSettings
from gateway.outcomes import NoBackend, Outcome


@dataclass(slots=True, eq=False)
class Backend:
    """One model server and what the gateway has running on it."""

    name: str
    url: str
    max_concurrency: int
    #: 0: no prefill budget.
    max_prefill_tokens: int = 0
    weight: float = 1.0
    api_key: str | None = None
    priority_field: bool = False
    in_flight: int = 0
    #: Prompt tokens of requests sent here that have not answered their first byte.
    prefilling_tokens: int = 0
    #: Prompt + max_tokens of the requests in flight here.
    outstanding_tokens: int = 0
    #: The last active health check passed (optimistic until the first one).
    healthy: bool = True
    #: Loop time until which the backend is ejected.
    ejected_until: float = 0.0
    consecutive_failures: int = 0
    ejections: int = 0

    @classmethod
    def from_settings(cls, settings: BackendSettings) -> Backend:
        return cls(
            name=settings.name,
            url=settings.url.rstrip("/"),
            max_concurrency=settings.max_concurrency,
            max_prefill_tokens=settings.max_prefill_tokens,
            weight=settings.weight,
            api_key=settings.api_key,
            priority_field=settings.priority_field,
        )

    @property
    def free_slots(self) -> int:
        return self.max_concurrency - self.in_flight

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.ejected_until

    def can_prefill(self, prompt_tokens: int) -> bool:
        if not self.max_prefill_tokens or not self.prefilling_tokens:
            return True
        return self.prefilling_tokens + prompt_tokens <= self.max_prefill_tokens


@dataclass(slots=True, eq=False)
class Slot:
    """One request's place on a backend."""

    backend: Backend
    prompt_tokens: int
    output_tokens: int
    prefilling: bool = True


class BackendPool:
    """Hands out slots on the least loaded available backend of a lane."""

    def __init__(
        self,
        backends: list[Backend],
        *,
        lane_backends: Mapping[str, Collection[str] | None] | None = None,
        health: HealthSettings | None = None,
        clock: Callable[[], float],
    ) -> None:
        self.backends = backends
        self.health = health or HealthSettings()
        self.clock = clock
        by_name = {b.name: b for b in backends}
        self._lane_backends = {
            lane: backends if names is None else [by_name[n] for n in names if n in by_name]
            for lane, names in (lane_backends or {}).items()
        }
        #: Called when a backend may have become available again (the scheduler's dispatch).
        self.on_available: Callable[[], None] = lambda: None

    def backends_of(self, lane: str) -> list[Backend]:
        return self._lane_backends.get(lane, self.backends)

    def has_available(self, lane: str | None = None) -> bool:
        now = self.clock()
        candidates = self.backends if lane is None else self.backends_of(lane)
        return any(b.available(now) for b in candidates)

    def require_available(self, lane: str) -> None:
        """NoBackend (retry after the next health check) when nothing serves `lane` now."""
        if not self.has_available(lane):
            raise NoBackend(
                f"No healthy backend serves the '{lane}' lane right now.",
                retry_after_s=self.health.interval_s,
            )

    def try_take(
        self,
        lane: str,
        prompt_tokens: int,
        output_tokens: int = 0,
        exclude: Slot | None = None,
    ) -> Slot | None:
        """A slot on the best backend for this request; not on `exclude`'s backend."""
        now = self.clock()
        avoid = exclude.backend if exclude is not None else None
        best: Backend | None = None
        best_key = (0.0, 0)
        for backend in self.backends_of(lane):
            if (
                backend is avoid
                or backend.free_slots <= 0
                or not backend.available(now)
                or not backend.can_prefill(prompt_tokens)
            ):
                continue
            key = (backend.outstanding_tokens / backend.weight, backend.in_flight)
            if best is None or key < best_key:
                best, best_key = backend, key
        if best is None:
            return None
        best.in_flight += 1
        best.prefilling_tokens += prompt_tokens
        best.outstanding_tokens += prompt_tokens + output_tokens
        return Slot(best, prompt_tokens, output_tokens)

    def prefill_done(self, slot: Slot) -> None:
        """The backend answered its first byte: the prompt is no longer in prefill."""
        if slot.prefilling:
            slot.prefilling = False
            slot.backend.prefilling_tokens -= slot.prompt_tokens

    def give_back(self, slot: Slot) -> None:
        self.prefill_done(slot)
        backend = slot.backend
        backend.in_flight -= 1
        backend.outstanding_tokens -= slot.prompt_tokens + slot.output_tokens

    def any_backend(self) -> Backend | None:
        """An available backend for requests that need no slot (model listing)."""
        now = self.clock()
        return next((b for b in self.backends if b.available(now)), None)

    # -- health ------------------------------------------------------------------------

    def record_result(self, backend: Backend, outcome: Outcome) -> None:
        """Passive health: what one request's outcome says about its backend."""
        if outcome.counts_against_backend:
            self.report_failure(backend)
        elif outcome.counts_for_backend:
            backend.consecutive_failures = 0

    def report_failure(self, backend: Backend) -> bool:
        """Count a failure; eject the backend at the threshold. True when it was ejected."""
        backend.consecutive_failures += 1
        if backend.consecutive_failures < self.health.failures_to_eject:
            return False
        self.eject(backend)
        return True

    def eject(self, backend: Backend) -> None:
        cooldown = min(self.health.eject_max_s, self.health.eject_base_s * 2**backend.ejections)
        backend.ejections += 1
        backend.consecutive_failures = 0
        backend.ejected_until = self.clock() + cooldown
        # Serve the queues again when the cooldown ends (a no-op if still unhealthy).
        asyncio.get_running_loop().call_later(cooldown, self.on_available)

    def set_health(self, backend: Backend, healthy: bool) -> None:
        """The result of an active check."""
        came_back = healthy and not backend.healthy
        backend.healthy = healthy
        if came_back:
            self.on_available()
