"""Which pool serves a request's `model`: a pool per model, aliases, the catch-all.

Backends that list the same models (`[[backends]] models`) form one pool with its
own queues, slots, prefill budgets and learned figures (`app.build_pools`), so a
full pool never delays a request for another: each is a whole gateway for its
models, sharing only the door (admission, tenants, metrics). Backends that list
no model form the catch-all pool `*`, where each serves what its engine lists
(`served.py`: `/v1/models`, or TGI's `/info`, re-read on every health check), and
those whose engines answer any name (llama.cpp, TGI, the simulator) take names
nobody lists too: a config with one such backend and no `models` keeps working
unchanged, whatever its clients ask for.

The catch-all pool stays one pool whatever its engines list: its backends share
its queues, and each request is filtered to the backends that serve its model
inside the pool (`BackendPool.try_take`, as adapters are), waiting aside while
those are full (`Deferred.own_full`) so the requests behind it for other models go
(the scheduler looks past such waiters up to `OWN_FULL_LOOKAHEAD`). Pools formed
from what the engines list would move backends, with requests queued and in
flight, between schedulers whenever an engine loads a model; the shared queue
costs a model its share of the lanes' depth, slot limits and predicted waits under
another's overload. Where that isolation matters, name the models in the config:
a pool each.

Resolution, in order: an alias (`[[models]]`) becomes its target (one of its
weighted targets, picked at random per request, for a gradual switch); the
target's pool is the one whose config lists it, else one whose backends list it
as a LoRA adapter (`/v1/models` entries with a `parent`, re-read on health
checks), else the catch-all when a backend of it lists the name or answers any
name; none of those: `model_not_found`, before any token is counted or any slot
taken. A body without `model` (TGI's routes have none) goes to the default pool:
the `[[models]]` entry marked `default`, else the only or first pool.

The route also carries the caps of the model asked for: its `[[models]]` entry's
`limits`, else its target's entry's, over `[limits]` (`config.model_limits`, a map
built here once; the pool's sizer then tightens them to what its backends accept).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.config import LimitsSettings, ModelSettings, model_limits
from gateway.outcomes import ModelNotFound
from gateway.upstream.pool import BackendPool
from gateway.upstream.served import lists

#: The pool of the backends whose entries name no model: each serves what its engine lists.
CATCH_ALL = "*"


def pool_key(models: Sequence[str]) -> str:
    """A pool's name: its models in their configured order, or `*`."""
    return ",".join(dict.fromkeys(models)) if models else CATCH_ALL


@dataclass(slots=True)
class ModelPool:
    """One pool: the backends serving the same models, and the machinery that is per pool.

    `scheduler`, `sizer` and `health` are typed loosely: this module only routes."""

    name: str
    serves: frozenset[str]
    pool: BackendPool
    scheduler: Any
    sizer: Any
    health: Any

    @property
    def catch_all(self) -> bool:
        return not self.serves

    def lists_adapter(self, model: str) -> bool:
        return any(model in backend.lora.listed for backend in self.pool.backends)

    def lists(self, model: str) -> bool:
        """Its config names `model`, or a backend's engine lists it (adapters included)."""
        return model in self.serves or any(lists(b, model) for b in self.pool.backends)

    def takes(self, model: str) -> bool:
        """The catch-all pool takes `model`: a backend lists it or answers any name (or
        it has no backend yet: then the request hears `no_backend`, not a 404)."""
        backends = self.pool.backends
        return not backends or any(lists(b, model) or b.served.answers_unlisted() for b in backends)

    def engine_names(self) -> list[str]:
        """The names its backends' engines list, each once, sorted per backend."""
        names: dict[str, None] = {}
        for backend in self.pool.backends:
            if backend.served.from_engine and backend.served.names:
                names.update(dict.fromkeys(sorted(backend.served.names)))
        return list(names)


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: its pool, and the model name its backend is sent."""

    pool: ModelPool
    #: The body's `model` for the backend: the alias's target; None: leave the body be.
    target: str | None
    #: The caps configured for the model asked (`[[models]] limits` over `[limits]`).
    limits: LimitsSettings
    #: The model its backend must serve: the target, else the name asked (None: none).
    model: str | None = None


class ModelRouter:
    """The pools and aliases, and the one question: which pool for this `model`?"""

    def __init__(
        self,
        pools: Sequence[ModelPool],
        aliases: Sequence[ModelSettings] = (),
        *,
        pick: Callable[[Sequence[str], Sequence[float]], str] | None = None,
        limits: LimitsSettings | None = None,
    ) -> None:
        assert pools, "a gateway has at least one pool (the catch-all when none is named)"
        self.pools = list(pools)
        self.aliases = {alias.name: alias.weighted_targets() for alias in aliases}
        #: `[limits]`, and the caps of each (asked, sent) pair that has its own.
        self.limits = limits or LimitsSettings()
        self._limits = model_limits(aliases, self.limits)
        self._default_limits = self.limits
        self._by_model = {model: p for p in self.pools for model in p.serves}
        self._catch_all = next((p for p in self.pools if p.catch_all), None)
        default = next((a for a in aliases if a.default), None)
        self.default = self.pools[0]
        if default is not None:
            first = default.weighted_targets()[0][0]
            self.default = self.resolve(first).pool
            self._default_limits = self._limits.get((default.name, first), self.limits)
        self._pick = pick or (lambda names, weights: random.choices(names, weights)[0])

    def resolve(self, model: str | None) -> Route:
        """The request's route; raises ModelNotFound when no pool serves `model`."""
        if model is None:
            return Route(self.default, None, self._default_limits)
        targets = self.aliases.get(model)
        target = model
        if targets is not None:
            names = [name for name, _ in targets]
            target = names[0] if len(names) == 1 else self._pick(names, [w for _, w in targets])
        pool = self._by_model.get(target)
        if pool is None:
            pool = next((p for p in self.pools if p.lists_adapter(target)), None)
        if pool is None and self._catch_all is not None and self._catch_all.takes(target):
            pool = self._catch_all
        if pool is None:
            raise ModelNotFound(
                f"The model {model!r} does not exist here. Served: "
                + ", ".join(self.listed_names())
                + ".",
                param="model",
            )
        limits = self._limits.get((model, target), self.limits) if self._limits else self.limits
        return Route(pool, target if target != model else None, limits, target)

    def listed_names(self) -> list[str]:
        """Every name a client may ask for that the gateway knows: served models (the
        config's, then what the engines list), adapters the backends list, aliases; each
        once, in that order."""
        names: dict[str, None] = {}
        for p in self.pools:
            names.update(dict.fromkeys(sorted(p.serves)))
            names.update(dict.fromkeys(p.engine_names()))
            for backend in p.pool.backends:
                names.update(dict.fromkeys(sorted(backend.lora.listed)))
        names.update(dict.fromkeys(self.aliases))
        return list(names)

    def of_backend(self, name: str) -> ModelPool | None:
        return next((p for p in self.pools if any(b.name == name for b in p.pool.backends)), None)

    def reconfigure(
        self, pools: Sequence[ModelPool], aliases: Sequence[ModelSettings], limits: LimitsSettings
    ) -> None:
        """A reload, or backends that came or went: the same router (the metrics read it)
        over these pools, aliases and caps, for the requests resolved from now on."""
        pick = self._pick
        self.__init__(pools, aliases, pick=pick, limits=limits)  # type: ignore[misc]
