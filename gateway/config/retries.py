"""[retries]: retries seen in the log and damped at the door."""

from __future__ import annotations

from typing import Annotated

import msgspec

from gateway.config.constraints import rule


class RetrySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Retries seen and damped (`admission/retries.py`): the same request again, soon.

    A request with the same sender and body bytes (or the same client-sent
    x-request-id) as one that ended within `window_s` is logged as a retry of it; with
    `damp`, one that comes before the Retry-After its earlier refusal was given is
    refused again at once with the time left, without queueing.
    """

    #: Seconds a request's fingerprint is remembered after its end. 0: off (no retry is
    #: seen, none damped).
    window_s: Annotated[float, rule("be from 0 to 3600 (0: off)", ge=0, le=3600)] = 60.0
    #: Most fingerprints remembered (the oldest go first): ~340 bytes each.
    max_remembered: Annotated[int, rule("be from 0 to 10000000 (0: off)", ge=0, le=10_000_000)] = (
        100_000
    )
    #: Refuse at once a retry that comes before its earlier refusal's Retry-After (for
    #: capacity: queue_full, wait_too_long, queue_timeout, no_backend), when
    #: the sender is one the client named (key, tenant, session, `user`) or it reused
    #: its x-request-id. Off: retries are only seen (logged and counted).
    damp: bool = True
