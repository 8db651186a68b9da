"""JSON lines: one per request (`event="request"`) plus a few lifecycle events (structlog).

The per-request line goes to stdout so that any log shipper can pick it up and
`python -m gateway analyze` can read it back. Prompt text is never logged.

The request line is on every request's path, so it is rendered directly with
msgspec (a tenth of structlog's chain with `json.dumps`) in the same shape
structlog gives the lifecycle events: the record's fields, then `event`,
`level` and an ISO 8601 UTC `timestamp`. Lines are ASCII: a non-ASCII value
(a model name) is written with `\\u` escapes, so a lone surrogate cannot break
the stream. On stdout the writing itself happens in a thread, so a slow
reader of the pipe (a log shipper that stalls) never blocks the event loop;
the lines go to that thread in batches, not one wake-up each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import sys
import threading
import time
from datetime import UTC, datetime
from typing import Any, TextIO

import msgspec
import structlog

from gateway.observability.record import RequestRecord, clock

_encode = msgspec.json.Encoder().encode


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


def render_request_line(record: RequestRecord, at: datetime | None = None) -> str:
    """The request's log line, newline included; `at`: its time (now unless given: a
    replay in virtual time stamps its lines with the virtual clock, so the analyzer reads
    them as it reads a real run's)."""
    fields = record.log_fields()
    fields["event"] = "request"
    fields["level"] = "info"
    fields["timestamp"] = (at or datetime.now(UTC)).isoformat().replace("+00:00", "Z")
    try:
        line = _encode(fields)
        if line.isascii():
            return line.decode("ascii") + "\n"
    except UnicodeEncodeError:  # a lone surrogate: json.dumps escapes it
        pass
    return _compact_json(fields) + "\n"


def ended_at(record: RequestRecord) -> datetime | None:
    """The wall-clock time of the request's end (None: it has none; now, then)."""
    if record.end is None:
        return None
    return datetime.fromtimestamp(time.time() - (clock() - record.end), UTC)


#: Lines wait this long in the loop's thread before the writer thread gets them. Woken
#: for every line, the thread cost more than the line: a thread switch and GIL handoffs
#: that the loop pays too, 13% of the CPU of a short streamed request (measured side by
#: side against writing each line at once).
HANDOFF_S = 0.05
#: ... or until this much text waits.
HANDOFF_CHARS = 256 * 1024


class RequestLog:
    """Writes the one log line of a finished request.

    `background=True` (what `serve` uses on stdout) hands the lines to a writer
    thread, a batch at a time (`HANDOFF_S`); otherwise (tests, a StringIO) each
    line is written at once.
    """

    def __init__(self, stream: TextIO | None = None, *, background: bool = False) -> None:
        self.stream = stream or sys.stdout
        self._lines: queue.SimpleQueue[str | None] | None = None
        self._writer: threading.Thread | None = None
        #: Text rendered but not yet handed to the writer thread, and the timer that will.
        self._held: list[str] = []
        self._held_chars = 0
        self._handoff: asyncio.TimerHandle | None = None
        if background:
            self._lines = queue.SimpleQueue()
            self._writer = threading.Thread(
                target=self._write_lines, name="request-log", daemon=True
            )
            self._writer.start()

    def request(self, record: RequestRecord) -> None:
        """Write `record`'s line, stamped with its end (it may be written a moment later)."""
        text = render_request_line(record, ended_at(record))
        if self._lines is None:
            self.stream.write(text)
            self.stream.flush()
            return
        self._held.append(text)
        self._held_chars += len(text)
        if self._held_chars >= HANDOFF_CHARS:
            self.hand_off()
        elif self._handoff is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # outside the loop (shutdown): no timer to wait for
                self.hand_off()
                return
            self._handoff = loop.call_later(HANDOFF_S, self.hand_off)

    def hand_off(self) -> None:
        """Give the writer thread the lines held now (a batch of them is complete)."""
        if self._handoff is not None:
            self._handoff.cancel()
            self._handoff = None
        if self._held and self._lines is not None:
            self._lines.put("".join(self._held))
            self._held.clear()
            self._held_chars = 0

    def _write_lines(self) -> None:
        assert self._lines is not None
        while True:
            line = self._lines.get()
            if line is None:
                return
            with contextlib.suppress(OSError, ValueError):  # a closed stdout loses the line
                self.stream.write(line)
                while not self._lines.empty():  # a burst: one flush for all of it
                    more = self._lines.get()
                    if more is None:
                        self.stream.flush()
                        return
                    self.stream.write(more)
                self.stream.flush()

    def close(self) -> None:
        """Write what is queued, then stop the writer (at shutdown)."""
        self.hand_off()
        if self._lines is not None and self._writer is not None:
            self._lines.put(None)
            self._writer.join(timeout=5)
            self._lines = None
