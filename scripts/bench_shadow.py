#!/usr/bin/env python3
"""Shadow traffic at 100%: is the primary's short-lane P99 TTFT unchanged?

Issue #12's target: "the primary's P99 is unchanged with shadowing at 100%". One
simulator is the primary, a second one (same knobs, another seed and model name)
the candidate, and two gateway processes sit in front of the primary:

  off   the default config, no [shadow]
  on    the same plus [shadow] url = the candidate, sample_rate = 1.0

Both get the same seeded Poisson schedule of the mixed load (the load generator's
default mix: 80% short, 20% long) at a share of the primary's measured capacity, in
alternating repetitions (off, on, on, off, off, on, ...) so that whatever else this
2-core machine is doing lands on both alike. It prints, per run and pooled per
configuration, the primary's short-lane ("interactive") P50/P99 TTFT as the client
saw it and the ratio on/off, plus what the shadow did in the "on" runs (mirrored,
dropped by reason, errors; from gateway_shadow_requests_total) and the median
candidate/primary TTFT ratio from its `shadow_compared` lines.

The candidate runs on the same machine, so in the "on" runs it competes with the
primary and the gateway for the same two cores; on real hardware it would not. The
ratio is therefore an upper bound of what mirroring costs the primary.

    python scripts/bench_shadow.py                   # 3 x 2 runs of 30 s, ~4 min
    python scripts/bench_shadow.py --duration 10 --reps 1 --capacity 8   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from benchlib import ROOT, Process, start_gateway, start_simulator

sys.path.insert(0, str(ROOT))

from bench_tail import fmt, measure_capacity  # noqa: E402

from gateway.tools.loadgen import (  # noqa: E402
    NAMED_MIXES,
    RunResult,
    closed_schedule,
    poisson_schedule,
    resolve_mix,
    run_open_loop,
)
from gateway.tools.simulator import SimulatorConfig  # noqa: E402
from gateway.tools.stats import percentile  # noqa: E402

SHORT_LANE = "interactive"
CONFIGS = ("off", "on")
_SHADOW_SAMPLE = re.compile(r'^gateway_shadow_requests_total\{result="(\w+)"\} (\S+)$', re.M)


def gateway_config(primary: str, slots: int, shadow: str | None) -> str:
    """The default config but for the backend (and, for "on", the [shadow] table)."""
    text = f'[[backends]]\nurl = "{primary}"\nname = "primary"\nmax_concurrency = {slots}\n'
    if shadow is not None:
        text = (
            f'[shadow]\nurl = "{shadow}"\nname = "candidate"\nmodel = "candidate"\n'
            "sample_rate = 1.0\n\n" + text
        )
    return text


async def shadow_counts(url: str) -> dict[str, float]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
        session.get(url + "/metrics") as resp,
    ):
        text = await resp.text()
    return {result: float(value) for result, value in _SHADOW_SAMPLE.findall(text)}


def short_ttfts(run: RunResult) -> list[float]:
    return [
        r.ttft_ms for r in run.results if r.lane == SHORT_LANE and r.ok and r.ttft_ms is not None
    ]


def figures(ttfts: list[float], run: RunResult | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "short_ok": len(ttfts),
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
    }
    if run is not None:
        out["requests"] = len(run.results)
        out["failed"] = sum(not r.ok for r in run.results)
    return out


def compared_lines(events_path: Path) -> list[dict[str, Any]]:
    lines = []
    for line in events_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"shadow_compared"' in line:
            lines.append(json.loads(line))
    return lines


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mix", default="default", help=f"a named mix ({', '.join(NAMED_MIXES)}) or a TOML file"
    )
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals (30)")
    parser.add_argument("--reps", type=int, default=3, help="runs per configuration (3)")
    parser.add_argument("--load", type=float, default=0.6, help="share of capacity (0.6)")
    parser.add_argument("--capacity", type=float, help="req/s of the primary; skips calibration")
    parser.add_argument("--calibration-requests", type=int, default=30)
    parser.add_argument("--slots", type=int, default=SimulatorConfig().max_batch)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="client timeout per request")
    parser.add_argument("--out", default="results/bench_shadow", help="folder for JSON and logs")
    args = parser.parse_args()
    try:
        mix = resolve_mix(args.mix)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    if args.reps < 1 or args.duration <= 0 or args.load <= 0:
        parser.error("--reps, --duration and --load must be > 0")
    out_dir = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    processes: list[Process] = []
    started = time.monotonic()
    try:
        primary = await start_simulator(name="primary")
        processes.append(primary)
        candidate = await start_simulator(["--seed", "7", "--model", "candidate"], "candidate")
        processes.append(candidate)
        gateways: dict[str, Process] = {}
        for name in CONFIGS:
            gateways[name] = await start_gateway(
                name,
                gateway_config(primary.url, args.slots, candidate.url if name == "on" else None),
                out_dir / f"{name}.toml",
                out_dir / f"{name}.log",
            )
            processes.append(gateways[name])
        capacity = args.capacity
        if capacity is None:
            print("calibrating: closed loop on the primary directly ...", flush=True)
            sample = closed_schedule(mix, args.calibration_requests, args.seed + 1)
            capacity = await measure_capacity(primary.url, sample, args.slots, "sim-model")
        rate = args.load * capacity
        schedule = poisson_schedule(mix, rate, args.duration, args.seed)
        print(
            f"capacity {capacity:.2f} req/s; {len(schedule)} requests at {rate:.2f} req/s "
            f"({args.load:.0%}) per run, {args.reps} reps per configuration, alternating",
            flush=True,
        )

        runs: list[dict[str, Any]] = []
        pooled: dict[str, list[float]] = {name: [] for name in CONFIGS}
        for rep in range(args.reps):
            order = CONFIGS if rep % 2 == 0 else tuple(reversed(CONFIGS))
            for name in order:
                gateway = gateways[name]
                before = await shadow_counts(gateway.url) if name == "on" else {}
                print(f"  rep {rep + 1} {name:<3} -> {gateway.url} ...", flush=True)
                run = await run_open_loop(gateway.url, schedule, timeout_s=args.timeout)
                await asyncio.sleep(1.5)  # the last mirrors end, the backends settle
                ttfts = short_ttfts(run)
                pooled[name] += ttfts
                entry = {"rep": rep + 1, "config": name, **figures(ttfts, run)}
                if name == "on":
                    after = await shadow_counts(gateway.url)
                    entry["shadow"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                runs.append(entry)
    finally:
        for process in reversed(processes):
            process.stop()

    lines = compared_lines(out_dir / "on.events")
    ttft_ratios = [x["ttft_ratio"] for x in lines if x.get("ttft_ratio") is not None]
    summary = {name: figures(pooled[name]) for name in CONFIGS}
    shadow_total: dict[str, float] = {}
    for entry in runs:
        for key, value in entry.get("shadow", {}).items():
            shadow_total[key] = shadow_total.get(key, 0) + value

    print(f"\n== primary short-lane ({SHORT_LANE}) TTFT as the client saw it (ms)")
    header = f"{'run':<10}{'requests':>9}{'failed':>8}{'short ok':>10}{'p50':>9}{'p99':>9}  shadow"
    print(header)
    print("-" * (len(header) + 40))
    for entry in runs:
        shadow = entry.get("shadow")
        shadow_text = (
            " ".join(f"{k}={v:g}" for k, v in shadow.items() if v) or "nothing"
            if shadow is not None
            else ""
        )
        print(
            f"{entry['config'] + ' #' + str(entry['rep']):<10}{entry['requests']:>9}"
            f"{entry['failed']:>8}{entry['short_ok']:>10}{fmt(entry['ttft_p50_ms']):>9}"
            f"{fmt(entry['ttft_p99_ms']):>9}  {shadow_text}"
        )
    print("-" * (len(header) + 40))
    for name in CONFIGS:
        s = summary[name]
        print(
            f"{name + ' all':<10}{'':>9}{'':>8}{s['short_ok']:>10}"
            f"{fmt(s['ttft_p50_ms']):>9}{fmt(s['ttft_p99_ms']):>9}"
        )
    p50 = ratio(summary["on"]["ttft_p50_ms"], summary["off"]["ttft_p50_ms"])
    p99 = ratio(summary["on"]["ttft_p99_ms"], summary["off"]["ttft_p99_ms"])
    print(f"{'on/off':<10}{'':>9}{'':>8}{'':>10}{p50:>9}{p99:>9}")
    pairs = []
    for rep in range(1, args.reps + 1):
        by = {e["config"]: e for e in runs if e["rep"] == rep}
        pairs.append(ratio(by["on"]["ttft_p99_ms"], by["off"]["ttft_p99_ms"]))
    print(f"per-rep P99 on/off: {', '.join(pairs)}")
    sampled = sum(shadow_total.values())
    mirrored = shadow_total.get("ok", 0) + shadow_total.get("error", 0)
    print(
        f"\n== shadow in the 'on' runs: {sampled:g} sampled, {mirrored:g} mirrored "
        f"({mirrored / sampled:.0%})"
        if sampled
        else "\n== shadow in the 'on' runs: nothing sampled"
    )
    for key, value in sorted(shadow_total.items()):
        print(f"  {key:<20} {value:g}")
    if ttft_ratios:
        print(
            f"  {len(lines)} shadow_compared lines; median candidate/primary TTFT "
            f"{statistics.median(ttft_ratios):.2f}x"
        )
    print(f"\n(wall time {time.monotonic() - started:.0f} s; logs and JSON in {out_dir})")
    (out_dir / "summary.json").write_text(
        json.dumps(
            {
                "args": vars(args),
                "capacity_rps": capacity,
                "rate_rps": rate,
                "runs": runs,
                "pooled": summary,
                "p50_ratio_on_off": p50,
                "p99_ratio_on_off": p99,
                "shadow": shadow_total,
                "shadow_compared_lines": len(lines),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
