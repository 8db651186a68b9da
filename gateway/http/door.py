"""A door that slow clients cannot hold: a deadline on each request's headers.

aiohttp bounds an idle connection (`keepalive_timeout`, from the connection's start
and after each answer) and the gateway bounds a request's body (`read_timeout_s`),
but nothing bounds the headers: a client that sends one header line every few
seconds and never ends them holds its connection, and a file descriptor, until the
keep-alive timer (aiohttp's default: an hour). A few hundred such clients exhaust
the fd limit. nginx closes them after `client_header_timeout`; so does this door,
after `[server] header_timeout_s`, with the clock of Go's ReadHeaderTimeout and
hyper's header_read_timeout:

- a new connection's first request line and headers must all arrive within the
  deadline of the connection opening (one that sends nothing is closed then too);
- on a kept-alive connection, idleness is `keepalive_timeout`'s business; the next
  request's headers must all arrive within the deadline of its first bytes.

Nothing else is timed: a request's body has `read_timeout_s`, and an answer being
streamed (a long SSE generation) is never cut. The cost is one loop timer per
connection, cancelled as its headers complete, and a look at the connection's state
on each read. The connection is closed without an answer, as nginx and Go do.

aiohttp offers no hook for this (its RequestHandler has no header timer, and
AppRunner's sites build stock handlers), so `DoorSite` listens as `web.TCPSite`
does, with `DoorConnection`, aiohttp's own handler plus the clock. The clock reads
two of the handler's attributes: `_waiter` (set while it waits for a request) and
`_request_count` (requests parsed so far); the door's tests fail if they change.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from prometheus_client import Counter


class DoorSite(web.BaseSite):
    """A listening TCP socket whose connections keep the header deadline.

    `connection_args` are aiohttp's RequestHandler settings (`keepalive_timeout`,
    `access_log`, ...): this site builds the connections, not the runner.
    """

    __slots__ = ("_host", "_port", "header_timeout_s", "_header_timeouts", "_idle_closes", "_args")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        header_timeout_s: float,
        closed: Counter,
        backlog: int = 128,
        **connection_args: Any,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        #: 0: no header deadline (idle connections still have keepalive_timeout).
        self.header_timeout_s = header_timeout_s
        self._header_timeouts = closed.labels(reason="header_timeout")
        self._idle_closes = closed.labels(reason="keepalive_idle")
        self._args = connection_args

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        self._server = await asyncio.get_running_loop().create_server(
            self._connection, self._host, self._port, backlog=self._backlog
        )

    def _connection(self) -> DoorConnection:
        server = self._runner.server
        assert server is not None  # set up before the site, torn down after it
        return DoorConnection(server, self, loop=asyncio.get_running_loop(), **self._args)

    def header_timed_out(self) -> None:
        self._header_timeouts.inc()

    def idle_closed(self) -> None:
        self._idle_closes.inc()


class DoorConnection(web.RequestHandler):
    """One client connection: aiohttp's handler, with a clock on each request's headers."""

    __slots__ = ("_site", "_header_clock", "_headers_seen")

    def __init__(self, manager: web.Server, site: DoorSite, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._site = site
        self._header_clock: asyncio.TimerHandle | None = None
        #: Requests parsed when the clock started: one more means its headers arrived.
        self._headers_seen = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._start_header_clock()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        waiter = self._waiter
        if waiter is None:
            return  # a request is being answered: its body has read_timeout_s
        if waiter.done():  # the headers are complete
            if self._header_clock is not None:
                self._header_clock.cancel()
                self._header_clock = None
        elif self._headers_seen != self._request_count:
            self._start_header_clock()  # the first bytes of the next request

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._header_clock is not None:
            self._header_clock.cancel()
            self._header_clock = None
        super().connection_lost(exc)

    def _start_header_clock(self) -> None:
        self._headers_seen = self._request_count
        if self._header_clock is not None:
            self._header_clock.cancel()
        timeout_s = self._site.header_timeout_s
        self._header_clock = (
            self._loop.call_later(timeout_s, self._headers_late) if timeout_s > 0 else None
        )

    def _headers_late(self) -> None:
        self._header_clock = None
        # Checked here rather than kept exact on every read: the clock may outlive the
        # headers it timed (they arrived before the handler began to wait for them).
        if self._request_count == self._headers_seen and self.transport is not None:
            self._site.header_timed_out()
            self.force_close()

    def _process_keepalive(self) -> None:
        # aiohttp's keep-alive timer; it closes the connection if it is waiting idle.
        was_open = self.transport is not None
        super()._process_keepalive()
        if was_open and self.transport is None:
            self._site.idle_closed()
