"""Named mixes: `--mix prefill-heavy` or `--mix default` wherever a mix file is accepted."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import pytest

from gateway.config import default_lanes
from gateway.tools.loadgen import (
    DEFAULT_MIX,
    NAMED_MIXES,
    PREFILL_HEAVY_MIX,
    TrafficClass,
    add_arguments,
    closed_schedule,
    load_mix,
    main,
    parse_class,
    poisson_schedule,
    resolve_mix,
)


def test_named_mixes_resolve_and_files_still_do(tmp_path: Path) -> None:
    assert set(NAMED_MIXES) == {"default", "prefill-heavy"}
    assert resolve_mix("default") == DEFAULT_MIX
    assert resolve_mix("prefill-heavy") == PREFILL_HEAVY_MIX
    resolve_mix("default").append(TrafficClass("x", 1, (1, 1), 1))  # a copy: no harm done
    assert len(resolve_mix("default")) == len(DEFAULT_MIX)
    path = tmp_path / "mix.toml"
    path.write_text('[[class]]\nname = "chat"\nshare = 1\nprompt_tokens = 20\nmax_tokens = 4\n')
    assert resolve_mix(str(path)) == [TrafficClass("chat", 1.0, (20, 20), 4)]
    with pytest.raises(ValueError, match="prefill-heavy"):
        resolve_mix(str(tmp_path / "missing.toml"))
    with pytest.raises(ValueError, match="neither a mix file nor a named mix"):
        resolve_mix("prefil-heavy")


def test_prefill_heavy_is_code_completion_like() -> None:
    short, long_ = (next(c for c in PREFILL_HEAVY_MIX if c.name == n) for n in ("short", "long"))
    first_lane = default_lanes()[0]
    assert first_lane.max_prompt_tokens is not None
    # One class, one lane: the short class fits the first default lane, the long one does not.
    assert short.prompt_tokens[1] <= first_lane.max_prompt_tokens < long_.prompt_tokens[0]
    schedule = closed_schedule(PREFILL_HEAVY_MIX, 2000, seed=4)
    prompts = [p.prompt_tokens for p in schedule]
    outputs = [p.max_tokens for p in schedule]
    assert 0.20 <= sum(p.cls == "short" for p in schedule) / len(schedule) <= 0.30
    assert sum(1000 <= p <= 5000 for p in prompts) / len(prompts) >= 0.7  # most prompts
    assert sum(p > 1024 for p in prompts) / len(prompts) >= 0.6  # as in the trace
    assert 1000 <= statistics.median(prompts) <= 3000
    assert max(outputs) < 60 + 1 and min(outputs) >= 8
    assert statistics.median(outputs) < 40
    assert len(set(outputs)) > 20  # drawn per request, not one fixed value
    for p in schedule:
        cls = short if p.cls == "short" else long_
        assert cls.prompt_tokens[0] <= p.prompt_tokens <= cls.prompt_tokens[1]
        low, high = cls.max_tokens_bounds
        assert low <= p.max_tokens <= high


def test_output_ranges_from_flags_and_toml(tmp_path: Path) -> None:
    assert parse_class("s:1:50-400:8-32") == TrafficClass("s", 1.0, (50, 400), (8, 32))
    assert parse_class("s:1:50:8").max_tokens_bounds == (8, 8)
    for bad in ("s:1:50:32-8", "s:1:50:0-8", "s:1:50:8-x"):
        with pytest.raises(ValueError):
            parse_class(bad)
    with pytest.raises(ValueError, match="max_tokens"):
        TrafficClass("s", 1, (5, 5), (9, 3))
    path = tmp_path / "mix.toml"
    path.write_text(
        '[[class]]\nname = "c"\nshare = 1\nprompt_tokens = [10, 20]\nmax_tokens = [8, 60]\n'
    )
    assert load_mix(path) == [TrafficClass("c", 1.0, (10, 20), (8, 60))]
    path.write_text('[[class]]\nname = "c"\nshare = 1\nprompt_tokens = 5\nmax_tokens = [8]\n')
    with pytest.raises(ValueError, match="max_tokens"):
        load_mix(path)


def test_a_fixed_output_mix_keeps_its_schedule() -> None:
    """Drawing output lengths only for ranges leaves every existing seeded schedule as it was."""
    fixed = poisson_schedule(DEFAULT_MIX, rate=20, duration_s=5, seed=7)
    as_ranges = [
        TrafficClass(c.name, c.share, c.prompt_tokens, c.max_tokens_bounds) for c in DEFAULT_MIX
    ]
    assert poisson_schedule(as_ranges, rate=20, duration_s=5, seed=7) == fixed
    assert poisson_schedule(PREFILL_HEAVY_MIX, 20, 5, 7) == poisson_schedule(
        PREFILL_HEAVY_MIX, 20, 5, 7
    )


def test_loadgen_cli_accepts_a_named_mix(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    # An unreachable target would take a while; a bad name stops at the flags (exit 2).
    assert main(parser.parse_args(["--mix", "no-such-mix"])) == 2
    assert "named mix (default, prefill-heavy)" in capsys.readouterr().err
    from gateway.tools.loadgen.cli import _mix

    assert _mix(parser.parse_args(["--mix", "prefill-heavy"])) == PREFILL_HEAVY_MIX
    assert _mix(parser.parse_args(["--mix", "default"])) == DEFAULT_MIX
