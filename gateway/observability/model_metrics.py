"""Metrics per model and per pool: what each model's clients got, and each pool's queue.

The gateway-wide series (`metrics.py`) stay as they were, by lane; a gateway in
front of several models adds these, so a dashboard can pick a model
(`gateway_model_*`, labelled with the model as asked: an alias is its own model)
or a pool (`gateway_pool_*`). The `model` label is bounded: only names the
config or the backends list (served models, adapters, aliases) are labels, any
other name a client sends is counted as `other`, so a client cycling through
random names cannot grow the series without bound.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.observability.metrics import LATENCY_BUCKETS
from gateway.observability.record import RequestRecord
from gateway.upstream.models import ModelRouter

#: The `model` label of a name nothing lists (and of a request without a model).
OTHER_MODEL = "other"


class ModelMetrics:
    """`gateway_model_requests_total`, `gateway_model_ttft_seconds`, and the pools' gauges."""

    def __init__(self, registry: CollectorRegistry, router: ModelRouter) -> None:
        self.router = router
        self.requests = Counter(
            "gateway_model_requests",
            "Requests by model (as asked), the pool it went to and outcome.",
            ["model", "pool", "outcome"],
            registry=registry,
        )
        self.ttft = Histogram(
            "gateway_model_ttft_seconds",
            "Arrival to first token, by model (as asked).",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        registry.register(_PoolGauges(router))
        # Each series' child, found once: `labels()` costs microseconds a request.
        self._requests: dict[tuple[str, str, str], Any] = {}
        self._ttft: dict[str, Any] = {}

    def label(self, model: str | None) -> str:
        """The model's label: its name when the config or a backend lists it."""
        if model is None:
            return OTHER_MODEL
        if model in self.router.aliases or any(p.lists(model) for p in self.router.pools):
            return model
        return OTHER_MODEL

    def observe(self, record: RequestRecord) -> None:
        model = self.label(record.model)
        key = (model, record.pool or "none", str(record.outcome or "unknown"))
        counter = self._requests.get(key)
        if counter is None:
            counter = self._requests[key] = self.requests.labels(*key)
        counter.inc()
        ttft = record.ttft_ms
        if ttft is not None:
            histogram = self._ttft.get(model)
            if histogram is None:
                histogram = self._ttft[model] = self.ttft.labels(model)
            histogram.observe(ttft / 1000.0)


class _PoolGauges(Collector):
    """Queue depth and slots held per pool and lane, read live from each pool's scheduler;
    and, for the backends whose engines say what they serve (`upstream/served.py`), how
    many names each lists and how many of those reads failed."""

    def __init__(self, router: ModelRouter) -> None:
        self.router = router

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        depth = GaugeMetricFamily(
            "gateway_pool_queue_depth",
            "Requests waiting, by pool and lane.",
            labels=["pool", "lane"],
        )
        in_flight = GaugeMetricFamily(
            "gateway_pool_in_flight", "Slots held, by pool and lane.", labels=["pool", "lane"]
        )
        for each in self.router.pools:
            for lane in each.scheduler.lanes:
                depth.add_metric([each.name, lane.name], len(lane.queue))
                in_flight.add_metric([each.name, lane.name], lane.in_flight)
        yield depth
        yield in_flight
        listed = GaugeMetricFamily(
            "gateway_backend_models_listed",
            "Model names the backend's engine lists (-1: not read yet), when its "
            "[[backends]] entry names no models.",
            labels=["pool", "backend"],
        )
        failures = CounterMetricFamily(
            "gateway_backend_model_listing_failures",
            "Reads of what a backend's engine serves that got no answer (its last list is kept).",
            labels=["pool", "backend"],
        )
        for each in self.router.pools:
            for backend in each.pool.backends:
                served = backend.served
                if served.from_engine:
                    count = -1 if served.names is None else len(served.names)
                    listed.add_metric([each.name, backend.name], count)
                    failures.add_metric([each.name, backend.name], served.failures)
        yield listed
        yield failures
