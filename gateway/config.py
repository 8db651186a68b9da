"""Typed settings: defaults, then a TOML file, then GATEWAY_* variables, then CLI flags.

A bad value stops start-up with one line naming the key (`ConfigError`), because
an SRE reading a crash loop needs the key, not a traceback.

Environment names: `GATEWAY_<SECTION>_<KEY>` for tables (`GATEWAY_LIMITS_MAX_OUTPUT_TOKENS`),
`GATEWAY_LANES_<LANE>_<KEY>` for a lane by name (`GATEWAY_LANES_BULK_QUEUE_TIMEOUT_S`),
`GATEWAY_BACKENDS_<INDEX>_<KEY>` for a backend by position, and `GATEWAY_BACKENDS` for a
comma-separated list of URLs that replaces the configured backends.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

ENV_PREFIX = "GATEWAY_"


class ConfigError(ValueError):
    """An invalid setting; the message names the key and what is wrong."""


@dataclass(slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    #: Bodies larger than this are refused (413) before being read whole.
    max_body_bytes: int = 4 * 1024 * 1024
    #: A request body that has not fully arrived after this long gets 408.
    read_timeout_s: float = 30.0
    #: On SIGTERM, how long in-flight requests may take to finish before the exit.
    drain_timeout_s: float = 30.0
    #: Run on uvloop (libuv's event loop) when it is installed: less CPU per relayed chunk.
    uvloop: bool = True


@dataclass(slots=True)
class TokenizerSettings:
    encoding: str = "cl100k_base"
    #: Prompts with more characters than this are encoded in a worker thread.
    offload_min_chars: int = 16_384


@dataclass(slots=True)
class LimitsSettings:
    max_prompt_tokens: int = 32_768
    default_max_tokens: int = 256
    max_output_tokens: int = 1024
    #: "clamp" lowers an over-cap max_tokens to the cap; "reject" answers 400.
    on_max_tokens_over: str = "clamp"
    #: The model's context window in tokens; 0 when unknown (no check).
    context_window: int = 0
    #: Most choices (`n`) one request may ask for.
    max_n: int = 16


@dataclass(slots=True)
class BackendSettings:
    url: str = ""
    name: str = ""
    #: Relative capacity: balancing divides outstanding tokens by it.
    weight: float = 1.0
    #: Requests the gateway lets run at once on this backend (its slots).
    max_concurrency: int = 8
    #: Prompt tokens this backend may be prefilling at once (dispatched, no first byte
    #: yet); a bigger prompt goes alone. 0: no limit.
    max_prefill_tokens: int = 4096
    #: Sent to this backend as `Authorization: Bearer ...` (the client's own never is).
    api_key: str | None = None
    #: Put the lane's priority in the body's `priority` (vLLM --scheduling-policy priority).
    priority_field: bool = False


@dataclass(slots=True)
class ApiKeySettings:
    """A client API key. With any configured, every generation request needs one."""

    #: For logs and metrics; the key itself is never logged.
    name: str = ""
    #: The secret the client sends as `Authorization: Bearer <key>`; better set by
    #: environment (GATEWAY_API_KEYS_<INDEX>_KEY) than in a file.
    key: str = ""
    #: Lanes this key may use; None: all of them.
    lanes: list[str] | None = None
    #: May choose its lane with the `X-Gateway-Lane` header, whatever its budget
    #: (for the rare long-context job that must get through).
    allow_lane_override: bool = False


@dataclass(slots=True)
class LaneSettings:
    name: str = ""
    #: Largest prompt this lane admits; None admits any prompt within the caps.
    max_prompt_tokens: int | None = None
    #: Largest output budget (n x max_tokens) this lane admits; None: any.
    max_output_tokens: int | None = None
    #: Most slots this lane may hold at once, absolute; None: no absolute limit.
    max_slots: int | None = None
    #: Most slots this lane may hold, as a share of all slots (0 < share <= 1).
    max_slot_share: float = 1.0
    #: A request still queued after this long gets 503 queue_timeout.
    queue_timeout_s: float = 30.0
    #: A request arriving at a queue this deep gets 429 queue_full at once.
    max_queue_depth: int = 256
    #: A request queued longer than this is served before higher lanes (no starvation)
    #: while its lane holds fewer than `promoted_slots` slots.
    promote_after_s: float | None = None
    #: How many slots promotion guarantees an aged lane. A lane that already runs this
    #: many is progressing, not starving, and higher lanes keep their priority.
    promoted_slots: int = 1
    #: Refuse at once (429 wait_too_long) when the predicted wait exceeds queue_timeout_s.
    reject_predicted_wait: bool = True
    #: Names of the backends this lane may use; None: all of them.
    backends: list[str] | None = None


@dataclass(slots=True)
class TimeoutSettings:
    connect_s: float = 5.0
    #: No first byte of the backend's answer within this long: 504 backend_timeout.
    first_token_s: float = 60.0
    #: Longest silence between two chunks of a stream before it is cut.
    idle_s: float = 60.0
    #: Longest a request may take end to end, queue included.
    total_s: float = 600.0
    #: Pooled keep-alive connections are dropped after this long idle; keep it below the
    #: backend's own keep-alive (llama.cpp's server closes idle connections after 5 s).
    pool_idle_s: float = 4.0


@dataclass(slots=True)
class HealthSettings:
    #: Active checks: GET <backend url><path> every interval_s, failing after timeout_s.
    path: str = "/health"
    interval_s: float = 5.0
    timeout_s: float = 2.0
    #: Passive checks: this many consecutive failures (connect errors, 5xx, first-token
    #: timeouts) eject a backend for eject_base_s, doubling on each repeat up to eject_max_s.
    failures_to_eject: int = 3
    eject_base_s: float = 5.0
    eject_max_s: float = 120.0


@dataclass(slots=True)
class LoggingSettings:
    #: Per-request JSON lines go to stdout; this sets the level of the others.
    level: str = "info"


def default_lanes() -> list[LaneSettings]:
    return [
        LaneSettings(
            name="interactive",
            max_prompt_tokens=1024,
            max_output_tokens=256,
            queue_timeout_s=5.0,
            max_queue_depth=256,
        ),
        LaneSettings(
            name="bulk",
            max_slot_share=0.5,
            queue_timeout_s=30.0,
            max_queue_depth=64,
            promote_after_s=10.0,
        ),
    ]


@dataclass(slots=True)
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    tokenizer: TokenizerSettings = field(default_factory=TokenizerSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    backends: list[BackendSettings] = field(default_factory=list)
    lanes: list[LaneSettings] = field(default_factory=default_lanes)
    timeouts: TimeoutSettings = field(default_factory=TimeoutSettings)
    health: HealthSettings = field(default_factory=HealthSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    api_keys: list[ApiKeySettings] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def total_slots(self) -> int:
        return sum(b.max_concurrency for b in self.backends)

    def lane_backends(self, lane: LaneSettings) -> list[BackendSettings]:
        if lane.backends is None:
            return list(self.backends)
        return [b for b in self.backends if b.name in lane.backends]

    def lane_slot_limit(self, lane: LaneSettings) -> int:
        """Slots a lane may hold: its absolute and its share limit, at least one.

        The share is of the slots of the backends the lane may use.
        """
        slots = sum(b.max_concurrency for b in self.lane_backends(lane))
        # round first: 90 * 0.7 is 62.999... in binary floating point
        by_share = math.floor(round(slots * lane.max_slot_share, 9))
        limit = by_share if lane.max_slots is None else min(lane.max_slots, by_share)
        return max(1, limit)


TABLES: dict[str, type] = {
    "server": ServerSettings,
    "tokenizer": TokenizerSettings,
    "limits": LimitsSettings,
    "timeouts": TimeoutSettings,
    "health": HealthSettings,
    "logging": LoggingSettings,
}
ARRAYS: dict[str, type] = {
    "backends": BackendSettings,
    "lanes": LaneSettings,
    "api_keys": ApiKeySettings,
}


def load_settings(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build validated settings from a TOML file, the environment and CLI overrides.

    `overrides` takes dotted keys (`server.port`) plus `backends` as a list of URLs.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_toml(Path(path))
    settings = _from_raw(raw)
    _apply_env(settings, os.environ if env is None else env)
    _apply_overrides(settings, overrides or {})
    _fill_backend_names(settings)
    validate(settings)
    return settings


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def _from_raw(raw: dict[str, Any]) -> Settings:
    settings = Settings()
    for key, value in raw.items():
        if key in TABLES:
            if not isinstance(value, dict):
                raise ConfigError(f"[{key}] must be a table")
            setattr(settings, key, _build(TABLES[key], value, f"[{key}]"))
        elif key in ARRAYS:
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                raise ConfigError(f"[[{key}]] must be an array of tables")
            items = [_build(ARRAYS[key], v, f"[[{key}]] #{i + 1}") for i, v in enumerate(value)]
            setattr(settings, key, items)
        else:
            raise ConfigError(f"unknown section [{key}]")
    return settings


def _build(cls: type, values: Mapping[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    obj = cls()
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"{where}: unknown key {key!r}")
        setattr(obj, key, _coerce(value, hints[key], f"{where}.{key}", from_text=False))
    return obj


def _coerce(value: Any, hint: Any, where: str, *, from_text: bool) -> Any:
    """Check (or, for environment text, parse) `value` against a field's type."""
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if optional and (value is None or (from_text and value.strip().lower() in ("", "none"))):
        return None
    try:
        if base is bool:
            if from_text:
                lowered = value.strip().lower()
                if lowered in ("1", "true", "yes", "on"):
                    return True
                if lowered in ("0", "false", "no", "off"):
                    return False
                raise ValueError
            if isinstance(value, bool):
                return value
            raise ValueError
        if base is int:
            if from_text:
                return int(value)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            raise ValueError
        if base is float:
            if from_text:
                number = float(value)
            elif isinstance(value, int | float) and not isinstance(value, bool):
                number = float(value)
            else:
                raise ValueError
            if not math.isfinite(number):
                raise ValueError
            return number
        if base is str:
            if isinstance(value, str):
                return value
            raise ValueError
        if typing.get_origin(base) is list:
            if from_text:
                return [item.strip() for item in value.split(",") if item.strip()]
            if isinstance(value, list) and all(isinstance(item, str) for item in value):
                return list(value)
            raise ValueError
    except ValueError:
        kind = {
            bool: "true or false",
            int: "an integer",
            float: "a number",
            str: "a string",
            list[str]: "an array of strings",
        }
        raise ConfigError(f"{where}: expected {kind.get(base, base)}, got {value!r}") from None
    raise ConfigError(f"{where}: unsupported setting type")


def _apply_env(settings: Settings, env: Mapping[str, str]) -> None:
    urls = env.get(ENV_PREFIX + "BACKENDS")
    if urls is not None:
        settings.backends = _backends_from_urls(urls.split(","))
    for name, text in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX + "BACKENDS":
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        if _apply_env_table(settings, rest, text, name):
            continue
        if rest.startswith("lanes_"):
            _apply_env_lane(settings, rest[len("lanes_") :], text, name)
        elif rest.startswith("backends_"):
            _apply_env_indexed(
                settings.backends, BackendSettings, rest[len("backends_") :], text, name
            )
        elif rest.startswith("api_keys_"):
            _apply_env_indexed(
                settings.api_keys, ApiKeySettings, rest[len("api_keys_") :], text, name
            )
        # Other GATEWAY_* names (the CLI's own, e.g. GATEWAY_CONFIG) are not settings.


#: GATEWAY_* names that are not settings but are ours (read by the CLI).
CLI_ENV_NAMES = frozenset({ENV_PREFIX + "CONFIG"})


def unrecognized_env_names(env: Mapping[str, str]) -> list[str]:
    """GATEWAY_* variables that configure nothing (typos, or another tool's)."""
    prefixes = [section + "_" for section in TABLES] + ["lanes_", "backends_", "api_keys_"]
    unknown = []
    for name in env:
        if not name.startswith(ENV_PREFIX) or name in CLI_ENV_NAMES:
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        if rest != "backends" and not any(rest.startswith(p) for p in prefixes):
            unknown.append(name)
    return sorted(unknown)


def _apply_env_table(settings: Settings, rest: str, text: str, name: str) -> bool:
    for section, cls in TABLES.items():
        if rest.startswith(section + "_"):
            key = rest[len(section) + 1 :]
            _set_field(getattr(settings, section), cls, key, text, name)
            return True
    return False


def _apply_env_lane(settings: Settings, rest: str, text: str, name: str) -> None:
    for lane in sorted(settings.lanes, key=lambda ln: -len(ln.name)):
        prefix = lane.name.lower().replace("-", "_") + "_"
        if rest.startswith(prefix):
            _set_field(lane, LaneSettings, rest[len(prefix) :], text, name)
            return
    raise ConfigError(f"{name}: no lane named in it (lanes: {_lane_names(settings)})")


def _apply_env_indexed(
    items: list[Any], cls: type, rest: str, text: str, name: str, *, add: bool = False
) -> None:
    """GATEWAY_<ARRAY>_<INDEX>_<KEY>; with `add`, an index one past the end adds an entry."""
    index_text, _, key = rest.partition("_")
    limit = len(items) + (1 if add else 0)
    if not index_text.isdigit() or int(index_text) >= limit:
        raise ConfigError(f"{name}: expected <index>_<key> with an index of an existing entry")
    if int(index_text) == len(items):
        items.append(cls())
    _set_field(items[int(index_text)], cls, key, text, name)


def _set_field(obj: Any, cls: type, key: str, text: str, where: str) -> None:
    hints = typing.get_type_hints(cls)
    if key not in hints or key == "name" and cls is LaneSettings:
        raise ConfigError(f"{where}: unknown setting {key!r}")
    setattr(obj, key, _coerce(text, hints[key], where, from_text=True))


def _apply_overrides(settings: Settings, overrides: Mapping[str, Any]) -> None:
    for dotted, value in overrides.items():
        if value is None:
            continue
        if dotted == "backends":
            if value:
                settings.backends = _backends_from_urls(list(value))
            continue
        section, _, key = dotted.partition(".")
        cls = TABLES.get(section)
        if cls is None:
            raise ConfigError(f"override {dotted}: unknown section")
        hints = typing.get_type_hints(cls)
        if key not in hints:
            raise ConfigError(f"override {dotted}: unknown key")
        setattr(
            getattr(settings, section), key, _coerce(value, hints[key], dotted, from_text=False)
        )


def _backends_from_urls(urls: list[str]) -> list[BackendSettings]:
    return [BackendSettings(url=u.strip()) for u in urls if u.strip()]


def _fill_backend_names(settings: Settings) -> None:
    for index, backend in enumerate(settings.backends):
        if not backend.name:
            backend.name = urlparse(backend.url).netloc or f"backend{index}"


def _lane_names(settings: Settings) -> str:
    return ", ".join(lane.name for lane in settings.lanes) or "none"


def validate(settings: Settings) -> None:
    """Raise ConfigError on the first invalid value."""
    s = settings
    if not 0 < s.server.port < 65536:
        raise ConfigError(f"[server].port: must be 1-65535, got {s.server.port}")
    _positive("[server].max_body_bytes", s.server.max_body_bytes)
    _positive("[server].drain_timeout_s", s.server.drain_timeout_s)
    _positive("[server].read_timeout_s", s.server.read_timeout_s)
    if not s.tokenizer.encoding:
        raise ConfigError("[tokenizer].encoding: must not be empty")
    _positive("[limits].max_prompt_tokens", s.limits.max_prompt_tokens)
    _positive("[limits].default_max_tokens", s.limits.default_max_tokens)
    _positive("[limits].max_output_tokens", s.limits.max_output_tokens)
    _positive("[limits].max_n", s.limits.max_n)
    if s.limits.on_max_tokens_over not in ("clamp", "reject"):
        raise ConfigError(
            f'[limits].on_max_tokens_over: must be "clamp" or "reject", '
            f"got {s.limits.on_max_tokens_over!r}"
        )
    if s.limits.default_max_tokens > s.limits.max_output_tokens:
        raise ConfigError("[limits].default_max_tokens: must not exceed max_output_tokens")
    if s.limits.context_window < 0:
        raise ConfigError("[limits].context_window: must be >= 0 (0 means unknown)")
    seen_backends: set[str] = set()
    for index, backend in enumerate(s.backends):
        where = f"[[backends]] #{index + 1}"
        parsed = urlparse(backend.url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ConfigError(f"{where}.url: expected http(s)://host:port, got {backend.url!r}")
        _positive(f"{where}.max_concurrency", backend.max_concurrency)
        _positive(f"{where}.weight", backend.weight)
        if backend.max_prefill_tokens < 0:
            raise ConfigError(f"{where}.max_prefill_tokens: must be >= 0 (0: no limit)")
        if backend.name in seen_backends:
            raise ConfigError(f"{where}.name: duplicate backend name {backend.name!r}")
        seen_backends.add(backend.name)
    if not s.lanes:
        raise ConfigError("[[lanes]]: at least one lane is required")
    seen_lanes: set[str] = set()
    for index, lane in enumerate(s.lanes):
        where = f"[[lanes]] #{index + 1}"
        if not lane.name:
            raise ConfigError(f"{where}.name: every lane needs a name")
        if lane.name in seen_lanes:
            raise ConfigError(f"{where}.name: duplicate lane name {lane.name!r}")
        seen_lanes.add(lane.name)
        where = f"[[lanes]] {lane.name}"
        for key in ("max_prompt_tokens", "max_output_tokens", "max_slots"):
            value = getattr(lane, key)
            if value is not None:
                _positive(f"{where}.{key}", value)
        if not 0 < lane.max_slot_share <= 1:
            raise ConfigError(
                f"{where}.max_slot_share: must be in (0, 1], got {lane.max_slot_share}"
            )
        _positive(f"{where}.queue_timeout_s", lane.queue_timeout_s)
        if lane.max_queue_depth < 0:
            raise ConfigError(f"{where}.max_queue_depth: must be >= 0")
        if lane.promote_after_s is not None:
            _positive(f"{where}.promote_after_s", lane.promote_after_s)
        _positive(f"{where}.promoted_slots", lane.promoted_slots)
        if lane.backends is not None:
            unknown = sorted(set(lane.backends) - seen_backends)
            if unknown and s.backends:
                raise ConfigError(
                    f"{where}.backends: no backend named {', '.join(unknown)} "
                    f"(backends: {', '.join(sorted(seen_backends))})"
                )
            if not lane.backends:
                raise ConfigError(f"{where}.backends: must name at least one backend")
    timeouts = dataclasses.asdict(s.timeouts)
    for key, value in timeouts.items():
        _positive(f"[timeouts].{key}", value)
    lane_names = {lane.name for lane in s.lanes}
    seen_keys: set[str] = set()
    for index, api_key in enumerate(s.api_keys):
        where = f"[[api_keys]] #{index + 1}"
        if len(api_key.key) < 8:
            raise ConfigError(f"{where}.key: must be at least 8 characters")
        if api_key.key in seen_keys:
            raise ConfigError(f"{where}.key: the same key twice")
        seen_keys.add(api_key.key)
        unknown_lanes = sorted(set(api_key.lanes or ()) - lane_names)
        if unknown_lanes:
            raise ConfigError(f"{where}.lanes: no lane named {', '.join(unknown_lanes)}")
        if not api_key.name:
            api_key.name = f"key{index + 1}"
    health = s.health
    for key in ("interval_s", "timeout_s", "eject_base_s", "eject_max_s"):
        _positive(f"[health].{key}", getattr(health, key))
    _positive("[health].failures_to_eject", health.failures_to_eject)
    if not health.path.startswith("/"):
        raise ConfigError(f"[health].path: must start with '/', got {health.path!r}")
    if s.logging.level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError("[logging].level: must be debug, info, warning or error")


def _positive(where: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{where}: must be > 0, got {value}")


def consistency_warnings(settings: Settings) -> list[str]:
    """Settings that are valid but contradict each other; `check-config` prints them."""
    s = settings
    warnings = []
    for lane in s.lanes:
        where = f"[[lanes]] {lane.name}"
        if lane.queue_timeout_s >= s.timeouts.total_s:
            warnings.append(
                f"{where}.queue_timeout_s ({lane.queue_timeout_s}) >= [timeouts].total_s "
                f"({s.timeouts.total_s}): a request could spend its whole time queued"
            )
        if lane.promote_after_s is not None and lane.promote_after_s >= lane.queue_timeout_s:
            warnings.append(
                f"{where}.promote_after_s ({lane.promote_after_s}) >= queue_timeout_s "
                f"({lane.queue_timeout_s}): requests time out before they are promoted"
            )
        if (
            lane.max_prompt_tokens is not None
            and lane.max_prompt_tokens > s.limits.max_prompt_tokens
        ):
            warnings.append(
                f"{where}.max_prompt_tokens ({lane.max_prompt_tokens}) > [limits].max_prompt_tokens "
                f"({s.limits.max_prompt_tokens}): the cap refuses those prompts first"
            )
    last = s.lanes[-1]
    if last.max_prompt_tokens is not None and last.max_prompt_tokens < s.limits.max_prompt_tokens:
        warnings.append(
            f"the last lane ({last.name}) admits prompts up to {last.max_prompt_tokens} tokens, "
            f"below [limits].max_prompt_tokens: larger prompts fit no lane and get 413"
        )
    if last.max_output_tokens is not None and last.max_output_tokens < s.limits.max_output_tokens:
        warnings.append(
            f"the last lane ({last.name}) admits outputs up to {last.max_output_tokens} tokens, "
            f"below [limits].max_output_tokens: larger budgets fit no lane"
        )
    if s.health.timeout_s >= s.health.interval_s:
        warnings.append("[health].timeout_s >= interval_s: health checks would overlap")
    if s.timeouts.first_token_s >= s.timeouts.total_s:
        warnings.append("[timeouts].first_token_s >= total_s: the first-token timeout never fires")
    if s.timeouts.pool_idle_s >= 5.0:
        warnings.append(
            "[timeouts].pool_idle_s >= 5: llama.cpp's server closes idle connections after 5 s; "
            "keep the pool's idle timeout below the backend's"
        )
    if s.backends and all(s.lane_slot_limit(lane) >= s.total_slots for lane in s.lanes[1:]):
        if len(s.lanes) > 1:
            warnings.append(
                "every lower-priority lane may take all slots: long requests can fill the backend"
            )
    return warnings
