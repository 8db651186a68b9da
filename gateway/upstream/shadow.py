"""Shadow traffic: mirror a sampled share of requests to a candidate backend, compare, discard.

Before a new model or engine version takes real traffic, an operator wants to
know how it would have served *this* traffic: its time to first token, its
time per output token, how much it generates, whether it fails. The gateway
already measures all of that for the primary, so it can send a copy of each
sampled request (the very bytes the primary got) to the candidate, time the
candidate's answer the same way, throw the answer away and log one
`shadow_compared` line with both sides' figures.

The shadow must never cost the primary anything, so the rules are:

- The hook (`ShadowMirror.offer`) runs on the primary's path after it was admitted
  and got its slot (refused requests are never mirrored). It only decides and
  creates a task: no await, no I/O, and it never raises.
- The candidate is not a member of the backend pool: it takes no lane slot, no
  prefill budget and no pooled connection; it has its own session and its own
  `max_concurrency`, over which a mirror is dropped, not queued.
- It is dropped first under load: while any lane of the request's pool has
  requests waiting in its queue, or the event loop runs late (the gateway itself
  is the bottleneck), new mirrors are dropped. Every drop is counted by reason in
  `gateway_shadow_requests_total{result=...}`.
- Its failures are a count and a warning line, never the primary's failure; at
  shutdown the mirrors still running are aborted.

With several models behind the gateway, a candidate stands in for some of them:
only the requests of `[shadow] models` (as asked, or as sent: an alias's target)
are mirrored, by default the default pool's, never another model's traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import aiohttp
import msgspec

from gateway.config import ShadowSettings, TimeoutSettings
from gateway.observability.record import RequestRecord, clock, mean_tpot_ms, ms_between
from gateway.upstream.relay import backend_session

if TYPE_CHECKING:
    from gateway.admission.admit import RequestShape
    from gateway.dialects.base import Dialect
    from gateway.observability.metrics import GatewayMetrics
    from gateway.upstream.models import Route

#: The `result` label of gateway_shadow_requests_total: how each sampled mirror ended.
OK = "ok"
ERROR = "error"
ABORTED = "aborted"
DROPPED_QUEUED = "dropped_queued"
DROPPED_LOOP_LAG = "dropped_loop_lag"
DROPPED_CONCURRENCY = "dropped_concurrency"
RESULTS = (OK, ERROR, ABORTED, DROPPED_QUEUED, DROPPED_LOOP_LAG, DROPPED_CONCURRENCY)

#: The candidate's error bodies are read (so the connection can be reused) but not kept.
MAX_ERROR_BODY_BYTES = 64 * 1024
#: Cut to this in the log line: a candidate's error message, not its whole body.
MAX_ERROR_CHARS = 200
#: How often the loop-lag probe wakes, and how many of its samples count as "now".
LAG_INTERVAL_S = 0.1
LAG_WINDOW = 10

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def drop_reason(
    *,
    lanes_waiting: bool,
    loop_lag_s: float,
    max_loop_lag_s: float,
    in_flight: int,
    max_concurrency: int,
) -> str | None:
    """Why a sampled request is not mirrored now, or None to mirror it.

    Load on the primary comes first: a queue in any lane means the backends are
    full, and a late loop means the gateway itself is; either way every spare
    cycle belongs to the primary. Only then the shadow's own limit.
    """
    if lanes_waiting:
        return DROPPED_QUEUED
    if loop_lag_s > max_loop_lag_s:
        return DROPPED_LOOP_LAG
    if in_flight >= max_concurrency:
        return DROPPED_CONCURRENCY
    return None


def shadow_body(body: bytes, model: str | None, openai_route: bool) -> bytes:
    """The primary's encoded backend body, with the candidate's model name when one is set.

    Only OpenAI routes name a model (TGI's native ones do not): elsewhere the
    bytes go unchanged.
    """
    if not model or not openai_route:
        return body
    decoded = _decode(body)
    if not isinstance(decoded, dict):
        return body
    decoded["model"] = model
    return _encode(decoded)


def _ratio(shadow: float | None, primary: float | None) -> float | None:
    if shadow is None or primary is None or primary <= 0:
        return None
    return round(shadow / primary, 3)


@dataclass(slots=True)
class ShadowResult:
    """What the candidate did with one mirrored request; times are `clock()`."""

    #: When the mirror was sent.
    sent: float
    status: int | None = None
    #: `ok`, `backend_error` (5xx, a broken or failed stream), `backend_rejected` (4xx),
    #: `backend_timeout`, `unreachable`, `internal_error`.
    outcome: str | None = None
    error: str | None = None
    first_token: float | None = None
    end: float | None = None
    completion_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    def fail(self, outcome: str, error: str) -> None:
        self.outcome = outcome
        self.error = error[:MAX_ERROR_CHARS]

    @property
    def ttft_ms(self) -> float | None:
        return ms_between(self.sent, self.first_token)

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first, as the primary's record counts it."""
        return mean_tpot_ms(self.first_token, self.end, self.completion_tokens)

    @property
    def e2e_ms(self) -> float | None:
        return ms_between(self.sent, self.end)


def comparison(record: RequestRecord, shadow: ShadowResult, shadow_name: str) -> dict[str, Any]:
    """The `shadow_compared` line's fields: the primary's figures beside the candidate's.

    Both sides are timed from the moment the request went to their backend (the
    primary's dispatch, the mirror's send), so the primary's queue wait, which
    the candidate never had, is left out of both TTFTs and end-to-end times.
    Absent figures are None (null), never made up.
    """
    primary_ttft = ms_between(record.dispatched, record.first_token)
    primary_tpot = record.tpot_ms
    return {
        "request_id": record.request_id,
        "route": record.route,
        "model": record.model,
        "pool": record.pool,
        "lane": record.lane,
        "stream": record.stream,
        "primary_backend": record.backend,
        "shadow_backend": shadow_name,
        "primary_status": record.status,
        "shadow_status": shadow.status,
        "primary_outcome": None if record.outcome is None else str(record.outcome),
        "shadow_outcome": shadow.outcome,
        "primary_error_code": record.error_code,
        "shadow_error": shadow.error,
        "primary_ttft_ms": primary_ttft,
        "shadow_ttft_ms": shadow.ttft_ms,
        "ttft_ratio": _ratio(shadow.ttft_ms, primary_ttft),
        "primary_tpot_ms": primary_tpot,
        "shadow_tpot_ms": shadow.tpot_ms,
        "tpot_ratio": _ratio(shadow.tpot_ms, primary_tpot),
        "primary_completion_tokens": record.completion_tokens,
        "shadow_completion_tokens": shadow.completion_tokens,
        "primary_e2e_ms": ms_between(record.dispatched, record.end),
        "shadow_e2e_ms": shadow.e2e_ms,
        #: How long after the primary's dispatch the mirror went out (the loop's delay).
        "shadow_start_delay_ms": ms_between(record.dispatched, shadow.sent),
    }


class LagProbe:
    """How late the event loop runs a timer now: the worst of the last second's samples.

    `LoopLagMonitor` keeps the same measure as a histogram for operators, which
    says nothing about *now*; the shadow needs the current figure to stand aside
    the moment the loop is busy.
    """

    def __init__(self, interval_s: float = LAG_INTERVAL_S, window: int = LAG_WINDOW) -> None:
        self.interval_s = interval_s
        self._samples: deque[float] = deque(maxlen=window)
        self._task: asyncio.Task[None] | None = None

    @property
    def recent_s(self) -> float:
        return max(self._samples, default=0.0)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="shadow-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self._samples.append(max(0.0, time.perf_counter() - asked - self.interval_s))


class ShadowMirror:
    """Sends sampled copies of dispatched requests to the candidate and logs the comparison.

    `scheduler` says whether any lane has requests in its queue; `events` is the
    gateway's event logger; `rng` decides the sample (seeded in tests).
    """

    def __init__(
        self,
        settings: ShadowSettings,
        timeouts: TimeoutSettings,
        *,
        default_pool: str,
        metrics: GatewayMetrics,
        events: Any,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.url = settings.url.rstrip("/")
        self.name = settings.name or urlparse(self.url).netloc or "shadow"
        self.enabled = bool(self.url) and settings.sample_rate > 0
        self._timeouts = timeouts
        #: The pool whose requests are mirrored when `models` names none.
        self._default_pool = default_pool
        self._models = frozenset(settings.models)
        self._metrics = metrics
        self._events = events
        self._rng = rng or random.Random()
        self._lag = LagProbe()
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.in_flight = 0
        # Every result's series exists from the start (at 0) when the shadow is on.
        self._counters = (
            {result: metrics.shadow_requests.labels(result) for result in RESULTS}
            if self.enabled
            else {}
        )

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Open the candidate's own session (never the primary's pool) and the lag probe."""
        if not self.enabled:
            return
        self._session = backend_session(
            aiohttp.TCPConnector(
                limit=self.settings.max_concurrency,
                keepalive_timeout=self._timeouts.pool_idle_s,
            ),
            aiohttp.ClientTimeout(total=None, sock_connect=self.settings.connect_timeout_s),
        )
        await self._lag.start()

    async def stop(self) -> None:
        """Abort the mirrors still running (counted `aborted`) and close the session."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._lag.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- the hook on the primary's path ---------------------------------------------

    def covers(self, asked: str | None, route: Route) -> bool:
        """Whether a request for model `asked`, routed by `route`, is the candidate's to
        mirror: it asked for one of `[shadow] models` or was sent one (an alias's target;
        no name at all asks for its pool's models); with none listed, the default pool's."""
        if not self._models:
            return route.pool.name == self._default_pool
        names = set(route.pool.serves) if asked is None else {asked}
        if route.target is not None:
            names.add(route.target)
        return not self._models.isdisjoint(names)

    def offer(
        self,
        record: RequestRecord,
        dialect: Dialect,
        shape: RequestShape,
        body: bytes,
        route: Route,
    ) -> None:
        """Called once the primary was dispatched: maybe mirror it. Never awaits, never raises.

        `route`: where the primary went (its pool's queues say whether it is loaded)."""
        if not self.enabled:
            return
        try:
            if (
                self._session is None
                or not self.covers(record.model, route)
                or self._rng.random() >= self.settings.sample_rate
            ):
                return
            reason = drop_reason(
                lanes_waiting=any(lane.queue for lane in route.pool.scheduler.lanes),
                loop_lag_s=self._lag.recent_s,
                max_loop_lag_s=self.settings.max_loop_lag_s,
                in_flight=self.in_flight,
                max_concurrency=self.settings.max_concurrency,
            )
            if reason is not None:
                self._counters[reason].inc()
                return
            loop = asyncio.get_running_loop()
            primary_done: asyncio.Future[None] = loop.create_future()
            primary = asyncio.current_task()
            if primary is None:
                primary_done.set_result(None)
            else:
                # The handler's task ends after its `finally` finished the record.
                primary.add_done_callback(lambda _: _set_done(primary_done))
            self.in_flight += 1
            self._metrics.shadow_in_flight.inc()
            task = loop.create_task(
                self._mirror(record, dialect, shape, body, primary_done),
                name=f"shadow-{record.request_id[:40]}",
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        except Exception as exc:  # a bug here must not become the primary's failure
            self._events.warning("shadow_offer_failed", error=repr(exc)[:MAX_ERROR_CHARS])

    # -- the mirror, on its own task -------------------------------------------------

    async def _mirror(
        self,
        record: RequestRecord,
        dialect: Dialect,
        shape: RequestShape,
        body: bytes,
        primary_done: asyncio.Future[None],
    ) -> None:
        result = ShadowResult(sent=clock())
        try:
            await self._send(result, record, dialect, shape, body)
        except asyncio.CancelledError:
            self._counters[ABORTED].inc()
            raise
        finally:
            if result.end is None:
                result.end = clock()
            self.in_flight -= 1
            self._metrics.shadow_in_flight.dec()
        self._counters[OK if result.ok else ERROR].inc()
        # The comparison needs the primary's final figures: wait for it (it cannot
        # outlast its own end-to-end timeout).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._timeouts.total_s):
                await primary_done
        fields = comparison(record, result, self.name)
        if result.ok:
            self._events.info("shadow_compared", **fields)
        else:
            self._events.warning("shadow_compared", **fields)

    async def _send(
        self,
        result: ShadowResult,
        record: RequestRecord,
        dialect: Dialect,
        shape: RequestShape,
        body: bytes,
    ) -> None:
        """POST the mirror and consume its answer as the primary's would be; fills `result`."""
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                await self._exchange(result, record, dialect, shape, body)
        except aiohttp.ServerTimeoutError as exc:  # the connect timeout (a TimeoutError too)
            result.fail("backend_timeout", f"{type(exc).__name__}: {exc}")
        except TimeoutError:
            result.fail(
                "backend_timeout", f"no complete answer within {self.settings.timeout_s:g} s"
            )
        except aiohttp.ClientConnectorError as exc:
            result.fail("unreachable", f"{type(exc).__name__}: {exc}")
        except aiohttp.ClientError as exc:
            result.fail("backend_error", f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # whatever the candidate sent, it is not the primary's problem
            result.fail("internal_error", repr(exc))

    async def _exchange(
        self,
        result: ShadowResult,
        record: RequestRecord,
        dialect: Dialect,
        shape: RequestShape,
        body: bytes,
    ) -> None:
        assert self._session is not None
        path = dialect.backend_path
        data = shadow_body(body, self.settings.model, path.startswith("/v1/"))
        headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream" if shape.stream else "application/json",
            "X-Request-Id": record.request_id,
            # The candidate's own logs can tell mirrored traffic from real traffic.
            "X-Gateway-Shadow": "1",
        }
        if self.settings.api_key:
            headers["Authorization"] = f"Bearer {self.settings.api_key}"
        result.sent = clock()
        async with self._session.post(self.url + path, data=data, headers=headers) as response:
            result.status = response.status
            if response.status >= 300:
                await _drain(response.content, MAX_ERROR_BODY_BYTES)
                result.end = clock()
                outcome = "backend_error" if response.status >= 500 else "backend_rejected"
                result.fail(outcome, f"the candidate answered {response.status}")
                return
            if response.headers.get("Content-Type", "").startswith("text/event-stream"):
                await _consume_stream(response, result, dialect, shape)
            else:
                answer = await response.read()
                result.end = clock()
                result.completion_tokens = dialect.completion_tokens(answer)
                result.outcome = "ok"


async def _consume_stream(
    response: aiohttp.ClientResponse, result: ShadowResult, dialect: Dialect, shape: RequestShape
) -> None:
    """Read the candidate's stream to its end with the primary's own watcher (same TTFT,
    same token count); the bytes go nowhere."""
    watcher = dialect.stream_watcher(shape)
    async for chunk in response.content.iter_any():
        watcher.feed(chunk)
        if result.first_token is None and watcher.first_token_seen:
            result.first_token = clock()
    watcher.flush()
    result.end = clock()
    result.completion_tokens = watcher.completion_tokens
    if watcher.backend_error:
        result.fail("backend_error", "the candidate's stream carried an error event")
    elif not watcher.done:
        result.fail("backend_error", "the candidate's stream ended before its end")
    else:
        result.outcome = "ok"


async def _drain(content: aiohttp.StreamReader, cap: int) -> None:
    """Read an error body to its end (the connection stays reusable), at most `cap` bytes."""
    read = 0
    while read < cap:
        chunk = await content.read(65536)
        if not chunk:
            return
        read += len(chunk)


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
