"""The gateway's per-app state, shared by the handlers (one object, built by app.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.admission.auth import ClientKeys
from gateway.admission.retries import RetryMemory
from gateway.admission.tenants import Tenants
from gateway.admission.tokens import TokenCounter
from gateway.config import LimitsSettings, Settings
from gateway.fleet.fleet import Fleet
from gateway.fleet.quotas import TenantQuotas
from gateway.observability.logs import RequestLog
from gateway.observability.loop_lag import LoopLagMonitor
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.model_metrics import ModelMetrics
from gateway.observability.record import RequestRecord
from gateway.observability.tenant_metrics import TenantMetrics
from gateway.observability.tracing import RequestTracer
from gateway.scheduling.fitting import PromptSizes
from gateway.scheduling.scheduler import Scheduler
from gateway.upstream.health import HealthMonitor
from gateway.upstream.learned_state import LearnedState
from gateway.upstream.models import ModelRouter
from gateway.upstream.pool import BackendPool
from gateway.upstream.relay import UpstreamClient
from gateway.upstream.shadow import ShadowMirror
from gateway.upstream.sizing import BackendSizer
from gateway.upstream.stall import StallRule

#: Finished requests written in one turn of the loop (`GatewayState.finish`), about
#: 0.1 ms: a request in flight meets a slice at each of its turns (with 8 a turn, one
#: request in a hundred at concurrency 1 was 0.5 ms later; with 2, 0.15-0.3 ms).
FINISH_SLICE = 2


@dataclass(slots=True)
class GatewayState:
    settings: Settings
    counter: TokenCounter
    pool: BackendPool
    scheduler: Scheduler
    metrics: GatewayMetrics
    request_log: RequestLog
    upstream: UpstreamClient
    #: The gateway's own lifecycle and error events (stderr), as opposed to request lines.
    events: Any
    health: HealthMonitor
    keys: ClientKeys
    #: Who each request is for (its share of a lane), and the tenants' metric labels.
    tenants: Tenants
    tenant_metrics: TenantMetrics
    loop_lag: LoopLagMonitor
    #: Recent prompt sizes by lane (what "a long prompt" is, for the engine floor).
    prompt_sizes: PromptSizes
    #: Sizes the lanes and pool to what the backends say and what was learned.
    sizer: BackendSizer
    #: Mirrors sampled requests to a candidate backend ([shadow]); off without a url.
    shadow: ShadowMirror
    #: Fingerprints of recent requests, to tell retries from new work ([retries]).
    retries: RetryMemory
    #: Every pool (one per served-model list) and the aliases; `pool`, `scheduler`,
    #: `sizer` and `health` above are the default pool's (TGI routes, leases, shadow).
    pools: ModelRouter
    #: Requests and TTFT per model, queue depth and in flight per pool.
    model_metrics: ModelMetrics | None = None
    #: While the start-up probe measures the backends (at most WARM_UP_READY_S), /readyz
    #: says "not ready": the first requests should meet deadlines fitted to the engine.
    warming_up: bool = False
    #: The first health checks have read what each backend serves (`upstream/served.py`):
    #: /readyz waits for it once, at start (a pool a reload adds later does not unready).
    backends_read: bool = False
    #: What was learned of the backends, kept across a restart ([health] state_file).
    learned_state: LearnedState | None = None
    #: Set on SIGTERM: new requests get 503, queued ones are told to retry elsewhere.
    draining: bool = False
    #: Makes each request's OpenTelemetry spans at its end ([tracing] enabled); None: off.
    tracer: RequestTracer | None = None
    #: State shared with the other replicas in Redis ([redis] url); None: this one alone.
    fleet: Fleet | None = None
    #: Requests and tokens per minute of the keys that have quotas (in Redis with a
    #: fleet, else local); the default applies to no key.
    quotas: TenantQuotas = field(default_factory=TenantQuotas)
    #: Reloads the config and follows the DNS names' records (`reload.py`); None: the
    #: backends are what the app was built with.
    reloader: Any = None
    #: How long a finished request's log line, metrics and spans may wait, to be written
    #: with the others that end meanwhile (`finish`); 0: at once (tests, replays).
    finish_after_s: float = 0.0
    _finished: list[RequestRecord] = field(default_factory=list)
    _finish_timer: asyncio.Handle | None = None

    @property
    def limits(self) -> LimitsSettings:
        """The caps in force: the config's, tightened by what the backends accept."""
        return self.sizer.limits_in_force

    @property
    def stall_rule(self) -> StallRule:
        """When a silent stream that may be resumed is a stalled backend ([resume])."""
        resume = self.settings.resume
        return StallRule(resume.stall_floor_s, resume.stall_multiple, self.settings.timeouts.idle_s)

    @property
    def in_flight(self) -> int:
        return sum(b.in_flight for each in self.pools.pools for b in each.pool.backends)

    def finish(self, record: RequestRecord) -> None:
        """Every request ends here exactly once: its log line and its metrics, written
        within `finish_after_s`.

        Nobody waits for them, while the next requests wait for the loop: a burst of
        arrivals (64 clients at once, a UI reconnecting) comes just as the answers before
        it end, and their bookkeeping (a log line, a dozen metric samples each) would go
        before the burst's first bytes. Held for a moment, it goes in one batch after
        them. A scrape of /metrics and the shutdown write what is held first
        (`write_finished`); each line carries its request's end, not its writing.
        """
        if self.finish_after_s <= 0:
            self._write(record)
            return
        self._finished.append(record)
        if self._finish_timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # outside the loop (shutdown): nothing to wait for
                self.write_finished()
                return
            self._finish_timer = loop.call_later(self.finish_after_s, self._write_a_slice)

    def write_finished(self) -> None:
        """Write all that `finish` holds now (a scrape, the shutdown)."""
        if self._finish_timer is not None:
            self._finish_timer.cancel()
            self._finish_timer = None
        finished, self._finished = self._finished, []
        self._write_all(finished)
        self.request_log.hand_off()

    def _write_a_slice(self) -> None:
        """`FINISH_SLICE` of what `finish` holds, and the rest in the next turns of the loop:
        a request arriving meanwhile waits for one slice, not for the whole batch."""
        finished = self._finished
        self._write_all(finished[:FINISH_SLICE])
        del finished[:FINISH_SLICE]
        if finished:
            self._finish_timer = asyncio.get_running_loop().call_soon(self._write_a_slice)
        else:  # the batch is written: its lines need not wait for the log's own timer
            self._finish_timer = None
            self.request_log.hand_off()

    def _write_all(self, finished: list[RequestRecord]) -> None:
        for record in finished:
            try:
                self._write(record)
            except Exception:  # a bug in one record's bookkeeping loses only that one
                self.events.exception("request_bookkeeping_failed", request_id=record.request_id)

    def _write(self, record: RequestRecord) -> None:
        self.request_log.request(record)
        self.metrics.observe(record)
        self.tenant_metrics.observe(record)
        if self.model_metrics is not None:
            self.model_metrics.observe(record)
        if self.tracer is not None:
            self.tracer.export(record)


GATEWAY: web.AppKey[GatewayState] = web.AppKey("gateway", GatewayState)
