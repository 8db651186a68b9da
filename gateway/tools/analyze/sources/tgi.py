"""Text Generation Inference's router log: one "Success" line per request, with its times.

TGI's router (router/src/server.rs) runs each request in a tracing span
(`generate`, `generate_stream`, `chat_completions`, `completions`, ...) whose fields
it fills when the request ends: `total_time`, `validation_time`, `queue_time`,
`inference_time` and `time_per_token`, each a Rust `Duration` printed with `{:?}`
(`1.2s`, `35.1ms`, `812µs`, `120ns`); then it logs `Success` inside that span.
The default text format prints the span as `name{field="value" ...}:` and colours
it; `--json-output` prints one JSON object with the span's fields under `span`
(and the whole stack under `spans`).

`queue_time` is the wait in TGI's own batching queue and `inference_time` the
prefill plus decode, so the tail splits into queue-bound and model-bound; what the
line cannot say is how inference divides into prefill and decode, or a request's
token counts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from gateway.tools.analyze.sources.common import json_object, percentiles, plain, rounded

#: The duration fields of the request span, and the names the reader gives them.
FIELDS: dict[str, str] = {
    "total_time": "total_ms",
    "validation_time": "validation_ms",
    "queue_time": "queue_ms",
    "inference_time": "inference_ms",
    "time_per_token": "time_per_token_ms",
}
#: Milliseconds per unit of Rust's `Duration` Debug format (plus m and h, which
#: humantime-style printers use for long waits).
UNIT_MS: dict[str, float] = {
    "ns": 1e-6,
    "µs": 1e-3,  # U+00B5, what Rust prints
    "μs": 1e-3,  # U+03BC, the Greek letter, which copy-paste often turns it into
    "us": 1e-3,
    "ms": 1.0,
    "s": 1000.0,
    "m": 60_000.0,
    "min": 60_000.0,
    "h": 3_600_000.0,
}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ns|µs|μs|us|ms|s|min|m|h)$")
_TEXT_FIELD = re.compile(
    r"\b(total_time|validation_time|queue_time|inference_time|time_per_token)="
    r"\"?([0-9.]+(?:ns|µs|μs|us|ms|s|min|m|h))\"?"
)
_TEXT_HEAD = re.compile(
    r"^(?P<time>\d{4}-\d\d-\d\dT[0-9:.]+Z?)?\s*(?P<level>TRACE|DEBUG|INFO|WARN|ERROR)\s+"
    r"(?P<span>[A-Za-z_][\w]*)\{"
)
#: The same share as our own analyzer's queueing-bound rule.
QUEUE_BOUND_SHARE = 0.5
TAIL_FRACTION = 0.01
SLOWEST_LISTED = 5
CANNOT_TELL = (
    "TGI's Success line does not split inference into prefill and decode, nor give token "
    "counts; failed requests log an error without these times, so they are not in the split"
)


def duration_ms(text: str) -> float | None:
    """Milliseconds of a Rust `Duration` Debug string (`35.1ms`, `812µs`), None if not one."""
    match = _DURATION.match(text.strip())
    if match is None:
        return None
    return float(match.group(1)) * UNIT_MS[match.group(2)]


def looks_like(line: str) -> str | None:
    """'tgi' or 'tgi-json' when the (plain) line is TGI's router speaking, else None."""
    if "text_generation_router" in line or ("total_time" in line and "queue_time" in line):
        return "tgi-json" if line.lstrip().startswith("{") else "tgi"
    return None


def parse_line(line: str) -> dict[str, Any] | None:
    """One request's times from a TGI Success line (text or JSON); None if it has none."""
    text = plain(line)
    if text.startswith("{"):
        return _parse_json(text)
    return _parse_text(text)


def _parse_text(text: str) -> dict[str, Any] | None:
    if not text.endswith("Success"):
        return None
    values: dict[str, float] = {}
    for name, raw in _TEXT_FIELD.findall(text):
        ms = duration_ms(raw)
        if ms is not None:
            values[FIELDS[name]] = ms
    head = _TEXT_HEAD.match(text)
    return _record(values, head.group("time") if head else None, head.group("span") if head else None)


def _parse_json(text: str) -> dict[str, Any] | None:
    obj = json_object(text)
    if obj is None:
        return None
    fields = obj.get("fields") if isinstance(obj.get("fields"), dict) else {}
    message = obj.get("message", fields.get("message"))
    if message != "Success":
        return None
    spans = [obj.get("span")] + list(reversed(obj.get("spans") or []))
    for span in spans:
        if isinstance(span, dict) and "total_time" in span:
            values = {
                FIELDS[name]: ms
                for name in FIELDS
                if isinstance(span.get(name), str) and (ms := duration_ms(span[name])) is not None
            }
            time = obj.get("timestamp")
            return _record(values, time if isinstance(time, str) else None, span.get("name"))
    return None


def _record(values: dict[str, float], time: str | None, span: Any) -> dict[str, Any] | None:
    if "total_ms" not in values or "queue_ms" not in values or "inference_ms" not in values:
        return None  # a line cut before its times, or another message of the span
    return {"time": time, "span": span if isinstance(span, str) else None, **values}


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Percentiles of total, queue and inference; the tail's split; the longest waits."""
    ranked = sorted(records, key=lambda r: r["total_ms"], reverse=True)
    tail = ranked[: max(1, round(len(ranked) * TAIL_FRACTION + 0.4999))] if ranked else []
    queue = sum(r["queue_ms"] for r in tail)
    inference = sum(r["inference_ms"] for r in tail)
    share = queue / (queue + inference) if queue + inference > 0 else None
    if share is None:
        verdict = None
    else:
        verdict = "queue" if share > QUEUE_BOUND_SHARE else "model"
    return {
        "requests": len(records),
        "total_ms": percentiles([r["total_ms"] for r in records]),
        "queue_ms": percentiles([r["queue_ms"] for r in records]),
        "inference_ms": percentiles([r["inference_ms"] for r in records]),
        "validation_ms": percentiles([r["validation_ms"] for r in records if "validation_ms" in r]),
        "time_per_token_ms": percentiles(
            [r["time_per_token_ms"] for r in records if "time_per_token_ms" in r]
        ),
        "tail": {
            "requests": len(tail),
            "queue_ms": rounded(queue / len(tail)) if tail else None,
            "inference_ms": rounded(inference / len(tail)) if tail else None,
            "queue_share": rounded(share),
        },
        "verdict": verdict,
        "longest_waits": [
            {k: r.get(k) for k in ("time", "span", "total_ms", "queue_ms", "inference_ms")}
            for r in sorted(records, key=lambda r: r["queue_ms"], reverse=True)[:SLOWEST_LISTED]
        ],
        "cannot_tell": CANNOT_TELL,
    }


VERDICT_TEXT = {
    "queue": "queue-bound → requests waited in TGI's own batching queue: send it fewer at "
    "once (the gateway's slots for it) or add replicas; the gateway's lanes can then order "
    "the wait",
    "model": "model-bound → inference (prefill + decode) made the tail: capacity, prompt "
    "or output size",
}
