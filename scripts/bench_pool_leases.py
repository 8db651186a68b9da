#!/usr/bin/env python3
"""Slot leases per pool (#28): does a non-default model's engine get more than its slots
when two gateway replicas share one Redis?

Two simulators, each serving one model strictly (`alpha`: the default pool, long
answers; `beta`: another pool, short turns), with `max_batch` = the gateway's
`max_concurrency` = SLOTS, so every request over the slots waits FIFO inside the
engine (what the lanes exist to avoid). Two gateway processes with the same config
(`[redis]` on) in front of both; clients spread over the replicas, closed loops of
2 x SLOTS clients per model per replica, for `--seconds`.

Side by side in one run: this tree, and `--baseline REV` (default 51c7045, the last
revision before per-pool leases, where a non-default pool's slots were local to each
replica), each gateway run from its own files (`git archive`), alternating `--reps`
times. Figures per variant: each engine's own peak of requests
held at once (`/sim/stats` `in_flight_peak`; target ≤ SLOTS for both models), beta's
short P50/P99 TTFT and the answers' statuses per model.

    python scripts/bench_pool_leases.py                     # ~1 min
    python scripts/bench_pool_leases.py --seconds 5 --reps 1 --baseline ''   # this tree only
    python scripts/bench_pool_leases.py --json results/bench_pool_leases.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import (  # noqa: E402
    ROOT,
    Process,
    Tally,
    checkout,
    start_gateway,
    start_simulator,
    stream_chat,
)
from replica_fleet import Children, peaks, redis_binary, reset_peaks, wait_sims_idle  # noqa: E402

from gateway.tools.stats import percentile  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

SLOTS = 4
REPLICAS = 2
LONG = {"words": 200, "max_tokens": 96}
SHORT = {"words": 30, "max_tokens": 16}


async def closed_loops(
    replicas: list[Process], model: str, kind: dict[str, int], seconds: float
) -> Tally:
    """2 x SLOTS clients per replica, each sending one request after another."""
    tally, stop_at = Tally(), time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def client(url: str) -> None:
            while time.monotonic() < stop_at:
                if await stream_chat(session, url, model, kind, tally) != 200:
                    await asyncio.sleep(0.05)  # refused at once: do not spin

        await asyncio.gather(*(client(r.url) for r in replicas for _ in range(2 * SLOTS)))
    return tally


def gateway_toml(alpha: Process, beta: Process, redis_url: str, prefix: str) -> str:
    return "\n".join(
        [
            "[[backends]]", f'url = "{alpha.url}"', 'name = "alpha"', 'models = ["alpha"]',
            f"max_concurrency = {SLOTS}", "",
            "[[backends]]", f'url = "{beta.url}"', 'name = "beta"', 'models = ["beta"]',
            f"max_concurrency = {SLOTS}", "",
            "[redis]", f'url = "{redis_url}"', f'key_prefix = "{prefix}"', "",
        ]
    )  # fmt: skip


async def run_variant(
    name: str,
    source: Path,
    sims: list[Process],
    redis: RedisServer,
    children: Children,
    work: Path,
    seconds: float,
    rep: int,
) -> dict[str, Any]:
    alpha, beta = sims
    tag = f"{name.replace('@', '-')}-{rep}"
    toml = gateway_toml(alpha, beta, redis.url, f"bench{rep}{tag}")
    replicas = list(
        await asyncio.gather(
            *(
                start_gateway(
                    f"{tag}-r{i}", toml, work / f"{tag}-r{i}.toml", work / f"{tag}-r{i}.log",
                    source=source,
                )
                for i in range(REPLICAS)
            )
        )
    )  # fmt: skip
    children.add(*replicas)
    try:
        async with aiohttp.ClientSession() as session:
            await wait_sims_idle(session, sims)
            await reset_peaks(session, sims)
            a, b = await asyncio.gather(
                closed_loops(replicas, "alpha", LONG, seconds),
                closed_loops(replicas, "beta", SHORT, seconds),
            )
            peak = await peaks(session, sims)
    finally:
        children.stop(replicas)
    return {
        "variant": name,
        "rep": rep,
        "alpha_peak": peak["alpha"],
        "beta_peak": peak["beta"],
        "alpha_statuses": dict(sorted(a.statuses.items())),
        "beta_statuses": dict(sorted(b.statuses.items())),
        "beta_ttft_p50_ms": b.ms(50),
        "beta_ttft_p99_ms": b.ms(99),
        "beta_ttft_s": b.ttft_s,
    }


async def main(args: argparse.Namespace) -> int:
    binary = redis_binary()
    if binary is None:
        print("redis-server is not installed (Debian: apt-get install redis-server)")
        return 2
    children = Children()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-pool-leases-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        variants = [("this tree", ROOT)]
        if args.baseline:
            variants.append((f"@{args.baseline}", checkout(args.baseline, work / "baseline")))
        try:
            children.redis = RedisServer(binary)
            children.redis.start()
            flags = ["--strict-model", "--max-batch", str(SLOTS)]
            sims = list(
                await asyncio.gather(
                    start_simulator(["--model", "alpha", *flags], name="alpha"),
                    start_simulator(["--model", "beta", *flags], name="beta"),
                )
            )
            children.add(*sims)
            for rep in range(args.reps):
                for name, source in variants if rep % 2 == 0 else variants[::-1]:
                    result = await run_variant(
                        name, source, sims, children.redis, children, work, args.seconds, rep
                    )
                    results.append(result)
                    print(
                        f"  rep {rep} {name}: beta peak {result['beta_peak']}, "
                        f"alpha peak {result['alpha_peak']}",
                        flush=True,
                    )
        finally:
            children.stop_all()
    print(f"\nslots per backend {SLOTS} (engine max_batch {SLOTS}), {REPLICAS} replicas, "
          f"{args.seconds:g} s x {args.reps} rep(s) per variant")  # fmt: skip
    header = (
        f"{'variant':<16}{'beta peak':>10}{'alpha peak':>11}{'beta P50 ms':>12}"
        f"{'beta P99 ms':>12}  beta statuses / alpha statuses"
    )
    print(header)
    summary = []
    for name, _ in variants:
        mine = [r for r in results if r["variant"] == name]
        ttfts = [t for r in mine for t in r["beta_ttft_s"]]
        row = {
            "variant": name,
            "beta_peak": max(r["beta_peak"] for r in mine),
            "alpha_peak": max(r["alpha_peak"] for r in mine),
            "beta_ttft_p50_ms": _ms(percentile(ttfts, 50)),
            "beta_ttft_p99_ms": _ms(percentile(ttfts, 99)),
            "beta_statuses": _sum(r["beta_statuses"] for r in mine),
            "alpha_statuses": _sum(r["alpha_statuses"] for r in mine),
        }
        summary.append(row)
        print(
            f"{name:<16}{row['beta_peak']:>10}{row['alpha_peak']:>11}"
            f"{_fmt(row['beta_ttft_p50_ms']):>12}{_fmt(row['beta_ttft_p99_ms']):>12}  "
            f"{row['beta_statuses']} / {row['alpha_statuses']}"
        )
    ok = summary[0]["beta_peak"] <= SLOTS and summary[0]["alpha_peak"] <= SLOTS
    print(f"\nthis tree: both engines within their {SLOTS} slots across replicas: {ok}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        for r in results:
            r.pop("beta_ttft_s")
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": results}, indent=2))
    return 0 if ok else 1


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 1)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _sum(dicts: Any) -> dict[int, int]:
    total: dict[int, int] = {}
    for each in dicts:
        for key, n in each.items():
            total[key] = total.get(key, 0) + n
    return dict(sorted(total.items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="load per variant and rep")
    parser.add_argument("--reps", type=int, default=2, help="alternating rounds per variant")
    parser.add_argument(
        "--baseline", default="51c7045", help="a git revision to run side by side ('': none)"
    )
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--keep", help="a directory to keep the configs and logs in")
    sys.exit(asyncio.run(main(parser.parse_args())))
