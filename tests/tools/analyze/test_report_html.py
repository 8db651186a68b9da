"""The HTML report: self-contained (no fetches), and a clear message when matplotlib is missing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.tools.analyze import analyze
from gateway.tools.analyze.report_html import bar_labels
from tests.tools.analyze.support import (
    bursts,
    engine_run,
    lane_with_slow_tail,
    rec,
    run_cli,
    storm_log,
    tenant_line,
    unfair_log,
    write_log,
)


def test_html_without_matplotlib_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import fails
    log = write_log(tmp_path / "gw.log", [rec()])
    code, _, err = run_cli([str(log), "--html", str(tmp_path / "r.html")], capsys)
    assert code == 2
    # The package is on no index, so `pip install 'llm-tail-gateway[report]'` cannot work.
    assert err.strip().splitlines() == [
        "analyze: --html needs matplotlib: make install-report "
        "(in a clone; or: .venv/bin/pip install -e '.[report]')"
    ]
    assert not (tmp_path / "r.html").exists()


def test_html_report_is_self_contained(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    records = lane_with_slow_tail("interactive", 900.0, 100.0)
    records += lane_with_slow_tail("bulk", 100.0, 900.0, fast=20)
    records += [rec(outcome="rejected_queue_full", queue=0.1, backend=None) for _ in range(3)]
    records += [rec(outcome="queue_timeout", queue=5000.0, backend=None, e2e=5000.0)]
    records += [rec(lane=None, outcome="rejected_prompt_too_long", queue=None, backend=None)]
    records += [rec(stream=False, e2e=300.0), rec(queue=None, backend=None, e2e=None)]
    log = write_log(tmp_path / "gw.log", records)
    out = tmp_path / "report.html"
    code, _, _ = run_cli([str(log), "--html", str(out)], capsys)
    assert code == 0
    page = out.read_text()
    assert page.count("<svg") == 4  # one tenant: no tenant chart; no retry_of: no retry chart
    assert "queueing-bound" in page and "backend-bound" in page
    assert "This log has no engine split (engine_queue_ms, prefill_ms, decode_ms)" in page
    assert "This log has no retry_of field" in page
    assert "One tenant, “(none)” (this log has no tenant field): nothing to compare." in page
    assert_self_contained(page)


def test_html_report_has_a_tenant_panel(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    records = unfair_log()
    records.append(
        tenant_line("b", 1.0, arrive=2.0, dispatch=None, end=2.001, refusal="quota_exceeded")
    )
    log = write_log(tmp_path / "gw.log", records)
    out = tmp_path / "report.html"
    code, _, _ = run_cli([str(log), "--html", str(out)], capsys)
    assert code == 0
    page = out.read_text()
    panel = page[page.index('<h2 id="tenants-panel">Tenants</h2>') :]
    # a: weight 2, 11 requests all served, 1320 tokens, 3300 charged, 1650 weighted
    assert (
        "<tr><td>a</td><td>2</td><td>11</td><td>11</td><td>1320</td><td>3300</td><td>1650</td>"
        in panel
    )
    assert (
        "<tr><td>b</td><td>1</td><td>7</td><td>6</td><td>720</td><td>600.0</td><td>600.0</td>"
        in panel
    )
    assert "quota_exceeded 1</td>" in panel
    # the chart: one bar per tenant, labelled with its weighted service
    assert page.count("<svg") == 5 and 'id="tenants"' in panel
    assert "weighted service (cost / weight, tokens)" in panel
    assert re.search(r">1650</text>", panel) and re.search(r">600\.0</text>", panel)
    # the fair share: J 0.8 in the one contended window, gap 1150 against 2·U = 300
    assert "<td>1</td><td>0</td><td>0.800</td><td>0.800</td><td class=first>1150</td>" in panel
    assert "<td>300.0</td><td>150.0</td><td class=text>a vs b</td>" in panel
    assert "over the bound, in-flight requests included" in panel
    assert "The gateway charges output tokens when a request ends" in panel
    assert_self_contained(page)


def test_waterfall_bars_are_labelled_by_what_tells_them_apart() -> None:
    """The gateway's ids share a per-process prefix: their first 10 characters read the same."""
    lines = engine_run(
        bursts(3, 8, every_s=3.0, spacing_s=0.05),
        gateway_slots=8,
        engine_slots=4,
        prefill_s=0.1,
        decode_s=1.0,
    )
    for i, line in enumerate(lines):
        line["request_id"] = f"ce6117b2c2a4f00d{1000 + i:016x}"
    slowest = analyze(lines)["lanes"]["interactive"]["tail"]["slowest"]
    labels = bar_labels(slowest)
    assert len(set(labels)) == len(labels) == len(slowest)
    assert len({label.split()[0] for label in labels}) > 1  # arrival times differ too
    # the first of the slowest: the 5th of the first burst, 0.2 s after the first arrival
    assert labels[0] == "23:43:30.200 …0003ec"
    assert slowest[0]["request_id"].endswith("3ec")
    assert bar_labels(
        [{"request_id": "req-1", "arrival": None, "outcome": "ok", "measure": "e2e_ms"}]
    ) == ["? req-1 e2e"]


def test_html_report_shows_the_four_parts_and_the_retry_panel(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("matplotlib")
    lines = engine_run(
        bursts(20, 8, every_s=3.0, spacing_s=0.05),
        gateway_slots=8,
        engine_slots=4,
        prefill_s=0.1,
        decode_s=1.0,
    )
    lines += [
        line | {"lane": "storms", "backend": line["backend"] and "b1"} for line in storm_log()
    ]
    log = write_log(tmp_path / "gw.log", lines)
    out = tmp_path / "report.html"
    code, _, _ = run_cli([str(log), "--html", str(out), "--tail-percent", "10"], capsys)
    assert code == 0
    page = out.read_text()
    # the cards: the engine queue with its figure, and the storm as a verdict of its own
    assert '<div class="verdict">engine-queue-bound</div>' in page
    assert "lower max_concurrency (b0: 8 → 4)" in page
    assert "none queued in the engine at ≤ 4 in flight, queued from 5: max_concurrency = 4." in page
    slots = page[page.index('<h3 id="engine-slots">') :]
    assert (
        "<tr><td>b0</td><td>160</td><td>8</td><td>5</td><td><b>4</b></td>"
        "<td class=text>1: 0/20, 2: 0/20, 3: 0/20, 4: 0/20, 5: 20/20, 6: 20/20, 7: 20/20, "
        "8: 20/20</td>"
    ) in slots
    assert '<div class="verdict">retry storm</div>' in page
    assert "Faster than told: rush 30." in page
    # the per-percentile bars and the waterfall, with the four parts in their legends
    bands = page[page.index('id="bands"') :]
    assert all(f">{label}  n=" in bands for label in ("&lt;P50", "P50-P90", "P90-P99", "≥P99"))
    assert ">engine queue<" in page and ">prefill<" in page and ">decode<" in page
    # the retry panel: its chart and the clients that retried
    panel = page[page.index('<h2 id="retries-panel">Retries</h2>') :]
    assert 'id="retries"' in panel and "storm above 20%" in panel
    assert (
        "<tr><td>rush</td><td>40</td><td>30</td><td>75%</td><td>30</td><td>30</td>"
        "<td>100.0</td><td>3</td><td>20</td></tr>"
    ) in panel
    assert page.count("<svg") == 6
    assert_self_contained(page)


def assert_self_contained(page: str) -> None:
    """No script, stylesheet, image or font is fetched from anywhere."""
    assert "<script" not in page.lower()
    assert not re.search(r"<link\b", page, re.I)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert not re.search(r"@import|url\(\s*['\"]?\s*(https?:)?//", page, re.I)
    # Every id is unique: several inline SVGs share one document.
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids))
