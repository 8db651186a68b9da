"""The whole settings, one field per section, and the sections' names as the sources
(TOML, GATEWAY_* variables, CLI flags) spell them.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import field

from gateway.config.backends import DEFAULT_MAX_CONCURRENCY, BackendSettings
from gateway.config.constraints import rule
from gateway.config.discovery import DiscoverySettings
from gateway.config.lanes import LaneSettings, default_lanes, slot_limit
from gateway.config.limits import LimitsSettings, TokenizerSettings
from gateway.config.models import ModelSettings
from gateway.config.observability import LoggingSettings, TracingSettings
from gateway.config.preemption import PreemptionSettings
from gateway.config.redis import RedisSettings
from gateway.config.resume import ResumeSettings
from gateway.config.retries import RetrySettings
from gateway.config.routing import RoutingSettings
from gateway.config.server import ServerSettings
from gateway.config.shadow import ShadowSettings
from gateway.config.tenants import ApiKeySettings, TenantSettings
from gateway.config.timeouts import HealthSettings, TimeoutSettings


class Settings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    server: ServerSettings = field(default_factory=ServerSettings)
    tokenizer: TokenizerSettings = field(default_factory=TokenizerSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    backends: list[BackendSettings] = field(default_factory=list)
    lanes: Annotated[list[LaneSettings], rule("have at least one lane", min_length=1)] = field(
        default_factory=default_lanes
    )
    timeouts: TimeoutSettings = field(default_factory=TimeoutSettings)
    health: HealthSettings = field(default_factory=HealthSettings)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    tenants: TenantSettings = field(default_factory=TenantSettings)
    retries: RetrySettings = field(default_factory=RetrySettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    api_keys: list[ApiKeySettings] = field(default_factory=list)
    #: Model names and aliases ([[models]]); backends' own lists are in [[backends]].
    models: list[ModelSettings] = field(default_factory=list)
    shadow: ShadowSettings = field(default_factory=ShadowSettings)
    tracing: TracingSettings = field(default_factory=TracingSettings)
    redis: RedisSettings = field(default_factory=RedisSettings)
    resume: ResumeSettings = field(default_factory=ResumeSettings)
    preemption: PreemptionSettings = field(default_factory=PreemptionSettings)
    discovery: DiscoverySettings = field(default_factory=DiscoverySettings)

    def to_dict(self) -> dict[str, Any]:
        """Plain, freshly built dicts and lists (a caller may edit them, e.g. to mask keys)."""
        result: dict[str, Any] = msgspec.to_builtins(self)
        return result

    @property
    def total_slots(self) -> int:
        return sum(b.max_concurrency or DEFAULT_MAX_CONCURRENCY for b in self.backends)

    def lane_backends(self, lane: LaneSettings) -> list[BackendSettings]:
        if lane.backends is None:
            return list(self.backends)
        return [b for b in self.backends if b.name in lane.backends]

    def lane_slot_limit(self, lane: LaneSettings) -> int:
        """Slots a lane may hold: its absolute and its share limit, at least one.

        The share is of the slots of the backends the lane may use.
        """
        slots = sum(b.max_concurrency or DEFAULT_MAX_CONCURRENCY for b in self.lane_backends(lane))
        return slot_limit(lane, slots)


TABLES: dict[str, type[msgspec.Struct]] = {
    "server": ServerSettings,
    "tokenizer": TokenizerSettings,
    "limits": LimitsSettings,
    "timeouts": TimeoutSettings,
    "health": HealthSettings,
    "routing": RoutingSettings,
    "tenants": TenantSettings,
    "retries": RetrySettings,
    "logging": LoggingSettings,
    "shadow": ShadowSettings,
    "tracing": TracingSettings,
    "redis": RedisSettings,
    "resume": ResumeSettings,
    "preemption": PreemptionSettings,
    "discovery": DiscoverySettings,
}
ARRAYS: dict[str, type[msgspec.Struct]] = {
    "backends": BackendSettings,
    "lanes": LaneSettings,
    "api_keys": ApiKeySettings,
    "models": ModelSettings,
}


#: A key's position in the raw settings: ("server", "port"), ("lanes", 1, "max_slots").
KeyPath = tuple[str | int, ...]
#: Where a value that is not from the file came from, by key: "GATEWAY_SERVER_PORT".
Origins = dict[KeyPath, str]
