"""The `loadgen` command line: two targets side by side, a closed loop from a mix file, bad flags."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest

from gateway.tools.loadgen import (
    add_arguments,
    main,
)
from tests.conftest import StartSimulator


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


async def test_main_two_targets_tables_and_json(
    start_simulator_at: StartSimulator, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = await start_simulator_at(), await start_simulator_at()
    out = tmp_path / "run.json"
    args = parse(
        ["--target", first, "--target", second, "--rate", "4", "--duration", "1.5"]
        + ["--class", "short:0.7:40-60:8", "--class", "long:0.3:500-700:16"]
        + ["--seed", "3", "--json", str(out), "--no-progress"]
    )
    # main() runs its own event loop: give it a thread while the simulators serve here.
    assert await asyncio.to_thread(main, args) == 0

    printed = capsys.readouterr().out
    assert f"== [1] {first}" in printed and f"== [2] {second}" in printed
    assert "side by side [1] vs [2]" in printed
    assert max(len(line) for line in printed.splitlines()) <= 100

    data = json.loads(out.read_text())
    assert data["params"]["seed"] == 3 and data["params"]["target"] == [first, second]
    assert [c["name"] for c in data["params"]["mix"]] == ["short", "long"]
    first_run, second_run = data["runs"]
    assert (first_run["target"], second_run["target"]) == (first, second)
    assert first_run["run_tag"] != second_run["run_tag"]
    planned_count = data["params"]["requests_planned"]
    for run in data["runs"]:
        assert len(run["results"]) == planned_count
        assert set(run["summary"]) <= {"short", "long", "all"}
        assert run["summary"]["all"]["ok"] == planned_count
        row = run["results"][0]
        for key in ("index", "cls", "scheduled_ms", "sent_ms", "status", "error_code", "ttft_ms"):
            assert key in row
        assert row["ok"] is True and row["attempts"] == 1
    # The same schedule on both targets.
    assert [(r["cls"], r["prompt_tokens"], r["scheduled_ms"]) for r in first_run["results"]] == [
        (r["cls"], r["prompt_tokens"], r["scheduled_ms"]) for r in second_run["results"]
    ]


async def test_main_closed_loop_with_a_mix_file(
    start_simulator_at: StartSimulator, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = await start_simulator_at()
    mix = tmp_path / "mix.toml"
    mix.write_text(
        '[[class]]\nname = "chat"\nshare = 1\nprompt_tokens = [20, 30]\nmax_tokens = 4\n'
    )
    args = parse(["--target", url, "--mix", str(mix), "--concurrency", "2", "--requests", "5"])
    assert await asyncio.to_thread(main, args) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"== {url}")
    assert any(
        line.startswith("chat") and line.split()[1:3] == ["5", "5"] for line in printed.splitlines()
    )


def test_main_refuses_bad_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(parse(["--mix", "x.toml", "--class", "a:1:5:5"])) == 2
    assert main(parse(["--rate", "0.001", "--duration", "0.01"])) == 2
    assert main(parse(["--trace", str(tmp_path / "missing.csv")])) == 2
    assert main(parse(["--json", str(tmp_path / "no" / "dir.json")])) == 2
    err = capsys.readouterr().err
    assert "not both" in err and "empty" in err and "no such directory" in err
