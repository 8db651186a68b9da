"""Rust's `Debug` format of `std::time::Duration` (`1.2s`, `35.1ms`, `812µs`, `120ns`) in ms.

TGI records its per-request times with `format!("{:?}", duration)`, so that is
the text its logs carry. Minutes and hours (`2m`, `1h`) are accepted too, for
tools that print humantime-style values.
"""

from __future__ import annotations

import math
import re

_UNIT_MS = {
    "ns": 1e-6,
    "µs": 1e-3,
    "μs": 1e-3,  # Greek mu, as some terminals re-encode it
    "us": 1e-3,
    "ms": 1.0,
    "s": 1000.0,
    "m": 60_000.0,
    "h": 3_600_000.0,
}
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ns|µs|μs|us|ms|s|m|h)\s*$")


def duration_ms(text: object) -> float | None:
    """Milliseconds in `text`, or None when it is not a duration."""
    if not isinstance(text, str):
        return None
    match = _DURATION.match(text.strip().strip('"'))
    if match is None:
        return None
    ms = float(match.group(1)) * _UNIT_MS[match.group(2)]
    return ms if math.isfinite(ms) else None  # 400 digits: not a duration anyone measured
