"""The Prometheus rules load, and every alert's promtool unit tests pass.

`promtool test rules` runs gateway.rules.test.yml: for each alert a case where it
fires (with its labels and annotations) and one where it does not. The last test
here keeps that true as alerts are added.
"""

from __future__ import annotations

import re
import subprocess
from typing import Any

import yaml

from tests.ops.conftest import EXAMPLE_CONFIG, PROMETHEUS_DIR, RULE_TESTS, RULES

TIMEOUT_S = 60


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


def load(path: Any) -> Any:
    with open(path, encoding="utf-8") as file:
        return yaml.safe_load(file)


def test_promtool_check_rules_accepts_the_rules(promtool: str) -> None:
    result = run(promtool, "check", "rules", RULES.name)
    print(result.stdout, result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    found = re.search(r"SUCCESS: (\d+) rules found", result.stdout)
    assert found and int(found.group(1)) == len(rules()), result.stdout


def test_promtool_unit_tests_of_every_alert_pass(promtool: str) -> None:
    result = run(promtool, "test", "rules", RULE_TESTS.name)
    print(result.stdout, result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_example_prometheus_config_is_valid_and_loads_the_rules(promtool: str) -> None:
    result = run(promtool, "check", "config", EXAMPLE_CONFIG.name)
    print(result.stdout, result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    assert load(EXAMPLE_CONFIG)["rule_files"] == [RULES.name]


def rules() -> list[dict[str, Any]]:
    return [rule for group in load(RULES)["groups"] for rule in group["rules"]]


def test_every_alert_has_a_case_where_it_fires_and_one_where_it_does_not() -> None:
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    assert len(alerts) >= 5
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in load(RULE_TESTS)["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert (fires | quiet) <= alerts, (
        f"tests of alerts that do not exist: {(fires | quiet) - alerts}"
    )
    assert alerts - fires == set(), "alerts never shown firing"
    assert alerts - quiet == set(), "alerts never shown quiet"


def test_every_alert_has_a_severity_and_a_summary() -> None:
    for rule in rules():
        if "alert" in rule:
            assert rule["labels"]["severity"] in ("page", "warn"), rule["alert"]
            assert rule["annotations"]["summary"], rule["alert"]
            assert rule["annotations"]["description"], rule["alert"]
