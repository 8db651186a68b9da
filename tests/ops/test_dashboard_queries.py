"""Every query of the Grafana dashboard and of the recording rules returns data from a
real Prometheus scraping a real gateway.

A misspelt metric, a label the gateway does not have, or a histogram that is never
filled gives an empty panel, which looks like "all quiet" to an operator. Here a real
`prometheus` (Debian's package) scrapes a gateway in front of the simulator every
second while a little mixed traffic goes through (streams and non-streams in both
lanes, some queueing on two slots, prompts over the cap refused with 413); then each
panel's expression, with the dashboard's variables replaced by concrete values, goes
through `/api/v1/query` and must return at least one finite sample.

The fast tests check the files themselves (dashboard structure, provisioning YAML, the
metric names against a live gateway's /metrics) and need no Prometheus.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import Settings
from tests.conftest import StartGateway, StartSimulator, chat, free_port
from tests.ops.conftest import DASHBOARD, GRAFANA_PROVISIONING, RULES

#: The dashboard's query variables and the concrete values the queries run with here.
LANES = ("interactive", "bulk")
#: `$__rate_interval`: Grafana makes it at least 4 scrape intervals; the whole run
#: here fits in a minute, so a 1 m window holds every sample.
RATE_INTERVAL = "1m"
#: Panel queries that may legitimately return no sample after this traffic, with why.
#: Deliberately empty: ejections, health and refusals are counters and gauges that exist
#: (at 0) from the first scrape, and the ratios fall back to 0 rather than to nothing.
MAY_BE_EMPTY: dict[str, str] = {}
#: A gateway metric's name; not the middle of a recording rule's `lane:gateway_...:p99_5m`.
GATEWAY_NAME = re.compile(r"(?<![:\w])gateway_[a-z_]+(?![:\w])")
#: The sample names a metric family of each type exposes.
SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "gauge": ("",),
}


# ----------------------------------------------------------------------------- the files


def dashboard() -> dict[str, Any]:
    with open(DASHBOARD, encoding="utf-8") as file:
        result: dict[str, Any] = json.load(file)
    return result


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])


def panel_queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title and refId, PromQL expression) of every panel target."""
    return [
        (f"{panel['title']} [{target['refId']}]", target["expr"])
        for panel in panels(board)
        for target in panel.get("targets", [])
    ]


def rules() -> list[dict[str, Any]]:
    with open(RULES, encoding="utf-8") as file:
        groups = yaml.safe_load(file)["groups"]
    return [rule for group in groups for rule in group["rules"]]


def variables(board: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {var["name"]: var for var in board["templating"]["list"]}


def substitute(expr: str, values: dict[str, str]) -> str:
    """`expr` with Grafana's `$name` / `${name}` / `${name:format}` replaced by `values`."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in values, f"unknown dashboard variable ${name} in {expr}"
        return values[name]

    result = re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", value, expr)
    assert "[[" not in result, f"old-style [[variable]] in {expr}"
    return result


def metric_names(expr: str) -> set[str]:
    return set(GATEWAY_NAME.findall(expr))


def test_the_dashboard_is_a_provisionable_grafana_dashboard() -> None:
    board = dashboard()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    assert "id" not in board or board["id"] is None, "a provisioned dashboard has no fixed id"
    ids = [panel["id"] for panel in panels(board)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    names = variables(board)
    assert names["DS_PROMETHEUS"]["type"] == "datasource"
    assert names["DS_PROMETHEUS"]["query"] == "prometheus"
    for panel in panels(board):
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        sources = [panel["datasource"]] + [t["datasource"] for t in panel["targets"]]
        for source in sources:
            assert source == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
    # Query variables use the datasource variable too, and every $variable is defined.
    for var in names.values():
        if var["type"] == "query":
            assert var["datasource"]["uid"] == "${DS_PROMETHEUS}", var["name"]
    defined = {**{name: "x" for name in names}, "__rate_interval": "1m"}
    for _, expr in panel_queries(board):
        substitute(expr, defined)


def test_the_issue_s_panels_are_there() -> None:
    """The panels issue #12 asks for, found by what they query."""
    queries = [expr for _, expr in panel_queries(dashboard())]
    text = "\n".join(queries)
    for metric in (
        "gateway_queue_wait_seconds_bucket",
        "gateway_ttft_seconds_bucket",
        "gateway_backend_ttft_seconds_bucket",
        "gateway_tpot_seconds_bucket",
    ):
        for quantile in ("0.5", "0.99"):
            assert any(
                f"histogram_quantile({quantile}," in q and metric in q and "lane" in q
                for q in queries
            ), f"no per-lane P{quantile} of {metric}"
    for needle in (
        "sum by (lane, outcome) (rate(gateway_requests_total",  # rate by outcome
        "sum by (outcome) (rate(gateway_requests_total",  # refusals by reason
        "gateway_queue_depth",
        "gateway_lane_in_flight",
        "gateway_backend_in_flight",
        "gateway_backend_available",
        "gateway_backend_ejections_total",
    ):
        assert needle in text, needle
    share = [q for q in queries if "gateway_queue_wait_seconds" in q and "/" in q]
    assert share and "gateway_ttft_seconds" in share[0], "no queue share of P99 TTFT"


def test_the_grafana_provisioning_files_point_at_the_dashboard() -> None:
    with open(GRAFANA_PROVISIONING / "dashboards" / "gateway.yml", encoding="utf-8") as file:
        dashboards = yaml.safe_load(file)
    with open(GRAFANA_PROVISIONING / "datasources" / "prometheus.yml", encoding="utf-8") as file:
        datasources = yaml.safe_load(file)
    assert dashboards["apiVersion"] == 1
    (provider,) = dashboards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
    assert datasources["apiVersion"] == 1
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http")


async def test_every_metric_the_dashboard_and_rules_name_is_on_a_gateway_s_metrics_page(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """Without Prometheus: the names alone, against what /metrics exposes."""
    gateway = await start_gateway([await start_simulator_at()])
    async with http.get(gateway.url + "/metrics") as resp:
        assert resp.status == 200
        # By family and type: a labelled histogram with no observation yet has no sample.
        exposed = {
            metric.name + suffix
            for metric in text_string_to_metric_families(await resp.text())
            for suffix in SAMPLE_SUFFIXES.get(metric.type, ("",))
        }
    used = set()
    for _, expr in panel_queries(dashboard()):
        used |= metric_names(expr)
    for rule in rules():
        used |= metric_names(rule["expr"])
    for var in variables(dashboard()).values():
        if var["type"] == "query":
            used |= metric_names(var["definition"])
    assert used, "no gateway_ metric found in the dashboard"
    unknown = used - exposed
    assert not unknown, f"not exposed by the gateway: {sorted(unknown)}"


# ----------------------------------------------------------------------------- the real run


def spawn(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to this process (by its pid), SIGKILL if it is still there after 10 s."""
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


async def running_prometheus(binary: str, tmp_path: Path, target: str) -> AsyncIterator[str]:
    """A Prometheus on a free 127.0.0.1 port scraping `target` every second with the
    gateway's rules loaded; stopped by its pid, its storage in `tmp_path`."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "gateway",
                "scrape_timeout": "1s",
                "static_configs": [{"targets": [target]}],
            }
        ],
    }
    async for url in serve_prometheus(binary, tmp_path, config):
        yield url


async def serve_prometheus(
    binary: str, tmp_path: Path, config: dict[str, Any]
) -> AsyncIterator[str]:
    """A Prometheus with `config` (prometheus.yml as a dict) on a free 127.0.0.1 port,
    its URL once it is ready; stopped by its pid, its storage in `tmp_path`."""
    port = free_port()
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = tmp_path / "prometheus.log"
    process = spawn(
        [
            binary,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1h",
        ],
        log_path,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            for _ in range(200):  # 20 s
                assert process.poll() is None, log_path.read_text()[-3000:]
                try:
                    async with http.get(url + "/-/ready") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("prometheus not ready in 20 s:\n" + log_path.read_text())
        yield url
    finally:
        await asyncio.to_thread(stop, process)


async def query(http: aiohttp.ClientSession, url: str, expr: str) -> list[dict[str, Any]]:
    async with http.get(url + "/api/v1/query", params={"query": expr}) as resp:
        body = await resp.json()
    assert resp.status == 200 and body["status"] == "success", f"{expr}: {body}"
    assert body["data"]["resultType"] == "vector", expr
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def finite(result: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [sample for sample in result if math.isfinite(float(sample["value"][1]))]


async def wait_for(
    http: aiohttp.ClientSession, url: str, expr: str, check: Any, timeout_s: float = 20.0
) -> list[dict[str, Any]]:
    """Query `expr` until `check(result)` holds (scrapes are asynchronous to the test)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = await query(http, url, expr)
        if check(result):
            return result
        if loop.time() > deadline:
            raise AssertionError(f"{expr} still {result} after {timeout_s:g} s")
        await asyncio.sleep(0.25)


async def traffic(http: aiohttp.ClientSession, gateway_url: str) -> int:
    """One round of mixed traffic; how many requests it sent.

    Interactive streams and non-streams, bulk streams (prompt over the interactive
    lane's 1024 tokens), and prompts over the 2048-token cap (413). With two slots,
    the burst queues (and may overflow the small interactive queue: 429)."""
    url = gateway_url + "/v1/chat/completions"
    bodies = (
        [chat(f"Hello {i}", stream=True, max_tokens=12) for i in range(8)]
        + [chat(f"Plain {i}", max_tokens=6) for i in range(3)]
        + [chat("long " * 1200, stream=True, max_tokens=6) for _ in range(2)]
        + [chat("huge " * 3000, max_tokens=4) for _ in range(2)]
    )

    async def send(body: dict[str, Any]) -> int:
        async with http.post(url, json=body) as resp:
            await resp.read()
            return resp.status

    statuses = await asyncio.gather(*(send(body) for body in bodies))
    assert statuses.count(413) == 2, statuses
    assert statuses.count(200) >= 4, statuses
    return len(bodies)


@pytest.fixture
async def gateway_and_prometheus(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    prometheus_binary: str,
    tmp_path: Path,
) -> AsyncIterator[tuple[str, str]]:
    simulator = await start_simulator_at()

    def configure(settings: Settings) -> Settings:
        interactive, *others = settings.lanes
        return msgspec.structs.replace(
            settings,
            limits=msgspec.structs.replace(settings.limits, max_prompt_tokens=2048),
            lanes=[msgspec.structs.replace(interactive, max_queue_depth=4), *others],
        )

    gateway = await start_gateway([simulator], max_concurrency=2, configure=configure)
    target = gateway.url.removeprefix("http://")
    async for prometheus in running_prometheus(prometheus_binary, tmp_path, target):
        yield gateway.url, prometheus


@pytest.mark.slow
async def test_every_panel_and_recording_rule_returns_data_from_a_real_prometheus(
    gateway_and_prometheus: tuple[str, str], http: aiohttp.ClientSession
) -> None:
    gateway_url, prometheus = gateway_and_prometheus
    target = gateway_url.removeprefix("http://")
    board = dashboard()
    values = {
        "job": "gateway",
        "instance": target,
        "lane": "|".join(LANES),
        "backend": "b0",
        "model": ".+",  # the selectors' "All"
        "pool": ".+",
        "DS_PROMETHEUS": "prometheus",
        "__rate_interval": RATE_INTERVAL,
    }
    async with asyncio.timeout(90):
        # Round 1 creates the series; a scrape sees them; round 2 makes them grow, so
        # every rate() and histogram_quantile() has two different samples in its window.
        sent = await traffic(http, gateway_url)
        await wait_for(
            http,
            prometheus,
            'sum(gateway_requests_total{job="gateway"})',
            lambda r: r and float(r[0]["value"][1]) >= sent,
        )
        sent += await traffic(http, gateway_url)
        await wait_for(
            http,
            prometheus,
            'sum(gateway_requests_total{job="gateway"})',
            lambda r: r and float(r[0]["value"][1]) >= sent,
        )

        names_resp = await http.get(prometheus + "/api/v1/label/__name__/values")
        stored = set((await names_resp.json())["data"])
        failures: list[str] = []
        checked = 0
        for title, expr in panel_queries(board):
            promql = substitute(expr, values)
            missing = metric_names(promql) - stored
            if missing:
                failures.append(f"{title}: metrics Prometheus never scraped: {sorted(missing)}")
            result = await query(http, prometheus, promql)
            checked += 1
            if not finite(result) and title not in MAY_BE_EMPTY:
                failures.append(f"{title}: no finite sample from {promql} -> {result}")
            for sample in finite(result)[:3]:
                labels = ",".join(f"{k}={v}" for k, v in sample["metric"].items())
                print(f"  {title} {{{labels}}} = {float(sample['value'][1]):.4g}")
        # The query variables: label_values(metric{selector}, label) as the label API.
        for var in variables(board).values():
            if var["type"] != "query":
                continue
            found = re.fullmatch(r"label_values\((.+), (\w+)\)", var["definition"])
            assert found, var["definition"]
            selector, label = substitute(found.group(1), values), found.group(2)
            resp = await http.get(
                f"{prometheus}/api/v1/label/{label}/values", params={"match[]": selector}
            )
            got = (await resp.json())["data"]
            if not got:
                failures.append(f"variable ${var['name']}: no values for {var['definition']}")
            if var["name"] == "lane" and set(got) != set(LANES):
                failures.append(f"variable $lane lists {got}")
        for rule in rules():
            name = rule.get("record") or rule["alert"]
            result = await query(http, prometheus, rule["expr"])
            checked += 1
            # Recording rules must give data; an alert's expression only has to be valid
            # (nothing is wrong here, so it is empty).
            if "record" in rule and not finite(result):
                failures.append(f"rule {name}: no finite sample from {rule['expr']} -> {result}")
        assert not failures, "\n".join(failures)

        # Prometheus evaluates the loaded rules itself, every second here: none errs.
        async def evaluated() -> list[dict[str, Any]]:
            async with http.get(prometheus + "/api/v1/rules") as resp:
                groups = (await resp.json())["data"]["groups"]
            return [rule for group in groups for rule in group["rules"]]

        for _ in range(40):
            loaded = await evaluated()
            if all(not r["lastEvaluation"].startswith("0001") for r in loaded):
                break
            await asyncio.sleep(0.25)
        assert len(loaded) == len(rules())
        bad = [(r["name"], r["health"], r.get("lastError")) for r in loaded if r["health"] != "ok"]
        assert not bad, bad
        # Its own recorded series appears at an evaluation after both traffic rounds
        # (one each second): poll for it rather than race the evaluation.
        recorded: Any = None
        for _ in range(40):
            recorded = await query(
                http, prometheus, 'lane:gateway_ttft_seconds:p99_5m{lane="interactive"}'
            )
            if finite(recorded):
                break
            await asyncio.sleep(0.25)
        assert finite(recorded), recorded
    print(f"{checked} expressions returned data ({len(panel_queries(board))} panel targets)")
