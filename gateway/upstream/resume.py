"""Carry an answer over to another backend when its own fails mid-stream.

A backend that breaks off after the client's stream began (connection reset,
an end before the stream's end, an error event mid-answer) used to cost the
user half an answer and an error. The gateway holds what it needs to go on:
the request, the events the client got (`seam.RelayedEvents`, bounded) and
the other backends of the request's pool. So the request's slot moves to
another backend, which is sent the same request with the text so far as the
start of its answer (each API and engine has its way: `Dialect.continuation`)
and the output budget less the tokens already sent; its stream is rewritten
into the first one's (`seam.Continuation`) and relayed to the same client
stream. The client sees one answer.

What is not carried over ends as before, with an SSE error event: a request
that could not be continued faithfully (n > 1, tools, response_format,
logprobs: `Dialect.not_resumable`, and tool calls or reasoning found in the
answer), a backend whose engine is unknown, no other backend with a free slot,
an answer longer than the buffer, or more carry-overs than `max_resumes`. The
record says why (`resume_failed`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from gateway.observability.record import RequestRecord
from gateway.outcomes import BackendError, BackendTimeout, Outcome
from gateway.upstream.pool import Backend, BackendPool
from gateway.upstream.relay import (
    BROKEN,
    DRAINED,
    SHUTDOWN,
    STALLED,
    BackendFailure,
    RelayPlan,
    StreamBroken,
    UpstreamClient,
    Watchdog,
    cut_at_shutdown,
    end_stream,
    end_with_error,
)
from gateway.upstream.seam import (
    BUFFER_FULL,
    FINISHED,
    LIMIT,
    NO_BACKEND,
    UNKNOWN_ENGINE,
    Continuation,
    RelayedEvents,
    Seam,
)


@dataclass(slots=True, frozen=True)
class Resumer:
    """How one request's answer is carried over (built by the handler, used here)."""

    max_resumes: int
    #: Moves the request's slot to another backend of its pool; False when none is free.
    move_elsewhere: Callable[[], bool]
    #: The backend the slot is on now.
    backend: Callable[[], Backend]
    #: What to send `backend` to continue from `seam`; None when its engine's way is unknown.
    continue_for: Callable[[Backend, Seam], RelayPlan | None]


async def carry_over(
    request: web.Request,
    record: RequestRecord,
    broken: StreamBroken,
    *,
    upstream: UpstreamClient,
    pool: BackendPool,
    resumer: Resumer,
) -> web.StreamResponse:
    """Continue a broken answer on other backends until it ends, or end it with an error."""
    origin = broken.plan
    relayed = origin.relayed
    assert relayed is not None  # no StreamBroken without a buffer
    client_response = broken.client_response
    while True:
        seam, target, plan, why = _next_leg(origin, relayed, record, resumer)
        if seam.obstacle == FINISHED and (end := origin.dialect.end_of_answer(seam, origin.shape)):
            # The whole answer had come, only its end was missing: end it here.
            record.outcome, record.completion_tokens = Outcome.OK, seam.tokens
            await end_stream(client_response, end)
            return client_response
        if why is not None or target is None or plan is None:
            record.resume_failed = why
            return await _give_up(client_response, origin, record, broken.message, seam)
        record.resumes += 1
        record.resumed_from = [*(record.resumed_from or ()), record.backend or "?"]
        record.resume_reason = broken.reason
        record.backend = target.name
        record.engine = target.engine
        record.attempts += 1
        stream = origin.dialect.continued_stream(seam, origin.shape)
        try:
            await relay_continuation(
                request, plan, record, upstream, client_response, stream, relayed
            )
        except StreamBroken as again:
            note_broken(pool, target, again)
            broken = again
            continue
        except BackendTimeout as timeout:
            pool.record_result(target, Outcome.BACKEND_TIMEOUT)
            broken = StreamBroken(BROKEN, client_response, origin, str(timeout))
            continue
        except BackendFailure as failure:
            pool.record_result(target, Outcome.BACKEND_ERROR)
            broken = StreamBroken(BROKEN, client_response, origin, str(failure))
            continue
        if record.outcome is Outcome.OK:
            pool.record_result(target, Outcome.OK)
        return client_response


def note_broken(pool: BackendPool, backend: Backend, broken: StreamBroken) -> None:
    """A backend that broke a stream failed; one that stalled is down until its checks
    pass (a frozen engine answers nothing, and its open connections say nothing)."""
    if broken.reason == DRAINED:
        return  # asked for: no failure of the backend's
    pool.record_result(backend, Outcome.BACKEND_ERROR)
    if broken.reason == STALLED:
        pool.set_health(backend, False)


def _next_leg(
    origin: RelayPlan, relayed: RelayedEvents, record: RequestRecord, resumer: Resumer
) -> tuple[Seam, Backend | None, RelayPlan | None, str | None]:
    """The seam, and where and how the answer goes on; or why it cannot."""
    if relayed.overflowed:
        return Seam(), None, None, BUFFER_FULL
    seam = origin.dialect.read_seam(relayed.data())
    if seam.obstacle is not None:
        return seam, None, None, seam.obstacle
    if record.resumes >= resumer.max_resumes:
        return seam, None, None, LIMIT
    if (record.max_tokens or 0) - seam.tokens <= 0:
        return seam, None, None, FINISHED
    if not resumer.move_elsewhere():
        return seam, None, None, NO_BACKEND
    target = resumer.backend()
    plan = resumer.continue_for(target, seam)
    if plan is None:
        return seam, None, None, UNKNOWN_ENGINE
    return seam, target, plan, None


async def _give_up(
    client_response: web.StreamResponse,
    origin: RelayPlan,
    record: RequestRecord,
    message: str,
    seam: Seam,
) -> web.StreamResponse:
    """Today's ending: the failure as the stream's last event."""
    error = BackendError(message)
    record.outcome = error.outcome
    record.error_code = error.code
    if record.completion_tokens is None:
        record.completion_tokens = seam.tokens or None
    await end_with_error(client_response, origin.error_event(error))
    return client_response


async def relay_continuation(
    request: web.Request,
    plan: RelayPlan,
    record: RequestRecord,
    upstream: UpstreamClient,
    client_response: web.StreamResponse,
    stream: Continuation,
    relayed: RelayedEvents,
) -> None:
    """Relay one continued leg into the client's open stream, rewritten as one answer.

    Raises StreamBroken when this leg fails after its first byte too (another seam),
    BackendFailure or BackendTimeout when it failed before (nothing of it was sent).
    """
    timeouts = upstream.timeouts
    loop = asyncio.get_running_loop()
    watchdog = Watchdog(timeouts.first_token_s, timeouts.idle_s, record.arrival + timeouts.total_s)
    backend_response: aiohttp.ClientResponse | None = None
    streams = plan.backend.streams
    streams.add(watchdog)  # a drain may hand it over again
    try:
        backend_response = await upstream.post(
            plan.backend, plan.dialect.backend_path, plan.body, plan.headers
        )
        content_type = backend_response.headers.get("Content-Type", "")
        if backend_response.status != 200 or not content_type.startswith("text/event-stream"):
            raise BackendFailure(
                f"Backend {plan.backend.name} answered the continuation with "
                f"{backend_response.status}."
            )
        content = backend_response.content
        watching = False
        while not stream.done:
            chunk = await content.readany()
            watchdog.note_chunk(loop.time())
            if not chunk:
                break
            if not watchdog.streaming:
                watchdog.streaming = True
                if plan.on_first_byte is not None:
                    plan.on_first_byte()
            out = stream.feed(chunk)
            if not watching and stream.first_token_seen and plan.stall is not None:
                watching = True
                watchdog.watch_stall(plan.stall, plan.backend.gaps.high)
            if out:
                relayed.keep(out)
                await client_response.write(out)
            if stream.backend_error:
                raise StreamBroken(BROKEN, client_response, plan, "The backend sent an error.")
        if not stream.done:
            raise StreamBroken(BROKEN, client_response, plan, "The backend's stream ended early.")
        await client_response.write_eof()
        record.outcome = Outcome.OK
        if watching:
            plan.backend.gaps.add(watchdog.gap)
        record.completion_tokens = stream.completion_tokens or stream.total_tokens
    except ConnectionResetError:  # the client went away (aiohttp's reset error is one too)
        record.outcome = Outcome.CLIENT_DISCONNECTED
        record.completion_tokens = stream.total_tokens
    except aiohttp.ClientError as exc:
        if not watchdog.streaming:
            raise BackendFailure(f"Backend {plan.backend.name} is unreachable.") from None
        raise StreamBroken(
            BROKEN, client_response, plan, f"The backend's stream broke off ({exc!r:.80})."
        ) from None
    except asyncio.CancelledError:
        if not watchdog.timed_out():
            raise
        if watchdog.expired == SHUTDOWN:  # the client's stream is open: its end says so
            await cut_at_shutdown(client_response, plan, record)
            record.completion_tokens = stream.total_tokens
            return
        if watchdog.expired == DRAINED:
            if not watchdog.streaming:
                raise BackendFailure(f"Backend {plan.backend.name} is drained.") from None
            raise StreamBroken(DRAINED, client_response, plan, "The backend was drained.") from None
        if not watchdog.streaming:
            raise BackendTimeout("The backend sent no first byte of the continuation.") from None
        raise StreamBroken(
            STALLED, client_response, plan, "The backend's stream stalled."
        ) from None
    finally:
        watchdog.stop()
        streams.discard(watchdog)
        if backend_response is not None:
            backend_response.close()
