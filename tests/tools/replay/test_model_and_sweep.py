"""Replay's load scaling and the sweep's search for the smallest fleet."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.tools.replay.model import (
    capacity_rps,
    request_cost_ms,
    scaled,
    source_rps,
    speed_for_load,
)
from gateway.tools.replay.report import smallest_fleet
from gateway.tools.replay.sources import Arrival
from gateway.tools.simulator.config import SimulatorConfig


def test_a_request_costs_its_prefill_and_its_share_of_full_batch_decode() -> None:
    config = SimulatorConfig(max_batch=8, step_base_ms=5.0, prefill_ms_per_token=0.5,
                             decode_ms_per_seq=0.5)  # fmt: skip
    # 1000 x 0.5 ms prefill + 100 x (0.5 + 5/8) ms decode
    assert request_cost_ms(Arrival(0.0, 1000, 100), config) == pytest.approx(612.5)
    assert capacity_rps([Arrival(0.0, 1000, 100)], config, 2) == pytest.approx(2000 / 612.5)


def test_load_scaling_offers_the_asked_multiple_of_capacity() -> None:
    config = SimulatorConfig()
    arrivals = [Arrival(float(t), 500, 200) for t in range(101)]  # 101 over 100 s
    factor = speed_for_load(arrivals, config, 3, 1.2)
    faster = scaled(arrivals, factor)
    assert source_rps(faster) == pytest.approx(1.2 * capacity_rps(arrivals, config, 3))
    assert [a.prompt_tokens for a in faster] == [500] * 101
    with pytest.raises(ValueError):
        scaled(arrivals, 0.0)


@pytest.mark.parametrize("needed", [1, 2, 3, 5, 17, 64])
def test_the_sweep_finds_the_fewest_backends_and_tries_few(needed: int) -> None:
    tried: list[int] = []

    def meets(n: int) -> bool:
        tried.append(n)
        return n >= needed

    assert smallest_fleet(meets, 1, 64) == needed
    assert len(tried) <= 14
    assert all(n <= 64 for n in tried)


def test_the_sweep_says_none_when_even_the_most_misses() -> None:
    assert smallest_fleet(lambda n: False, 1, 8) is None


def test_with_model_pools_each_pools_capacity_is_said_apart(tmp_path: Path) -> None:
    """Two models on a backend each: what each pool sustains of its own requests (the
    sum over both backends said "2 backends sustain 4.05/s" of a two-model mix)."""
    from gateway.config import load_settings
    from gateway.tools.replay.cli import pool_lines

    config = tmp_path / "gateway.toml"
    config.write_text(
        '[[backends]]\nurl = "http://a.invalid"\nmodels = ["chat"]\n\n'
        '[[backends]]\nurl = "http://b.invalid"\nmodels = ["code"]\n'
    )
    arrivals = [Arrival(i * 0.1, 50, 32, model="chat") for i in range(30)]
    arrivals += [Arrival(i * 0.5, 3000, 256, model="code") for i in range(6)]
    arrivals += [Arrival(1.0, 10, 10, model="nobody")]
    lines = pool_lines(
        sorted(arrivals, key=lambda a: a.at_s), load_settings(config), SimulatorConfig()
    )
    assert len(lines) == 3
    chat = next(line for line in lines if "30 requests" in line)
    code = next(line for line in lines if "6 requests" in line)
    assert "1 backends sustain" in chat and "1 backends sustain" in code
    rate = lambda line: float(line.split("sustain ")[1].split("/s")[0])  # noqa: E731
    assert rate(chat) > 5 * rate(code)  # short chat turns against long code prompts
    assert "1 requests name a model no pool serves" in lines[-1]
