"""The config reloaded while the gateway runs: on SIGHUP, `POST /admin/reload`, or when
the file changes ([discovery] watch_config_s).

A reload reads the config the gateway was started with again (the file, the GATEWAY_*
variables, the command's flags) and applies it to the requests that arrive from then
on: backends (joining and leaving, `upstream/membership.py`), models and aliases,
lanes' settings, tenants, API keys and their quotas, limits, routing, health checks,
resume, DNS discovery. Requests queued and streams in flight are untouched: they keep
the pool, scheduler, lane and backend they hold. What was learned stays with the
backends and lanes that remain.

A file that does not load (bad TOML, a bad value, a rule broken) changes nothing: the
config in force stays, and one warning line says why, with
`gateway_config_reloads_total{result="failed"}`. What cannot change in a running
process keeps its old value, and the line names it (`not_applied`): where it listens
and how it accepts connections, the tokenizer, the backend hop's timeouts, retries'
memory, shadow, tracing, Redis, logging, the state file, the tenants' fair share, and
the lanes' names and order (their queues hold requests). Those need a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from msgspec.structs import replace
from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.admission.auth import ClientKeys
from gateway.config import ConfigError, Settings
from gateway.state import GatewayState
from gateway.upstream.discovery import DnsDiscovery
from gateway.upstream.membership import Changes, Membership

#: Sections read once at start: a reload keeps them as they were.
RESTART_SECTIONS = ("tokenizer", "timeouts", "retries", "shadow", "tracing", "redis", "logging")
#: The [server] keys a reload applies (read per request); every other one needs a restart.
LIVE_SERVER_KEYS = ("read_timeout_s", "sse_keepalive_s")
#: Keys of live sections that are read once at start.
RESTART_KEYS = {"health": ("state_file", "probe_on_start"), "tenants": ("fair_share",)}


def settings_hash(settings: Settings) -> str:
    """A short digest of the settings in force (what a reload loaded), for the log line
    and `gateway_config_info`: two replicas on the same config show the same one."""
    return hashlib.sha256(msgspec.json.encode(settings)).hexdigest()[:12]


def kept_for_restart(old: Settings, new: Settings) -> tuple[Settings, list[str]]:
    """`new` with what cannot change live put back to `old`'s, and the keys that differed."""
    not_applied: list[str] = []
    changes: dict[str, Any] = {}
    for section in RESTART_SECTIONS:
        if getattr(new, section) != getattr(old, section):
            not_applied.append(section)
            changes[section] = getattr(old, section)
    server_kept = {
        key: getattr(old.server, key)
        for key in old.server.__struct_fields__
        if key not in LIVE_SERVER_KEYS and getattr(new.server, key) != getattr(old.server, key)
    }
    not_applied += [f"server.{key}" for key in server_kept]
    changes["server"] = replace(new.server, **server_kept)
    for section, keys in RESTART_KEYS.items():
        kept = {
            key: getattr(getattr(old, section), key)
            for key in keys
            if getattr(getattr(new, section), key) != getattr(getattr(old, section), key)
        }
        not_applied += [f"{section}.{key}" for key in kept]
        changes[section] = replace(getattr(new, section), **kept)
    if [lane.name for lane in new.lanes] != [lane.name for lane in old.lanes]:
        not_applied.append("lanes (names and order)")
        changes["lanes"] = old.lanes
    return replace(new, **changes), not_applied


def changed_sections(old: Settings, new: Settings) -> list[str]:
    return [name for name in old.__struct_fields__ if getattr(old, name) != getattr(new, name)]


@dataclass(slots=True)
class ReloadResult:
    """What one reload did (the admin route answers it, the log line says it)."""

    ok: bool
    reason: str
    error: str | None = None
    sha256: str | None = None
    changed: list[str] = field(default_factory=list)
    not_applied: list[str] = field(default_factory=list)
    changes: Changes = field(default_factory=Changes)

    def to_json(self) -> dict[str, Any]:
        return {
            "result": "ok" if self.ok else "failed",
            "reason": self.reason,
            "error": self.error,
            "sha256": self.sha256,
            "changed": self.changed,
            "not_applied": self.not_applied,
            "joined": self.changes.joined,
            "left": self.changes.left,
            "updated": self.changes.updated,
        }


class Reloader:
    """Loads the config again and applies it; keeps the DNS names' backends current."""

    def __init__(
        self,
        state: GatewayState,
        load: Callable[[], Settings] | None,
        membership: Membership,
        registry: CollectorRegistry,
        *,
        path: str | None = None,
    ) -> None:
        self.state = state
        #: Reads the config as at start (file, environment, flags); None: nothing to read.
        self.load = load
        self.path = path
        self.membership = membership
        self.discovery = DnsDiscovery(state.events, self.sync_backends, registry)
        #: One reload or DNS change applied at a time.
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[ReloadResult]] = set()
        self._reloads = Counter(
            "gateway_config_reloads",
            "Config reloads (SIGHUP, POST /admin/reload, the file watch), by result: ok, or "
            "failed (the config in force was kept; the warning line says why).",
            ["result"],
            registry=registry,
        )
        self._last_ok = Gauge(
            "gateway_config_last_reload_successful",
            "1 when the last reload loaded, 0 when it failed (the config in force is older "
            "than the file).",
            registry=registry,
        )
        self._loaded_at = Gauge(
            "gateway_config_last_reload_success_timestamp_seconds",
            "When the config in force was loaded (Unix time; start-up counts).",
            registry=registry,
        )
        self._info = Gauge(
            "gateway_config_info",
            "The config in force, by a digest of its settings (the same digest: the same config).",
            ["sha256"],
            registry=registry,
        )
        self._last_ok.set(1)
        self._loaded_at.set(time.time())
        self._info.labels(settings_hash(state.settings)).set(1)

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Before the first request: the DNS names resolved and their backends in the
        pools; then the names kept fresh, and the file watched when asked."""
        settings = self.state.settings
        self.discovery.configure(settings)
        if self.discovery.entries(settings):
            async with self._lock:
                changes = await self._sync(settings, resolve=True)
            self.state.events.info("backends_found", joined=changes.joined, cause="dns")
        self.discovery.start()
        watch_s = settings.discovery.watch_config_s
        if watch_s and self.path is not None and self.load is not None:
            self._watch = asyncio.create_task(self._watch_file(watch_s), name="config-watch")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.discovery.stop()
        await self.membership.stop()

    def request(self, reason: str) -> None:
        """From a signal handler: reload soon, in a task of its own."""
        task = asyncio.get_running_loop().create_task(self.reload(reason))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    # -- reloading ----------------------------------------------------------------------

    async def reload(self, reason: str) -> ReloadResult:
        """Read the config again and apply it; a config that does not load changes nothing."""
        async with self._lock:
            result = await self._reload(reason)
        self._reloads.labels("ok" if result.ok else "failed").inc()
        self._last_ok.set(1 if result.ok else 0)
        events = self.state.events
        if result.ok:
            self._loaded_at.set(time.time())
            events.info("config_reloaded", path=self.path, **_fields(result))
        else:
            events.warning(
                "config_reload_failed",
                path=self.path,
                reason=reason,
                error=result.error,
                hint="the config in force is unchanged; fix the file and reload again",
            )
        return result

    async def _reload(self, reason: str) -> ReloadResult:
        if self.load is None:
            return ReloadResult(False, reason, error="this gateway was built without a config")
        try:
            fresh = self.load()
        except ConfigError as error:
            return ReloadResult(False, reason, error="; ".join(error.problems))
        except (OSError, ValueError) as error:
            return ReloadResult(False, reason, error=f"{type(error).__name__}: {error}")
        old = self.state.settings
        settings, not_applied = kept_for_restart(old, fresh)
        changed = changed_sections(old, settings)
        self.apply_settings(settings)
        changes = await self._sync(settings, resolve=True)
        digest = settings_hash(settings)
        self._info.clear()
        self._info.labels(digest).set(1)
        return ReloadResult(True, reason, None, digest, changed, not_applied, changes)

    def apply_settings(self, settings: Settings) -> None:
        """What is read per request from now on: the settings, keys, tenants, quotas, and
        each pool's lanes, caps, routing and health checks (its members: `_sync`)."""
        state = self.state
        state.settings = settings
        state.keys = ClientKeys(settings.api_keys)
        state.tenants.reconfigure(settings)
        state.quotas.set_keys(settings.api_keys)
        for each in state.pools.pools:
            each.sizer.reconfigure(settings)
            each.health.settings = settings.health
            each.pool.health = settings.health
            each.pool.routing = settings.routing
        self.discovery.configure(settings)

    async def _sync(self, settings: Settings, *, resolve: bool = False) -> Changes:
        """The pools made to hold the configured backends and the DNS names' addresses
        (`resolve`: the names asked again first, as a reload may have changed them)."""
        if resolve and self.discovery.entries(settings):
            await self.discovery.refresh()
        return await self.membership.apply(settings, self.discovery.backends(settings))

    async def sync_backends(self) -> None:
        """The DNS names' addresses changed: the pools follow."""
        async with self._lock:
            changes = await self._sync(self.state.settings)
        if changes.joined or changes.left:
            self.state.events.info(
                "backends_changed", joined=changes.joined, left=changes.left, cause="dns"
            )

    async def _watch_file(self, every_s: float) -> None:
        """Reload when the file's modification time or size changes. A ConfigMap volume
        swaps a symlink: `stat` follows it, so the swap is seen too."""
        assert self.path is not None
        seen = _stamp(self.path)
        while True:
            await asyncio.sleep(every_s)
            now = _stamp(self.path)
            if now != seen:
                seen = now
                await self.reload("file_changed")


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size, stat.st_ino


def _fields(result: ReloadResult) -> dict[str, Any]:
    fields = result.to_json()
    del fields["result"], fields["error"]
    if result.not_applied:
        fields["hint"] = "not_applied needs a restart: the values in force are the old ones"
    return fields
