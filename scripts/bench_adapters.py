#!/usr/bin/env python3
"""LoRA adapters on two simulators: model-blind routing vs adapter-aware routing.

Issue #28's proof for adapters. Two simulators serve the same four adapters
(`--lora-adapters a1,a2,a3,a4`) on one base model with `--max-lora 2` (two
distinct adapters per batch, two loaded at once, as vLLM's `--max-loras 2`) and a
swap cost (`--lora-swap-ms`, the time a step takes longer when it loads an adapter
that is not loaded). One gateway process (`python -m gateway serve`) sits in front
of them, in two configurations:

  model-blind    [routing] adapter_affinity = false: adapters balanced by load alone
  adapter-aware  the default config: an adapter's requests go where it runs

Each gets the same seeded open-loop load (Poisson arrivals, each request naming one
of the four adapters uniformly, streamed completions), interleaved
(blind, aware, aware, blind, ... with `--reps`), with simulators and gateway started
anew for every run so each begins with nothing loaded. Figures: the swaps both
simulators counted (`/sim/stats` `lora_swaps`), client-side TTFT (send to the first
token) P50/P99, and requests per second. Targets: swaps at least halved, TTFT P50
and P99 no worse (within `--tolerance`).

    python scripts/bench_adapters.py                # 2 reps x 2 configs x 20 s, ~2 min
    python scripts/bench_adapters.py --seconds 10 --reps 1
    python scripts/bench_adapters.py --json results/bench_adapters.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import Process, start_gateway, start_simulator  # noqa: E402

from gateway.tools.stats import percentile  # noqa: E402

BLIND, AWARE = "model-blind", "adapter-aware"
ADAPTERS = ("a1", "a2", "a3", "a4")
#: The simulators' knobs: an 8-place batch, two adapters per batch, a 30 ms load.
SIM_FLAGS = (
    "--model", "base",
    "--lora-adapters", ",".join(ADAPTERS),
    "--max-lora", "2",
    "--lora-swap-ms", "30",
    "--max-batch", "8",
)  # fmt: skip


@dataclass
class Run:
    config: str
    ttft_s: list[float] = field(default_factory=list)
    errors: int = 0
    swaps: int = 0
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "requests": len(self.ttft_s),
            "errors": self.errors,
            "lora_swaps": self.swaps,
            "ttft_p50_ms": _ms(percentile(self.ttft_s, 50)),
            "ttft_p99_ms": _ms(percentile(self.ttft_s, 99)),
            "requests_per_s": round(len(self.ttft_s) / self.seconds, 2) if self.seconds else 0,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)


def gateway_toml(backends: list[Process], config: str) -> str:
    """The default config but for the backends; adapter routing off for the blind one."""
    lines = ["[routing]", "adapter_affinity = false", ""] if config == BLIND else []
    for backend in backends:
        lines += ["[[backends]]", f'url = "{backend.url}"', f'name = "{backend.name}"', ""]
    return "\n".join(lines)


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    adapter: str,
    max_tokens: int,
    number: int,
    run: Run,
) -> None:
    # A prompt of its own, not the adapter's: no backend's prefix cache gives the blind
    # config a reason to keep an adapter's requests together.
    body = {
        "model": adapter,
        "prompt": f"Request {number}: write about something. " * 20,
        "max_tokens": max_tokens,
        "stream": True,
    }
    start = time.monotonic()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                run.errors += 1
                await resp.read()
                return
            first = None
            async for line in resp.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.monotonic() - start
            if first is None:
                run.errors += 1
            else:
                run.ttft_s.append(first)
    except aiohttp.ClientError:
        run.errors += 1


async def load(url: str, args: argparse.Namespace, run: Run) -> None:
    """Open-loop Poisson arrivals for `args.seconds`, the same sequence in every run."""
    rng = random.Random(args.seed)
    tasks = []
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        at = 0.0
        while at < args.seconds:
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            adapter = rng.choice(ADAPTERS)
            max_tokens = rng.randint(16, 64)
            number = len(tasks)
            tasks.append(
                asyncio.create_task(one_request(session, url, adapter, max_tokens, number, run))
            )
            at += rng.expovariate(args.rate)
        await asyncio.gather(*tasks)
    run.seconds = time.monotonic() - start


async def run_config(config: str, args: argparse.Namespace, work: Path, index: int) -> Run:
    run = Run(config)
    sims: list[Process] = []
    gateway: Process | None = None
    try:
        for number in range(2):
            sim = await start_simulator(SIM_FLAGS, name=f"sim{number}")
            sims.append(sim)
        stem = f"run{index}-{config}"
        gateway = await start_gateway(
            config, gateway_toml(sims, config), work / f"{stem}.toml", work / f"{stem}.log"
        )
        await asyncio.sleep(args.settle)  # the first checks: which adapters each lists
        await load(gateway.url, args, run)
        async with aiohttp.ClientSession() as session:
            for sim in sims:
                async with session.get(sim.url + "/sim/stats") as resp:
                    run.swaps += (await resp.json())["lora_swaps"]
    finally:
        if gateway is not None:
            gateway.stop()
        for sim in sims:
            sim.stop()
    return run


def pooled(runs: list[Run], config: str) -> Run:
    total = Run(config)
    for run in runs:
        if run.config == config:
            total.ttft_s += run.ttft_s
            total.errors += run.errors
            total.swaps += run.swaps
            total.seconds += run.seconds
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="load per run (20)")
    parser.add_argument("--reps", type=int, default=2, help="runs of each config (2)")
    parser.add_argument("--rate", type=float, default=12.0, help="requests per second (12)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--settle", type=float, default=1.0, help="wait before the load (1 s)")
    parser.add_argument("--tolerance", type=float, default=0.05, help="TTFT noise allowed")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    order = [BLIND, AWARE, AWARE, BLIND] * args.reps
    order = order[: 2 * args.reps]

    async def everything() -> list[Run]:
        with tempfile.TemporaryDirectory(prefix="bench_adapters.") as tmp:
            return [
                await run_config(config, args, Path(tmp), index)
                for index, config in enumerate(order)
            ]

    runs = asyncio.run(everything())
    blind, aware = pooled(runs, BLIND).summary(), pooled(runs, AWARE).summary()
    keys = ["requests", "errors", "lora_swaps", "ttft_p50_ms", "ttft_p99_ms", "requests_per_s"]
    print(f"{'':16}" + "".join(f"{k:>16}" for k in keys))
    for row in (blind, aware):
        print(f"{row['config']:16}" + "".join(f"{str(row[k]):>16}" for k in keys))
    swap_ratio = aware["lora_swaps"] / blind["lora_swaps"] if blind["lora_swaps"] else None
    checks = {
        "swaps at least halved": swap_ratio is not None and swap_ratio <= 0.5,
        "TTFT P50 no worse": aware["ttft_p50_ms"] <= blind["ttft_p50_ms"] * (1 + args.tolerance),
        "TTFT P99 no worse": aware["ttft_p99_ms"] <= blind["ttft_p99_ms"] * (1 + args.tolerance),
        "no errors": aware["errors"] == 0 and blind["errors"] == 0,
    }
    print(f"\nswaps aware/blind: {swap_ratio if swap_ratio is None else round(swap_ratio, 3)}")
    print(
        "TTFT P50 aware/blind: "
        f"{aware['ttft_p50_ms'] / blind['ttft_p50_ms']:.2f}, P99: "
        f"{aware['ttft_p99_ms'] / blind['ttft_p99_ms']:.2f}"
    )
    for name, ok in checks.items():
        print(f"  {'PASS' if ok else 'MISS'}  {name}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "pooled": [blind, aware],
            "runs": [run.summary() for run in runs],
            "checks": checks,
        }
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
