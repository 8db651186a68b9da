"""The ops kit's tests need Prometheus' own binaries (Debian's `prometheus` package).

Without them the tests skip on a developer's machine, but fail under CI (CI=true),
where `.ci/run` installs the package: a missing binary there is a broken CI, not a
reason to pass.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "config" / "prometheus"
RULES = PROMETHEUS_DIR / "gateway.rules.yml"
RULE_TESTS = PROMETHEUS_DIR / "gateway.rules.test.yml"
EXAMPLE_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
DASHBOARD = ROOT / "config" / "grafana" / "gateway.json"
GRAFANA_PROVISIONING = ROOT / "config" / "grafana" / "provisioning"


def require_binary(name: str) -> str:
    """The path of `name`; skip without it, or fail when running under CI."""
    path = shutil.which(name)
    if path is not None:
        return path
    why = f"`{name}` is not installed (Debian: apt-get install prometheus; .ci/run does it)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}, and CI=true: CI must have it", pytrace=False)
    pytest.skip(why)


@pytest.fixture
def promtool() -> str:
    return require_binary("promtool")


@pytest.fixture
def prometheus_binary() -> str:
    return require_binary("prometheus")
