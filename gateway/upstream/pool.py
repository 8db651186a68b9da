"""The backends and their slots; the scheduler's `SlotSource`.

Each backend has `max_concurrency` slots: the most requests the gateway lets
run on it at once. Keeping that number near the engine's batch size keeps the
queue in the gateway, where lanes can order it, rather than in the engine,
which serves first-come-first-served.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import BackendSettings


@dataclass(slots=True, eq=False)
class Backend:
    """One model server and what the gateway has running on it."""

    name: str
    url: str
    max_concurrency: int
    in_flight: int = 0

    @classmethod
    def from_settings(cls, settings: BackendSettings) -> Backend:
        return cls(settings.name, settings.url.rstrip("/"), settings.max_concurrency)

    @property
    def free_slots(self) -> int:
        return self.max_concurrency - self.in_flight


class BackendPool:
    """Hands out slots on the least busy backend that has one free."""

    def __init__(self, backends: list[Backend]) -> None:
        self.backends = backends

    @property
    def total_slots(self) -> int:
        return sum(b.max_concurrency for b in self.backends)

    def try_take(self, lane: str) -> Backend | None:
        best: Backend | None = None
        for backend in self.backends:
            if backend.free_slots > 0 and (best is None or backend.in_flight < best.in_flight):
                best = backend
        if best is not None:
            best.in_flight += 1
        return best

    def give_back(self, slot: Backend) -> None:
        slot.in_flight -= 1

    def any_backend(self) -> Backend | None:
        """A backend for requests that need no slot (model listing)."""
        return self.backends[0] if self.backends else None
