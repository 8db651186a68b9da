"""What the gateway learned of its backends, kept across a restart.

A restarted gateway (a rolling upgrade, a crash, a new config) knew each engine's
prefill rate, first-token cost, decode time and token ratio. Starting again from the
priors (a GPU's) fitted its deadlines to the wrong engine until traffic taught them
anew, and on a slow CPU that was a minute of refusals. So the learned figures are
written to a state file every `SAVE_EVERY_S` and at shutdown (JSON, replaced whole, so
a reader never sees half of one), and read back at start:

- a backend is known by its URL; figures older than `MAX_AGE_S` are left unread;
- restored figures count as learned, but as a few samples: the backend's own traffic
  outvotes them within a few requests (`BackendModel.restore`);
- the batch its engine was seen to run when full (`Backend.engine_batch`: TGI's, below
  the router's limit it reports) is kept with them;
- the engine's facts (kind, model, slots, prefill) are kept beside them, and when the
  first health round finds other facts at that URL (a new engine version, another
  model, another machine), the figures are dropped and learned anew (`check_facts`).

A file that cannot be read or written is a warning, never a failed start or request.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gateway.upstream.pool import Backend
from gateway.upstream.telemetry import BackendFacts

#: Written this often while serving (and at shutdown).
SAVE_EVERY_S = 60.0
#: Figures older than this are not trusted: the engine may have changed meanwhile.
MAX_AGE_S = 7 * 24 * 3600.0
#: `[health] state_file` that turns it off.
OFF = "off"
FORMAT = 1


def default_path() -> Path:
    """Where `serve` keeps it unless told: the user's state directory (XDG)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    return Path(base) / "llm-tail-gateway" / "learned.json"


def fingerprint(facts: BackendFacts | None) -> dict[str, Any] | None:
    """What identifies the engine behind a URL: when it changes, so do its figures."""
    if facts is None:
        return None
    return {
        "engine": facts.engine,
        "model": facts.model,
        "slots": facts.slots,
        "prefill": facts.prefill,
    }


class LearnedState:
    """The state file of one gateway: read at start, written while serving."""

    def __init__(
        self, path: str | Path, events: Any, *, clock: Any = time.time, on_failure: Any = None
    ) -> None:
        self.path = Path(path)
        self.events = events
        self._clock = clock
        #: Called on each failed read or write (the metric).
        self._on_failure = on_failure
        #: The facts each restored backend had when its figures were saved, by URL.
        self._restored_facts: dict[str, dict[str, Any] | None] = {}
        self.failures = 0

    def restore(self, backends: Iterable[Backend]) -> int:
        """Put the saved figures back into these backends' models; how many got some."""
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as error:
            self._warn("state_unreadable", error)
            return 0
        return self.restore_from(raw, backends)

    def restore_from(self, raw: Any, backends: Iterable[Backend]) -> int:
        """`restore` from a document already read (the file's, or Redis's)."""
        saved = raw.get("backends") if isinstance(raw, dict) else None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(saved, dict):
            return 0
        restored = 0
        now = self._clock()
        for backend in backends:
            entry = saved.get(backend.url)
            if not isinstance(entry, dict) or not isinstance(entry.get("figures"), dict):
                continue
            age = now - float(entry.get("saved_at", 0.0))
            if not 0 <= age <= MAX_AGE_S:
                continue
            backend.model.restore(entry["figures"])
            batch = entry.get("batch")
            if isinstance(batch, int) and not isinstance(batch, bool) and batch > 0:
                backend.engine_batch = batch
            self._restored_facts[backend.url] = entry.get("facts")
            restored += 1
            self.events.info(
                "backend_state_restored",
                backend=backend.name,
                age_s=round(age, 1),
                learned=entry["figures"],
                source=self.source,
            )
        return restored

    def check_facts(self, backend: Backend, facts: BackendFacts | None) -> None:
        """The engine said what it is: if not what it was when its figures were saved,
        they are forgotten (learned anew from this engine's traffic)."""
        if backend.url not in self._restored_facts or facts is None:
            return
        before = self._restored_facts.pop(backend.url)
        now = fingerprint(facts)
        if before is not None and before != now:
            backend.model.forget()
            backend.engine_batch = None
            self.events.warning(
                "backend_changed",
                backend=backend.name,
                before=before,
                now=now,
                hint="the engine at this address is not the one its saved figures were "
                "learned from: learning it anew",
            )

    def save(self, backends: Iterable[Backend], facts: dict[str, BackendFacts | None]) -> bool:
        """Write the learned figures of these backends (keeping other URLs' entries, a
        replica of another config's, as they were); False on failure (warned)."""
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, ValueError):
            raw = None
        document = self.merged(raw, backends, facts)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            partial.write_text(json.dumps(document, indent=1))
            os.replace(partial, self.path)
        except OSError as error:
            self._warn("state_unwritable", error)
            return False
        return True

    def merged(
        self, raw: Any, backends: Iterable[Backend], facts: dict[str, BackendFacts | None]
    ) -> dict[str, Any]:
        """The document `raw` with these backends' figures as of now (and entries past
        `MAX_AGE_S` dropped)."""
        now = self._clock()
        saved = {}
        if isinstance(raw, dict) and raw.get("format") == FORMAT:
            saved = {k: v for k, v in (raw.get("backends") or {}).items() if isinstance(v, dict)}
        for backend in backends:
            figures = backend.model.snapshot()
            if figures:
                saved[backend.url] = {
                    "saved_at": now,
                    "figures": figures,
                    "facts": fingerprint(facts.get(backend.name)),
                }
                if backend.engine_batch is not None:
                    saved[backend.url]["batch"] = backend.engine_batch
        saved = {
            url: entry
            for url, entry in saved.items()
            if now - float(entry.get("saved_at", 0)) <= MAX_AGE_S
        }
        return {"format": FORMAT, "backends": saved}

    @property
    def source(self) -> str:
        return str(self.path)

    def _warn(self, event: str, error: Exception) -> None:
        self.failures += 1
        if self._on_failure is not None:
            self._on_failure()
        self.events.warning(
            event,
            path=str(self.path),
            error=repr(error)[:200],
            hint="what was learned of the backends is not kept across a restart: "
            'set [health] state_file to a writable path, or "off"',
        )


class SharedLearnedState(LearnedState):
    """The same figures in the fleet's Redis ([redis]): one document for every replica,
    so a replica started in a rolling upgrade starts from what the fleet learned. Redis
    down is the store's warning and `gateway_redis_errors_total{op="learned_state"}`."""

    def __init__(self, store: Any, events: Any, *, clock: Any = time.time) -> None:
        super().__init__(store.key("learned"), events, clock=clock)
        self.store = store
        self.redis_key = store.key("learned")

    @property
    def source(self) -> str:
        return f"redis:{self.redis_key}"

    async def restore_shared(self, backends: Iterable[Backend]) -> int:
        raw = await self.store.call(
            "learned_state", lambda: self.store.client.get(self.redis_key), off_request_path=True
        )
        if not raw:
            return 0
        try:
            return self.restore_from(json.loads(raw), backends)
        except ValueError as error:
            self._warn("state_unreadable", error)
            return 0

    async def save_shared(
        self, backends: Iterable[Backend], facts: dict[str, BackendFacts | None]
    ) -> bool:
        client, key = self.store.client, self.redis_key
        raw = await self.store.call("learned_state", lambda: client.get(key), off_request_path=True)
        try:
            before = json.loads(raw) if raw else None
        except ValueError:
            before = None
        document = json.dumps(self.merged(before, backends, facts))
        done = await self.store.call(
            "learned_state",
            lambda: client.set(key, document, ex=int(MAX_AGE_S)),
            off_request_path=True,
        )
        return bool(done)
