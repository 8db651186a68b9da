"""Keep a long-waiting stream's connection alive: early headers, then SSE comments.

Load balancers and proxies cut a connection that sends nothing for a while
(nginx's `proxy_read_timeout` and AWS ALB's idle timeout are 60 s). A streaming
request that waits longer than `server.sse_keepalive_s` in its lane's queue,
or for its backend's first byte, gets its 200 and SSE headers, then a comment
line every interval: `: queued` while queued, `: waiting` while the backend
prefills. Every SSE client skips comments (the `openai` and `huggingface_hub`
SDKs, browsers' EventSource); curl shows them.

Requests that get their slot and first byte sooner (nearly all) send nothing
early: they pay one loop timer, and their refusals keep their HTTP status. Once
the headers went out, a refusal or a backend error can only be a final SSE
error event in that 200 stream: `settle` turns an answer into one (the proxy
adds the retry hint and queue time the headers could not carry).

The headers go before the wait ends, so an early stream cannot carry
`x-gateway-queue-ms`: once dispatched, it says its queue time in one more comment,
`: x-gateway-queue-ms 1234.5`, just before the backend's first byte (comments are
what every SSE client skips, so no parser sees a new event).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from gateway.upstream.relay import STREAM_HEADERS, SseResponse

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any

QUEUED = b": queued\n\n"
WAITING = b": waiting\n\n"


def queue_time_comment(queue_ms: float) -> bytes:
    """The queue time an early stream's headers could not carry, as an SSE comment."""
    return b": x-gateway-queue-ms %.1f\n\n" % queue_ms


class EarlyStream:
    """The client's stream response of one request, which may be started before the
    backend answers. The relay streams into `response` (prepared or not) after `stop`.
    """

    __slots__ = (
        "_request",
        "_interval_s",
        "_timer",
        "_task",
        "_sleeping",
        "response",
        "phase",
        "queue_ms",
    )

    def __init__(self, request: web.Request, headers: Mapping[str, str], interval_s: float) -> None:
        self._request = request
        self._interval_s = interval_s
        self.response = SseResponse(status=200, headers={**STREAM_HEADERS, **headers})
        #: The comment sent at the next tick: QUEUED, then WAITING once dispatched.
        self.phase = QUEUED
        #: The queue time, once dispatched: said in a comment by `stop` if the stream began.
        self.queue_ms: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._sleeping = False
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            interval_s, self._start
        )

    @property
    def started(self) -> bool:
        """The headers went out: the answer can only be this 200 stream now."""
        return self.response.prepared

    def _start(self) -> None:
        self._timer = None
        self._task = asyncio.get_running_loop().create_task(self._tick(), name="sse-keepalive")

    async def _tick(self) -> None:
        try:
            await self.response.prepare(self._request)
            while self._task is not None:  # `stop` clears it
                await self.response.write(self.phase)
                if self._task is None:
                    break
                self._sleeping = True
                try:
                    await asyncio.sleep(self._interval_s)
                finally:
                    self._sleeping = False
        except (ConnectionError, RuntimeError):
            pass  # the client went away: its handler is being cancelled

    async def stop(self) -> None:
        """No more comments; waits out one being written, so the relay writes alone.

        A stream that began says its queue time last (once: `settle` may stop again).
        """
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task, self._task = self._task, None
        if task is None:
            return
        if self._sleeping or not self.response.prepared:
            task.cancel()
        # wait(), not `await task`: the task's own end (cancelled) is no error here, and a
        # cancellation of the handler itself (the client left) must still reach it.
        await asyncio.wait((task,))
        if self.response.prepared and self.queue_ms is not None:
            try:
                await self.response.write(queue_time_comment(self.queue_ms))
            except (ConnectionError, RuntimeError):
                pass  # the client went away: the relay's own write will say so

    def cancel(self) -> None:
        """Stop at once, without waiting (the request is over, or was cancelled)."""
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()

    async def settle(
        self,
        answer: web.StreamResponse,
        error_event: Callable[[dict[str, Any]], bytes],
    ) -> web.StreamResponse:
        """`answer` itself, unless the stream had started: then `answer` (an error the
        client can no longer get as a status) goes as a final error event in it."""
        await self.stop()
        if answer is self.response or not self.started:
            return answer
        await end_with_event(self.response, error_event(error_of(answer)))
        return self.response


def error_of(answer: web.StreamResponse) -> dict[str, Any]:
    """The OpenAI error object of an error answer (the gateway's or a backend's)."""
    body = answer.body if isinstance(answer, web.Response) else None
    if isinstance(body, bytes):
        try:
            decoded = msgspec.json.decode(body)
        except msgspec.DecodeError:
            decoded = None
        if isinstance(decoded, dict) and isinstance(decoded.get("error"), dict):
            error: dict[str, Any] = decoded["error"]
            return error
    return {
        "message": f"The backend answered {answer.status}.",
        "type": "server_error",
        "param": None,
        "code": "backend_error",
    }


async def end_with_event(response: web.StreamResponse, event: bytes) -> None:
    """The last event of a started stream, then its end (the client may be gone)."""
    try:
        await response.write(event)
        await response.write_eof()
    except (ConnectionError, RuntimeError):
        pass
