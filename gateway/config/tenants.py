"""[[api_keys]] and [tenants]: who a request is for, its quotas and its share of a lane."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import field

from gateway.config.constraints import Positive, PositiveFloat, rule


class ApiKeySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A client API key. With any configured, every generation request needs one."""

    #: For logs and metrics; the key itself is never logged.
    name: str = ""
    #: The secret the client sends as `Authorization: Bearer <key>`; better set by
    #: environment (GATEWAY_API_KEYS_<INDEX>_KEY) than in a file.
    key: Annotated[str, rule("be at least 8 characters", min_length=8)] = ""
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
    #: May call the admin routes (`POST /admin/backends/{name}/drain`, `.../undrain`).
    admin: bool = False


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
    header: Annotated[str, rule("be a header name", pattern=r"^[A-Za-z0-9-]+$")] = "x-tenant-id"
    #: Share each lane's queue fairly between backlogged tenants, by the tokens each
    #: was served over its weight (a Virtual Token Counter). Off: first come.
    fair_share: bool = True
    #: What one output token costs against a prompt token in the fair share. 0: learned
    #: from the backends (the prompt tokens they prefill in the time one output token
    #: holds a slot).
    output_token_weight: Annotated[float, rule("be from 0 to 10000 (0: learned)", ge=0, le=1e4)] = (
        0.0
    )
    #: Tenant names, besides the API keys' names, that get their own metric series; the
    #: others are counted together as "other" (a label per client id would be unbounded).
    labeled: list[str] = field(default_factory=list)
