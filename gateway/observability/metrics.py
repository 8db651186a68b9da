"""Prometheus metrics, fed once per request from its RequestRecord.

Queue depth and in-flight gauges are read from the scheduler and the pool at
scrape time (a custom collector), so the hot path updates no gauges at all.
Each app gets its own registry so several gateways can live in one process
(tests, benchmarks).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.observability.record import RequestRecord

if TYPE_CHECKING:
    from gateway.scheduling.scheduler import Scheduler
    from gateway.upstream.pool import BackendPool

#: LLM latencies span milliseconds (a queue hop) to minutes (a long generation).
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "gateway_requests",
            "Requests finished, by lane, outcome and status.",
            ["lane", "outcome", "status"],
            registry=r,
        )
        # A stream whose 200 and headers went out early (keep-alive comments) or whose
        # backend failed mid-answer ends with an SSE error event: a 200 in
        # gateway_requests_total by status, an error here by its code.
        self.stream_errors = Counter(
            "gateway_stream_errors",
            "Streams answered 200 that ended with an in-band SSE error event, by lane and "
            "error code (queue_timeout, backend_timeout, backend_stream_error, ...).",
            ["lane", "code"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds",
            "Time spent in the lane's queue.",
            ["lane"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "gateway_ttft_seconds",
            "Arrival to first token (what the user feels).",
            ["lane"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.backend_ttft = Histogram(
            "gateway_backend_ttft_seconds",
            "Dispatch to first token (the model's share).",
            ["lane"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "gateway_tpot_seconds",
            "Mean time per output token after the first.",
            ["lane"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "gateway_e2e_seconds",
            "Arrival to last byte.",
            ["lane"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # The backend's time split (upstream/engine_timings.py): from the engine's own
        # timings, its histogram window, or the learned model (the log's timing_source).
        self.engine_queue = Histogram(
            "gateway_engine_queue_seconds",
            "Time in the engine's own queue, before its prefill began.",
            ["lane"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill = Histogram(
            "gateway_prefill_seconds",
            "The engine's prefill of the prompt (the tokens not in its cache).",
            ["lane"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decode = Histogram(
            "gateway_decode_seconds",
            "The engine's decode, first token to last.",
            ["lane"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "gateway_prompt_tokens", "Prompt tokens of admitted requests.", ["lane"], registry=r
        )
        self.completion_tokens = Counter(
            "gateway_completion_tokens",
            "Completion tokens the backends reported.",
            ["lane"],
            registry=r,
        )
        # Shadow traffic (upstream/shadow.py): sampled mirrors by how they ended, drops
        # by reason (dropped_queued, dropped_loop_lag, dropped_concurrency).
        self.shadow_requests = Counter(
            "gateway_shadow_requests",
            "Sampled shadow mirrors, by result: ok, error, aborted, or dropped_<reason>.",
            ["result"],
            registry=r,
        )
        self.shadow_in_flight = Gauge(
            "gateway_shadow_in_flight", "Shadow mirrors running now.", registry=r
        )
        # Cache-aware routing (upstream/pool.py): why each backend was chosen, and the
        # prompt tokens each backend said it served from its cache, next to all it got.
        self.routing_decisions = Counter(
            "gateway_routing_decisions",
            "Dispatches by why the backend was chosen: prefix (cached there), session, load.",
            ["backend", "reason"],
            registry=r,
        )
        self.backend_prompt_tokens = Counter(
            "gateway_backend_prompt_tokens",
            "Prompt tokens the backend reported (usage.prompt_tokens), of requests that "
            "reported cached tokens too.",
            ["backend"],
            registry=r,
        )
        self.backend_cached_tokens = Counter(
            "gateway_backend_cached_tokens",
            "Prompt tokens the backend reported served from its prefix cache "
            "(usage.prompt_tokens_details.cached_tokens): the hit ratio is this over "
            "gateway_backend_prompt_tokens_total.",
            ["backend"],
            registry=r,
        )
        # Client connections the gateway closed itself (http/door.py), by reason:
        # header_timeout (headers not all in within [server] header_timeout_s),
        # keepalive_idle (idle past keepalive_timeout_s). Counted per connection, not request.
        self.connections_closed = Counter(
            "gateway_connections_closed",
            "Client connections closed by the gateway, by reason: header_timeout, keepalive_idle.",
            ["reason"],
            registry=r,
        )
        # Retries (admission/retries.py): requests that repeat one seen shortly before, by
        # what the earlier one got (its refusal code, its outcome, or in_flight), and
        # those refused at once for coming before its Retry-After.
        self.client_retries = Counter(
            "gateway_client_retries",
            "Requests that repeat one seen shortly before (same sender and body, or the "
            "same x-request-id), by lane and what the earlier one got (after).",
            ["lane", "after"],
            registry=r,
        )
        self.retries_damped = Counter(
            "gateway_client_retries_damped",
            "Retries refused at once for coming before their earlier refusal's Retry-After.",
            ["lane"],
            registry=r,
        )
        # The learned-state file (upstream/learned_state.py) that could not be read or
        # written: the figures learned are not kept across a restart.
        self.state_file_failures = Counter(
            "gateway_state_file_failures",
            "Reads and writes of the learned-state file ([health] state_file) that failed.",
            registry=r,
        )
        # Answers carried over mid-stream (upstream/resume.py), by why; and carry-overs
        # that were needed but could not be done, by why not.
        self.resumes = Counter(
            "gateway_stream_resumes",
            "Answers carried over to another backend mid-stream, by the backend left and "
            "why: broken (reset, early end, error event), stalled (silent past its stall "
            "time), drained.",
            ["backend", "reason"],
            registry=r,
        )
        self.resumes_failed = Counter(
            "gateway_stream_resumes_failed",
            "Streams whose backend failed mid-answer and that could not be carried over "
            "(they ended with an error event), by why: request_shape, logprobs, tool_calls, "
            "reasoning, unknown_engine, no_backend, buffer_full, limit, finished, disabled.",
            ["why"],
            registry=r,
        )
        self.preemptions = Counter(
            "gateway_preemptions",
            "Requests preempted in prefill for a request of a higher lane and sent again "
            "([preemption]), by their lane: each counts once per preemption.",
            ["lane"],
            registry=r,
        )
        self.deadline_graces = Counter(
            "gateway_deadline_graces",
            "Requests that waited past their lane's fitted queue deadline at the head of a "
            "lower lane's line (the grace: a promotion and a slot hold more; never past a "
            "written deadline), by lane and how they ended (ok: served).",
            ["lane", "outcome"],
            registry=r,
        )
        # Label children looked up once per label set, not on every request.
        self._request_counters: dict[tuple[str, str, int | None], Any] = {}
        self._routing_counters: dict[tuple[str, str], Any] = {}
        self._retry_counters: dict[tuple[str, str], Any] = {}
        self._cache_counters: dict[str, tuple[Any, Any]] = {}
        self._lane_series: dict[str, _LaneSeries] = {}

    def observe(self, record: RequestRecord) -> None:
        lane = record.lane
        key = (lane or "none", record.outcome or "unknown", record.status)
        counter = self._request_counters.get(key)
        if counter is None:
            counter = self.requests.labels(key[0], key[1], str(record.status or 0))
            self._request_counters[key] = counter
        counter.inc()
        if record.error_code is not None and record.status == 200:
            self.stream_errors.labels(lane or "none", record.error_code).inc()
        if record.retried_outcome is not None:
            self._observe_retry(lane or "none", record.retried_outcome, record.retry_damped)
        if record.resumes:
            for left in record.resumed_from or ():
                self.resumes.labels(left, record.resume_reason or "broken").inc()
        if record.resume_failed is not None:
            self.resumes_failed.labels(record.resume_failed).inc()
        if record.preempted:
            self.preemptions.labels(lane or "none").inc(record.preempted)
        if record.deadline_grace_s:
            self.deadline_graces.labels(lane or "none", key[1]).inc()
        if lane is None:
            return
        series = self._lane_series.get(lane)
        if series is None:
            series = self._lane_series[lane] = self._series_of(lane)
        for histogram, value_ms in (
            (series.queue_wait, record.queue_ms),
            (series.ttft, record.ttft_ms),
            (series.backend_ttft, record.backend_ttft_ms),
            (series.tpot, record.tpot_ms),
            (series.e2e, record.e2e_ms),
        ):
            if value_ms is not None:
                histogram.observe(value_ms / 1000.0)
        timings = record.timings
        if timings is not None:
            for histogram, value_s in (
                (series.engine_queue, timings.engine_queue_s),
                (series.prefill, timings.prefill_s),
                (series.decode, timings.decode_s),
            ):
                if value_s is not None:
                    histogram.observe(value_s)
        if record.dispatched is not None and record.prompt_tokens:
            series.prompt_tokens.inc(record.prompt_tokens)
        if record.completion_tokens:
            series.completion_tokens.inc(record.completion_tokens)
        if record.backend is not None and record.routed_by is not None:
            self._observe_routing(record.backend, record.routed_by, record)

    def _observe_retry(self, lane: str, after: str, damped: bool) -> None:
        retries = self._retry_counters.get((lane, after))
        if retries is None:
            retries = self._retry_counters[(lane, after)] = self.client_retries.labels(lane, after)
        retries.inc()
        if damped:
            self.retries_damped.labels(lane).inc()

    def _observe_routing(self, backend: str, reason: str, record: RequestRecord) -> None:
        decisions = self._routing_counters.get((backend, reason))
        if decisions is None:
            decisions = self.routing_decisions.labels(backend, reason)
            self._routing_counters[(backend, reason)] = decisions
        decisions.inc()
        if record.cached_tokens is not None and record.backend_prompt_tokens:
            tokens = self._cache_counters.get(backend)
            if tokens is None:
                tokens = self._cache_counters[backend] = (
                    self.backend_prompt_tokens.labels(backend),
                    self.backend_cached_tokens.labels(backend),
                )
            tokens[0].inc(record.backend_prompt_tokens)
            tokens[1].inc(record.cached_tokens)

    def _series_of(self, lane: str) -> _LaneSeries:
        return _LaneSeries(
            self.queue_wait.labels(lane),
            self.ttft.labels(lane),
            self.backend_ttft.labels(lane),
            self.tpot.labels(lane),
            self.e2e.labels(lane),
            self.engine_queue.labels(lane),
            self.prefill.labels(lane),
            self.decode.labels(lane),
            self.prompt_tokens.labels(lane),
            self.completion_tokens.labels(lane),
        )

    def watch(
        self,
        scheduler: Scheduler,
        pool: BackendPool,
        floors: Mapping[str, float] | None = None,
    ) -> None:
        """Export queue depth, in-flight and learned figures read live from the scheduler
        and pool (and the lanes' engine floors, by lane)."""
        self.registry.register(_LiveGauges(scheduler, pool))
        self.registry.register(
            _LearnedGauges(scheduler, pool, floors if floors is not None else {})
        )


class _LaneSeries(NamedTuple):
    queue_wait: Any
    ttft: Any
    backend_ttft: Any
    tpot: Any
    e2e: Any
    engine_queue: Any
    prefill: Any
    decode: Any
    prompt_tokens: Any
    completion_tokens: Any


class _LiveGauges(Collector):
    def __init__(self, scheduler: Scheduler, pool: BackendPool) -> None:
        self.scheduler = scheduler
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        depth = GaugeMetricFamily(
            "gateway_queue_depth", "Requests waiting, by lane.", labels=["lane"]
        )
        in_flight = GaugeMetricFamily(
            "gateway_lane_in_flight", "Slots held, by lane.", labels=["lane"]
        )
        limit = GaugeMetricFamily(
            "gateway_lane_slot_limit", "Most slots a lane may hold.", labels=["lane"]
        )
        for lane in self.scheduler.lanes:
            depth.add_metric([lane.name], len(lane.queue))
            in_flight.add_metric([lane.name], lane.in_flight)
            limit.add_metric([lane.name], lane.slot_limit)
        backend_in_flight = GaugeMetricFamily(
            "gateway_backend_in_flight", "Requests running, by backend.", labels=["backend"]
        )
        backend_slots = GaugeMetricFamily(
            "gateway_backend_slots", "Slots (max_concurrency), by backend.", labels=["backend"]
        )
        prefilling = GaugeMetricFamily(
            "gateway_backend_prefill_tokens",
            "Prompt tokens sent to a backend that has not answered their first byte yet.",
            labels=["backend"],
        )
        outstanding = GaugeMetricFamily(
            "gateway_backend_outstanding_tokens",
            "Prompt + max_tokens of the requests in flight, by backend (what balancing uses).",
            labels=["backend"],
        )
        available = GaugeMetricFamily(
            "gateway_backend_available",
            "1 when the backend passes its health checks and is not ejected.",
            labels=["backend"],
        )
        draining = GaugeMetricFamily(
            "gateway_backend_draining",
            "1 while the backend is drained (POST /admin/backends/{name}/drain): no new "
            "request, its streams finishing or carried over at the drain deadline.",
            labels=["backend"],
        )
        ejections = CounterMetricFamily(
            "gateway_backend_ejections",
            "Times a backend was ejected after consecutive failures.",
            labels=["backend"],
        )
        now = self.pool.clock()
        for backend in self.pool.backends:
            name = [backend.name]
            backend_in_flight.add_metric(name, backend.in_flight)
            backend_slots.add_metric(name, backend.max_concurrency)
            prefilling.add_metric(name, backend.prefilling_tokens)
            outstanding.add_metric(name, backend.outstanding_tokens)
            available.add_metric(name, 1 if backend.available(now) else 0)
            draining.add_metric(name, 1 if backend.draining else 0)
            ejections.add_metric(name, backend.ejections)
        yield from (depth, in_flight, limit, backend_in_flight, backend_slots, prefilling)
        yield from (outstanding, available, draining, ejections)


class _LearnedGauges(Collector):
    """What the gateway learned of its backends and fitted its lanes to."""

    def __init__(
        self, scheduler: Scheduler, pool: BackendPool, floors: Mapping[str, float]
    ) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.floors = floors

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["backend"]
        prefill = GaugeMetricFamily(
            "gateway_backend_prefill_tokens_per_second",
            "Learned prefill rate (gateway-counted prompt tokens per second), by backend.",
            labels=labels,
        )
        decode = GaugeMetricFamily(
            "gateway_backend_decode_tokens_per_second",
            "Learned decode rate of one stream at the current concurrency, by backend.",
            labels=labels,
        )
        overhead = GaugeMetricFamily(
            "gateway_backend_ttft_overhead_seconds",
            "Learned time to a first token beyond prefill, by backend.",
            labels=labels,
        )
        ratio = GaugeMetricFamily(
            "gateway_backend_token_ratio",
            "Learned backend prompt tokens per gateway (tiktoken) token, by backend.",
            labels=labels,
        )
        prefilling_s = GaugeMetricFamily(
            "gateway_backend_prefill_seconds",
            "Predicted prefill seconds in flight (the prefill budget's use), by backend.",
            labels=labels,
        )
        waiting = GaugeMetricFamily(
            "gateway_backend_engine_waiting",
            "Requests the engine reports waiting in its own queue, by backend.",
            labels=labels,
        )
        running = GaugeMetricFamily(
            "gateway_backend_engine_running",
            "Requests the engine reports running, by backend.",
            labels=labels,
        )
        for backend in self.pool.backends:
            name = [backend.name]
            figures = backend.model.figures(max(1, backend.in_flight))
            prefill.add_metric(name, figures.prefill_tokens_per_s)
            decode.add_metric(name, figures.decode_tokens_per_s)
            overhead.add_metric(name, figures.ttft_overhead_s)
            ratio.add_metric(name, figures.token_ratio)
            prefilling_s.add_metric(name, backend.prefilling_s)
            if backend.engine_waiting is not None:
                waiting.add_metric(name, backend.engine_waiting)
            if backend.engine_running is not None:
                running.add_metric(name, backend.engine_running)
        deadline = GaugeMetricFamily(
            "gateway_lane_deadline_seconds",
            "Queue deadline in force, by lane (queue_timeout_s, or fitted to the engine).",
            labels=["lane"],
        )
        floor = GaugeMetricFamily(
            "gateway_lane_engine_floor_seconds",
            "Measured engine floor of a lane: one long prefill ahead plus its own.",
            labels=["lane"],
        )
        predicted = GaugeMetricFamily(
            "gateway_lane_predicted_wait_seconds",
            "Wait predicted for a request arriving now, by lane.",
            labels=["lane"],
        )
        demand = GaugeMetricFamily(
            "gateway_lane_demand_slots",
            "A lane's measured demand in slots: its arrival rate times its slot hold time.",
            labels=["lane"],
        )
        headroom = GaugeMetricFamily(
            "gateway_lane_headroom_slots",
            "Slots an active lane keeps from the lanes below it for its own demand.",
            labels=["lane"],
        )
        for lane in self.scheduler.lanes:
            deadline.add_metric([lane.name], lane.deadline_s)
            if lane.name in self.floors:
                floor.add_metric([lane.name], self.floors[lane.name])
            wait = self.scheduler.predicted_wait_s(lane.name)
            if wait is not None:
                predicted.add_metric([lane.name], wait)
            shares = self.scheduler.headroom_figures(lane.name)
            demand.add_metric([lane.name], shares["demand_slots"])
            headroom.add_metric([lane.name], shares["headroom_slots"])
        yield from (prefill, decode, overhead, ratio, prefilling_s, waiting, running)
        yield from (deadline, floor, predicted, demand, headroom)
