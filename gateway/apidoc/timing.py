"""Deadlines, timeouts and streams: how long a caller may wait, and what a long wait looks like.

The keepalive comments are `http/keepalive.py`'s bytes and the SSE error events the
dialects' own `error_event`, so the examples are what a client really receives.
"""

from __future__ import annotations

from gateway.admission.deadline import DEADLINE_HEADER
from gateway.apidoc.markdown import code, fenced, seconds, table
from gateway.config import Settings
from gateway.dialects import ChatDialect, TgiDialect
from gateway.http.errors import error_body, in_band_error
from gateway.http.keepalive import QUEUED, WAITING, queue_time_comment
from gateway.scheduling.fitting import DEADLINE_OVER_FLOOR
from gateway.scheduling.scheduler import REFUSE_AT_DEADLINE_SHARE, SHED_LOWER_AT
from gateway.upstream.relay import STREAM_HEADERS
from gateway.upstream.sizing import UNLEARNED_DEADLINE_S


def deadlines_section(settings: Settings) -> list[str]:
    """Queue deadlines and timeouts: what a caller's own timeout must exceed."""
    share = f"{REFUSE_AT_DEADLINE_SHARE:.0%}"
    rows = []
    for lane in settings.lanes:
        fitted = (
            f"yes: raised to {DEADLINE_OVER_FLOOR:g} × the engine floor when that is longer, "
            f"and {UNLEARNED_DEADLINE_S:g} s while the engine is unmeasured"
            if lane.fit_timeout_to_engine
            else "no: exact, as configured"
        )
        refused = (
            f"yes: 429 `wait_too_long` when the predicted wait is over {share} of the "
            "deadline, or the prompts in prefill ahead of it alone outlast it"
            if lane.reject_predicted_wait
            else "no: it waits, and gets 503 `queue_timeout` at the deadline"
        )
        rows.append((code(lane.name), seconds(lane.queue_timeout_s), fitted, refused))
    timeouts = settings.timeouts
    timeout_rows = [
        (
            "first byte of a stream",
            seconds(timeouts.first_token_s),
            "504 `backend_timeout` (after the queue)",
        ),
        (
            "silence in the middle of a stream",
            seconds(timeouts.idle_s),
            "the stream ends with a `backend_timeout` error event",
        ),
        (
            "end to end, queue included (and a whole non-streamed answer)",
            seconds(timeouts.total_s),
            "504 `backend_timeout`, or an error event once streaming",
        ),
    ]
    return [
        "## Deadlines and timeouts",
        "",
        "A request waits in its lane's queue at most its *queue deadline*; then it gets 503 "
        "`queue_timeout`. Rather than let you wait only to be refused, the gateway refuses "
        "at arrival (429 `wait_too_long`) a request whose predicted wait would not fit, "
        "and while a higher lane's recent requests waited over "
        f"{SHED_LOWER_AT:.0%} of their deadline it refuses the lanes below it first.",
        "",
        *table(
            ("lane", "configured queue deadline", "fitted to the engine", "refused at arrival"),
            rows,
        ),
        "",
        "*Fitted to the engine*: a deadline the operator wrote is exact. One left unset "
        "(the built-in lanes') adapts: at start and as it learns, the gateway measures how "
        "long its backends take to prefill (the engine floor: one long prompt ahead of you "
        "plus your own), and raises the deadline where that floor would not fit in it; the "
        "figures above are the configured ones, and a `queue_timeout` message names the "
        "deadline that applied.",
        "",
        f"Your own deadline: send `{DEADLINE_HEADER}` (see [Headers](#headers)) and the "
        "shorter of yours and the lane's applies.",
        "",
        *table(("timeout", "limit", "then"), timeout_rows),
        "",
        "Set your HTTP client's timeout *above* the gateway's, or you only ever see your "
        "own timeout and never the gateway's reason: for a stream, at least the queue "
        "deadline plus the first-byte timeout; for a whole answer, the end-to-end timeout.",
    ]


def _comment(line: bytes) -> str:
    return line.decode().strip()


def streaming_section(settings: Settings) -> list[str]:
    """Keepalive comments and the error event in a 200 stream: what SSE parsers must handle."""
    interval = settings.server.sse_keepalive_s
    lines = [
        "## Streaming",
        "",
        "With `stream: true` (or TGI's `/generate_stream`) the backend's Server-Sent Events "
        "reach you byte for byte as they are made: OpenAI's `data: <chunk>` … "
        "`data: [DONE]`, TGI's `data:<token>`. The gateway adds "
        + ", ".join(f"`{name}: {value}`" for name, value in STREAM_HEADERS.items())
        + " (so that a proxy in front does not buffer the stream).",
        "",
    ]
    queued, waiting = _comment(QUEUED), _comment(WAITING)
    if interval > 0:
        lines += [
            f"**Keepalive.** A streaming request that has waited {seconds(interval)} — in "
            "its lane's queue or for the backend's first byte — gets its 200 and SSE headers "
            f"then, and an SSE comment line every {seconds(interval)} after: `{queued}` "
            f"while it is queued, `{waiting}` while the backend reads the prompt. Proxies "
            "and load balancers that cut a silent connection (often after 60 s) then leave "
            "it alone. Lines that start with `:` are comments, not events: the `openai` "
            "SDKs, `huggingface_hub` and browsers' `EventSource` skip them; a parser of "
            "your own must skip them too. Its headers went before its wait was over, so "
            "instead of `x-gateway-queue-ms` such a stream says its queue time in one more "
            f"comment, just before the backend's first byte: `{_comment(queue_time_comment(2016.4))}`. "
            "Requests served sooner (nearly all) get no comment and no early headers. "
            "Non-streamed requests never do.",
            "",
            "**A refusal after a keepalive.** Before the first keepalive, a refusal keeps "
            "its HTTP status (429/503 with `Retry-After`). After it the status is already "
            "200, so the refusal (or a later backend failure) is the stream's last event, "
            "an error, and the stream ends without `[DONE]`. When it failed before the "
            "backend's first byte, the error also carries what the headers no longer "
            "could: `retry_after` (the whole seconds `Retry-After` would have said) and "
            "`queue_ms` (the time it queued). On the OpenAI routes:",
        ]
    else:
        lines += [
            "**Keepalive is off here** (`sse_keepalive_s = 0`): a streaming request gets "
            "its headers with the backend's first byte, and a refusal before that keeps "
            "its HTTP status.",
            "",
            "**A failure after the stream started** (the backend broke off, or went "
            "silent) is the stream's last event, an error, and the stream ends without "
            "`[DONE]`. On the OpenAI routes:",
        ]
    error = error_body("queue_timeout", "…")
    if interval > 0:  # the lane's timeout as the queue time, a 5 s hint: an example
        queued_ms = settings.lanes[0].queue_timeout_s * 1000
        error = in_band_error(error, retry_after_s=5.0, queue_ms=queued_ms)
    openai_event = ChatDialect("/v1/chat/completions").error_event(error).decode()
    tgi_event = TgiDialect("/generate_stream", stream=True).error_event(error).decode()
    example = "HTTP/1.1 200 OK\n" + f"Content-Type: {STREAM_HEADERS['Content-Type']}\n\n"
    if interval > 0:
        example += f"{queued}\n\n{queued}\n\n"
    lines += [
        "",
        *fenced("text", example + openai_event),
        "",
        "The `openai` SDKs raise `APIError` for it (not `APIStatusError`: there is no "
        "status); its `code` is the error's `code`"
        + (
            ', and its `body` the whole error object (`body["retry_after"]`)'
            if interval > 0
            else ""
        )
        + ". On the TGI routes the event is TGI's own shape, which `huggingface_hub` raises "
        "as an error:",
        "",
        *fenced("text", tgi_event),
    ]
    return lines
