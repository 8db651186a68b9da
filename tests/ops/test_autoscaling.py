"""The autoscaling examples (config/autoscaling/) scale on queries that work.

A KEDA trigger or an HPA external metric whose query names a metric the gateway does
not export returns nothing, and the autoscaler then either errors quietly or holds the
fleet at its minimum while users queue. So the fast tests check the files' shape (and
that every metric the HPA names is served by an adapter rule), and the slow one runs
every query they contain (KEDA's as written, the adapter's rendered as the adapter
renders them for the HPA) against a real Prometheus scraping two real gateways that
share a real Redis, while one of them queues: each must give exactly one finite
sample (KEDA wants a single element), the queue must show in it, and both replicas
must export the same fleet view.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import yaml

from gateway.config import RedisSettings, Settings
from tests.conftest import StartGateway, StartSimulator, chat
from tests.ops.conftest import ROOT
from tests.ops.test_dashboard_queries import (
    finite,
    metric_names,
    query,
    serve_prometheus,
    wait_for,
)
from tests.redis_server import RedisServer

AUTOSCALING = ROOT / "config" / "autoscaling"
KEDA = AUTOSCALING / "keda-scaledobject.yaml"
ADAPTER = AUTOSCALING / "prometheus-adapter.yaml"
#: The labels the examples select on; the test's Prometheus attaches them as a
#: Kubernetes scrape would (job from the Service, namespace from the pod).
JOB = "llm-gateway"
NAMESPACE = "llm"
#: The only template variables an adapter metricsQuery here may use.
TEMPLATE = re.compile(r"<<\s*\.(\w+)\s*>>")


# ----------------------------------------------------------------------------- the files


def scaled_object() -> dict[str, Any]:
    with open(KEDA, encoding="utf-8") as file:
        result: dict[str, Any] = yaml.safe_load(file)
    return result


def adapter_documents() -> tuple[dict[str, Any], dict[str, Any]]:
    """(the adapter's rules, the HPA)."""
    with open(ADAPTER, encoding="utf-8") as file:
        config_map, hpa = yaml.safe_load_all(file)
    assert config_map["kind"] == "ConfigMap"
    rules: dict[str, Any] = yaml.safe_load(config_map["data"]["config.yaml"])
    return rules, hpa


def keda_queries() -> list[tuple[str, str]]:
    return [
        (f"KEDA trigger {trigger['name']}", trigger["metadata"]["query"])
        for trigger in scaled_object()["spec"]["triggers"]
    ]


def rule_for(rules: dict[str, Any], metric: str) -> dict[str, Any]:
    found = [rule for rule in rules["externalRules"] if rule["name"]["as"] == metric]
    assert len(found) == 1, f"{len(found)} adapter rules expose {metric}"
    return found[0]


def render(rule: dict[str, Any], selector: dict[str, str], namespace: str) -> str:
    """The PromQL the adapter sends for an HPA in `namespace` selecting `selector`."""
    (series,) = metric_names(rule["seriesQuery"])
    matchers = [f'namespace="{namespace}"'] + [f'{k}="{v}"' for k, v in selector.items()]
    values = {"Series": series, "LabelMatchers": ",".join(matchers)}

    def value(match: re.Match[str]) -> str:
        assert match.group(1) in values, f"template variable {match.group(0)} not rendered"
        return values[match.group(1)]

    return TEMPLATE.sub(value, rule["metricsQuery"])


def adapter_queries() -> list[tuple[str, str]]:
    """The series query of every rule, and each HPA metric's query as the adapter
    renders it."""
    rules, hpa = adapter_documents()
    queries = [
        (f"adapter seriesQuery {rule['name']['as']}", rule["seriesQuery"])
        for rule in rules["externalRules"]
    ]
    for metric in hpa["spec"]["metrics"]:
        external = metric["external"]["metric"]
        selector = external.get("selector", {}).get("matchLabels", {})
        rule = rule_for(rules, external["name"])
        queries.append(
            (f"HPA metric {external['name']} {selector}", render(rule, selector, NAMESPACE))
        )
    return queries


def test_the_scaled_object_scales_the_gateway_on_prometheus_queries() -> None:
    doc = scaled_object()
    assert doc["apiVersion"] == "keda.sh/v1alpha1" and doc["kind"] == "ScaledObject"
    spec = doc["spec"]
    assert spec["scaleTargetRef"]["name"] == "llm-gateway"
    assert spec["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
    assert 2 <= spec["minReplicaCount"] < spec["maxReplicaCount"]
    triggers = spec["triggers"]
    assert triggers and len({t["name"] for t in triggers}) == len(triggers)
    for trigger in triggers:
        assert trigger["type"] == "prometheus", trigger
        assert trigger["metricType"] in ("Value", "AverageValue"), trigger
        metadata = trigger["metadata"]
        assert metadata["serverAddress"].startswith("http")
        # KEDA reads metadata as strings; a YAML number here is rejected.
        assert all(isinstance(v, str) for v in metadata.values()), metadata
        assert float(metadata["threshold"]) > 0
        assert metadata["ignoreNullValues"] == "false", "an empty answer must not read 0"
        names = metric_names(metadata["query"])
        assert names and all(n.startswith("gateway_fleet_") for n in names), names
        assert metadata["query"].startswith("max("), "the fleet view is aggregated by max()"
    assert "cpu" not in {t["type"] for t in triggers}


def test_the_adapter_serves_every_metric_the_hpa_scales_on() -> None:
    rules, hpa = adapter_documents()
    assert hpa["apiVersion"] == "autoscaling/v2" and hpa["kind"] == "HorizontalPodAutoscaler"
    assert hpa["spec"]["scaleTargetRef"]["name"] == "llm-gateway"
    for rule in rules["externalRules"]:
        (series,) = metric_names(rule["seriesQuery"])
        assert rule["name"]["as"] == series, rule
        assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
        assert set(TEMPLATE.findall(rule["metricsQuery"])) == {"Series", "LabelMatchers"}
        assert rule["metricsQuery"].startswith("max("), rule["metricsQuery"]
    metrics = hpa["spec"]["metrics"]
    assert {m["type"] for m in metrics} == {"External"}
    for metric in metrics:
        rule_for(rules, metric["external"]["metric"]["name"])
        target = metric["external"]["target"]
        assert float(target[{"Value": "value", "AverageValue": "averageValue"}[target["type"]]]) > 0
    # The two examples ask for the same thing.
    keda = {
        t["metricType"]: float(t["metadata"]["threshold"])
        for t in scaled_object()["spec"]["triggers"]
    }
    hpa_targets = {
        m["external"]["target"]["type"]: float(
            m["external"]["target"].get("value") or m["external"]["target"]["averageValue"]
        )
        for m in metrics
    }
    assert keda == hpa_targets


def test_rendering_follows_the_adapter_s_template() -> None:
    rule = {
        "seriesQuery": 'gateway_fleet_queue_depth{namespace!=""}',
        "metricsQuery": "max(<<.Series>>{<<.LabelMatchers>>})",
    }
    assert render(rule, {"lane": "bulk"}, "ns") == (
        'max(gateway_fleet_queue_depth{namespace="ns",lane="bulk"})'
    )


# ----------------------------------------------------------------------------- the real run


async def running_prometheus(binary: str, tmp_path: Path, targets: list[str]) -> AsyncIterator[str]:
    """A Prometheus on a free 127.0.0.1 port scraping `targets` every second, with the
    job and namespace labels a Kubernetes scrape would give; stopped by its pid."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": JOB,
                "scrape_timeout": "1s",
                "static_configs": [{"targets": targets, "labels": {"namespace": NAMESPACE}}],
            }
        ],
    }
    async for url in serve_prometheus(binary, tmp_path, config):
        yield url


@pytest.fixture
async def two_replicas_and_prometheus(
    redis_server: RedisServer,  # first: stopped after the gateways
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    prometheus_binary: str,
    tmp_path: Path,
) -> AsyncIterator[tuple[list[str], str]]:
    # ~25 ms a step: a 60-token answer holds the one slot for ~1.5 s.
    simulator = await start_simulator_at(step_base_ms=25.0)

    def configure(settings: Settings) -> Settings:
        # A queue that lasts: 8 streams of ~1.5 s on one slot, none timing out.
        interactive, *others = settings.lanes
        return msgspec.structs.replace(
            settings,
            redis=RedisSettings(url=redis_server.url, tick_s=0.25),
            lanes=[msgspec.structs.replace(interactive, queue_timeout_s=20.0), *others],
        )

    gateways = [
        await start_gateway([simulator], max_concurrency=1, configure=configure) for _ in range(2)
    ]
    urls = [gateway.url for gateway in gateways]
    targets = [url.removeprefix("http://") for url in urls]
    async for prometheus in running_prometheus(prometheus_binary, tmp_path, targets):
        yield urls, prometheus


async def check_query(
    http: aiohttp.ClientSession, prometheus: str, stored: set[str], title: str, expr: str
) -> list[str]:
    """What is wrong with `expr` (nothing: an empty list). A scaling query must give
    one finite sample; an adapter's seriesQuery (discovery) finite series at least."""
    failures = []
    missing = metric_names(expr) - stored
    if missing:
        failures.append(f"{title}: metrics Prometheus never scraped: {sorted(missing)}")
    result = await query(http, prometheus, expr)
    discovery = "seriesQuery" in title
    if not finite(result) or (not discovery and len(finite(result)) != 1):
        failures.append(f"{title}: not one finite sample from {expr} -> {result}")
    return failures


@pytest.mark.slow
async def test_every_autoscaling_query_answers_from_real_gateways_sharing_redis(
    two_replicas_and_prometheus: tuple[list[str], str], http: aiohttp.ClientSession
) -> None:
    (first, _), prometheus = two_replicas_and_prometheus
    queries = keda_queries() + adapter_queries()
    keda = dict(keda_queries())
    wait_query = keda["KEDA trigger interactive_predicted_wait"]
    queue_query = keda["KEDA trigger queued_per_replica"]

    async def stream(url: str) -> int:
        body = chat("Tell me a story", stream=True, max_tokens=60)
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            await resp.read()
            return resp.status

    async with asyncio.timeout(90):
        # Both replicas in the fleet view, on every replica.
        await wait_for(
            http,
            prometheus,
            f'min(gateway_fleet_replicas{{job="{JOB}"}})',
            lambda r: r and float(r[0]["value"][1]) == 2,
        )
        # Eight streams on one replica, one slot shared by both: seven wait in its
        # queue, and the other replica, which queues nothing itself, exports them too.
        traffic = asyncio.gather(*(stream(first) for _ in range(8)))
        try:
            # Once the first stream has ended, the wait of the ones behind it is known
            # (the idle replica's 0 s does not hide it).
            await wait_for(
                http, prometheus, wait_query, lambda r: r and float(r[0]["value"][1]) > 1
            )
            await wait_for(
                http,
                prometheus,
                f'min(gateway_fleet_queue_depth{{job="{JOB}",lane="interactive"}})',
                lambda r: r and float(r[0]["value"][1]) >= 2,
            )
            result = await query(http, prometheus, queue_query)
            assert finite(result) and float(result[0]["value"][1]) >= 2, result
            names_resp = await http.get(prometheus + "/api/v1/label/__name__/values")
            stored = set((await names_resp.json())["data"])
            failures: list[str] = []
            for title, expr in queries:
                failures += await check_query(http, prometheus, stored, title, expr)
                print(f"  {title}: {expr} -> {await query(http, prometheus, expr)}")
            assert not failures, "\n".join(failures)
            # The check itself catches a misspelt metric.
            title, expr = queries[0]
            typo = expr.replace("gateway_fleet_", "gateway_fleets_")
            assert await check_query(http, prometheus, stored, title, typo)
        finally:
            statuses = await traffic
        assert statuses == [200] * len(statuses), statuses
    # The age of the view stays small while Redis is up.
    result = await query(http, prometheus, f'max(gateway_fleet_view_age_seconds{{job="{JOB}"}})')
    assert finite(result) and float(result[0]["value"][1]) < 5, result
