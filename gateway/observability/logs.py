"""structlog JSON lines: one per request (`event="request"`) plus a few lifecycle events.

The per-request line goes to stdout so that any log shipper can pick it up and
`python -m gateway analyze` can read it back. Prompt text is never logged.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, TextIO

import structlog

from gateway.observability.record import RequestRecord


def _compact_json(obj: Any, **_: Any) -> str:
    # ASCII escapes: a client's lone surrogate in `model` must not break the log stream.
    return json.dumps(obj, separators=(",", ":"))


def make_logger(stream: TextIO | None = None, level: str = "info") -> Any:
    """A structlog logger rendering one JSON object per line to `stream` (stdout)."""
    return structlog.wrap_logger(
        structlog.WriteLogger(stream or sys.stdout),
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_compact_json),
        ],
    )


class RequestLog:
    """Writes the one log line of a finished request."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.logger = make_logger(stream)

    def request(self, record: RequestRecord) -> None:
        self.logger.info("request", **record.log_fields())
