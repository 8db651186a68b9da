"""The one Redis connection of a replica, and whether it can be trusted right now.

Every call goes through `SharedStore.call`: bounded by `[redis] timeout_s`, and
never raising. A failure or a timeout marks the store *down* (one warning, the
`gateway_redis_up` gauge at 0, `gateway_redis_errors_total{op}` counted) and
the callers fall back to their local state; the fleet's tick tries Redis again
and marks it *up* when it answers (one info line), and the callers rejoin.
Requests never fail because Redis did: the worst a slow Redis can add to one
is `timeout_s`, once, after which nobody waits for it until it is back.

The timeout is Redis's, not this process's: a deadline this replica's own event loop
woke up to late (a busy loop, a process starved of CPU on a loaded machine) says
nothing of Redis, whose answer may be sitting unread in the socket. Such a call gets
its time once more before it counts as a failure (`_within`). On a loaded 2-core
machine 100 ms of the loop's own lateness was enough to send a replica to its local
share, with half the quota in its headers, though Redis answered in under 10 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.exceptions import RedisError

from gateway.config import RedisSettings

T = TypeVar("T")

#: A deadline woken up to later than this was missed by this process, not by Redis.
LATE_WAKE_S = 0.02

#: Connections to Redis per replica: calls beyond wait for one (each holds it a round trip).
POOL_CONNECTIONS = 16
#: Connections opened at start-up (`warm`), so a first burst of requests does not
#: open them on the request path (a connection is several round trips: connect, HELLO,
#: CLIENT SETINFO), where nine at once on a loaded machine took over `timeout_s`.
WARM_CONNECTIONS = 4

_PASSWORD = re.compile(r"^(?P<scheme>[a-z]+://)(?P<user>[^:@/]*):[^@/]*@", re.IGNORECASE)


def backstop_s(timeout_s: float) -> float:
    """redis-py's timeouts, past the two windows `_within` may give a call, and the
    ping's (off the request path): at least 1 s."""
    return max(1.0, 3 * timeout_s)


def mask_url_password(url: str) -> str:
    """`redis://user:secret@host` as `redis://user:***@host` (for check-config, logs)."""
    return _PASSWORD.sub(r"\g<scheme>\g<user>:***@", url)


class SharedStore:
    """A replica's Redis client, its up/down state, and its id in the fleet."""

    def __init__(
        self,
        settings: RedisSettings,
        *,
        events: Any,
        registry: CollectorRegistry,
        client: aioredis.Redis | None = None,
    ) -> None:
        self.settings = settings
        self.events = events
        #: Unique per process and start: leases and signals are this replica's.
        self.replica_id = f"{os.uname().nodename[:32]}-{os.getpid()}-{os.urandom(3).hex()}"
        self.client = client or aioredis.Redis(
            # A bounded pool that makes callers wait for a connection: redis-py's default
            # raises past 100 connections, and a cold burst opening one connection per
            # call took ~0.2 s for 200 calls (16 connections: 25 ms), which would trip the
            # timeout and send the replica to local state.
            connection_pool=aioredis.BlockingConnectionPool.from_url(
                settings.url,
                max_connections=POOL_CONNECTIONS,
                # redis-py's own timeouts only back `_within` up (which bounds every call
                # by timeout_s, this process's lateness aside): at timeout_s they fired on
                # a late loop too, and blamed Redis for it.
                timeout=backstop_s(settings.timeout_s),
                socket_timeout=backstop_s(settings.timeout_s),
                socket_connect_timeout=backstop_s(settings.timeout_s),
                # A fresh connection per retry would only double the wait: fail, fall back.
                retry_on_timeout=False,
                health_check_interval=0,
            )
        )
        #: Redis answered the last call (optimistic until the first one).
        self.up = True
        #: Called after the store comes back up (the callers re-register their state).
        self.on_up: list[Callable[[], Awaitable[None]]] = []
        self._up_gauge = Gauge(
            "gateway_redis_up",
            "1 while this replica's shared state is in Redis; 0 while it runs on local "
            "state (Redis unreachable or slow).",
            registry=registry,
        )
        self._up_gauge.set(1)
        self._errors = Counter(
            "gateway_redis_errors",
            "Redis calls that failed or timed out, by operation (each one fell back to "
            "local state).",
            ["op"],
            registry=registry,
        )
        self._error_children: dict[str, Any] = {}

    def key(self, *parts: str) -> str:
        """A key under the fleet's prefix: `llmgw:slots:<backend>`."""
        return ":".join((self.settings.key_prefix, *parts))

    def script(self, lua: str) -> Any:
        """A Lua script run by its SHA (EVALSHA, loaded on first use)."""
        return self.client.register_script(lua)

    async def call(
        self, op: str, fn: Callable[[], Awaitable[T]], *, off_request_path: bool = False
    ) -> T | None:
        """`fn()` within the timeout; None (and the store down) when it failed.

        While the store is down nothing is tried (None at once): only `ping`, from the
        fleet's tick, brings it back. A call no request waits for (the learned state's
        read at start-up and its saves) gets `backstop_s`, like the ping: at start-up,
        on a loaded machine, its first read took over 0.1 s and sent the replica to its
        local share of every quota though Redis was fine.
        """
        if not self.up:
            return None
        bound_s = backstop_s(self.settings.timeout_s) if off_request_path else None
        return await self._attempt(op, fn, bound_s)

    async def _attempt(
        self, op: str, fn: Callable[[], Awaitable[T]], timeout_s: float | None = None
    ) -> T | None:
        try:
            return await _within(fn, timeout_s or self.settings.timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(op, exc)
            return None

    def _failed(self, op: str, exc: BaseException) -> None:
        child = self._error_children.get(op)
        if child is None:
            child = self._error_children[op] = self._errors.labels(op)
        child.inc()
        if self.up:
            self.up = False
            self._up_gauge.set(0)
            self.events.warning(
                "redis_unavailable",
                op=op,
                error=f"{type(exc).__name__}: {exc}"[:200],
                hint="running on local state (this replica's share of each backend's "
                "slots and of each quota) until Redis answers again",
            )

    async def ping(self) -> bool:
        """Try Redis (also while down); on the way back up, let the callers rejoin."""
        was_up = self.up
        if not was_up:
            # A restarted Redis closed every pooled connection: drop them all now, or each
            # would fail once on its next use and send the replica back to local state.
            with contextlib.suppress(RedisError, OSError):
                await self.client.connection_pool.disconnect()
        # Off the request path (start-up, the fleet's tick), and the first call on a fresh
        # connection (connect, CLIENT SETINFO, PING: several round trips): a loaded
        # machine took over 0.1 s for it at start-up, and the replica began on local state.
        bound_s = backstop_s(self.settings.timeout_s)
        answered = await self._attempt("ping", self.client.ping, bound_s) is not None
        if answered and not was_up:
            self.up = True
            for rejoin in self.on_up:
                await rejoin()
            if self.up:  # a rejoin may have failed again
                self._up_gauge.set(1)
                self.events.info("redis_rejoined", url=mask_url_password(self.settings.url))
        return answered and self.up

    async def warm(self) -> bool:
        """Open WARM_CONNECTIONS pooled connections now (off the request path: start-up),
        each answering a ping; False when Redis did not (the store is down then)."""
        bound_s = backstop_s(self.settings.timeout_s)
        answers = await asyncio.gather(
            *(self._attempt("ping", self.client.ping, bound_s) for _ in range(WARM_CONNECTIONS))
        )
        return all(answer is not None for answer in answers)

    async def close(self) -> None:
        try:
            await self.client.aclose()
        except (RedisError, OSError):
            pass


async def _within(fn: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    """`fn()`'s result, or TimeoutError when Redis took over `timeout_s`.

    When this process woke up to the deadline late (its loop was busy or it had no
    CPU), the call gets `timeout_s` once more: the time was ours, and an answer that
    came meanwhile is read first (asyncio runs the socket's callback before the late
    timer's, so the call may already be done). A second late deadline ends it too: a
    loop that late has worse problems than Redis.
    """
    loop = asyncio.get_running_loop()
    call = asyncio.ensure_future(fn())
    try:
        for attempt in range(2):
            deadline = loop.time() + timeout_s
            done, _ = await asyncio.wait((call,), timeout=timeout_s)
            if done:
                return call.result()
            if attempt == 0 and loop.time() - deadline < LATE_WAKE_S:
                break  # woken on time: Redis is slow
        raise TimeoutError(f"Redis did not answer within {timeout_s:g} s")
    finally:
        if not call.done():
            # Not waited for (redis-py has swallowed a cancellation before, see leases):
            # it drops its connection as it ends; whatever it ends with is read here.
            call.add_done_callback(_retrieved)
            call.cancel()


def _retrieved(call: asyncio.Future[Any]) -> None:
    if not call.cancelled():
        call.exception()
