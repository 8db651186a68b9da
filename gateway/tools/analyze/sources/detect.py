"""Which source wrote a line: ours, TGI, vLLM, nginx, or unknown.

Our own request line carries `"event": "request"`; nginx's JSON has
`request_time` and `status`; TGI's has the "Success" message with queue_time;
vLLM's is its stats or uvicorn access text. Order matters only for JSON, where
ours is checked first so our log reads exactly as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.tools.analyze.analyzer import parse_line as parse_ours
from gateway.tools.analyze.sources import nginx, tgi, vllm

SOURCES: tuple[str, ...] = ("tgi", "vllm", "nginx")


def classify(line: str) -> tuple[str, dict[str, Any] | None]:
    """(source name, parsed entry) for one line; ("unknown", None) when nothing reads it."""
    if parse_ours(line) is not None:
        return "ours", None
    for name, parser in (
        ("tgi", tgi.parse_line),
        ("nginx", nginx.parse_line),
        ("vllm", vllm.parse_line),
    ):
        entry = parser(line)
        if entry is not None:
            return name, entry
    return "unknown", None


def read_sources(lines: Iterable[str]) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """Other servers' entries by source, and how many non-blank lines no reader knew."""
    found: dict[str, list[dict[str, Any]]] = {name: [] for name in SOURCES}
    unknown = 0
    for line in lines:
        if not line.strip():
            continue
        name, entry = classify(line)
        if entry is not None:
            found[name].append(entry)
        elif name == "unknown":
            unknown += 1
    return found, unknown
