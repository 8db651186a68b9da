"""`analyze` splits its tables by model when the log holds several: each has its own verdict."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.tools.analyze import analyze
from gateway.tools.analyze.models import NO_MODEL, model_of
from gateway.tools.analyze.report_text import format_report
from tests.tools.analyze.support import rec, run_cli


def with_model(lines: list[dict[str, Any]], model: str, pool: str) -> list[dict[str, Any]]:
    return [{**line, "model": model, "pool": pool} for line in lines]


def two_models() -> list[dict[str, Any]]:
    """`chat` (an alias of `llama-3`) whose slowest waited in the queue; `code` whose slowest
    was slow in the model."""
    chat = [rec(queue=1.0, backend=10.0) for _ in range(99)] + [rec(queue=4000.0, backend=50.0)]
    code = [rec(queue=1.0, backend=10.0) for _ in range(49)] + [rec(queue=2.0, backend=3000.0)]
    return with_model(chat, "chat", "llama-3") + with_model(code, "code", "code")


def test_each_model_gets_its_own_lanes_and_verdict() -> None:
    models = analyze(two_models())["models"]
    assert list(models) == ["chat", "code"]  # most requests first
    assert models["chat"]["requests"] == 100 and models["chat"]["pools"] == {"llama-3": 100}
    assert models["chat"]["lanes"]["interactive"]["tail"]["verdict"] == "queueing"
    assert models["code"]["lanes"]["interactive"]["tail"]["verdict"] == "backend"


def test_the_text_report_has_a_row_per_model_and_lane() -> None:
    text = format_report(analyze(two_models()))
    rows = text.split("PER MODEL (2 models", 1)[1].splitlines()
    chat = next(row for row in rows if row.strip().startswith("chat → llama-3"))
    code = next(row for row in rows if row.strip().startswith("code"))
    assert chat.split()[-1] == "queueing" and "interactive" in chat and " 100 " in chat
    assert code.split()[-1] == "backend" and "code →" not in code  # its pool is its name


@pytest.mark.parametrize("names", [["m"], ["m", None]])
def test_a_log_of_one_model_keeps_its_shape(names: list[str | None]) -> None:
    lines = [rec(model=name) for name in names for _ in range(5)]
    analysis = analyze(lines)
    assert "models" not in analysis
    assert "PER MODEL" not in format_report(analysis)


def test_a_line_without_a_model_is_grouped_apart() -> None:
    assert model_of({"model": None}) == NO_MODEL and model_of({"model": 7}) == NO_MODEL
    lines = with_model([rec()], "a", "a") + with_model([rec()], "b", "b") + [rec(model=None)]
    assert list(analyze(lines)["models"]) == ["a", "b", NO_MODEL]


def test_the_html_report_has_a_per_model_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    log = tmp_path / "gw.log"
    log.write_text("".join(json.dumps(line) + "\n" for line in two_models()))
    out = tmp_path / "report.html"
    code, _, _ = run_cli([str(log), "--html", str(out)], capsys)
    assert code == 0
    panel = out.read_text().split('<h2 id="models-panel">Per model</h2>', 1)[1]
    assert "<td class='text'>chat</td><td class='text'>llama-3</td>" in panel
    assert "<td class='text'>interactive</td><td>100</td><td>100</td>" in panel
    assert "<td class='text'>queueing</td>" in panel and "<td class='text'>backend</td>" in panel
