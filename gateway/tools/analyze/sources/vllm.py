"""vLLM's periodic engine-stats line and its per-request uvicorn access line.

vLLM (V1, `vllm/v1/metrics/loggers.py`) logs every few seconds

    INFO 12-03 07:00:10 [loggers.py:118] Engine 000: Avg prompt throughput: 512.3 tokens/s,
    Avg generation throughput: 88.1 tokens/s, Running: 12 reqs, Waiting: 3 reqs,
    GPU KV cache usage: 71.5%, Prefix cache hit rate: 12.0%

and the older V0 engine (`vllm/engine/metrics.py`) wrote "Running: N reqs,
Swapped: N reqs, Pending: N reqs, GPU KV cache usage: X%, CPU KV cache usage:
Y%". Pending is V0's name for Waiting. Each HTTP request adds uvicorn's access
line `INFO:     127.0.0.1:51234 - "POST /v1/chat/completions HTTP/1.1" 200 OK`,
which has a status but no time. Neither has a per-request TTFT or queue time.
"""

from __future__ import annotations

import math
import re
from typing import Any

from gateway.tools.analyze.sources.tgi import strip_ansi

_TIME = re.compile(r"\b(?:INFO|WARNING|DEBUG)\s+(\d\d-\d\d \d\d:\d\d:\d\d)")
_NUMBERS = {
    "prompt_tps": re.compile(r"Avg prompt throughput: (\d+(?:\.\d+)?) tokens/s"),
    "generation_tps": re.compile(r"Avg generation throughput: (\d+(?:\.\d+)?) tokens/s"),
    "running": re.compile(r"Running: (\d+) reqs"),
    "waiting": re.compile(r"(?:Waiting|Pending): (\d+) reqs"),
    "swapped": re.compile(r"Swapped: (\d+) reqs"),
    "kv_usage_pct": re.compile(r"GPU KV cache usage: (\d+(?:\.\d+)?)%"),
    "prefix_hit_pct": re.compile(r"Prefix cache hit rate: (\d+(?:\.\d+)?)%"),
}
_ACCESS = re.compile(r'"(GET|POST|PUT|DELETE|HEAD|OPTIONS) (\S+) HTTP/[0-9.]+" (\d{3})')


def parse_line(line: str) -> dict[str, Any] | None:
    """A stats line ({kind: stats}), an access line ({kind: access}), or None."""
    text = strip_ansi(line)
    time = _TIME.search(text)
    stamp = time.group(1) if time else None
    if "Avg prompt throughput" in text and "Running:" in text:
        entry: dict[str, Any] = {"source": "vllm", "kind": "stats", "time": stamp}
        for key, pattern in _NUMBERS.items():
            match = pattern.search(text)
            # A corrupted or absurd number (71..0, 400 digits) is not read: skipped, not fatal.
            if match and math.isfinite(value := float(match.group(1))):
                entry[key] = value
        if "running" not in entry or "waiting" not in entry:
            return None
        return entry
    if text.lstrip().startswith("INFO:"):
        access = _ACCESS.search(text)
        if access:
            return {
                "source": "vllm",
                "kind": "access",
                "method": access.group(1),
                "path": access.group(2),
                "status": int(access.group(3)),
            }
    return None


def clock_s(stamp: str | None) -> float | None:
    """Seconds since the start of the month for vLLM's `MM-DD HH:MM:SS` (no year in it)."""
    if not stamp:
        return None
    match = re.match(r"(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)", stamp)
    if match is None:
        return None
    _, day, hour, minute, second = (int(g) for g in match.groups())
    return ((day * 24 + hour) * 60 + minute) * 60 + second
