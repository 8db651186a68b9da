"""Replay's sources: the Azure trace CSV and our own request log become the same arrivals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.tools.replay.sources import load_source, time_slice


def test_azure_csv_rows_become_arrivals_from_the_first(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:45.6805900,0,0\n"
    )
    arrivals = load_source(path).arrivals
    assert [round(a.at_s, 3) for a in arrivals] == [0.0, 1.0, 5.315]
    assert [(a.prompt_tokens, a.max_tokens) for a in arrivals] == [(1, 1), (374, 44), (396, 109)]
    assert all(a.lane is None for a in arrivals)


def test_our_log_arrival_is_its_end_minus_e2e_and_it_carries_engine_figures(
    tmp_path: Path,
) -> None:
    lines = [
        {"timestamp": "2026-12-03T07:00:02.000Z", "e2e_ms": 2000.0, "prompt_tokens": 1000,
         "completion_tokens": 50, "max_tokens": 256, "lane": "bulk", "tpot_ms": 9.0,
         "prefill_ms": 400.0},
        {"timestamp": "2026-12-03T07:00:01.500Z", "e2e_ms": 500.0, "prompt_tokens": 20,
         "completion_tokens": None, "max_tokens": 64, "lane": "interactive", "tpot_ms": 11.0,
         "prefill_ms": 30.0},
        {"level": "warning", "event": "lane_override_ignored"},
    ]  # fmt: skip
    path = tmp_path / "gateway.log"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\nnot json\n")
    source = load_source(path)
    assert [(a.at_s, a.prompt_tokens, a.max_tokens, a.lane) for a in source.arrivals] == [
        (0.0, 1000, 50, "bulk"),
        (1.0, 20, 64, "interactive"),
    ]
    assert source.tpot_ms == 10.0
    assert source.prefill_ms_per_token == 0.4  # only prompts of 256+ tokens teach the rate


def test_a_malformed_json_line_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "gateway.log"
    path.write_text('{"prompt_tokens": 1, "timestamp": "2026-12-03T07:00:00Z"}\n{"broken\n')
    with pytest.raises(ValueError, match="line 2"):
        load_source(path)


def test_a_slice_is_rebased_to_its_start() -> None:
    from gateway.tools.replay.sources import Arrival

    arrivals = [Arrival(float(t), 10, 10) for t in range(10)]
    cut = time_slice(arrivals, 3.0, 4.0)
    assert [a.at_s for a in cut] == [0.0, 1.0, 2.0, 3.0]
