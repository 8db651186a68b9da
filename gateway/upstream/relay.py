"""Send a request to a backend and relay its answer to the client as it arrives.

The relay knows nothing about lanes. It owns the backend connection for one
request: it opens it (retrying once on a fresh connection when a pooled
keep-alive connection turns out to be closed), enforces the first-byte, idle
and total timeouts, forwards the stream byte for byte, and closes the backend
connection the moment the client goes away so the engine stops generating.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from gateway.config import TimeoutSettings
from gateway.observability.record import RequestRecord, clock
from gateway.outcomes import BackendError, BackendTimeout, Outcome, Refusal, ShuttingDown
from gateway.upstream.engine_timings import llamacpp_timings, tgi_headers
from gateway.upstream.pool import Backend
from gateway.upstream.seam import RelayedEvents
from gateway.upstream.sse import StreamWatcher
from gateway.upstream.stall import StallRule

if TYPE_CHECKING:
    from gateway.admission.admit import RequestShape
    from gateway.dialects.base import Dialect

#: Error bodies from a backend are passed through; bigger ones are cut here.
MAX_ERROR_BODY_BYTES = 64 * 1024
#: Backend answers that mean "not now, try another server" (before any byte reached the client).
RETRYABLE_STATUSES = frozenset({502, 503})
#: A read at least this big means the backend sends faster than the loop relays.
BATCH_AFTER_BYTES = 1024
#: The log's error_code when the backend sent an error event inside a 200 stream.
STREAM_ERROR_CODE = "backend_stream_error"
STREAM_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    # Tell an nginx in front of us not to buffer the stream.
    "X-Accel-Buffering": "no",
}


class SseResponse(web.StreamResponse):
    """The client's stream: its headers leave with its first bytes, in one write.

    aiohttp's StreamResponse sends its headers at `prepare()`, so a relayed stream
    cost a write (and a segment for the client to read) for the headers alone; its
    Response already holds them back for the body, and this does the same.
    """

    _send_headers_immediately = False


def backend_session(
    connector: aiohttp.BaseConnector, timeout: aiohttp.ClientTimeout
) -> aiohttp.ClientSession:
    """A client session for relaying to backends: their bytes as they sent them.

    - `Accept-Encoding: identity`: the relay reads the backend's events (first token,
      usage, the end) and passes its bytes on without a `Content-Encoding`, so it must
      get them uncompressed; aiohttp's default asks for gzip and deflate.
    - No cookie jar: a backend's (or its load balancer's) `Set-Cookie` answers one
      client's request; kept, it would go with every other client's requests too.
    """
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        headers={"Accept-Encoding": "identity"},
    )


class UpstreamClient:
    """The HTTP client side: one keep-alive pool plus a fresh-connection fallback."""

    def __init__(self, timeouts: TimeoutSettings) -> None:
        self.timeouts = timeouts
        self._pooled: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the sessions (they need the running loop)."""
        client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeouts.connect_s)
        self._pooled = backend_session(
            aiohttp.TCPConnector(limit=0, keepalive_timeout=self.timeouts.pool_idle_s),
            client_timeout,
        )
        self._fresh = backend_session(
            aiohttp.TCPConnector(limit=0, force_close=True), client_timeout
        )

    @property
    def pooled(self) -> aiohttp.ClientSession:
        assert self._pooled is not None, "UpstreamClient.start() was not awaited"
        return self._pooled

    @property
    def fresh(self) -> aiohttp.ClientSession:
        assert self._fresh is not None, "UpstreamClient.start() was not awaited"
        return self._fresh

    async def close(self) -> None:
        for session in (self._pooled, self._fresh):
            if session is not None:
                await session.close()

    async def post(
        self, backend: Backend, path: str, body: bytes, headers: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        """POST and wait for the response headers; BackendFailure when unreachable."""
        url = backend.url + path
        try:
            return await self.pooled.post(url, data=body, headers=headers)
        except aiohttp.ClientConnectorError as exc:
            raise _unreachable(backend, exc) from None
        except aiohttp.ClientConnectionError:
            # The pooled connection was closed by the backend before it answered
            # (keep-alive race): the request never ran, so one retry is safe.
            pass
        except aiohttp.ClientError as exc:  # not HTTP (a bad status line, bad headers)
            raise _unreachable(backend, exc) from None
        try:
            return await self.fresh.post(url, data=body, headers=headers)
        except aiohttp.ClientError as exc:
            raise _unreachable(backend, exc) from None

    async def get(
        self, backend: Backend, path: str, headers: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        try:
            return await self.pooled.get(
                backend.url + path,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeouts.first_token_s),
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _unreachable(backend, exc) from None


class BackendFailure(BackendError):
    """The backend failed before anything reached the client: safe to retry elsewhere.

    `passthrough` is the backend's own answer (a 502/503) to give the client
    when no retry is possible; without it the client gets this error's envelope.
    """

    def __init__(self, message: str, passthrough: web.Response | None = None) -> None:
        super().__init__(message)
        self.passthrough = passthrough


#: Why an answer was carried over to another backend (the log's `resume_reason`).
BROKEN, STALLED, DRAINED = "broken", "stalled", "drained"
#: The watchdog's expiries that, mid-answer, are a stalled backend (resumed elsewhere).
STALL_KINDS = frozenset({"stall", "idle"})
#: The watchdog's expiry when the scheduler preempts the request before its first byte
#: (`scheduling/preemption.py`): the relay raises `Preempted`, the handler requeues it.
PREEMPTED = "preempted"
#: The watchdog's expiry when this gateway stops (SIGTERM's drain deadline, `app.drain`):
#: the stream ends here with a `shutting_down` event, and its slot is given back.
SHUTDOWN = "shutdown"


def shutdown_cut() -> ShuttingDown:
    """What a request still running at the drain deadline is told."""
    return ShuttingDown(
        "This gateway is shutting down; retry the request on another instance.",
        retry_after_s=1,
    )


class Preempted(Exception):
    """The scheduler took the request's engine back before its first byte: its backend
    connection is closed (the engine aborts it) and nothing reached the client but
    keep-alive comments; it waits in its lane's line again."""


class StreamBroken(Exception):
    """The backend failed after the client's stream had started, and what the client got
    was kept (`RelayPlan.relayed`): the caller may continue the answer elsewhere.

    Only whole events reached the client; its stream is open, without an end."""

    def __init__(
        self, reason: str, client_response: web.StreamResponse, plan: RelayPlan, message: str
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.client_response = client_response
        self.plan = plan
        self.message = message


def _unreachable(backend: Backend, exc: BaseException) -> BackendFailure:
    return BackendFailure(f"Backend {backend.name} is unreachable ({type(exc).__name__}).")


class Watchdog:
    """Cancels the relaying task when the backend is silent for too long.

    One timer per request, re-armed lazily: the relay only stores the time of
    each chunk, and the timer, when it fires, checks whether the silence really
    lasted. `expired` names the timeout that fired. Once the first token has
    passed, a stream that may be resumed is watched for a stall too (`stall.py`):
    the relay then also notes its longest silence (`gap`).
    """

    __slots__ = (
        "_loop",
        "_task",
        "_idle_s",
        "_total_at",
        "_handle",
        "_stall",
        "_learned_gap",
        "last",
        "gap",
        "streaming",
        "expired",
        "ended",
    )

    def __init__(self, first_byte_s: float, idle_s: float, total_at: float) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._idle_s = idle_s
        self._total_at = total_at
        self._stall: StallRule | None = None
        self._learned_gap = 0.0
        self.last = self._loop.time()
        #: The longest silence between chunks since the stall watch began.
        self.gap = 0.0
        self.streaming = False
        self.expired: str | None = None
        #: The relay is over: nothing of it may be cancelled any more.
        self.ended = False
        self._handle = self._loop.call_at(min(self.last + first_byte_s, total_at), self._check)

    def note_chunk(self, now: float) -> None:
        """A chunk came at `now`: the silence before it may be the longest yet."""
        if now - self.last > self.gap:
            self.gap = now - self.last
        self.last = now

    def watch_stall(self, rule: StallRule, learned_gap_s: float) -> None:
        """From the first token on: a silence past the stall time is a stall."""
        self._stall = rule
        self._learned_gap = learned_gap_s
        self.gap = 0.0
        self._handle.cancel()
        self._handle = self._loop.call_at(
            min(self.last + self._silence_s(), self._total_at), self._check
        )

    def _silence_s(self) -> float:
        if self._stall is None:
            return self._idle_s
        return min(self._idle_s, self._stall.stall_s(self._learned_gap, self.gap))

    def _check(self) -> None:
        now = self._loop.time()
        if now >= self._total_at:
            self._expire("total")
        elif not self.streaming:
            self._expire("first_byte")
        elif now - self.last >= (silence := self._silence_s()):
            self._expire("idle" if self._stall is None or silence >= self._idle_s else "stall")
        else:
            self._handle = self._loop.call_at(min(self.last + silence, self._total_at), self._check)

    def _expire(self, kind: str) -> None:
        self.expired = kind
        self._task.cancel()

    def drain(self) -> None:
        """Its backend's drain deadline came: hand the stream over (`pool.drain`)."""
        if self.expired is None:
            self._expire(DRAINED)

    def preempt(self) -> None:
        """The scheduler preempts the request: only before the backend's first byte (a
        whole-body answer has none before its end: never once the relay is over)."""
        if self.expired is None and not self.streaming and not self.ended:
            self._expire(PREEMPTED)

    def shut_down(self) -> None:
        """The gateway's own drain deadline came: end the request here (`app.drain`)."""
        if self.expired is None:  # (one being handed over has its next leg's watchdog)
            self._expire(SHUTDOWN)

    def stop(self) -> None:
        self.ended = True
        self._handle.cancel()

    def timed_out(self) -> bool:
        """After a CancelledError: True when it was this watchdog's doing (and only its)."""
        return self.expired is not None and self._task.uncancel() == 0


def timeout_error(kind: str, timeouts: TimeoutSettings) -> BackendTimeout:
    if kind == "first_byte":
        message = f"The backend sent no first byte within {timeouts.first_token_s:g} s."
    elif kind == "idle":
        message = f"The backend sent nothing for {timeouts.idle_s:g} s in the middle of the stream."
    else:
        message = f"The request took longer than {timeouts.total_s:g} s end to end."
    return BackendTimeout(message)


@dataclass(slots=True)
class RelayPlan:
    """What to send and how to answer; built per attempt, read by the relay."""

    backend: Backend
    body: bytes
    headers: dict[str, str]
    #: The request's API: its backend path, how its stream is watched, its usage read.
    dialect: Dialect
    shape: RequestShape
    #: Headers the client gets (request id, lane, caps, queue time).
    response_headers: dict[str, str]
    #: The final SSE event for a refusal after the stream started (rendered by http/).
    error_event: Callable[[Refusal], bytes]
    #: Called once when the backend's first byte arrives (its prefill is over).
    on_first_byte: Callable[[], None] | None = None
    #: The client's stream response when the handler made it already (it may have sent
    #: keep-alive comments), and how to stop those before the relay writes to it.
    early_response: web.StreamResponse | None = None
    stop_early: Callable[[], Awaitable[None]] | None = None
    #: The whole events relayed so far, kept when the answer could be resumed elsewhere
    #: should this backend fail mid-stream (None: it could not; nothing is kept).
    relayed: RelayedEvents | None = None
    #: Why not (`seam.py`'s reasons), for the record when the stream does break.
    resume_blocked: str | None = None
    #: When a silence mid-answer is a stall (with `relayed`: a stall is resumed elsewhere).
    stall: StallRule | None = None
    #: Called as the request is sent, with what preempts it before its first byte.
    on_sent: Callable[[Callable[[], None]], None] | None = None


async def relay(
    request: web.Request,
    plan: RelayPlan,
    record: RequestRecord,
    upstream: UpstreamClient,
) -> web.StreamResponse:
    """Run the request on the backend and answer the client; fills `record`."""
    timeouts = upstream.timeouts
    loop = asyncio.get_running_loop()
    stream = plan.shape.stream
    first_byte_s = timeouts.first_token_s if stream else timeouts.total_s
    watchdog = Watchdog(first_byte_s, timeouts.idle_s, record.arrival + timeouts.total_s)
    backend_response: aiohttp.ClientResponse | None = None
    client_response: web.StreamResponse | None = None
    streams = plan.backend.streams
    streams.add(watchdog)  # a drain may hand it over
    if plan.on_sent is not None:
        plan.on_sent(watchdog.preempt)
    try:
        backend_response = await upstream.post(
            plan.backend, plan.dialect.backend_path, plan.body, plan.headers
        )
        content_type = backend_response.headers.get("Content-Type", "")
        if backend_response.status >= 300 or not content_type.startswith("text/event-stream"):
            return await _relay_body(backend_response, plan, record)
        if plan.early_response is None:
            client_response = SseResponse(
                status=200, headers={**STREAM_HEADERS, **plan.response_headers}
            )
        else:  # its headers count if they have not gone out yet
            client_response = plan.early_response
            client_response.headers.update(plan.response_headers)
        return await _relay_stream(
            request, backend_response, client_response, plan, record, watchdog, loop
        )
    except asyncio.CancelledError:
        if not watchdog.timed_out():
            raise
        if watchdog.expired == PREEMPTED:
            raise Preempted(f"Preempted on {plan.backend.name} before its first byte.") from None
        if watchdog.expired == SHUTDOWN:
            if client_response is None or not watchdog.streaming:
                raise shutdown_cut() from None  # the handler answers 503
            await cut_at_shutdown(client_response, plan, record)
            return client_response
        if watchdog.expired == DRAINED:
            if client_response is None or not watchdog.streaming:
                raise BackendFailure(f"Backend {plan.backend.name} is drained.") from None
            if plan.relayed is not None:
                raise StreamBroken(
                    DRAINED, client_response, plan, "The backend was drained."
                ) from None
            record.outcome, record.error_code = Outcome.BACKEND_ERROR, BackendError.code
            await end_with_error(
                client_response, plan.error_event(BackendError("The backend was drained."))
            )
            return client_response
        if watchdog.expired in STALL_KINDS and client_response is not None and plan.relayed:
            raise StreamBroken(
                STALLED, client_response, plan, "The backend's stream stalled."
            ) from None
        error = timeout_error(watchdog.expired or "total", timeouts)
        if client_response is None or not watchdog.streaming:
            # Nothing of the backend's reached the client (keep-alive comments at most):
            # the handler answers with the error.
            raise error from None
        record.outcome = error.outcome
        record.error_code = error.code
        await end_with_error(client_response, plan.error_event(error))
        return client_response
    finally:
        watchdog.stop()
        streams.discard(watchdog)
        if backend_response is not None:
            # close() drops the connection unless the body was read to the end:
            # an abandoned generation stops on the backend at once.
            backend_response.close()


async def _relay_body(
    backend_response: aiohttp.ClientResponse, plan: RelayPlan, record: RequestRecord
) -> web.Response:
    """A whole-body answer: a non-stream completion or a backend error, passed through."""
    status = backend_response.status
    try:
        if status >= 300:
            body = await _read_capped(backend_response.content, MAX_ERROR_BODY_BYTES)
        else:
            body = await backend_response.read()
    except aiohttp.ClientError as exc:  # cut short: nothing reached the client yet
        raise _unreachable(plan.backend, exc) from None
    record.first_byte = clock()
    record.status = status
    headers = dict(plan.response_headers)
    headers["Content-Type"] = backend_response.headers.get("Content-Type", "application/json")
    if "Retry-After" in backend_response.headers:  # a backend's 429/503 says when to come back
        headers["Retry-After"] = backend_response.headers["Retry-After"]
    if status < 300:
        record.outcome = Outcome.OK
        record.completion_tokens = plan.dialect.completion_tokens(body)
        record.backend_prompt_tokens = plan.dialect.backend_prompt_tokens(body)
        record.cached_tokens = plan.dialect.backend_cached_tokens(body)
        # TGI's timing headers (its /generate, and its OpenAI routes), else the body's.
        record.engine_report = tgi_headers(backend_response.headers) or (
            plan.dialect.engine_report(body)
        )
        body = plan.dialect.client_body(plan.shape, body)
    else:
        record.outcome = Outcome.BACKEND_ERROR if status >= 500 else Outcome.BACKEND_REJECTED
        record.error_code = f"backend_{status}"
    response = web.Response(status=status, body=body, headers=headers)
    if status in RETRYABLE_STATUSES:
        raise BackendFailure(f"Backend {plan.backend.name} answered {status}.", response)
    return response


async def _read_capped(content: aiohttp.StreamReader, cap: int) -> bytes:
    """Read to the end, keeping at most `cap` bytes (an error body may come in pieces)."""
    parts: list[bytes] = []
    kept = 0
    while True:
        chunk = await content.read(65536)
        if not chunk:
            return b"".join(parts)
        if kept < cap:
            parts.append(chunk[: cap - kept])
            kept += len(parts[-1])


async def _relay_stream(
    request: web.Request,
    backend_response: aiohttp.ClientResponse,
    client_response: web.StreamResponse,
    plan: RelayPlan,
    record: RequestRecord,
    watchdog: Watchdog,
    loop: asyncio.AbstractEventLoop,
) -> web.StreamResponse:
    watcher = plan.dialect.stream_watcher(plan.shape)
    content = backend_response.content
    try:
        # The client's 200 waits for the backend's first byte, so a backend that
        # fails or hangs before it still gets a real status (502/504), not an SSE error.
        first = await content.readany()
        if not first:  # headers, then nothing: a failure before the first byte
            raise BackendFailure(f"Backend {plan.backend.name} ended its stream before any byte.")
        watchdog.last = loop.time()
        record.first_byte = clock()
        watchdog.streaming = True
        if plan.on_first_byte is not None:
            plan.on_first_byte()
        if plan.stop_early is not None:
            await plan.stop_early()
        await client_response.prepare(request)
        record.status = 200
        chunk = first
        relayed = plan.relayed
        watcher.hold_errors = relayed is not None
        while True:
            out = watcher.feed(chunk)
            if record.first_token is None and watcher.first_token_seen:
                record.first_token = clock()
                if plan.stall is not None:
                    watchdog.watch_stall(plan.stall, plan.backend.gaps.high)
            if relayed is not None:  # what the client has, for a seam (no parsing here)
                if out:
                    relayed.keep(out)
                if watcher.held_error:  # an error event mid-answer: resumed, not relayed
                    if out:
                        await client_response.write(out)
                    raise StreamBroken(
                        BROKEN, client_response, plan, "The backend sent an error mid-stream."
                    )
            if content.at_eof():  # the backend's stream is over: `out` goes with its end
                break
            if out:
                await client_response.write(out)
            if len(chunk) >= BATCH_AFTER_BYTES:
                # A backend flooding tokens: one turn of the loop lets more arrive, so the
                # next read and write carry more (fewer syscalls per token at full speed).
                await asyncio.sleep(0)
            chunk = await content.readany()
            watchdog.note_chunk(loop.time())
            if not chunk:
                out = b""
                break
        held = watcher.release_held()  # (a finishing event with nothing after it)
        if held:
            out += held
            if relayed is not None:
                relayed.keep(held)
        tail = watcher.flush()
        if relayed is not None and not watcher.done:
            # Cut short: only whole events reach the client before a seam.
            if out:  # (kept already, in the loop)
                await client_response.write(out)
            raise StreamBroken(BROKEN, client_response, plan, "The backend's stream ended early.")
        if tail:
            # An unterminated last event: end it, so a following error event stays apart.
            out += tail if watcher.done else tail + b"\n\n"
        if watcher.done:
            # The last events and the stream's end in one write: the client reads its
            # end with the data, not one turn of its loop later.
            await client_response.write_eof(out)
        elif out:  # cut short: an error event follows (below)
            await client_response.write(out)
    except ConnectionResetError:
        # Writing to a client that has gone, before aiohttp cancelled this handler.
        # (aiohttp's ClientConnectionResetError is one too: check it first.)
        record.outcome = Outcome.CLIENT_DISCONNECTED
        record.completion_tokens = watcher.relayed_tokens
        return client_response
    except asyncio.CancelledError:
        # aiohttp cancels the handler of a client that went away (`handler_cancellation`):
        # the engine's usage chunk never comes, so what it was relayed is counted. Before
        # the backend's first byte nothing was: the count stays unknown. (The watchdog's
        # own cancels, `expired`, are answered in `relay`.)
        if watchdog.expired is None and watchdog.streaming:
            record.completion_tokens = watcher.relayed_tokens
        raise
    except aiohttp.ClientError as exc:
        if not watchdog.streaming:  # before the first byte: safe to retry elsewhere
            raise _unreachable(plan.backend, exc) from None
        if plan.relayed is not None:
            raise StreamBroken(
                BROKEN, client_response, plan, f"The backend's stream broke off ({exc!r:.80})."
            ) from None
        return await _fail_stream(client_response, plan, record, watcher, "broke off mid-stream")
    record.completion_tokens = watcher.completion_tokens
    record.backend_prompt_tokens = watcher.prompt_tokens
    record.cached_tokens = watcher.cached_tokens
    if watcher.timings is not None:
        record.engine_report = llamacpp_timings(watcher.timings)
    if not watcher.done:
        return await _fail_stream(client_response, plan, record, watcher, "ended before its end")
    if watcher.backend_error:  # relayed as the backend sent it; the log says what happened
        record.outcome = Outcome.BACKEND_ERROR
        record.error_code = STREAM_ERROR_CODE
    else:
        record.outcome = Outcome.OK
        if plan.stall is not None and record.first_token is not None:
            plan.backend.gaps.add(watchdog.gap)  # how long this backend may be silent
    return client_response  # its end went out with its last events


async def _fail_stream(
    client_response: web.StreamResponse,
    plan: RelayPlan,
    record: RequestRecord,
    watcher: StreamWatcher,
    what: str,
) -> web.StreamResponse:
    record.completion_tokens = watcher.completion_tokens
    record.resume_failed = plan.resume_blocked
    error = BackendError(f"The backend's stream {what}.")
    record.outcome = error.outcome
    record.error_code = error.code
    await end_with_error(client_response, plan.error_event(error))
    return client_response


async def cut_at_shutdown(
    client_response: web.StreamResponse, plan: RelayPlan, record: RequestRecord
) -> None:
    """A stream still running at the gateway's drain deadline: its last event says so,
    with the retry hint, and its record the refusal (the client got a 200 and part of
    the answer)."""
    cut = shutdown_cut()
    record.outcome, record.error_code = cut.outcome, cut.code
    record.retry_after_s = cut.retry_after_s
    await end_with_error(client_response, plan.error_event(cut))


async def end_with_error(client_response: web.StreamResponse, event: bytes) -> None:
    """A stream already answered 200: the failure goes in a final SSE error event."""
    await end_stream(client_response, event)


async def end_stream(client_response: web.StreamResponse, last: bytes) -> None:
    """The last events of a stream already answered 200, and its end."""
    try:
        await client_response.write(last)
        await client_response.write_eof()
    except (ConnectionError, RuntimeError):
        pass  # the client is gone too
