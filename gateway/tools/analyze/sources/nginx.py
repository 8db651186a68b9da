"""nginx's JSON access log (our config/nginx.conf's `gateway` log_format, or a similar one).

`$request_time` is seconds from the first client byte to the last byte sent;
`$upstream_header_time` is seconds until the upstream's response header, the
time to first byte (for a streaming LLM: queue + prefill, which nginx cannot
tell apart); `$upstream_response_time` until the upstream's last byte. When
nginx tried several upstreams these read "0.012, 0.340" (one per try, the time
is their sum here) and "-" when no upstream answered.
"""

from __future__ import annotations

import json
import math
from typing import Any


def seconds_ms(value: object) -> float | None:
    """Milliseconds from nginx's seconds value: a number, "0.012", "0.012, 0.340", or "-"."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) * 1000 if math.isfinite(value) else None
    if not isinstance(value, str):
        return None
    total = 0.0
    seen = False
    for part in value.replace(":", ",").split(","):
        part = part.strip()
        if not part or part == "-":
            continue
        try:
            seconds = float(part)
        except ValueError:
            return None
        if not math.isfinite(seconds):  # "nan", "inf": not a time nginx wrote
            return None
        total += seconds
        seen = True
    return total * 1000 if seen else None


def parse_line(line: str) -> dict[str, Any] | None:
    """An nginx access entry (status, request/TTFB/upstream ms) from one JSON line, or None."""
    text = line.strip()
    start = text.find("{")
    if start < 0:
        return None
    try:
        obj = json.loads(text[start:])
    except ValueError:
        return None
    if not isinstance(obj, dict) or "request_time" not in obj or "status" not in obj:
        return None
    try:
        status = int(obj["status"])
    except (TypeError, ValueError):
        return None
    return {
        "source": "nginx",
        "time": obj.get("time") or obj.get("time_iso8601"),
        "status": status,
        "uri": obj.get("uri") or obj.get("request_uri"),
        "request_ms": seconds_ms(obj.get("request_time")),
        "ttfb_ms": seconds_ms(obj.get("upstream_header_time")),
        "upstream_ms": seconds_ms(obj.get("upstream_response_time")),
        "request_length": obj.get("request_length"),
    }
