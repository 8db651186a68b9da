"""Per-tenant Prometheus series: who was served, who waited, who was refused.

A dashboard must show whether one client is taking a lane from the others, so
requests, queue wait, TTFT and the work served (the fair share's weighted tokens)
are counted by tenant and lane. The tenant label is bounded: the API keys' names
and `[tenants] labeled`, the rest folded into "other" (a label per client-chosen
id would grow the registry without end). Queue depth per tenant is read from the
lanes' fair queues at scrape time, like the other live gauges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.observability.record import RequestRecord
from gateway.scheduling.scheduler import DEFAULT_TENANT

if TYPE_CHECKING:
    from gateway.scheduling.scheduler import Scheduler

#: The same buckets as the lanes' histograms (milliseconds to minutes).
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)


class _Series(NamedTuple):
    queue_wait: Any
    ttft: Any
    cost: Any


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry, label: Callable[[str | None], str]) -> None:
        self._label = label
        self.requests = Counter(
            "gateway_tenant_requests",
            "Requests finished, by tenant, lane and outcome.",
            ["tenant", "lane", "outcome"],
            registry=registry,
        )
        self.queue_wait = Histogram(
            "gateway_tenant_queue_wait_seconds",
            "Time spent in the lane's queue, by tenant.",
            ["tenant", "lane"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "gateway_tenant_ttft_seconds",
            "Arrival to first token, by tenant.",
            ["tenant", "lane"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.cost = Counter(
            "gateway_tenant_cost_tokens",
            "Work served, in the fair share's weighted tokens (uncached prompt + weighted "
            "output), by tenant and lane.",
            ["tenant", "lane"],
            registry=registry,
        )
        self._requests: dict[tuple[str, str, str], Any] = {}
        self._series: dict[tuple[str, str], _Series] = {}

    def observe(self, record: RequestRecord) -> None:
        tenant, lane = self._label(record.tenant), record.lane or "none"
        key = (tenant, lane, str(record.outcome or "unknown"))
        counter = self._requests.get(key)
        if counter is None:
            counter = self._requests[key] = self.requests.labels(*key)
        counter.inc()
        if record.lane is None:
            return
        series = self._series.get((tenant, lane))
        if series is None:
            series = self._series[(tenant, lane)] = _Series(
                self.queue_wait.labels(tenant, lane),
                self.ttft.labels(tenant, lane),
                self.cost.labels(tenant, lane),
            )
        if record.queue_ms is not None:
            series.queue_wait.observe(record.queue_ms / 1000.0)
        if record.ttft_ms is not None:
            series.ttft.observe(record.ttft_ms / 1000.0)
        if record.cost_tokens:
            series.cost.inc(record.cost_tokens)

    def watch(self, scheduler: Scheduler, registry: CollectorRegistry) -> None:
        registry.register(_TenantQueues(scheduler, self._label))


class _TenantQueues(Collector):
    def __init__(self, scheduler: Scheduler, label: Callable[[str | None], str]) -> None:
        self.scheduler = scheduler
        self.label = label

    def collect(self) -> Iterator[GaugeMetricFamily]:
        depth = GaugeMetricFamily(
            "gateway_tenant_queue_depth",
            "Requests waiting, by tenant and lane.",
            labels=["tenant", "lane"],
        )
        running = GaugeMetricFamily(
            "gateway_tenant_in_flight",
            "Slots held, by tenant and lane.",
            labels=["tenant", "lane"],
        )
        for lane in self.scheduler.lanes:
            # The shared tenant always has a series (0 when idle), so the dashboard's
            # panels have one to show before any tenant waits.
            queued: dict[str, int] = {DEFAULT_TENANT: 0}
            in_flight: dict[str, int] = {DEFAULT_TENANT: 0}
            for share in lane.queue.tenants():
                label = self.label(share.name or None)
                queued[label] = queued.get(label, 0) + len(share.queue)
                in_flight[label] = in_flight.get(label, 0) + share.in_flight
            for label in sorted(queued):
                depth.add_metric([label, lane.name], queued[label])
                running.add_metric([label, lane.name], in_flight[label])
        yield depth
        yield running
