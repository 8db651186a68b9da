"""[redis]: the state several gateway replicas share (leases, quotas, signals)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from gateway.config.constraints import PositiveFloat, rule


class RedisSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Shared state for several gateway replicas in front of the same backends: slot
    leases (each backend's `max_concurrency` and prefill budget hold across replicas),
    tenant quotas and fleet signals. Empty url: one replica, everything local.

    Redis unreachable or slow: each replica falls back to its share of each backend's
    slots and of each quota, with a warning and `gateway_redis_up 0`; it rejoins when
    Redis answers again. Requests never fail because Redis did."""

    #: redis://host:port/db (or rediss://, unix://); empty: no shared state.
    url: Annotated[
        str,
        rule(
            "be empty (off) or redis://, rediss:// or unix:// URL",
            pattern=r"(?i)^(?:$|(?:redis|rediss|unix)://\S+)",
        ),
    ] = ""
    #: Prefix of every key, so several gateway fleets can share one Redis.
    key_prefix: Annotated[str, rule("be set", min_length=1)] = "llmgw"
    #: A lease not renewed for this long is gone: a crashed replica's slots come back.
    lease_ttl_s: Annotated[float, rule("be from 0.5 to 300", ge=0.5, le=300)] = 5.0
    #: Longest a Redis call may take on the request path before the replica falls back
    #: to local state (loopback answers in ~0.2 ms; a slow Redis must not become the tail).
    #: Redis's time, not this process's: a deadline woken up to late (a busy loop, a
    #: starved process) gives the call the same time once more (`fleet/store.py`).
    timeout_s: PositiveFloat = 0.1
    #: How often leases are renewed, counts refreshed and signals published (and, when
    #: fallen back, Redis tried again); 0: a third of lease_ttl_s.
    tick_s: Annotated[float, rule("be >= 0 (0: lease_ttl_s / 3)", ge=0)] = 0.0
    #: This replica's share of each backend's slots and of each quota while Redis is
    #: down; 0: one over the number of replicas last seen in Redis (1 before any).
    replica_share: Annotated[float, rule("be from 0 to 1 (0: learned)", ge=0, le=1)] = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.url)

    @property
    def interval_s(self) -> float:
        return self.tick_s or self.lease_ttl_s / 3
