"""[timeouts] and [health]: how long the gateway waits on a backend, and when it gives up
on one.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from gateway.config.constraints import Positive, PositiveFloat, rule


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
    path: Annotated[str, rule("start with '/'", pattern="^/")] = "/health"
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
    #: Where what was learned of the backends (prefill rate, first-token cost, decode
    #: time, token ratio) is kept across a restart, by backend URL. Empty: the user's
    #: state directory (`$XDG_STATE_HOME/llm-tail-gateway/learned.json`) when started
    #: with `serve`; "off": nowhere, every start learns anew.
    state_file: str = ""
