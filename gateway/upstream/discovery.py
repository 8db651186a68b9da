"""Backends found by DNS: `[[backends]] dns = "tgi.models.svc.cluster.local:80"`.

A Kubernetes headless Service (`clusterIP: None`) answers its name with one A (or
AAAA) record per ready pod: those addresses, with the entry's port, are the servers.
Each becomes a backend of its own, named `<entry name>@<address>`, with the entry's
other settings (slots, weight, models, key), and `membership.py` makes the pools
follow: a new address joins, a vanished one is drained (its streams finish, or are
carried over at the drain deadline) and forgotten once idle.

The names are asked again every [discovery] interval_s, or sooner when the records'
TTL is shorter (at least a second apart), of the system's resolvers
(/etc/resolv.conf, with its search domains: in a pod, the cluster DNS), or of the
servers [discovery] nameservers names. A resolution that fails (a timeout, no such
name, no DNS server) keeps the addresses last known, with a warning and a metric: a
DNS outage must not empty the pools. A name that exists with no address (a Service
scaled to zero) has no server, and its backends leave.

dnspython does the asking: it returns the records' TTL, which `getaddrinfo` does not,
and its resolver can be pointed at any server and port (a test's own DNS server).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver
from msgspec.structs import replace
from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.config import BackendSettings, DiscoverySettings, Settings
from gateway.upstream.membership import ENTRY_SEPARATOR

#: Never ask a name again sooner than this, whatever its TTL says.
MIN_INTERVAL_S = 1.0
DNS_PORT = 53


@dataclass(frozen=True, slots=True)
class Resolved:
    """One name's servers as last resolved, and until when that answer holds."""

    addresses: tuple[str, ...]
    #: Seconds the records may be kept (the smallest TTL of the answers).
    ttl_s: float


def split_dns(entry: str) -> tuple[str, int]:
    """`tgi.models.svc.cluster.local:80` as (name, port)."""
    name, _, port = entry.rpartition(":")
    return name, int(port)


def backend_url(address: str, port: int) -> str:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"http://{host}:{port}"


def nameserver(text: str) -> dns.nameserver.Do53Nameserver:
    """`10.0.0.10`, `127.0.0.1:5353`, `::1` or `[::1]:5353` as a server to ask."""
    if text.startswith("["):
        address, _, port = text[1:].partition("]:")
        return dns.nameserver.Do53Nameserver(address.rstrip("]"), int(port or DNS_PORT))
    if text.count(":") == 1:
        address, port = text.split(":")
        return dns.nameserver.Do53Nameserver(address, int(port))
    return dns.nameserver.Do53Nameserver(text, DNS_PORT)


def make_resolver(settings: DiscoverySettings) -> dns.asyncresolver.Resolver:
    """The system's resolver (/etc/resolv.conf), or one asking the configured servers."""
    if not settings.nameservers:
        return dns.asyncresolver.Resolver()
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [nameserver(text) for text in settings.nameservers]
    return resolver


async def resolve(resolver: dns.asyncresolver.Resolver, name: str, timeout_s: float) -> Resolved:
    """Every A and AAAA address of `name`, sorted; raises DNSException when the name
    could not be resolved (no such name, no server answered in time)."""
    addresses: list[str] = []
    ttls: list[float] = []
    for kind in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(name, kind, lifetime=timeout_s, search=True)
        except dns.resolver.NoAnswer:  # the name exists without records of this kind
            continue
        addresses += [record.address for record in answer]
        if answer.rrset is not None:
            ttls.append(float(answer.rrset.ttl))
    return Resolved(tuple(sorted(set(addresses))), min(ttls, default=float("inf")))


class DnsDiscovery:
    """The addresses of every `[[backends]] dns` name, kept fresh; `on_change` is awaited
    when any changed (the pools then follow, `membership.py`)."""

    def __init__(
        self,
        events: Any,
        on_change: Callable[[], Awaitable[None]],
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.events = events
        self.on_change = on_change
        self.clock = clock
        #: By `dns` entry (name:port): what it resolved to last.
        self.known: dict[str, Resolved] = {}
        self._due: dict[str, float] = {}
        self._settings = DiscoverySettings()
        self._resolver: dns.asyncresolver.Resolver | None = None
        self._entries: list[str] = []
        self._task: asyncio.Task[None] | None = None
        self._resolutions = Counter(
            "gateway_dns_resolutions",
            "Resolutions of [[backends]] dns names, by name and result (ok, or failed: the "
            "addresses last known were kept).",
            ["name", "result"],
            registry=registry,
        )
        self._addresses = Gauge(
            "gateway_dns_addresses",
            "Addresses a [[backends]] dns name resolves to (its backends), as last known.",
            ["name"],
            registry=registry,
        )

    @staticmethod
    def entries(settings: Settings) -> list[str]:
        return list(dict.fromkeys(b.dns for b in settings.backends if b.dns))

    def configure(self, settings: Settings) -> None:
        """The names and the resolver of the settings in force (at start, on a reload)."""
        if settings.discovery != self._settings or self._resolver is None:
            self._settings = settings.discovery
            self._resolver = None  # made when first needed: no /etc/resolv.conf read before
        self._entries = self.entries(settings)
        for gone in set(self.known) - set(self._entries):
            del self.known[gone]
            self._due.pop(gone, None)
            with contextlib.suppress(KeyError):  # never resolved: no series
                self._addresses.remove(gone)

    def backends(self, settings: Settings) -> list[BackendSettings]:
        """The configured backends with each DNS entry replaced by its addresses: a
        backend per address, `<name>@<address>`, with the entry's settings."""
        found: list[BackendSettings] = []
        for entry in settings.backends:
            if not entry.dns:
                found.append(entry)
                continue
            _, port = split_dns(entry.dns)
            resolved = self.known.get(entry.dns)
            for address in resolved.addresses if resolved is not None else ():
                found.append(
                    replace(
                        entry,
                        dns="",
                        url=backend_url(address, port),
                        name=f"{entry.name}{ENTRY_SEPARATOR}{address}",
                    )
                )
        return found

    async def refresh(self, only_due: bool = False) -> bool:
        """Resolve the names (those due, or all); True when some name's addresses changed."""
        now = self.clock()
        changed = False
        for entry in self._entries:
            if only_due and self._due.get(entry, 0.0) > now:
                continue
            changed |= await self._refresh_one(entry)
        return changed

    async def _refresh_one(self, entry: str) -> bool:
        name, _ = split_dns(entry)
        settings = self._settings
        before = self.known.get(entry)
        try:
            if self._resolver is None:
                self._resolver = make_resolver(settings)
            resolved = await resolve(self._resolver, name, settings.timeout_s)
        except (dns.exception.DNSException, OSError, ValueError) as error:
            self._resolutions.labels(entry, "failed").inc()
            self._due[entry] = self.clock() + settings.interval_s
            self.events.warning(
                "dns_resolution_failed",
                name=entry,
                error=f"{type(error).__name__}: {error}"[:200],
                kept=list(before.addresses) if before is not None else [],
                hint="the addresses last known stay in use",
            )
            return False
        self._resolutions.labels(entry, "ok").inc()
        self._addresses.labels(entry).set(len(resolved.addresses))
        wait = min(settings.interval_s, max(MIN_INTERVAL_S, resolved.ttl_s))
        self._due[entry] = self.clock() + wait
        self.known[entry] = resolved
        if before is not None and before.addresses == resolved.addresses:
            return False
        self.events.info(
            "dns_addresses_changed",
            name=entry,
            addresses=list(resolved.addresses),
            before=list(before.addresses) if before is not None else None,
        )
        return True

    # -- the loop ----------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="dns-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._next_in())
            try:
                if await self.refresh(only_due=True):
                    await self.on_change()
            except Exception as error:  # noqa: BLE001 - discovery must go on
                self.events.warning("dns_discovery_failed", error=repr(error)[:200])

    def _next_in(self) -> float:
        if not self._entries:
            return self._settings.interval_s
        now = self.clock()
        return max(0.0, min(self._due.get(entry, now) for entry in self._entries) - now)
