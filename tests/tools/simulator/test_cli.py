"""The simulator's command line: one flag per knob, and a process that stops cleanly on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from gateway.tools.simulator import SimulatorConfig, add_arguments, config_from_args

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_cli_flags_cover_every_knob():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--max-batch", "3", "--prefill-tokens-per-step", "64", "--step-base-ms", "2.5",
         "--port", "0", "--model", "x"]
    )  # fmt: skip
    config = config_from_args(args)
    assert (config.max_batch, config.prefill_tokens_per_step, config.step_base_ms) == (3, 64, 2.5)
    assert config.model == "x"
    assert config.decode_ms_per_seq == SimulatorConfig().decode_ms_per_seq
    assert (args.host, args.port) == ("127.0.0.1", 0)
    with pytest.raises(ValueError):
        config_from_args(parser.parse_args(["--max-batch", "0"]))


def test_prefix_cache_flags():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    default = config_from_args(parser.parse_args([]))
    assert (default.prefix_cache, default.block_tokens, default.prefix_cache_blocks) == (
        True,
        16,
        16384,
    )
    args = ["--no-prefix-cache", "--block-tokens", "32", "--prefix-cache-blocks", "100"]
    config = config_from_args(parser.parse_args(args))
    assert (config.prefix_cache, config.block_tokens, config.prefix_cache_blocks) == (
        False,
        32,
        100,
    )
    assert config_from_args(parser.parse_args(["--prefix-cache"])).prefix_cache is True
    with pytest.raises(ValueError):
        config_from_args(parser.parse_args(["--block-tokens", "0"]))


async def test_cli_main_serves_until_sigterm(session: aiohttp.ClientSession):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.tools.simulator", "--port", "0", "--max-batch", "2",
        stdout=asyncio.subprocess.PIPE, cwd=REPO_ROOT, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()
        assert "listening on http://127.0.0.1:" in line
        url = line.split()[3]
        async with session.get(f"{url}/health") as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_timings_flag():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).timings == "vllm"
    assert config_from_args(parser.parse_args(["--timings", "llamacpp"])).timings == "llamacpp"
    with pytest.raises(ValueError, match="timings must be one of vllm, llamacpp, none"):
        config_from_args(parser.parse_args(["--timings", "sometimes"]))
