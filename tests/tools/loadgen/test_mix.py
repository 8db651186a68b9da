"""Traffic classes and seeded schedules: same seed same schedule, shares, arrivals, traces."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from gateway.tools.loadgen import (
    DEFAULT_MIX,
    TrafficClass,
    closed_schedule,
    load_mix,
    parse_class,
    poisson_schedule,
    trace_schedule,
)
from tests.tools.loadgen.support import gateway_count

REPO_ROOT = Path(__file__).resolve().parents[3]
AZURE_TRACE = REPO_ROOT.parent / "shared" / "data" / "AzureLLMInferenceTrace_conv.csv"


def test_same_seed_same_schedule() -> None:
    first = poisson_schedule(DEFAULT_MIX, rate=20, duration_s=5, seed=7)
    closed_schedule([TrafficClass("huge", 1, (20_000, 20_000), 1)], 1, 0)  # another text size
    again = poisson_schedule(DEFAULT_MIX, rate=20, duration_s=5, seed=7)
    other = poisson_schedule(DEFAULT_MIX, rate=20, duration_s=5, seed=8)
    assert first == again
    assert [p.at_s for p in first] != [p.at_s for p in other]
    assert closed_schedule(DEFAULT_MIX, 50, 3) == closed_schedule(DEFAULT_MIX, 50, 3)
    assert all(p.at_s == 0 for p in closed_schedule(DEFAULT_MIX, 5, 3))


def test_shares_follow_the_mix() -> None:
    schedule = closed_schedule(DEFAULT_MIX, 1000, seed=11)
    short = sum(p.cls == "short" for p in schedule) / len(schedule)
    assert 0.75 <= short <= 0.85  # binomial sd ~0.013
    for p in schedule:
        cls = next(c for c in DEFAULT_MIX if c.name == p.cls)
        assert cls.prompt_tokens[0] <= p.prompt_tokens <= cls.prompt_tokens[1]
        assert p.max_tokens == cls.max_tokens
    assert [p.index for p in schedule] == list(range(1000))


def test_poisson_inter_arrival_mean() -> None:
    rate = 50.0
    schedule = poisson_schedule([TrafficClass("a", 1, (10, 20), 4)], rate, 40.0, seed=5)
    assert 1600 <= len(schedule) <= 2400
    times = [p.at_s for p in schedule]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 40.0
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(1 / rate, rel=0.15)
    # Exponential gaps: the standard deviation is about the mean, unlike a fixed pace.
    assert statistics.stdev(gaps) == pytest.approx(1 / rate, rel=0.25)


def test_mix_from_flags_and_toml(tmp_path: Path) -> None:
    assert parse_class("short:0.8:40-60:64") == TrafficClass("short", 0.8, (40, 60), 64)
    assert parse_class("x:1:100:8") == TrafficClass("x", 1.0, (100, 100), 8)
    for bad in ("short:0.8:40-60", "s:0:40-60:64", "s:1:60-40:64", "s:1:a-b:64", "s:1:5:0"):
        with pytest.raises(ValueError):
            parse_class(bad)
    path = tmp_path / "mix.toml"
    path.write_text(
        '[[class]]\nname = "chat"\nshare = 3\nprompt_tokens = [10, 20]\nmax_tokens = 32\n'
        '[[class]]\nname = "rag"\nshare = 1\nprompt_tokens = 2000\nmax_tokens = 128\n'
    )
    assert load_mix(path) == [
        TrafficClass("chat", 3.0, (10, 20), 32),
        TrafficClass("rag", 1.0, (2000, 2000), 128),
    ]
    path.write_text('[[class]]\nname = "chat"\nshare = 1\nprompt_tokens = "big"\nmax_tokens = 3\n')
    with pytest.raises(ValueError, match="prompt_tokens"):
        load_mix(path)


def write_trace(path: Path, rows: list[tuple[str, int, int]]) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"{stamp},{ctx},{gen}" for stamp, ctx, gen in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_trace_schedule(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "trace.csv",
        [
            ("2023-11-16 18:15:46.6805900", 1024, 256),  # the first lane's limits: short
            ("2023-11-16 18:15:48.6805900", 1025, 10),  # prompt over: long
            ("2023-11-16 18:15:50.1805900", 100, 257),  # output over: long
            ("2023-11-16 18:15:56.6805900", 3000, 0),
        ],
    )
    schedule = trace_schedule(path, speedup=2.0, prompt_scale=1.0, output_scale=1.0)
    assert [p.at_s for p in schedule] == pytest.approx([0.0, 1.0, 1.75, 5.0])
    assert [p.cls for p in schedule] == ["short", "long", "long", "long"]
    assert [p.prompt_tokens for p in schedule] == [1024, 1025, 100, 3000]
    assert [p.max_tokens for p in schedule] == [256, 10, 257, 1]  # at least one token
    assert gateway_count(schedule[1].prompt) == 1025

    scaled = trace_schedule(
        path, speedup=1.0, prompt_scale=0.5, output_scale=0.1, start=1, limit=2, seed=3
    )
    assert [p.at_s for p in scaled] == pytest.approx([0.0, 1.5])  # from the window's first row
    assert [(p.prompt_tokens, p.max_tokens) for p in scaled] == [(512, 1), (50, 26)]
    assert [p.cls for p in scaled] == ["short", "short"]

    (tmp_path / "bad.csv").write_text("time,ctx\n1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        trace_schedule(tmp_path / "bad.csv", speedup=1, prompt_scale=1, output_scale=1)


@pytest.mark.skipif(not AZURE_TRACE.exists(), reason="the Azure trace is not next to the repo")
def test_azure_trace_smoke() -> None:
    schedule = trace_schedule(
        AZURE_TRACE, speedup=10.0, prompt_scale=1.0, output_scale=1.0, start=100, limit=200
    )
    assert len(schedule) == 200
    times = [p.at_s for p in schedule]
    assert times[0] == 0.0 and times == sorted(times) and times[-1] < 100.0
    assert {p.cls for p in schedule} == {"short", "long"}
    for p in schedule[:20]:
        assert gateway_count(p.prompt) == p.prompt_tokens
