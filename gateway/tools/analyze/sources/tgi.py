"""TGI (text-generation-inference) router's per-request "Success" log line.

TGI's router records on its request span (`generate`, `generate_stream`,
`chat_completions`, `completions`, ...) the fields `total_time`,
`validation_time`, `queue_time`, `inference_time` and `time_per_token` as Rust
`Debug` durations, then logs the event "Success" inside that span. In the
default text format that reads

    2026-12-03T07:00:01.123456Z  INFO generate{... total_time="1.2s" validation_time="812µs"
    queue_time="35.1ms" inference_time="1.16s" time_per_token="23.2ms" seed="None"}:
    text_generation_router::server: router/src/server.rs:422: Success

(one line, usually ANSI-coloured); with `--json-output` (tracing_subscriber's
JSON) the same fields sit in the object's `span` (and `spans`) and the message in
`fields.message` or, flattened, `message`. queue_time is the router's queue
(waiting for a batch slot); inference_time is prefill + decode in the shards.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.tools.analyze.sources.durations import duration_ms

#: TGI's field name -> the name this analyzer uses (milliseconds).
FIELDS: dict[str, str] = {
    "total_time": "total_ms",
    "validation_time": "validation_ms",
    "queue_time": "queue_ms",
    "inference_time": "inference_ms",
    "time_per_token": "time_per_token_ms",
}
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_FIELD = re.compile(
    r'\b(total_time|validation_time|queue_time|inference_time|time_per_token)="?([^"\s}]+)"?'
)
_SPAN = re.compile(r"\b([a-z_]+)\{")
_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z?)")


def strip_ansi(line: str) -> str:
    return _ANSI.sub("", line)


def parse_line(line: str) -> dict[str, Any] | None:
    """A TGI request's times from one line (text or JSON), or None."""
    text = strip_ansi(line).strip()
    if text.startswith("{"):
        return _parse_json(text)
    if "Success" not in text or "queue_time" not in text:
        return None
    entry: dict[str, Any] = {"source": "tgi", "format": "text"}
    for name, value in _FIELD.findall(text):
        ms = duration_ms(value)
        if ms is not None:
            entry[FIELDS[name]] = ms
    if "total_ms" not in entry or "queue_ms" not in entry:
        return None
    time = _TIME.match(text)
    entry["time"] = time.group(1) if time else None
    span = _SPAN.search(text)
    entry["span"] = span.group(1) if span else None
    return entry


def _parse_json(text: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    fields = obj.get("fields")
    message = obj.get("message", fields.get("message") if isinstance(fields, dict) else None)
    if message != "Success":
        return None
    spans = [obj.get("span")] + list(obj.get("spans") or [])
    entry: dict[str, Any] = {"source": "tgi", "format": "json", "time": obj.get("timestamp")}
    for span in spans:
        if not isinstance(span, dict):
            continue
        for name, key in FIELDS.items():
            ms = duration_ms(span.get(name))
            if ms is not None and key not in entry:
                entry[key] = ms
                entry.setdefault("span", span.get("name"))
    if "total_ms" not in entry or "queue_ms" not in entry:
        return None
    return entry
