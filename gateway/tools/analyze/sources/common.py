"""What the other servers' log readers share: ANSI codes stripped, numbers read, percentiles.

Other servers' logs come through terminals, `docker logs` and collectors, so a line
may be coloured, prefixed or cut in the middle; these helpers never raise.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from gateway.tools.stats import percentile

#: CSI escape sequences (colours, bold, dim) that tracing's text format and
#: coloured terminals put around fields.
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
PERCENTILES: tuple[float, ...] = (50, 95, 99)


def plain(line: str) -> str:
    """The line without ANSI escapes and surrounding whitespace."""
    return ANSI.sub("", line).strip()


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50 / p95 / p99 of `values` in their own unit, rounded; None when there are none."""
    return {f"p{q:g}": _round(percentile(values, q)) for q in PERCENTILES}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def json_object(text: str) -> dict[str, Any] | None:
    """The JSON object starting at the first `{` of `text`, or None (cut, not JSON, a list)."""
    import json

    start = text.find("{")
    if start < 0:
        return None
    try:
        obj = json.loads(text[start:])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None
