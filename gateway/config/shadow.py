"""[shadow]: the candidate backend that gets mirrored copies of sampled requests."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import field

from gateway.config.constraints import Positive, PositiveFloat, rule


class ShadowSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A candidate backend (a new model or engine version) that gets mirrored copies of
    sampled requests; its answers are discarded and compared with the primary's in the
    log (`shadow_compared`). It is no member of the pool: it takes no slot, and its
    mirrors are dropped first whenever the primary is under load."""

    #: The candidate's base URL; empty: no shadow traffic.
    url: Annotated[
        str,
        rule("be empty (off) or http(s)://host:port", pattern=r"(?i)^(?:$|https?://[^/?#\s]+)"),
    ] = ""
    #: For the log line (default: host:port).
    name: str = ""
    #: Sent as the body's `model` on OpenAI routes (the candidate serves another name).
    model: str | None = None
    #: Whose requests are mirrored: those asking for one of these names, or sent to one
    #: (an alias's target); a request naming no model (TGI's routes) asks for its pool's.
    #: Empty: the default pool's requests (every request, with one pool). With several
    #: models a candidate is a candidate for some of them, never for another's traffic.
    models: list[Annotated[str, rule("be a non-empty name", min_length=1)]] = field(
        default_factory=list
    )
    #: Sent to the candidate as `Authorization: Bearer ...`.
    api_key: str | None = None
    #: Share of dispatched requests mirrored. With a url set, all of them by default: the
    #: candidate's load is bounded by max_concurrency and the drop rules, not by sampling.
    sample_rate: Annotated[float, rule("be from 0 to 1", ge=0, le=1)] = 1.0
    #: Mirrors in flight at once; a sampled request over it is dropped, not queued.
    max_concurrency: Positive = 4
    connect_timeout_s: PositiveFloat = 2.0
    #: A mirror that has not ended after this long is cut (and counted an error).
    timeout_s: PositiveFloat = 120.0
    #: No new mirror while the event loop runs this late (the gateway itself is busy).
    max_loop_lag_s: PositiveFloat = 0.05
