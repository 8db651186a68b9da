"""Who a request is for: its tenant, whose share of a lane it uses.

A lane's queue is shared fairly between tenants (`scheduling/fairness.py`), so the
gateway must tell them apart. With API keys a tenant is a key, by its `name`, and
the key's `weight` is its share: the only identity a client cannot make up. Without
keys, `[tenants] source` picks a header (set by an authenticating proxy in front,
say) or the body's `user` (OpenAI's end-user id); a request naming none belongs to
the one shared tenant. An unauthenticated name can be made up, but making up names
gains a client nothing over first come: each made-up tenant is lifted to the same
counter as everyone else.

Names reach logs and counters, so a name too long or unprintable is replaced by a
digest of it (still one tenant, never a refusal). Metrics get a bounded label: the
configured names, the rest folded into "other".
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.config import ApiKeySettings, Settings
from gateway.scheduling.scheduler import DEFAULT_TENANT

#: Longest tenant name kept as sent; longer ones are named by their digest.
MAX_TENANT_NAME = 64
#: The metric label of tenants not named in the config.
OTHER_TENANTS = "other"


@dataclass(slots=True, frozen=True)
class Tenant:
    name: str
    weight: float = 1.0


SHARED = Tenant(DEFAULT_TENANT)


def tenant_name(raw: str) -> str:
    """`raw` as a tenant name: itself when short and printable, else its digest."""
    name = raw.strip()
    if not name:
        return DEFAULT_TENANT
    if len(name) <= MAX_TENANT_NAME and name.isprintable():
        return name
    return "sha256:" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class Tenants:
    """Finds each request's tenant, as `[tenants]` and the API keys say."""

    def __init__(self, settings: Settings) -> None:
        self.reconfigure(settings)

    def reconfigure(self, settings: Settings) -> None:
        """From `settings` (at start, and on a reload: the metrics keep reading this one's
        labels)."""
        config = settings.tenants
        self._keyed = bool(settings.api_keys)
        self._source = config.source
        self._header = config.header
        self._labels = {DEFAULT_TENANT, *config.labeled, *(k.name for k in settings.api_keys)}

    def identify(
        self, client: ApiKeySettings | None, headers: Mapping[str, str], body: Mapping[str, object]
    ) -> Tenant:
        if client is not None:
            return Tenant(client.name, client.weight)
        if self._keyed:  # keys on but no client: refused before this; one tenant anyway
            return SHARED
        raw: object = None
        if self._source == "header":
            raw = headers.get(self._header)
        elif self._source == "user":
            raw = body.get("user")
        if not isinstance(raw, str):
            return SHARED
        return Tenant(tenant_name(raw))

    def label(self, tenant: str | None) -> str:
        """The tenant's metric label: its name when configured, else "other"."""
        if tenant is None:
            return DEFAULT_TENANT
        return tenant if tenant in self._labels else OTHER_TENANTS
