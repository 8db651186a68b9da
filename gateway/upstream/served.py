"""What a backend serves when its `[[backends]]` entry names no `models`: what its engine lists.

vLLM, SGLang and most OpenAI-compatible servers list their models on `/v1/models` and
answer 404 for any other name; TGI lists its one model as `/info` `model_id`. So a
backend whose entry has no `models` serves what its engine lists, read on every health
check (`health.py`), so a model loaded or removed later is followed within a check.
Some engines answer *any* name, though: llama.cpp lists its model file and serves it
whatever `model` says, TGI ignores `model` (its API calls the field unused; its users'
clients send `"tgi"`), and the project's simulator does unless run strict. For those,
the names they list are where those names go, and they also take names nobody lists
(`any_name`), as they always did. `[[backends]] serves` says which for an engine that
cannot be told: "listed" (only what it lists), "any" (any name, its listing not read:
the catch-all of earlier releases); "auto" (the default) decides by the engine:

| engine (what it says it is) | serves |
| --- | --- |
| vLLM, SGLang (`owned_by`), the simulator run strict | what it lists |
| llama.cpp (`/props`, `owned_by` llamacpp), TGI (`/info`), the simulator | that, and any name |
| another that lists names | what it lists (as OpenAI's own API: a name it lists or a 404) |
| one that lists nothing (an empty list, or no `/v1/models` nor `/info`) | any name |

A listing that fails (the engine up but its `/v1/models` timing out) keeps the last one
read, with a warning line and `gateway_backend_model_listing_failures_total`: a failed
read never changes where requests go. Before the first read a backend is unknown and
treated as answering any name (today's behaviour); the first round of checks reads every
listing at start and `/readyz` answers 503 until it is done, so a gateway rolled out
behind a load balancer takes traffic only once it knows where each model is.

Which backends a request may use (`serving`): those that list its model, and those nothing
is known of (not read yet, `serves = "any"`, an engine that lists nothing: they take
every name, as before); when nobody lists it, those that answer any name (llama.cpp, TGI:
the wrong model for a name another backend lists, the right place for one nobody lists).
None: `model_not_found`, before anything is counted (`models.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from gateway.config import ServesMode
from gateway.upstream.adapters import BackendAdapters
from gateway.upstream.telemetry import ModelListing

#: Engines that enforce the names they list (a 404 for any other).
ENFORCING = frozenset({"vllm", "sglang"})
#: Engines that answer any name whatever they list.
ANSWERS_ANY = frozenset({"llama.cpp", "tgi"})


def answers_any_name(
    mode: ServesMode, engine: str | None, strict: bool | None, lists_any: bool = True
) -> bool:
    """Whether a backend also takes names it does not list (the table above); `lists_any`:
    its listing named at least one model."""
    if mode != "auto":
        return mode == "any"
    if engine in ANSWERS_ANY:
        return True
    if engine == "simulator":
        return not strict
    if engine in ENFORCING:
        return False
    return not lists_any  # another engine: as OpenAI's API when it lists names


@dataclass(slots=True)
class ServedModels:
    """The names one backend serves, and whether it takes others too."""

    #: `[[backends]] serves`.
    mode: ServesMode = "auto"
    #: Read from its engine (its entry names no `models`); else the config's list.
    from_engine: bool = True
    #: What it lists: the last listing read (or the config's `models`); None: none read yet.
    names: frozenset[str] | None = None
    #: It also answers names it does not list.
    any_name: bool = False
    #: The engine its last listing said it is (for /debug and the log line).
    engine: str | None = None
    #: Listings that failed, in all (the metric), and whether the last one did.
    failures: int = 0
    failing: bool = False

    @classmethod
    def configured(cls, models: Sequence[str], mode: ServesMode) -> ServedModels:
        """A backend whose entry says what it serves (`models`), or that reads its engine."""
        if models:
            return cls(mode, from_engine=False, names=frozenset(models))
        if mode == "any":  # today's catch-all: nothing to read
            return cls(mode, from_engine=False, any_name=True)
        return cls(mode)

    @property
    def known(self) -> bool:
        return self.names is not None

    def answers_unlisted(self) -> bool:
        """It takes a name it does not list: it answers any, or nothing was read yet."""
        return self.any_name or self.names is None

    def lists_nothing(self) -> bool:
        """Nothing is known of what it serves (not read yet, `serves = "any"`, or an engine
        that lists nothing) and it takes any name: the catch-all of earlier releases."""
        return not self.names and self.answers_unlisted()

    def describe(self) -> dict[str, object]:
        """For /debug/backends and `check-config --probe`."""
        return {
            "from": "engine" if self.from_engine else ("config" if self.names else "serves=any"),
            "models": None if self.names is None else sorted(self.names),
            "any_name": self.answers_unlisted(),
            "engine": self.engine,
            "listing_failing": self.failing,
        }

    def note(self, listing: ModelListing | None, configured_engine: str | None) -> str | None:
        """One read of its engine's listing (None: it failed); what changed, for one log
        line: "listed" (the names or the way changed), "failed" (it failed, after an
        answer or at the first read), or None (as before)."""
        if listing is None:
            self.failures += 1
            was_failing, self.failing = self.failing, True
            return None if was_failing else "failed"
        self.failing = False
        engine = configured_engine or listing.engine
        any_name = answers_any_name(self.mode, engine, listing.strict, bool(listing.names))
        if (listing.names, any_name, engine) == (self.names, self.any_name, self.engine):
            return None
        self.names, self.any_name, self.engine = listing.names, any_name, engine
        return "listed"


class ServingBackend(Protocol):
    """What `serving` reads of a backend (`pool.Backend`)."""

    served: ServedModels
    lora: BackendAdapters


B = TypeVar("B", bound=ServingBackend)


def lists(backend: ServingBackend, model: str) -> bool:
    """The backend lists `model`: its engine or the config does, or it is an adapter of it."""
    names = backend.served.names
    return (names is not None and model in names) or model in backend.lora.listed


def serving(model: str, backends: Sequence[B]) -> list[B]:
    """The backends `model`'s request may go to, in their order: those that list it (and
    those nothing is known of, as before); when none lists it, those that answer any
    name. Empty: none serves it."""
    if any(lists(b, model) for b in backends):
        return [b for b in backends if lists(b, model) or b.served.lists_nothing()]
    return [b for b in backends if b.served.answers_unlisted()]
