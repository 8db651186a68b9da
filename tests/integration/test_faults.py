"""Every backend and client fault ends cleanly: the right answer, the right log line, nothing left.

Each backend here is a small raw HTTP/1.1 server on 127.0.0.1 built on asyncio
streams, so a test controls every byte and the connection itself (refuse,
reset, hang, stall, close mid-event, odd SSE framing). Each fault is checked for:

- the client's answer: status and body, or the final SSE error event;
- the request's log line (`outcome`, `status`);
- the backend's side: the connection the gateway abandoned is closed;
- nothing left behind: the gateway's queue and in-flight gauges back at zero,
  and no extra asyncio task or open file descriptor once things settle.

tests/upstream/test_backend_faults.py already checks the status and outcome of
hangs, stalls, breaks and idle streams, and tests/integration/test_gateway.py
client disconnects against the simulator; here those faults get what was
missing: the leak checks and the backend's view of its connection
(`test_known_faults_leave_nothing_behind`, `test_a_client_gone_*`).

Tests marked xfail(strict=True) document gateway bugs found here; each reason
names the code at fault. Fix the bug and the test turns into a failure
("XPASS strict") until its mark is removed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from msgspec.structs import replace

from gateway.config import LaneSettings, Settings
from tests.conftest import RunningGateway, StartGateway, chat, sse_events
from tests.helpers import Baseline, assert_nothing_left, baseline

CHUNK = (
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"hi "},"finish_reason":null}]}\n\n'
)
USAGE = (
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
)
DONE = b"data: [DONE]\n\n"
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
)
LAST_CHUNK = b"0\r\n\r\n"
ROUTE = "/v1/chat/completions"


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def crlf(events: bytes) -> bytes:
    """The same events with CRLF line endings (`\\r\\n` lines, `\\r\\n\\r\\n` between events)."""
    return events.replace(b"\n", b"\r\n")


def cr(events: bytes) -> bytes:
    """The same events with bare CR line endings (allowed by the SSE spec)."""
    return events.replace(b"\n", b"\r")


# ------------------------------------------------------------------------ the raw backend


@dataclass
class Exchange:
    """One POST the backend received, and the connection to answer it on."""

    backend: RawBackend
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    body: bytes

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def until_gateway_closes(self) -> None:
        """Wait, sending nothing, until the gateway closes this connection."""
        while await self.reader.read(65536):
            pass
        self.backend.closed_by_gateway += 1


#: What the backend does with a POST; returns True to keep the connection for another request.
Behaviour = Callable[[Exchange], Awaitable[bool]]


@dataclass
class RawBackend:
    behaviour: Behaviour
    posts: int = 0
    health_checks: int = 0
    #: Connections open right now, from the backend's side.
    open: int = 0
    connections: int = 0
    #: Connections the gateway closed while the backend was still holding them.
    closed_by_gateway: int = 0
    bodies: list[bytes] = field(default_factory=list)
    server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop_listening(self) -> None:
        """New connections are refused from now on (the port has no listener)."""
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.open += 1
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                if head.startswith(b"GET"):
                    self.health_checks += 1
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    await writer.drain()
                    continue
                self.posts += 1
                self.bodies.append(body)
                if not await self.behaviour(Exchange(self, reader, writer, body)):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass  # stop(): end quietly (a cancelled client_connected_cb task logs an error on 3.11)
        finally:
            self.open -= 1
            writer.close()
            self._tasks.discard(task)


# --------------------------------------------------------------------- behaviours


async def hang_before_headers(ex: Exchange) -> bool:
    await ex.until_gateway_closes()
    return False


async def stall_after_headers(ex: Exchange) -> bool:
    await ex.write(SSE_HEAD)
    await ex.until_gateway_closes()
    return False


async def stall_after_first_chunk(ex: Exchange) -> bool:
    await ex.write(SSE_HEAD + chunked(CHUNK))
    await ex.until_gateway_closes()
    return False


async def break_mid_stream(ex: Exchange) -> bool:
    await ex.write(SSE_HEAD + chunked(CHUNK))
    await asyncio.sleep(0.05)
    ex.writer.transport.abort()  # gone, without the chunked terminator
    return False


async def reset_without_answer(ex: Exchange) -> bool:
    ex.writer.transport.abort()
    return False


async def stream_until_gone(ex: Exchange) -> bool:
    """Keeps generating (a chunk every 20 ms) until the gateway closes the connection."""
    await ex.write(SSE_HEAD)
    for _ in range(1000):
        if ex.reader.at_eof():
            break
        try:
            await ex.write(chunked(CHUNK))
        except ConnectionError:
            break
        await asyncio.sleep(0.02)
    ex.backend.closed_by_gateway += 1
    return False


def sse(payload: bytes, piece: int = 0, delay_s: float = 0.0) -> Behaviour:
    """A 200 SSE answer carrying `payload` (in `piece`-byte chunks), properly terminated."""

    async def behave(ex: Exchange) -> bool:
        await ex.write(SSE_HEAD)
        step = piece or len(payload)
        for i in range(0, len(payload), step):
            await ex.write(chunked(payload[i : i + step]))
            if delay_s:
                await asyncio.sleep(delay_s)
        await ex.write(LAST_CHUNK)
        return True

    return behave


def sse_until_close(payload: bytes) -> Behaviour:
    """A 200 SSE answer delimited by closing the connection (no length, not chunked)."""

    async def behave(ex: Exchange) -> bool:
        await ex.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
        )
        await ex.write(payload)
        await asyncio.sleep(0.02)
        return False

    return behave


def status(code: int, body: bytes, *, pieces: int = 1, headers: bytes = b"") -> Behaviour:
    """A plain error answer with Content-Length; the body in `pieces` writes 50 ms apart."""
    reason = {429: b"Too Many Requests", 500: b"Internal Server Error"}.get(code, b"Error")

    async def behave(ex: Exchange) -> bool:
        await ex.write(
            b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (code, reason, len(body), headers)
        )
        size = -(-len(body) // pieces)
        for i in range(0, len(body), size):
            if i:
                await asyncio.sleep(0.05)
            await ex.write(body[i : i + size])
        return True

    return behave


def held_stream(release: asyncio.Event) -> Behaviour:
    """One chunk, then the rest of the stream once `release` is set."""

    async def behave(ex: Exchange) -> bool:
        await ex.write(SSE_HEAD + chunked(CHUNK))
        await release.wait()
        await ex.write(chunked(DONE) + LAST_CHUNK)
        return True

    return behave


# ------------------------------------------------------------------------ helpers


@pytest.fixture
async def backends() -> AsyncIterator[Callable[[Behaviour], Awaitable[RawBackend]]]:
    started: list[RawBackend] = []

    async def start(behaviour: Behaviour) -> RawBackend:
        backend = RawBackend(behaviour)
        await backend.start()
        started.append(backend)
        return backend

    yield start
    for backend in started:
        await backend.stop()


StartBackend = Callable[[Behaviour], Awaitable[RawBackend]]


def quick_faults(settings: Settings, stream_timeouts_s: float = 10) -> Settings:
    return replace(
        settings,
        # one check at start-up, none during the test
        health=replace(settings.health, interval_s=60),
        timeouts=replace(
            settings.timeouts,
            pool_idle_s=0.3,  # idle keep-alive connections go quickly
            # Long enough that a busy machine never trips them where no timeout is meant.
            first_token_s=stream_timeouts_s,
            idle_s=stream_timeouts_s,
        ),
    )


def short_timeouts(settings: Settings) -> Settings:
    """For the faults that end by a timeout."""
    return quick_faults(settings, stream_timeouts_s=0.5)


def url_of(backend: RawBackend) -> str:
    assert backend.server is not None
    return f"http://127.0.0.1:{backend.server.sockets[0].getsockname()[1]}"


async def eventually(check: Callable[[], bool], within_s: float = 3.0, what: str = "") -> float:
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not check():
        if loop.time() - start > within_s:
            pytest.fail(f"not within {within_s} s: {what or check}")
        await asyncio.sleep(0.01)
    return loop.time() - start


async def ready(gateway: RunningGateway, *backends: RawBackend) -> Baseline:
    """Wait for the start-up health check to be over, then note tasks and fds."""
    await eventually(
        lambda: all(b.health_checks >= 1 and b.open == 0 for b in backends),
        what="the first health check",
    )
    await asyncio.sleep(0.05)
    return baseline()


async def post(gateway: RunningGateway, body: dict[str, Any]) -> tuple[int, bytes, dict[str, str]]:
    """One request on its own connection (closed afterwards, so it does not count as a leak)."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.post(gateway.url + ROUTE, json=body) as resp:
            return resp.status, await resp.read(), dict(resp.headers)


async def the_log_line(gateway: RunningGateway, index: int = 0) -> dict[str, Any]:
    await eventually(lambda: len(gateway.request_lines()) > index, what="the log line")
    return gateway.request_lines()[index]


class RawClient:
    """A client on a raw socket, so a test can drop the connection at an exact moment."""

    def __init__(self) -> None:
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def send(self, gateway: RunningGateway, body: dict[str, Any]) -> None:
        host, _, port = gateway.url.removeprefix("http://").partition(":")
        self.reader, self.writer = await asyncio.open_connection(host, int(port))
        data = json.dumps(body).encode()
        self.writer.write(
            f"POST {ROUTE} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        await self.writer.drain()

    async def read_until(self, marker: bytes) -> bytes:
        assert self.reader is not None
        return await asyncio.wait_for(self.reader.readuntil(marker), 5)

    async def drop(self) -> None:
        assert self.writer is not None
        self.writer.close()
        await self.writer.wait_closed()


# ------------------------------------------------------------------- unreachable backend


@pytest.mark.parametrize("stream", [True, False])
async def test_a_backend_that_refuses_connections_gives_502_and_leaves_nothing(
    stream: bool, backends: StartBackend, start_gateway: StartGateway
) -> None:
    backend = await backends(hang_before_headers)
    gateway = await start_gateway([url_of(backend)], configure=quick_faults)
    await ready(gateway, backend)
    await backend.stop_listening()  # checked healthy, and now nobody listens on its port
    before = baseline()
    code, raw, headers = await post(gateway, chat(max_tokens=4, stream=stream))
    assert code == 502
    assert json.loads(raw)["error"]["code"] == "backend_error"
    assert headers["x-gateway-lane"] == "interactive"
    line = await the_log_line(gateway)
    assert (line["status"], line["outcome"], line["error_code"]) == (
        502,
        "backend_error",
        "backend_error",
    )
    assert backend.posts == 0
    await assert_nothing_left(gateway, before)


async def test_a_backend_that_resets_every_connection_gives_502_after_one_fresh_retry(
    backends: StartBackend, start_gateway: StartGateway
) -> None:
    backend = await backends(reset_without_answer)
    gateway = await start_gateway([url_of(backend)], configure=quick_faults)
    before = await ready(gateway, backend)
    connections = backend.connections
    code, raw, _ = await post(gateway, chat(max_tokens=4, stream=True))
    assert code == 502 and json.loads(raw)["error"]["code"] == "backend_error"
    line = await the_log_line(gateway)
    assert (line["status"], line["outcome"]) == (502, "backend_error")
    # The pooled attempt, then one on a fresh connection (a keep-alive race looks the same).
    assert backend.connections - connections == 2 and backend.posts == 2
    await assert_nothing_left(gateway, before)


# ------------------------------------------------------- faults already covered elsewhere


@pytest.mark.parametrize(
    ("behaviour", "status_code", "stream_error", "outcome", "gateway_closes"),
    [
        (hang_before_headers, 504, None, "backend_timeout", True),
        (stall_after_headers, 504, None, "backend_timeout", True),
        (stall_after_first_chunk, 200, "backend_timeout", "backend_timeout", True),
        (break_mid_stream, 200, "backend_error", "backend_error", False),
    ],
    ids=["hang-before-headers", "stall-after-headers", "stall-mid-stream", "close-mid-stream"],
)
async def test_known_faults_leave_nothing_behind(
    behaviour: Behaviour,
    status_code: int,
    stream_error: str | None,
    outcome: str,
    gateway_closes: bool,
    backends: StartBackend,
    start_gateway: StartGateway,
) -> None:
    backend = await backends(behaviour)
    gateway = await start_gateway([url_of(backend)], configure=short_timeouts)
    before = await ready(gateway, backend)
    code, raw, _ = await post(gateway, chat(max_tokens=4, stream=True))
    assert code == status_code
    if stream_error is None:
        assert json.loads(raw)["error"]["code"] == outcome
    else:
        assert sse_events(raw)[-1]["error"]["code"] == stream_error
    line = await the_log_line(gateway)
    assert (line["status"], line["outcome"]) == (status_code, outcome)
    if gateway_closes:
        await eventually(lambda: backend.closed_by_gateway == 1, what="the backend sees the close")
    await eventually(lambda: backend.open == 0, what="the backend connection closed")
    await assert_nothing_left(gateway, before)


# ------------------------------------------------------------------------ malformed SSE

GARBAGE = (
    CHUNK
    + b"this line is no field at all\n\n"
    + b"\xff\xfe\x00 binary junk \x80\n\n"
    + b"data\n\n"
    + CHUNK
    + DONE
)
BAD_JSON = b'data: {"choices": [oops\n\n' + CHUNK + b'data: {"usage": nope}\n\n' + DONE
NO_DATA = (
    b": keep-alive comment\n\n" + b"event: ping\n\n" + b"id: 7\nretry: 1000\n\n" + CHUNK + DONE
)
UNTERMINATED_DONE = CHUNK + b"data: [DONE]"

MALFORMED = {
    # name: (payload sent, client asks for usage, bytes the client must get, completion_tokens)
    "garbage-lines": (GARBAGE, False, GARBAGE, None),
    "invalid-json": (BAD_JSON, False, BAD_JSON, None),
    "events-without-data": (NO_DATA, False, NO_DATA, None),
    "crlf-framing": (crlf(CHUNK + USAGE + DONE), True, crlf(CHUNK + USAGE + DONE), 2),
    "crlf-usage-removed": (crlf(CHUNK + USAGE + DONE), False, crlf(CHUNK + DONE), 2),
    "cr-framing": (cr(CHUNK + USAGE + DONE), True, cr(CHUNK + USAGE + DONE), 2),
    "done-without-blank-line": (UNTERMINATED_DONE, False, UNTERMINATED_DONE, None),
}


@pytest.mark.parametrize("piece", [0, 3], ids=["whole", "3-byte-pieces"])
@pytest.mark.parametrize("case", list(MALFORMED))
async def test_malformed_sse_is_forwarded_byte_for_byte(
    case: str, piece: int, backends: StartBackend, start_gateway: StartGateway
) -> None:
    payload, usage, expected, completion_tokens = MALFORMED[case]
    backend = await backends(sse(payload, piece))
    gateway = await start_gateway([url_of(backend)], configure=quick_faults)
    before = await ready(gateway, backend)
    body = chat(max_tokens=4, stream=True)
    if usage:
        body["stream_options"] = {"include_usage": True}
    code, raw, _ = await post(gateway, body)
    assert code == 200
    assert raw == expected
    line = await the_log_line(gateway)
    assert (line["status"], line["outcome"], line["error_code"]) == (200, "ok", None)
    assert line["completion_tokens"] == completion_tokens
    assert line["ttft_ms"] is not None  # the content chunk was recognised in any framing
    await assert_nothing_left(gateway, before)


@pytest.mark.parametrize(
    "framing", ["chunked", "close-delimited"], ids=["chunked", "close-delimited"]
)
async def test_a_stream_that_ends_without_done_gets_a_final_error_event(
    framing: str, backends: StartBackend, start_gateway: StartGateway
) -> None:
    payload = CHUNK + CHUNK
    behaviour = sse(payload) if framing == "chunked" else sse_until_close(payload)
    backend = await backends(behaviour)
    gateway = await start_gateway([url_of(backend)], configure=quick_faults)
    before = await ready(gateway, backend)
    code, raw, _ = await post(gateway, chat(max_tokens=4, stream=True))
    assert code == 200
    assert raw.startswith(payload)  # what the backend sent, unchanged, then the error
    error = sse_events(raw[len(payload) :])
    assert len(error) == 1 and error[0]["error"]["code"] == "backend_error"
    line = await the_log_line(gateway)
    assert (line["status"], line["outcome"]) == (200, "backend_error")
    await assert_nothing_left(gateway, before)


async def test_a_stream_cut_inside_an_event_still_ends_with_a_parseable_error_event(
    backends: StartBackend, start_gateway: StartGateway
) -> None:
    half = b'data: {"id":"x","object":"chat.completion.ch'
    backend = await backends(sse_until_close(CHUNK + half))
    gateway = await start_gateway([url_of(backend)], configure=quick_faults)
    await ready(gateway, backend)
    code, raw, _ = await post(gateway, chat(max_tokens=4, stream=True))
    assert code == 200
    line = await the_log_line(gateway)
    assert line["outcome"] == "backend_error"
    # However the half event is treated, the last event must be the gateway's error.
    last = raw.replace(b"\r\n", b"\n").rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"data: ")
    assert json.loads(last[len(b"data: ") :])["error"]["code"] == "backend_error"


# ------------------------------------------------------------------ backend error answers


@pytest.mark.parametrize(("code", "outcome"), [(429, "backend_rejected"), (500, "backend_error")])
@pytest.mark.parametrize("stream", [True, False])
async def test_backend_429_and_500_are_passed_through_with_their_body_and_not_retried(
    code: int,
    outcome: str,
    stream: bool,
    backends: StartBackend,
    start_gateway: StartGateway,
) -> None:
    body = json.dumps({"error": {"message": f"backend says {code}", "type": "x", "code": code}})
    failing = await backends(status(code, body.encode()))
    healthy = await backends(sse(CHUNK + DONE))
    # b0 (the failing one) wins the tie between two idle backends.
    gateway = await start_gateway([url_of(failing), url_of(healthy)], configure=quick_faults)
    before = await ready(gateway, failing, healthy)
    got, raw, headers = await post(gateway, chat(max_tokens=4, stream=stream))
    assert got == code
    assert raw == body.encode()
    assert headers["Content-Type"].startswith("application/json")
    assert headers["x-gateway-lane"] == "interactive"
    line = await the_log_line(gateway)
    assert (line["status"], line["outcome"], line["error_code"]) == (
        code,
        outcome,
        f"backend_{code}",
    )
    assert line["attempts"] == 1 and line["backend"] == "b0"
    assert (failing.posts, healthy.posts) == (1, 0)  # only 502/503 are retried elsewhere
    await assert_nothing_left(gateway, before)


async def test_a_backend_error_body_arriving_in_pieces_is_passed_through_whole(
    backends: StartBackend, start_gateway: StartGateway
) -> None:
    body = json.dumps({"error": {"message": "engine failed " + "x" * 200, "code": 500}}).encode()
    backend = await backends(status(500, body, pieces=2))
    gateway = await start_gateway([url_of(backend)], configure=quick_faults)
    await ready(gateway, backend)
    got, raw, _ = await post(gateway, chat(max_tokens=4))
    assert got == 500
    assert raw == body


async def test_a_backend_429_keeps_its_retry_after(
    backends: StartBackend, start_gateway: StartGateway
) -> None:
    body = b'{"error": {"message": "slow down", "code": 429}}'
    backend = await backends(status(429, body, headers=b"Retry-After: 7\r\n"))
    gateway = await start_gateway([url_of(backend)], configure=quick_faults)
    await ready(gateway, backend)
    got, raw, headers = await post(gateway, chat(max_tokens=4))
    assert (got, raw) == (429, body)
    assert headers.get("Retry-After") == "7"


# ------------------------------------------------------------------- clients that go away


async def test_a_client_gone_while_queued_leaves_the_queue_and_never_reaches_the_backend(
    backends: StartBackend, start_gateway: StartGateway
) -> None:
    release = asyncio.Event()
    backend = await backends(held_stream(release))
    lanes = [LaneSettings(name="only", queue_timeout_s=30, reject_predicted_wait=False)]
    gateway = await start_gateway(
        [url_of(backend)], max_concurrency=1, lanes=lanes, configure=quick_faults
    )
    before = await ready(gateway, backend)
    lane = gateway.state.scheduler.lane("only")
    holder = asyncio.create_task(post(gateway, chat(max_tokens=4, stream=True)))
    await eventually(lambda: lane.in_flight == 1 and backend.posts == 1, what="slot held")
    client = RawClient()
    await client.send(gateway, chat(max_tokens=4, stream=True))
    await eventually(lambda: len(lane.queue) == 1, what="the second request queued")
    await client.drop()
    took = await eventually(lambda: not lane.queue, within_s=2, what="the queue emptied")
    assert took < 1.0
    line = await the_log_line(gateway)
    assert (line["status"], line["outcome"], line["backend"]) == (499, "client_disconnected", None)
    release.set()
    code, raw, _ = await holder
    assert code == 200 and raw == CHUNK + DONE
    assert backend.posts == 1  # the one that left never reached it
    await assert_nothing_left(gateway, before)


@pytest.mark.parametrize(
    ("behaviour", "stream"),
    [(hang_before_headers, True), (stall_after_headers, True), (hang_before_headers, False)],
    ids=["before-headers", "after-headers", "non-stream"],
)
async def test_a_client_gone_before_the_first_token_closes_the_backend_connection(
    behaviour: Behaviour, stream: bool, backends: StartBackend, start_gateway: StartGateway
) -> None:
    backend = await backends(behaviour)

    gateway = await start_gateway([url_of(backend)], configure=quick_faults)
    before = await ready(gateway, backend)
    client = RawClient()
    await client.send(gateway, chat(max_tokens=4, stream=stream))
    await eventually(lambda: backend.posts == 1, what="the request reached the backend")
    await asyncio.sleep(0.05)  # headers (if any) are on their way to the gateway
    await client.drop()
    took = await eventually(
        lambda: backend.closed_by_gateway == 1, within_s=2, what="the backend sees the close"
    )
    assert took < 1.0
    line = await the_log_line(gateway)
    assert (line["status"], line["outcome"]) == (499, "client_disconnected")
    await assert_nothing_left(gateway, before)


@pytest.mark.parametrize(
    "behaviour",
    [stall_after_first_chunk, stream_until_gone],
    ids=["backend-silent", "backend-writing"],
)
async def test_a_client_gone_mid_stream_closes_the_backend_connection(
    behaviour: Behaviour, backends: StartBackend, start_gateway: StartGateway
) -> None:
    backend = await backends(behaviour)

    gateway = await start_gateway([url_of(backend)], configure=quick_faults)
    before = await ready(gateway, backend)
    client = RawClient()
    await client.send(gateway, chat(max_tokens=4, stream=True))
    head = await client.read_until(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b'"hi "' in await client.read_until(b"\n\n")  # the first event arrived
    await client.drop()
    took = await eventually(
        lambda: backend.closed_by_gateway == 1, within_s=2, what="the backend sees the close"
    )
    assert took < 1.0
    line = await the_log_line(gateway)
    assert (line["status"], line["outcome"]) == (200, "client_disconnected")
    await assert_nothing_left(gateway, before)


# ------------------------------------------------------- answers that are not valid HTTP


async def bad_status_line(ex: Exchange) -> bool:
    await ex.write(b"NOT HTTP AT ALL\r\n\r\n")
    return False


async def body_cut_short(ex: Exchange) -> bool:
    """A whole-body answer whose Content-Length promises more than ever comes."""
    await ex.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        b'{"object": "chat.completion", "cho'
    )
    ex.writer.transport.abort()
    return False


async def headers_then_reset(ex: Exchange) -> bool:
    await ex.write(SSE_HEAD)
    await asyncio.sleep(0.05)
    ex.writer.transport.abort()
    return False


async def empty_stream(ex: Exchange) -> bool:
    """SSE headers, then a clean end with not one byte of body."""
    await ex.write(SSE_HEAD + LAST_CHUNK)
    return True


BAD_ANSWERS = {
    "bad-status-line": (bad_status_line, False),
    "body-cut-short": (body_cut_short, False),
    "headers-then-reset": (headers_then_reset, True),
    "empty-stream": (empty_stream, True),
}


@pytest.mark.parametrize("case", list(BAD_ANSWERS))
async def test_a_broken_backend_answer_leaves_nothing_behind(
    case: str, backends: StartBackend, start_gateway: StartGateway
) -> None:
    behaviour, stream = BAD_ANSWERS[case]
    backend = await backends(behaviour)
    gateway = await start_gateway([url_of(backend)], configure=quick_faults)
    before = await ready(gateway, backend)
    code, _, _ = await post(gateway, chat(max_tokens=4, stream=stream))
    line = await the_log_line(gateway)
    assert line["status"] == code and line["outcome"] is not None
    await eventually(lambda: backend.open == 0, what="the backend connection closed")
    await assert_nothing_left(gateway, before)
    assert len(gateway.request_lines()) == 1


@pytest.mark.parametrize(
    "case",
    [
        "bad-status-line",
        "body-cut-short",
        "headers-then-reset",
        "empty-stream",
    ],
)
async def test_a_broken_backend_answer_before_the_first_byte_is_a_502(
    case: str, backends: StartBackend, start_gateway: StartGateway
) -> None:
    behaviour, stream = BAD_ANSWERS[case]
    backend = await backends(behaviour)
    gateway = await start_gateway([url_of(backend)], configure=quick_faults)
    await ready(gateway, backend)
    code, raw, _ = await post(gateway, chat(max_tokens=4, stream=stream))
    assert code == 502
    assert json.loads(raw)["error"]["code"] == "backend_error"
    line = await the_log_line(gateway)
    assert (line["status"], line["outcome"]) == (502, "backend_error")
