"""Typed settings: defaults, then a TOML file, then GATEWAY_* variables, then CLI flags.

A bad value stops start-up with one line naming the key (`ConfigError`), because
an SRE reading a crash loop needs the key, not a traceback.

The settings are frozen msgspec Structs: each field's type and range are declared next
to it (`Annotated[int, rule("be > 0", gt=0)]`: a msgspec Meta and the words its error
uses) and msgspec checks them, strictly (a TOML `true` is no integer, a string no number,
NaN and inf no timeout), when a source is converted; unknown keys are refused. Each source
is checked as it is read: a file must be valid on its own (an environment variable cannot
rescue a bad value in it), then file, environment and flags together, with the rules
across fields (`validate`). To change settings, build new ones (`msgspec.structs.replace`).

Environment names: `GATEWAY_<SECTION>_<KEY>` for tables (`GATEWAY_LIMITS_MAX_OUTPUT_TOKENS`),
`GATEWAY_LANES_<LANE>_<KEY>` for a lane by name (`GATEWAY_LANES_BULK_QUEUE_TIMEOUT_S`),
`GATEWAY_BACKENDS_<INDEX>_<KEY>` for a backend by position, `GATEWAY_API_KEYS_<INDEX>_<KEY>`
for a client key by position, `GATEWAY_MODELS_<INDEX>_<KEY>` for a [[models]] entry by
position (and `GATEWAY_MODELS_<INDEX>_LIMITS_<KEY>` for its caps), and `GATEWAY_BACKENDS`
for a comma-separated list of URLs
that replaces the configured backends. Their text is parsed by the field's type: numbers as
Python reads them, booleans as 1/true/yes/on or 0/false/no/off, lists as comma-separated
items, and `none` (or nothing) clears an optional key.

The package holds one module per section (`server`, `limits` with [tokenizer], `backends`,
`models`, `lanes`, `tenants` with [[api_keys]], `timeouts` with [health], `routing`,
`retries`, `observability` ([logging], [tracing]), `shadow`, `redis`, `resume`,
`preemption`, `discovery`), `settings` (the
whole), `loading` (the sources in order), `environment` (GATEWAY_* names), `messages`
(msgspec's errors as one line naming the key) and `checks` (the rules across fields and
the warnings of `check-config`). Import from here: `from gateway.config import Settings`.
"""

from __future__ import annotations

from gateway.config.backends import (
    DEFAULT_MAX_CONCURRENCY,
    BackendSettings,
    EngineKind,
    ServesMode,
)
from gateway.config.checks import consistency_warnings
from gateway.config.constraints import (
    ConfigError,
    NonEmpty,
    NonNegative,
    Positive,
    PositiveFloat,
)
from gateway.config.discovery import DiscoverySettings
from gateway.config.environment import CLI_ENV_NAMES, ENV_PREFIX, unrecognized_env_names
from gateway.config.lanes import LaneSettings, default_lanes, slot_limit
from gateway.config.limits import LimitsSettings, TokenizerSettings
from gateway.config.loading import load_settings, validate
from gateway.config.models import ModelLimits, ModelSettings, ModelTarget, model_limits
from gateway.config.observability import LoggingSettings, TracingSettings
from gateway.config.preemption import PreemptionSettings
from gateway.config.redis import RedisSettings
from gateway.config.resume import ResumeSettings
from gateway.config.retries import RetrySettings
from gateway.config.routing import RoutingSettings
from gateway.config.server import ServerSettings
from gateway.config.settings import ARRAYS, TABLES, KeyPath, Origins, Settings
from gateway.config.shadow import ShadowSettings
from gateway.config.tenants import ApiKeySettings, TenantSettings
from gateway.config.timeouts import HealthSettings, TimeoutSettings

__all__ = [
    "ARRAYS",
    "ApiKeySettings",
    "BackendSettings",
    "CLI_ENV_NAMES",
    "ConfigError",
    "DEFAULT_MAX_CONCURRENCY",
    "DiscoverySettings",
    "EngineKind",
    "ENV_PREFIX",
    "HealthSettings",
    "KeyPath",
    "LaneSettings",
    "LimitsSettings",
    "LoggingSettings",
    "ModelLimits",
    "ModelSettings",
    "ModelTarget",
    "NonEmpty",
    "NonNegative",
    "Origins",
    "Positive",
    "PositiveFloat",
    "RedisSettings",
    "PreemptionSettings",
    "ResumeSettings",
    "RetrySettings",
    "RoutingSettings",
    "ServerSettings",
    "ServesMode",
    "Settings",
    "ShadowSettings",
    "TABLES",
    "TenantSettings",
    "TimeoutSettings",
    "TokenizerSettings",
    "TracingSettings",
    "consistency_warnings",
    "default_lanes",
    "load_settings",
    "model_limits",
    "slot_limit",
    "unrecognized_env_names",
    "validate",
]
