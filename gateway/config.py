"""Typed settings: defaults, then a TOML file, then GATEWAY_* variables, then CLI flags.

A bad value stops start-up with one line naming the key (`ConfigError`), because
an SRE reading a crash loop needs the key, not a traceback.

The settings are frozen msgspec Structs: each field's type and range are declared next
to it (`Annotated[int, _rule("be > 0", gt=0)]`: a msgspec Meta and the words its error
uses) and msgspec checks them, strictly (a TOML `true` is no integer, a string no number,
NaN and inf no timeout), when a source is converted; unknown keys are refused. Each source
is checked as it is read: a file must be valid on its own (an environment variable cannot
rescue a bad value in it), then file, environment and flags together, with the rules
across fields (`validate`). To change settings, build new ones (`msgspec.structs.replace`).

Environment names: `GATEWAY_<SECTION>_<KEY>` for tables (`GATEWAY_LIMITS_MAX_OUTPUT_TOKENS`),
`GATEWAY_LANES_<LANE>_<KEY>` for a lane by name (`GATEWAY_LANES_BULK_QUEUE_TIMEOUT_S`),
`GATEWAY_BACKENDS_<INDEX>_<KEY>` for a backend by position, `GATEWAY_API_KEYS_<INDEX>_<KEY>`
for a client key by position, and `GATEWAY_BACKENDS` for a comma-separated list of URLs
that replaces the configured backends. Their text is parsed by the field's type: numbers as
Python reads them, booleans as 1/true/yes/on or 0/false/no/off, lists as comma-separated
items, and `none` (or nothing) clears an optional key.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

import msgspec
from msgspec import Meta, field
from msgspec import inspect as mi
from msgspec.structs import replace

ENV_PREFIX = "GATEWAY_"


class ConfigError(ValueError):
    """An invalid setting; the message names the key and what is wrong."""


def _rule(must: str, **constraint: Any) -> Meta:
    """A msgspec constraint with the words an error uses for it: `[x].y: must <must>`."""
    return Meta(**constraint, extra={"must": must})


# NaN fails every bound and `le=` the largest float refuses inf: a bounded float is finite.
Positive = Annotated[int, _rule("be > 0", gt=0)]
NonNegative = Annotated[int, _rule("be >= 0", ge=0)]
#: Slots of a backend whose config does not set them and whose engine does not say.
DEFAULT_MAX_CONCURRENCY = 8

PositiveFloat = Annotated[float, _rule("be finite and > 0", gt=0, le=sys.float_info.max)]
NonEmpty = Annotated[str, _rule("not be empty", min_length=1)]


class ServerSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: Annotated[int, _rule("be from 1 to 65535", ge=1, le=65535)] = 8080
    #: Bodies larger than this are refused (413) before being read whole.
    max_body_bytes: Positive = 4 * 1024 * 1024
    #: A request body that has not fully arrived after this long gets 408.
    read_timeout_s: PositiveFloat = 30.0
    #: On SIGTERM, how long in-flight requests may take to finish before the exit.
    drain_timeout_s: PositiveFloat = 30.0
    #: Run on uvloop (libuv's event loop) when it is installed: less CPU per relayed chunk.
    uvloop: bool = True
    #: A stream that waited this long (queued, or for its first token) gets its headers
    #: and then an SSE comment every interval, so proxies in front do not cut it for
    #: silence (nginx and load balancers: 60 s). 0 turns it off.
    sse_keepalive_s: Annotated[
        float, _rule("be finite and >= 0 (0: off)", ge=0, le=sys.float_info.max)
    ] = 15.0
    #: Origins whose pages may call the gateway (CORS): exact `scheme://host[:port]`, as
    #: browsers send them (no path, no trailing slash), or "*" for any. Empty: CORS off.
    cors_origins: Annotated[
        list[
            Annotated[
                str,
                # "*", or scheme://host[:port] with host a name or a bracketed IPv6 address
                Meta(
                    pattern=r"(?i)^(\*|[a-z][a-z0-9+.-]*://"
                    r"(\[[0-9a-f:.]+\]|[^/?#\s:\[\]]+)(:[0-9]{1,5})?)$"
                ),
            ]
        ],
        _rule('hold "*" or origins like https://app.example.com (no path, no trailing slash)'),
    ] = field(default_factory=list)
    #: Serve the chat page at GET /playground (streams through this gateway).
    playground: bool = False
    #: A connection whose request line and headers have not all arrived this long after
    #: it opened (or after its previous answer, on keep-alive) is closed, like nginx's
    #: client_header_timeout: a client trickling its headers must not hold a file
    #: descriptor forever. 0 turns it off.
    header_timeout_s: Annotated[
        float, _rule("be finite and >= 0 (0: off)", ge=0, le=sys.float_info.max)
    ] = 10.0
    #: An idle keep-alive connection from a client is closed after this long (nginx's
    #: keepalive_timeout; keep it above the idle timeout of a load balancer in front).
    keepalive_timeout_s: PositiveFloat = 75.0


class TokenizerSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    encoding: NonEmpty = "cl100k_base"
    #: Prompts with more characters than this are encoded in a worker thread.
    offload_min_chars: int = 16_384


class LimitsSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    max_prompt_tokens: Positive = 32_768
    default_max_tokens: Positive = 256
    max_output_tokens: Positive = 1024
    #: "clamp" lowers an over-cap max_tokens to the cap; "reject" answers 400.
    on_max_tokens_over: Literal["clamp", "reject"] = "clamp"
    #: The model's context window in tokens; 0 when unknown (no check).
    context_window: Annotated[int, _rule("be >= 0 (0: unknown)", ge=0)] = 0
    #: Most choices (`n`) one request may ask for.
    max_n: Positive = 16


class BackendSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    url: Annotated[str, _rule("be http(s)://host:port", pattern=r"(?i)^https?://[^/?#\s]+")] = ""
    name: str = ""
    #: Relative capacity: balancing divides outstanding tokens by it.
    weight: PositiveFloat = 1.0
    #: Requests the gateway lets run at once on this backend (its slots). Unset: what
    #: the engine reports (llama.cpp /props total_slots, TGI /info
    #: max_concurrent_requests), else DEFAULT_MAX_CONCURRENCY.
    max_concurrency: Positive | None = None
    #: Predicted prefill seconds this backend may have in flight (dispatched, no first
    #: byte yet), from its learned prefill rate; a bigger prompt goes alone. It bounds
    #: how long a short request waits behind long prompts. 0: no such budget.
    prefill_budget_s: Annotated[float, _rule("be >= 0 (0: no budget)", ge=0)] = 0.5
    #: An optional hard cap in prompt tokens on top of the budget in seconds. 0: none.
    max_prefill_tokens: Annotated[int, _rule("be >= 0 (0: no limit)", ge=0)] = 0
    #: Sent to this backend as `Authorization: Bearer ...` (the client's own never is).
    api_key: str | None = None
    #: Put the lane's priority in the body's `priority` (vLLM --scheduling-policy priority).
    priority_field: bool = False
    #: The model names it serves. Backends with the same list form one pool (their own
    #: queues and slots); a request goes only to a pool that serves its `model`. Empty:
    #: it serves whatever is asked (the catch-all pool, today's single-model behaviour).
    models: list[Annotated[str, _rule("be a non-empty name", min_length=1)]] = field(
        default_factory=list
    )


class ModelTarget(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One model an alias may send to, and its share of the alias's requests."""

    model: Annotated[str, _rule("be a non-empty name", min_length=1)]
    weight: PositiveFloat = 1.0


class ModelLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One model's caps where they differ from `[limits]`; an unset key inherits it.

    A small fast model has a smaller context window than the big one next to it, and
    its users a smaller default output: the caps that are the model's own are here;
    the policy (`on_max_tokens_over`, `max_n`) stays the gateway's.
    """

    max_prompt_tokens: Positive | None = None
    default_max_tokens: Positive | None = None
    max_output_tokens: Positive | None = None
    #: The model's context window in tokens; 0: unknown (no check).
    context_window: Annotated[int, _rule("be >= 0 (0: unknown)", ge=0)] | None = None

    def over(self, limits: LimitsSettings) -> LimitsSettings:
        """`limits` with the keys set here put in their place."""
        changes = {
            name: value
            for name in self.__struct_fields__
            if (value := getattr(self, name)) is not None
        }
        return replace(limits, **changes) if changes else limits


class ModelSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A name clients may ask for: an alias of one model (`target`) or of several with
    weights (`targets`, a gradual switch), and whether TGI's routes (no `model`) go there.

    An entry with neither target is the settings of a served name itself (its `limits`,
    `default`): asking for it sends the same name on."""

    name: Annotated[str, _rule("be a non-empty name", min_length=1)] = ""
    #: The model the backend receives in the body's `model`. Unset: `name` itself.
    target: str | None = None
    #: Several targets, each chosen at random in proportion to its weight.
    targets: list[ModelTarget] | None = None
    #: The model of TGI's native routes (`/generate`, `/info`), which carry no model.
    default: bool = False
    #: Caps for requests asking for this name, over `[limits]` (unset keys inherit it);
    #: an alias without its own takes its target's entry's.
    limits: ModelLimits | None = None

    def weighted_targets(self) -> list[tuple[str, float]]:
        if self.targets:
            return [(t.model, t.weight) for t in self.targets]
        return [(self.target or self.name, 1.0)]


class ApiKeySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A client API key. With any configured, every generation request needs one."""

    #: For logs and metrics; the key itself is never logged.
    name: str = ""
    #: The secret the client sends as `Authorization: Bearer <key>`; better set by
    #: environment (GATEWAY_API_KEYS_<INDEX>_KEY) than in a file.
    key: Annotated[str, _rule("be at least 8 characters", min_length=8)] = ""
    #: Lanes this key may use; None: all of them.
    lanes: list[str] | None = None
    #: May choose its lane with the `X-Gateway-Lane` header, whatever its budget
    #: (for the rare long-context job that must get through).
    allow_lane_override: bool = False
    #: Requests per minute this key may send (over every replica, with [redis]);
    #: over it: 429 quota_exceeded. None: no quota.
    requests_per_minute: Positive | None = None
    #: Tokens per minute: each request reserves its prompt and its whole output budget
    #: (n x max_tokens) at admission and gives back what its backend did not use. None:
    #: no quota.
    tokens_per_minute: Positive | None = None
    #: Its share of a lane when several tenants wait there: backlogged tenants are
    #: served in proportion to their weights ([tenants] fair_share).
    weight: PositiveFloat = 1.0


class LaneSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, _rule("be set (every lane needs a name)", min_length=1)] = ""
    #: Largest prompt this lane admits; None admits any prompt within the caps.
    max_prompt_tokens: Positive | None = None
    #: Largest output budget (n x max_tokens) this lane admits; None: any.
    max_output_tokens: Positive | None = None
    #: Most slots this lane may hold at once, absolute; None: no absolute limit.
    max_slots: Positive | None = None
    #: Most slots this lane may hold, as a share of all slots (0 < share <= 1).
    max_slot_share: Annotated[float, _rule("be in (0, 1]", gt=0, le=1)] = 1.0
    #: A request still queued after this long gets 503 queue_timeout.
    queue_timeout_s: PositiveFloat = 30.0
    #: A request arriving at a queue this deep gets 429 queue_full at once.
    max_queue_depth: NonNegative = 256
    #: A request queued longer than this is served before higher lanes (no starvation)
    #: while its lane holds fewer than `promoted_slots` slots.
    promote_after_s: PositiveFloat | None = None
    #: How many slots promotion guarantees an aged lane. A lane that already runs this
    #: many is progressing, not starving, and higher lanes keep their priority.
    promoted_slots: Positive = 1
    #: Slots this lane keeps while a higher lane has requests waiting: a lower lane may
    #: use every free slot, but gives slots back as its requests end when a higher lane
    #: waits, down to this floor (so it is never starved). Never all the slots the two
    #: share: on one slot the lanes are strict priority (and promotion).
    min_slots: NonNegative = 1
    #: Most requests one tenant may have queued in this lane; an arrival over it gets
    #: 429 queue_full at once. 0: no cap of its own (the lane's fair share of
    #: max_queue_depth still applies when the queue is full).
    max_queue_depth_per_tenant: NonNegative = 0
    #: Refuse at once (429 wait_too_long) when the predicted wait exceeds the deadline.
    reject_predicted_wait: bool = True
    #: Raise queue_timeout_s when the measured engine floor (one long prefill ahead plus
    #: the request's own) would not fit in it: a deadline shorter than the engine
    #: allows only turns requests away that the backend would have served.
    fit_timeout_to_engine: bool = True
    #: Names of the backends this lane may use; None: all of them.
    backends: Annotated[list[str], _rule("name at least one backend", min_length=1)] | None = None


class TimeoutSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    connect_s: PositiveFloat = 5.0
    #: No first byte of the backend's answer within this long: 504 backend_timeout.
    first_token_s: PositiveFloat = 60.0
    #: Longest silence between two chunks of a stream before it is cut.
    idle_s: PositiveFloat = 60.0
    #: Longest a request may take end to end, queue included.
    total_s: PositiveFloat = 600.0
    #: Pooled keep-alive connections are dropped after this long idle; keep it below the
    #: backend's own keep-alive (llama.cpp's server closes idle connections after 5 s).
    pool_idle_s: PositiveFloat = 4.0


class HealthSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    #: Active checks: GET <backend url><path> every interval_s, failing after timeout_s.
    path: Annotated[str, _rule("start with '/'", pattern="^/")] = "/health"
    interval_s: PositiveFloat = 5.0
    timeout_s: PositiveFloat = 2.0
    #: Passive checks: this many consecutive failures (connect errors, 5xx, first-token
    #: timeouts) eject a backend for eject_base_s, doubling on each repeat up to eject_max_s.
    failures_to_eject: Positive = 3
    eject_base_s: PositiveFloat = 5.0
    eject_max_s: PositiveFloat = 120.0
    #: At start, measure each backend's prefill with three short and three long one-token
    #: completions (random words), so deadlines fit the engine before the first user waits.
    probe_on_start: bool = True


class RoutingSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Which backend of a lane gets a request, besides load (see `upstream/pool.py`)."""

    #: Send a prompt to the backend that was sent its prefix lately (its engine probably
    #: has it cached and skips that prefill). Costs nothing with one backend.
    prefix_affinity: bool = True
    #: Keep a session (`x-session-id`, else OpenAI's `user`, else the API key) on one
    #: backend, the same on every replica (rendezvous hashing), so its first turns land
    #: where the later ones will find their history cached.
    session_affinity: bool = True
    #: A backend busier than the least loaded one by more than this share of its slots
    #: (requests in flight over slots) is not chosen for its cache or the session: a hot
    #: prefix spreads, it never piles up. A share, so it means the same on 4 slots and 256.
    cache_load_margin: Annotated[float, _rule("be in [0, 1]", ge=0, le=1)] = 0.5
    #: Tokens of prefixes remembered per backend (its engine's cache is bounded too).
    prefix_memory_tokens: Positive = 262_144
    #: Longest a request waits for a busy backend that would still give it a sooner first
    #: token than a free one: its prompt cached there, or a faster engine. Each waits
    #: at most what it would gain (predicted), and only as many wait for a backend as
    #: its slots free for in time, so a hot prefix or a fast engine does not draw a
    #: pile-up; requests behind them in line are served meanwhile. 0: never wait.
    max_wait_for_sooner_s: Annotated[float, _rule("be from 0 to 60", ge=0, le=60)] = 5.0
    #: Choose the lane by the prompt's uncached part (a long prompt that is mostly cached
    #: is a short request for the engine). Off: the lane is chosen by the whole prompt.
    lane_by_uncached_tokens: bool = False
    #: Send a LoRA adapter's request (its `model` an adapter a backend lists in /v1/models)
    #: to a backend that runs that adapter now, else one with room for another, so engines
    #: swap adapters rarely (`upstream/adapters.py`). Off: adapters are routed by load alone.
    adapter_affinity: bool = True


class TenantSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Who a request is for, so that one client cannot take a lane from the others.

    With API keys configured a request's tenant is its key's `name` (and its `weight`
    its share). Without keys it comes from `source`; else every request is one shared
    tenant, "default" (first come, as without tenants).
    """

    #: Without API keys: "header" (the `header` below), "user" (the body's `user`,
    #: OpenAI's end-user id) or "none" (one shared tenant).
    source: Literal["header", "user", "none"] = "header"
    #: The request header naming the tenant when `source` is "header".
    header: Annotated[str, _rule("be a header name", pattern=r"^[A-Za-z0-9-]+$")] = "x-tenant-id"
    #: Share each lane's queue fairly between backlogged tenants, by the tokens each
    #: was served over its weight (a Virtual Token Counter). Off: first come.
    fair_share: bool = True
    #: What one output token costs against a prompt token in the fair share. 0: learned
    #: from the backends (the prompt tokens they prefill in the time one output token
    #: holds a slot).
    output_token_weight: Annotated[
        float, _rule("be from 0 to 10000 (0: learned)", ge=0, le=1e4)
    ] = 0.0
    #: Tenant names, besides the API keys' names, that get their own metric series; the
    #: others are counted together as "other" (a label per client id would be unbounded).
    labeled: list[str] = field(default_factory=list)


class RetrySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Retries seen and damped (`admission/retries.py`): the same request again, soon.

    A request with the same sender and body bytes (or the same client-sent
    x-request-id) as one that ended within `window_s` is logged as a retry of it; with
    `damp`, one that comes before the Retry-After its earlier refusal was given is
    refused again at once with the time left, without queueing.
    """

    #: Seconds a request's fingerprint is remembered after its end. 0: off (no retry is
    #: seen, none damped).
    window_s: Annotated[float, _rule("be from 0 to 3600 (0: off)", ge=0, le=3600)] = 60.0
    #: Most fingerprints remembered (the oldest go first): ~340 bytes each.
    max_remembered: Annotated[int, _rule("be from 0 to 10000000 (0: off)", ge=0, le=10_000_000)] = (
        100_000
    )
    #: Refuse at once a retry that comes before its earlier refusal's Retry-After (for
    #: capacity: queue_full, wait_too_long, queue_timeout, no_backend), when
    #: the sender is one the client named (key, tenant, session, `user`) or it reused
    #: its x-request-id. Off: retries are only seen (logged and counted).
    damp: bool = True


class LoggingSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    #: Per-request JSON lines go to stdout; this sets the level of the others.
    level: Annotated[
        str, _rule("be debug, info, warning or error", pattern="(?i)^(debug|info|warning|error)$")
    ] = "info"


class ShadowSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A candidate backend (a new model or engine version) that gets mirrored copies of
    sampled requests; its answers are discarded and compared with the primary's in the
    log (`shadow_compared`). It is no member of the pool: it takes no slot, and its
    mirrors are dropped first whenever the primary is under load."""

    #: The candidate's base URL; empty: no shadow traffic.
    url: Annotated[
        str,
        _rule("be empty (off) or http(s)://host:port", pattern=r"(?i)^(?:$|https?://[^/?#\s]+)"),
    ] = ""
    #: For the log line (default: host:port).
    name: str = ""
    #: Sent as the body's `model` on OpenAI routes (the candidate serves another name).
    model: str | None = None
    #: Sent to the candidate as `Authorization: Bearer ...`.
    api_key: str | None = None
    #: Share of dispatched requests mirrored. With a url set, all of them by default: the
    #: candidate's load is bounded by max_concurrency and the drop rules, not by sampling.
    sample_rate: Annotated[float, _rule("be from 0 to 1", ge=0, le=1)] = 1.0
    #: Mirrors in flight at once; a sampled request over it is dropped, not queued.
    max_concurrency: Positive = 4
    connect_timeout_s: PositiveFloat = 2.0
    #: A mirror that has not ended after this long is cut (and counted an error).
    timeout_s: PositiveFloat = 120.0
    #: No new mirror while the event loop runs this late (the gateway itself is busy).
    max_loop_lag_s: PositiveFloat = 0.05


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
        _rule(
            "be empty (off) or redis://, rediss:// or unix:// URL",
            pattern=r"(?i)^(?:$|(?:redis|rediss|unix)://\S+)",
        ),
    ] = ""
    #: Prefix of every key, so several gateway fleets can share one Redis.
    key_prefix: Annotated[str, _rule("be set", min_length=1)] = "llmgw"
    #: A lease not renewed for this long is gone: a crashed replica's slots come back.
    lease_ttl_s: Annotated[float, _rule("be from 0.5 to 300", ge=0.5, le=300)] = 5.0
    #: Longest a Redis call may take on the request path before the replica falls back
    #: to local state (loopback answers in ~0.2 ms; a slow Redis must not become the tail).
    timeout_s: PositiveFloat = 0.1
    #: How often leases are renewed, counts refreshed and signals published (and, when
    #: fallen back, Redis tried again); 0: a third of lease_ttl_s.
    tick_s: Annotated[float, _rule("be >= 0 (0: lease_ttl_s / 3)", ge=0)] = 0.0
    #: This replica's share of each backend's slots and of each quota while Redis is
    #: down; 0: one over the number of replicas last seen in Redis (1 before any).
    replica_share: Annotated[float, _rule("be from 0 to 1 (0: learned)", ge=0, le=1)] = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.url)

    @property
    def interval_s(self) -> float:
        return self.tick_s or self.lease_ttl_s / 3


class TracingSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """OpenTelemetry spans of each request (admission, queue wait, backend TTFT, stream).

    Exported as the standard OTEL_* variables say (OTEL_TRACES_EXPORTER,
    OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER; OTEL_SDK_DISABLED
    turns it off); needs the `tracing` extra. Off or on, the client's W3C `traceparent` (or
    a new one) is forwarded to the backend and its trace id logged.
    """

    #: Off by default: an OTEL_* variable injected into every pod must not add span work
    #: to the gateway's hot path unasked; this one switch is what check-config shows.
    enabled: bool = False


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
            queue_timeout_s=30.0,
            max_queue_depth=64,
            promote_after_s=10.0,
        ),
    ]


class Settings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    server: ServerSettings = field(default_factory=ServerSettings)
    tokenizer: TokenizerSettings = field(default_factory=TokenizerSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    backends: list[BackendSettings] = field(default_factory=list)
    lanes: Annotated[list[LaneSettings], _rule("have at least one lane", min_length=1)] = field(
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


def slot_limit(lane: LaneSettings, slots: int) -> int:
    """Slots a lane may hold of `slots`: its absolute and its share limit, at least one."""
    # round first: 90 * 0.7 is 62.999... in binary floating point
    by_share = math.floor(round(slots * lane.max_slot_share, 9))
    limit = by_share if lane.max_slots is None else min(lane.max_slots, by_share)
    return max(1, limit)


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


def load_settings(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build validated settings from a TOML file, the environment and CLI overrides.

    `overrides` takes dotted keys (`server.port`) plus `backends` as a list of URLs.
    """
    raw: dict[str, Any] = {} if path is None else _read_toml(Path(path))
    data: dict[str, Any] = msgspec.to_builtins(_convert(raw, {}))
    origins: Origins = {}
    _apply_env(data, os.environ if env is None else env, origins)
    _apply_overrides(data, overrides or {}, origins)
    return _checked(_convert(data, origins))


def validate(settings: Settings) -> Settings:
    """The settings checked and completed, or ConfigError on the first invalid value.

    Checks every field's declared constraint (settings built in code skip them), fills
    the names left empty (a backend's from its URL, a client key's `key<N>`), and checks
    the rules across fields. Returns new settings: frozen ones cannot be filled in place.
    """
    return _checked(_convert(msgspec.to_builtins(settings), {}))


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


# --- from msgspec's error to one line naming the key ------------------------------------------

_ERROR = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<key>[^`]+)`$")
_WRONG_TYPE = re.compile(r"^Expected `[^`]+`, got `[^`]+`$")
#: Values never repeated in a message.
_SECRETS = {("api_keys", "key"), ("backends", "api_key"), ("shadow", "api_key"), ("redis", "url")}


def _convert(data: dict[str, Any], origins: Origins) -> Settings:
    """msgspec's strict conversion: a bool is no integer, a string no number (an integer
    is a float, though: `total_s = 120` is 120.0)."""
    try:
        return msgspec.convert(data, Settings)
    except msgspec.ValidationError as exc:
        raise ConfigError(_message(str(exc), data, origins)) from None


def _message(error: str, data: Any, origins: Origins) -> str:
    """Rewrite msgspec's `Expected `int`, got `str` - at `$.server.port`` in our terms.

    The key comes from the error's path; what was expected from the field's declared
    type (`msgspec.inspect`), and what was got from the data itself.
    """
    match = _ERROR.match(error)
    what, path_text = (match["what"], match["path"] or "") if match else (error, "")
    path: list[str | int] = [
        name if name else int(index) for name, index in _PATH_PART.findall(path_text)
    ]
    unknown = _UNKNOWN_FIELD.match(what)
    if unknown:
        if not path:
            return f"unknown section [{unknown['key']}]"
        return f"{_where(path, data)}: unknown key {unknown['key']!r}"
    if not path:
        return f"the settings: {what}"
    path = _field_path(path)
    kind = _type_at(path)
    where = _where(path, data)
    origin = origins.get(tuple(path))
    if origin:
        where = f"{where} (from {origin})"
    problem = f"expected {_kind(kind)}" if _WRONG_TYPE.match(what) else f"must {_must(kind, what)}"
    if path and (path[0], path[-1]) in _SECRETS:
        return f"{where}: {problem}"
    return f"{where}: {problem}, got {_shown(_value_at(data, path))}"


def _where(path: list[str | int], data: Any) -> str:
    """`[server].port`, `[[backends]] #1.url`, `[[lanes]] bulk.max_slots` (lanes by name)."""
    section = str(path[0])
    if section not in ARRAYS:
        return f"[{section}]" + "".join(f".{p}" for p in path[1:])
    if len(path) == 1:
        return f"[[{section}]]"
    index = int(path[1])
    label = f"#{index + 1}"
    if section in ("lanes", "models") and len(path) > 2 and path[2] != "name":
        name = _value_at(data, [section, index, "name"])
        if isinstance(name, str) and name:
            label = name
    if len(path) == 2:
        return f"[[{section}]] {label}"
    return f"[[{section}]] {label}" + "".join(
        f"[{p}]" if isinstance(p, int) else f".{p}" for p in path[2:]
    )


def _field_path(path: list[str | int]) -> list[str | int]:
    """The path of the field an error is in: an item of a list of strings is named by
    its list (the whole list is shown); an item of an array of tables by its index."""
    for end, part in enumerate(path):
        if isinstance(part, int) and end > 0:
            kind = _unwrap(_type_at(path[:end]))
            if isinstance(kind, mi.ListType) and not isinstance(
                _unwrap(kind.item_type), mi.StructType
            ):
                return path[:end]
    return path


def _value_at(data: Any, path: list[str | int]) -> Any:
    for part in path:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None
    return data


@functools.cache
def _settings_type() -> mi.StructType:
    info = mi.type_info(Settings)
    assert isinstance(info, mi.StructType)
    return info


def _type_at(path: list[str | int]) -> mi.Type | None:
    """The declared type of the key at `path` (None optional members dropped)."""
    kind: mi.Type | None = _settings_type()
    for part in path:
        kind = _unwrap(kind)
        if isinstance(part, int) and isinstance(kind, mi.ListType):
            kind = kind.item_type
        elif isinstance(part, str) and isinstance(kind, mi.StructType):
            kind = next((f.type for f in kind.fields if f.name == part), None)
        else:
            return None
    return kind


def _without_none(kind: mi.Type | None) -> mi.Type | None:
    if isinstance(kind, mi.UnionType):
        members = [t for t in kind.types if not isinstance(t, mi.NoneType)]
        return members[0] if len(members) == 1 else kind
    return kind


def _unwrap(kind: mi.Type | None) -> mi.Type | None:
    """Drop `| None` and constraint metadata: the type a value must have."""
    kind = _without_none(kind)
    return kind.type if isinstance(kind, mi.Metadata) else kind


def _kind(kind: mi.Type | None) -> str:
    """What a value of this type is, in TOML's words."""
    base = _unwrap(kind)
    if isinstance(base, mi.BoolType):
        return "true or false"
    if isinstance(base, mi.IntType):
        return "an integer"
    if isinstance(base, mi.FloatType):
        return "a number"
    if isinstance(base, mi.LiteralType):
        return " or ".join(f'"{v}"' for v in base.values)
    if isinstance(base, mi.StrType):
        return "a string"
    if isinstance(base, mi.StructType):
        return "a table"
    if isinstance(base, mi.ListType):
        items = _unwrap(base.item_type)
        return "an array of tables" if isinstance(items, mi.StructType) else "an array of strings"
    return "a valid value"


def _must(kind: mi.Type | None, error: str) -> str:
    """The rule a value broke: the words declared with it, else msgspec's own."""
    kind = _without_none(kind)
    if isinstance(kind, mi.Metadata) and kind.extra and "must" in kind.extra:
        return str(kind.extra["must"])
    if isinstance(kind, mi.LiteralType):
        return f"be {_kind(kind)}"
    return f"be valid ({error})"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- the environment -------------------------------------------------------------------------

#: GATEWAY_* names that are not settings but are ours (read by the CLI).
CLI_ENV_NAMES = frozenset({ENV_PREFIX + "CONFIG"})

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _apply_env(data: dict[str, Any], env: Mapping[str, str], origins: Origins) -> None:
    urls = env.get(ENV_PREFIX + "BACKENDS")
    if urls is not None:
        data["backends"] = _backends_from_urls(urls.split(","))
    for name, text in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX + "BACKENDS":
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        section = next((s for s in TABLES if rest.startswith(s + "_")), None)
        if section is not None:
            _set_from_env(data, (section,), rest[len(section) + 1 :], text, name, origins)
        elif rest.startswith("lanes_"):
            _apply_env_lane(data, rest[len("lanes_") :], text, name, origins)
        elif rest.startswith("backends_"):
            _apply_env_indexed(data, "backends", rest[len("backends_") :], text, name, origins)
        elif rest.startswith("api_keys_"):
            _apply_env_indexed(data, "api_keys", rest[len("api_keys_") :], text, name, origins)
        # Other GATEWAY_* names (the CLI's own, e.g. GATEWAY_CONFIG) are not settings.


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


def _apply_env_lane(
    data: dict[str, Any], rest: str, text: str, name: str, origins: Origins
) -> None:
    lanes = data["lanes"]
    by_length = sorted(range(len(lanes)), key=lambda i: -len(lanes[i]["name"]))
    for index in by_length:
        prefix = lanes[index]["name"].lower().replace("-", "_") + "_"
        if rest.startswith(prefix):
            key = rest[len(prefix) :]
            if key == "name":
                raise ConfigError(f"{name}: a lane's name cannot be set (it finds the lane)")
            _set_from_env(data, ("lanes", index), key, text, name, origins)
            return
    names = ", ".join(lane["name"] for lane in lanes) or "none"
    raise ConfigError(f"{name}: no lane named in it (lanes: {names})")


def _apply_env_indexed(
    data: dict[str, Any], array: str, rest: str, text: str, name: str, origins: Origins
) -> None:
    """GATEWAY_<ARRAY>_<INDEX>_<KEY> sets a key of an existing entry."""
    index_text, _, key = rest.partition("_")
    if not index_text.isdigit() or int(index_text) >= len(data[array]):
        raise ConfigError(f"{name}: expected <index>_<key> with an index of an existing entry")
    _set_from_env(data, (array, int(index_text)), key, text, name, origins)


def _set_from_env(
    data: dict[str, Any], table: KeyPath, key: str, text: str, name: str, origins: Origins
) -> None:
    kind = _type_at([*table, key])
    if kind is None:
        raise ConfigError(f"{name}: unknown setting {key!r}")
    path = (*table, key)
    try:
        value = _parse_text(text, kind)
    except ValueError:
        where = _where(list(path), data)
        raise ConfigError(f"{where} (from {name}): expected {_kind(kind)}, got {text!r}") from None
    target: Any = data
    for part in table:
        target = target[part]
    target[key] = value
    origins[path] = name


def _parse_text(text: str, kind: mi.Type) -> Any:
    """An environment variable's text as a value of the field's type (then checked by msgspec).

    Floats are parsed as Python does, so `nan` and `inf` parse and are then refused by the
    field's bounds, naming the variable.
    """
    optional = isinstance(kind, mi.UnionType) and any(
        isinstance(t, mi.NoneType) for t in kind.types
    )
    if optional and text.strip().lower() in ("", "none"):
        return None
    base = _unwrap(kind)
    if isinstance(base, mi.BoolType):
        word = text.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise ValueError(text)
    if isinstance(base, mi.IntType):
        return int(text)
    if isinstance(base, mi.FloatType):
        return float(text)
    if isinstance(base, mi.ListType):
        return [item.strip() for item in text.split(",") if item.strip()]
    return text


# --- CLI flags -------------------------------------------------------------------------------


def _apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any], origins: Origins) -> None:
    for dotted, value in overrides.items():
        if value is None:
            continue
        if dotted == "backends":
            if value:
                data["backends"] = _backends_from_urls(list(value))
            continue
        section, _, key = dotted.partition(".")
        if section not in TABLES:
            raise ConfigError(f"override {dotted}: unknown section")
        if _type_at([section, key]) is None:
            raise ConfigError(f"override {dotted}: unknown key")
        data[section][key] = value
        origins[(section, key)] = f"override {dotted}"


def _backends_from_urls(urls: list[str]) -> list[dict[str, Any]]:
    return [{"url": u.strip()} for u in urls if u.strip()]


# --- the rules across fields -----------------------------------------------------------------


def _checked(settings: Settings) -> Settings:
    """Names filled in, then the checks no single field's type can express."""
    s = replace(
        settings,
        backends=[
            b if b.name else replace(b, name=urlparse(b.url).netloc or f"backend{index}")
            for index, b in enumerate(settings.backends)
        ],
        api_keys=[
            k if k.name else replace(k, name=f"key{index + 1}")
            for index, k in enumerate(settings.api_keys)
        ],
    )
    if s.limits.default_max_tokens > s.limits.max_output_tokens:
        raise ConfigError("[limits].default_max_tokens: must not exceed max_output_tokens")
    seen_backends: set[str] = set()
    for index, backend in enumerate(s.backends):
        where = f"[[backends]] #{index + 1}"
        if backend.name in seen_backends:
            raise ConfigError(f"{where}.name: duplicate backend name {backend.name!r}")
        seen_backends.add(backend.name)
    seen_lanes: set[str] = set()
    for index, lane in enumerate(s.lanes):
        if lane.name in seen_lanes:
            raise ConfigError(f"[[lanes]] #{index + 1}.name: duplicate lane name {lane.name!r}")
        seen_lanes.add(lane.name)
        unknown = sorted(set(lane.backends or ()) - seen_backends)
        if unknown and s.backends:
            raise ConfigError(
                f"[[lanes]] {lane.name}.backends: no backend named {', '.join(unknown)} "
                f"(backends: {', '.join(sorted(seen_backends))})"
            )
    _check_models(s)
    seen_keys: set[str] = set()
    for index, api_key in enumerate(s.api_keys):
        where = f"[[api_keys]] #{index + 1}"
        if api_key.key in seen_keys:
            raise ConfigError(f"{where}.key: the same key twice")
        seen_keys.add(api_key.key)
        unknown_lanes = sorted(set(api_key.lanes or ()) - seen_lanes)
        if unknown_lanes:
            raise ConfigError(f"{where}.lanes: no lane named {', '.join(unknown_lanes)}")
    return s


def _check_models(s: Settings) -> None:
    """[[models]]: unique names, one way to name targets, at most one default, and every
    target served by some backend when the backends say what they serve."""
    served = {m for b in s.backends for m in b.models}
    catch_all = any(not b.models for b in s.backends) or not s.backends
    seen: set[str] = set()
    defaults = []
    for index, model in enumerate(s.models):
        where = f"[[models]] #{index + 1}"
        if not model.name:
            raise ConfigError(f"{where}.name: must be a non-empty name")
        if model.name in seen:
            raise ConfigError(f"{where}.name: duplicate model name {model.name!r}")
        seen.add(model.name)
        if model.target is not None and model.targets is not None:
            raise ConfigError(f"{where}: give target or targets, not both")
        if model.targets is not None and not model.targets:
            raise ConfigError(f"{where}.targets: must list at least one target")
        if model.default:
            defaults.append(model.name)
        unserved = sorted({t for t, _ in model.weighted_targets()} - served)
        if unserved and not catch_all:
            raise ConfigError(
                f"{where} {model.name}: no backend serves {', '.join(unserved)} "
                f"(served: {', '.join(sorted(served))})"
            )
    if len(defaults) > 1:
        raise ConfigError(f"[[models]]: more than one default ({', '.join(defaults)})")
    _check_model_limits(s)


def model_limits(
    models: Sequence[ModelSettings], limits: LimitsSettings
) -> dict[tuple[str, str], LimitsSettings]:
    """The caps of each (name asked, model sent) pair that has caps of its own.

    The entry asked for, over its target's entry (an alias without caps of its own
    takes its model's), over `[limits]`; a pair not in the map has `[limits]`. Built
    once at start-up, so a request pays one dict lookup for its caps.
    """
    entries = {model.name: model for model in models}
    table: dict[tuple[str, str], LimitsSettings] = {}
    for model in models:
        for target, _ in model.weighted_targets():
            of_target = entries.get(target) if target != model.name else None
            layers = [of_target.limits if of_target else None, model.limits]
            if not any(layers):
                continue
            in_force = limits
            for layer in layers:
                in_force = layer.over(in_force) if layer else in_force
            table[(model.name, target)] = in_force
    return table


def _check_model_limits(s: Settings) -> None:
    """Each model's caps in force obey the rule `[limits]` does, naming the entry."""
    for (name, target), limits in model_limits(s.models, s.limits).items():
        if limits.default_max_tokens > limits.max_output_tokens:
            via = "" if target == name else f", with {target}'s limits"
            raise ConfigError(
                f"[[models]] {name}.limits.default_max_tokens: must not exceed "
                f"max_output_tokens ({limits.default_max_tokens} > {limits.max_output_tokens}{via})"
            )


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
    for (name, _), limits in model_limits(s.models, s.limits).items():
        for key in ("max_prompt_tokens", "max_output_tokens"):
            cap, lane_cap = getattr(limits, key), getattr(last, key)
            if cap != getattr(s.limits, key) and lane_cap is not None and lane_cap < cap:
                warnings.append(
                    f"[[models]] {name}.limits.{key} ({cap}) > the last lane's ({last.name}, "
                    f"{lane_cap}): larger requests for it fit no lane"
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
    shadow_url = s.shadow.url.rstrip("/").lower()
    if shadow_url and shadow_url in {b.url.rstrip("/").lower() for b in s.backends}:
        warnings.append(
            "[shadow].url is also a [[backends]] url: the mirrors would compete with the "
            "primary's own requests on that engine; point it at the candidate"
        )
    return warnings
