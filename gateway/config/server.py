"""[server]: where the gateway listens, and how long it waits for its clients."""

from __future__ import annotations

import sys
from typing import Annotated

import msgspec
from msgspec import Meta, field

from gateway.config.constraints import Positive, PositiveFloat, rule


class ServerSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: Annotated[int, rule("be from 1 to 65535", ge=1, le=65535)] = 8080
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
        float, rule("be finite and >= 0 (0: off)", ge=0, le=sys.float_info.max)
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
        rule('hold "*" or origins like https://app.example.com (no path, no trailing slash)'),
    ] = field(default_factory=list)
    #: Serve the chat page at GET /playground (streams through this gateway).
    playground: bool = False
    #: A connection whose request line and headers have not all arrived this long after
    #: it opened (or after its previous answer, on keep-alive) is closed, like nginx's
    #: client_header_timeout: a client trickling its headers must not hold a file
    #: descriptor forever. 0 turns it off.
    header_timeout_s: Annotated[
        float, rule("be finite and >= 0 (0: off)", ge=0, le=sys.float_info.max)
    ] = 10.0
    #: An idle keep-alive connection from a client is closed after this long (nginx's
    #: keepalive_timeout; keep it above the idle timeout of a load balancer in front).
    keepalive_timeout_s: PositiveFloat = 75.0
