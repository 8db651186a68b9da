"""The backends and their slots; the scheduler's `SlotSource`.

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
    #: 0: no prefill budget.
    max_prefill_tokens: int = 0
    in_flight: int = 0
    #: Prompt tokens of requests sent here that have not answered their first byte.
    prefilling_tokens: int = 0

    @classmethod
    def from_settings(cls, settings: BackendSettings) -> Backend:
        return cls(
            settings.name,
            settings.url.rstrip("/"),
            settings.max_concurrency,
            settings.max_prefill_tokens,
        )

    @property
    def free_slots(self) -> int:
        return self.max_concurrency - self.in_flight

    def can_prefill(self, prompt_tokens: int) -> bool:
        if not self.max_prefill_tokens or not self.prefilling_tokens:
            return True
        return self.prefilling_tokens + prompt_tokens <= self.max_prefill_tokens


@dataclass(slots=True, eq=False)
class Slot:
    """One request's place on a backend."""

    backend: Backend
    prompt_tokens: int
    prefilling: bool = True


class BackendPool:
    """Hands out slots on the least busy backend that has one free."""

    def __init__(self, backends: list[Backend]) -> None:
        self.backends = backends

    @property
    def total_slots(self) -> int:
        return sum(b.max_concurrency for b in self.backends)

    def try_take(self, lane: str, prompt_tokens: int) -> Slot | None:
        best: Backend | None = None
        for backend in self.backends:
            if backend.free_slots <= 0 or not backend.can_prefill(prompt_tokens):
                continue
            if best is None or backend.in_flight < best.in_flight:
                best = backend
        if best is None:
            return None
        best.in_flight += 1
        best.prefilling_tokens += prompt_tokens
        return Slot(best, prompt_tokens)

    def prefill_done(self, slot: Slot) -> None:
        """The backend answered its first byte: the prompt is no longer in prefill."""
        if slot.prefilling:
            slot.prefilling = False
            slot.backend.prefilling_tokens -= slot.prompt_tokens

    def give_back(self, slot: Slot) -> None:
        self.prefill_done(slot)
        slot.backend.in_flight -= 1

    def any_backend(self) -> Backend | None:
        """A backend for requests that need no slot (model listing)."""
        return self.backends[0] if self.backends else None
