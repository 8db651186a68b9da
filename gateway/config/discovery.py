"""[discovery]: backends found by DNS (`[[backends]] dns`), and the config reloaded live."""

from __future__ import annotations

import sys
from typing import Annotated

import msgspec
from msgspec import field

from gateway.config.constraints import PositiveFloat, rule


class DiscoverySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where the backends are when the config names them by DNS, and how often the config
    file itself is looked at again (`reload.py`)."""

    #: Seconds between two resolutions of each `[[backends]] dns` name; sooner when the
    #: records' TTL is shorter (never under a second). A Kubernetes headless Service's
    #: records change as its pods become ready or go away.
    interval_s: Annotated[float, rule("be from 1 to 3600", ge=1, le=3600)] = 5.0
    #: Longest one resolution may take before it counts as failed (the last known
    #: addresses are kept, with a warning and a metric).
    timeout_s: PositiveFloat = 2.0
    #: DNS servers to ask, as `address` or `address:port` ("[::1]:53" for IPv6). Empty: the
    #: system's resolver configuration (/etc/resolv.conf: in a pod, the cluster DNS and its
    #: search domains).
    nameservers: list[Annotated[str, rule("be an address[:port]", min_length=1)]] = field(
        default_factory=list
    )
    #: Seconds between two looks at the config file's modification time: a changed file is
    #: reloaded as on SIGHUP (a Kubernetes ConfigMap mounted as a volume changes the file in
    #: place, a minute or so after the ConfigMap). 0: off (reload on SIGHUP or
    #: POST /admin/reload only).
    watch_config_s: Annotated[
        float, rule("be finite and >= 0 (0: off)", ge=0, le=sys.float_info.max)
    ] = 0.0
