"""[routing]: which backend of a pool gets a request, besides load."""

from __future__ import annotations

from typing import Annotated

import msgspec

from gateway.config.constraints import Positive, rule


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
    cache_load_margin: Annotated[float, rule("be in [0, 1]", ge=0, le=1)] = 0.5
    #: Tokens of prefixes remembered per backend (its engine's cache is bounded too).
    prefix_memory_tokens: Positive = 262_144
    #: Longest a request waits for a busy backend that would still give it a sooner first
    #: token than a free one: its prompt cached there, or a faster engine. Each waits
    #: at most what it would gain (predicted), and only as many wait for a backend as
    #: its slots free for in time, so a hot prefix or a fast engine does not draw a
    #: pile-up; requests behind them in line are served meanwhile. 0: never wait.
    max_wait_for_sooner_s: Annotated[float, rule("be from 0 to 60", ge=0, le=60)] = 5.0
    #: Choose the lane by the prompt's uncached part (a long prompt that is mostly cached
    #: is a short request for the engine). Off: the lane is chosen by the whole prompt.
    lane_by_uncached_tokens: bool = False
    #: Send a LoRA adapter's request (its `model` an adapter a backend lists in /v1/models)
    #: to a backend that runs that adapter now, else one with room for another, so engines
    #: swap adapters rarely (`upstream/adapters.py`). Off: adapters are routed by load alone.
    adapter_affinity: bool = True
