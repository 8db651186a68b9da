"""Backends joining and leaving the running gateway: a reload's `[[backends]]`, the
addresses a DNS name resolves to now (`discovery.py`).

One question, asked with the backends that should be (each with its URL): what
changes? The answer is applied at once, for the requests that arrive from now on:

- a backend that should be and is not joins the pool of its models (a pool is made
  when none serves them yet), with its settings; the next health round checks it and
  asks what it is (its slots, its engine), and it is learned like any other;
- a backend that is and should not be (or whose URL or models changed: another
  server) leaves: drained (`BackendPool.drain`), so it gets no new request, its
  streams finish where they are, and those still running after [resume]
  drain_timeout_s are carried over to another backend of their pool and cut; once
  idle it is forgotten;
- a backend that stays keeps its object: what was learned of it, its slots in use;
  the settings a reload may change (weight, slots, prefill budget, key, engine) are
  set on it.

Requests queued and in flight keep the objects they hold (their pool, scheduler, slot,
backend): a slot is given back to its backend even after the backend left. A pool left
with no backend at all is dropped from the router (its models get `model_not_found`),
unless it is the last one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from msgspec.structs import replace
from prometheus_client import CollectorRegistry, Counter

from gateway.config import DEFAULT_MAX_CONCURRENCY, BackendSettings, LaneSettings, Settings
from gateway.upstream.models import ModelPool, ModelRouter, pool_key
from gateway.upstream.pool import Backend
from gateway.upstream.served import ServedModels

#: How often a leaving backend is looked at until it is idle.
IDLE_CHECK_S = 0.1
#: How long past its drain deadline a leaving backend may take to hand its last streams
#: over before it is forgotten anyway (a slot it still holds is given back to the object).
LEAVE_GRACE_S = 30.0
#: Between a DNS entry's name and an address in its backends' names: `tgi@10.1.2.3`.
ENTRY_SEPARATOR = "@"

#: Makes a pool for models no pool serves yet: (name, its backends, settings).
PoolFactory = Callable[[str, list[BackendSettings], Settings], Awaitable[ModelPool]]


def entry_of(backend_name: str) -> str:
    """The `[[backends]]` entry a backend comes from: its name, or for an address of a DNS
    entry (`tgi@10.1.2.3`) the entry's."""
    return backend_name.partition(ENTRY_SEPARATOR)[0]


def lane_members(
    lanes: Sequence[LaneSettings], names: Collection[str]
) -> dict[str, list[str] | None]:
    """Which of a pool's backends (by name) each lane may use: None, all; a lane whose
    `backends` names an entry gets that entry's backends (a DNS entry's addresses too).
    A lane that names none of them is left out (it may use the pool's all)."""
    members: dict[str, list[str] | None] = {}
    for lane in lanes:
        if lane.backends is None:
            members[lane.name] = None
            continue
        chosen = [n for n in names if n in lane.backends or entry_of(n) in lane.backends]
        if chosen:
            members[lane.name] = chosen
    return members


@dataclass(slots=True)
class Changes:
    """What one application changed, by backend name (the log line says it)."""

    joined: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.joined or self.left or self.updated)


class Membership:
    """Applies the backends that should be to the router's pools (see the module doc)."""

    def __init__(
        self,
        router: ModelRouter,
        make_pool: PoolFactory,
        events: Any,
        registry: CollectorRegistry | None = None,
        on_pools_changed: Callable[[], None] = lambda: None,
    ) -> None:
        self.router = router
        self.make_pool = make_pool
        self.events = events
        #: Told when the router's pools changed (the state's default pool follows).
        self.on_pools_changed = on_pools_changed
        #: Backends drained for good, until idle: the task that forgets each.
        self._leaving: dict[Backend, asyncio.Task[None]] = {}
        #: The health checks of dropped pools, being stopped (kept from the collector).
        self._stopping: set[asyncio.Task[None]] = set()
        self._changes = Counter(
            "gateway_backend_membership_changes",
            "Backends that joined or left a pool while the gateway ran (a config reload, "
            "a DNS name's records).",
            ["change"],
            registry=registry,
        )

    @property
    def leaving(self) -> list[Backend]:
        return list(self._leaving)

    async def apply(self, settings: Settings, wanted: Sequence[BackendSettings]) -> Changes:
        """Make the pools hold `wanted` (every entry with its URL): joins, leaves, updates."""
        changes = Changes()
        desired = {b.name: b for b in wanted}
        pools = {each.name: each for each in self.router.pools}
        members = {name: list(each.pool.backends) for name, each in pools.items()}
        present: set[str] = set()
        fresh: list[tuple[ModelPool, Backend]] = []  # joined: what each serves, read now
        for each in pools.values():
            for backend in each.pool.backends:
                if backend.leaving:
                    continue
                want = desired.get(backend.name)
                if want is None or not _same_server(backend, want, each.name):
                    self._leave(each, backend, settings.resume.drain_timeout_s)
                    changes.left.append(backend.name)
                    continue
                present.add(backend.name)
                if _update(backend, want, each.sizer.facts_of(backend)):
                    changes.updated.append(backend.name)
        for name, want in desired.items():
            if name in present:
                continue
            key = pool_key(want.models)
            if key not in pools:
                # Made empty (an entry without URL only says what it serves): it joins next.
                pools[key] = await self.make_pool(key, [replace(want, url="")], settings)
                members[key] = []
            returning = self._returning(pools[key], want)
            if returning is not None:  # left, not idle yet, and wanted again: it stays
                changes.joined.append(name)
                continue
            # A leaving backend of the same name (its URL changed) is forgotten at once:
            # its streams still end where they are, and its slots go back to its object.
            members[key] = [b for b in members[key] if b.name != name]
            backend = Backend.from_settings(want)
            members[key].append(backend)
            fresh.append((pools[key], backend))
            changes.joined.append(name)
        for name, each in pools.items():
            each.pool.set_members(
                members[name], lane_members(settings.lanes, _names(members[name]))
            )
            # Which lanes compete, their slot limits and deadlines: from the new members.
            each.scheduler.reconfigure(settings.lanes, each.pool.shares_backends)
            each.scheduler.max_preemptions = settings.preemption.max_per_request
            each.sizer.refit()
        self._set_pools(settings, list(pools.values()))
        for each, backend in fresh:
            each.health.joined(backend)
        self._changes.labels("joined").inc(len(changes.joined))
        self._changes.labels("left").inc(len(changes.left))
        return changes

    async def stop(self) -> None:
        """At shutdown: stop waiting for leaving backends to be idle."""
        for task in self._leaving.values():
            task.cancel()
        for task in list(self._leaving.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _returning(self, each: ModelPool, want: BackendSettings) -> Backend | None:
        """A backend still leaving that is the one wanted (same name and server): undrained."""
        for backend in each.pool.backends:
            if (
                backend.leaving
                and backend.name == want.name
                and _same_server(backend, want, each.name)
            ):
                self._leaving.pop(backend).cancel()
                backend.leaving = False
                each.pool.undrain(backend)
                _update(backend, want, each.sizer.facts_of(backend))
                return backend
        return None

    def _leave(self, each: ModelPool, backend: Backend, deadline_s: float) -> None:
        backend.leaving = True
        each.pool.drain(backend, deadline_s)
        self.events.warning(
            "backend_leaving",
            backend=backend.name,
            pool=each.name,
            in_flight=backend.in_flight,
            deadline_s=deadline_s,
        )
        self._leaving[backend] = asyncio.create_task(
            self._forget_when_idle(each, backend, deadline_s), name=f"leave-{backend.name}"
        )

    async def _forget_when_idle(self, each: ModelPool, backend: Backend, deadline_s: float) -> None:
        """Once nothing runs on it (its streams ended, or were carried over at the drain
        deadline): out of its pool, its learned facts dropped."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + deadline_s + LEAVE_GRACE_S
        # Polled: the pool signals nothing per backend when a slot is given back.
        while (backend.in_flight or backend.streams) and loop.time() < give_up:  # noqa: ASYNC110
            await asyncio.sleep(IDLE_CHECK_S)
        self._leaving.pop(backend, None)
        remaining = [b for b in each.pool.backends if b is not backend]
        each.pool.set_members(remaining, lane_members(each.sizer.settings.lanes, _names(remaining)))
        each.sizer.forget(backend.name)
        self.events.info(
            "backend_left", backend=backend.name, pool=each.name, in_flight=backend.in_flight
        )
        if not remaining:
            self._set_pools(each.sizer.settings, list(self.router.pools))
        else:
            each.sizer.refit()

    def _set_pools(self, settings: Settings, pools: list[ModelPool]) -> None:
        """The router over `pools`, less those left with no backend (but never none)."""
        kept = [each for each in pools if each.pool.backends]
        dropped = [each for each in pools if not each.pool.backends] if kept else []
        for each in dropped:
            self.events.info("pool_dropped", pool=each.name)
            stopping = asyncio.get_running_loop().create_task(each.health.stop())
            self._stopping.add(stopping)
            stopping.add_done_callback(self._stopping.discard)
        self.router.reconfigure(kept or pools[:1], settings.models, settings.limits)
        self.on_pools_changed()


def _names(backends: Sequence[Backend]) -> list[str]:
    return [b.name for b in backends]


def _same_server(backend: Backend, want: BackendSettings, pool: str) -> bool:
    """The wanted entry is this backend: the same URL, in the pool of the same models."""
    return backend.url == want.url.rstrip("/") and pool == pool_key(want.models)


def _reloadable(backend: Backend) -> tuple[Any, ...]:
    """What a reload may change on a backend that stays."""
    return (
        backend.weight,
        backend.api_key,
        backend.priority_field,
        backend.max_prefill_tokens,
        backend.max_concurrency,
        backend.prefill_budget_s,
        backend.prefill_budget_auto,
        backend.engine,
    )


def _update(backend: Backend, want: BackendSettings, facts: Any) -> bool:
    """Set what a reload may change on a backend that stays; True when something did."""
    before = _reloadable(backend)
    backend.weight = want.weight
    backend.api_key = want.api_key
    backend.priority_field = want.priority_field
    backend.max_prefill_tokens = want.max_prefill_tokens
    backend.concurrency_configured = want.max_concurrency is not None
    if want.max_concurrency is not None:
        backend.max_concurrency = want.max_concurrency
    else:
        # What the engine said (less the batch it was seen to run: TGI's), else the default.
        told = getattr(facts, "slots", None) or DEFAULT_MAX_CONCURRENCY
        backend.max_concurrency = min(told, backend.engine_batch or told)
    backend.prefill_budget_auto = want.prefill_budget_s is None
    if want.prefill_budget_s is not None:
        backend.prefill_budget_s = want.prefill_budget_s
    backend.engine_configured = want.engine is not None
    if want.engine is not None:
        backend.engine = want.engine
    elif facts is not None:
        backend.engine = facts.engine
    serves_changed = backend.served.mode != want.serves
    if serves_changed:  # read anew at the next check (or not at all: "any")
        backend.served = ServedModels.configured(want.models, want.serves)
    return _reloadable(backend) != before or serves_changed
