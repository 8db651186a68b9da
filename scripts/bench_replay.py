#!/usr/bin/env python3
"""Replay's fidelity and speed: virtual time against the real gateway in real time.

For a slice of the Azure trace it runs, side by side:

  virtual   `gateway replay`'s gateway run: the gateway's scheduler and pool in front of
            the simulator's engine, on a virtual clock (no sockets, no sleeping)
  real      the same slice sent by the loadgen's trace replay through a real gateway
            process (`serve`, default lanes) in front of real simulator processes

and prints each class's (lane's) P50/P95/P99 TTFT for both, with the P99 gap, at the
loads asked (default 0.8 and 1.2 of the modelled capacity). Then the full hour in
virtual time (wall seconds), and with `--target-p99` the sweep's fleet checked in real
time with that count and one fewer.

    python scripts/bench_replay.py --seconds 600            # 10-minute slice, ~25 min
    python scripts/bench_replay.py --quick                  # 60-s slice, one load (~2 min)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import ROOT, request_log_lines, start_gateway, start_simulator

from gateway.tools.loadgen.mix import trace_schedule
from gateway.tools.replay.cli import settings_for
from gateway.tools.replay.model import capacity_rps, source_rps
from gateway.tools.replay.report import smallest_fleet, summary
from gateway.tools.replay.runs import classify, run_direct, run_gateway
from gateway.tools.replay.sources import Arrival, azure_trace
from gateway.tools.simulator.config import SimulatorConfig
from gateway.tools.stats import percentile

TRACE = Path("/work/shared/data/AzureLLMInferenceTrace_conv.csv")


def slice_rows(trace: Path, start_s: float, seconds: float) -> tuple[int, int]:
    """The first row and row count of [start, start + seconds) of the trace."""
    arrivals = azure_trace(trace)  # sorted; the CSV is in time order
    rows = [i for i, a in enumerate(arrivals) if start_s <= a.at_s < start_s + seconds]
    return rows[0], len(rows)


def planned(trace: Path, first: int, rows: int, speedup: float) -> list[Arrival]:
    """The loadgen's very schedule (its prompts' real token counts) as replay arrivals."""
    plan = trace_schedule(trace, speedup=speedup, prompt_scale=1.0, output_scale=1.0,
                          start=first, limit=rows)  # fmt: skip
    return [Arrival(p.at_s, p.prompt_tokens, p.max_tokens) for p in plan]


def virtual(arrivals: list[Arrival], backends: int) -> dict[str, Any]:
    config = SimulatorConfig()
    settings = settings_for(None, backends, config.max_batch)
    classes = [classify(a, settings) for a in arrivals]
    return {
        "direct": summary(run_direct(arrivals, classes, backends, config)),
        "gateway": summary(run_gateway(arrivals, classes, settings, config)),
    }


async def real(trace: Path, first: int, rows: int, speedup: float, backends: int,
               work: Path) -> dict[str, Any]:  # fmt: skip
    """The slice through a real gateway process in front of real simulators."""
    sims = [await start_simulator(name=f"sim{i}") for i in range(backends)]
    gateway = None
    try:
        toml = "".join(
            f'[[backends]]\nurl = "{s.url}"\nname = "b{i}"\n' for i, s in enumerate(sims)
        )
        gateway = await start_gateway("gateway", toml, work / "gw.toml", work / "gw.log")
        loadgen = [
            *(sys.executable, "-m", "gateway", "loadgen", "--target", gateway.url),
            *("--trace", str(trace), "--trace-start", str(first), "--trace-limit", str(rows)),
            *("--speedup", repr(speedup), "--no-progress", "--timeout", "600"),
        ]
        subprocess.run(loadgen, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        await asyncio.sleep(0.5)  # the log's last lines
        assert gateway.log_path is not None
        lines = request_log_lines(gateway.log_path)
    finally:
        if gateway is not None:
            gateway.stop()
        for sim in sims:
            sim.stop()
    classes: dict[str, Any] = {}
    for lane in sorted({str(line.get("lane")) for line in lines}):
        mine = [line for line in lines if str(line.get("lane")) == lane]
        ttfts = [float(line["ttft_ms"]) for line in mine if line.get("ttft_ms") is not None]
        classes[lane] = {
            "ttft_ms": {f"p{q}": _round(percentile(ttfts, q)) for q in (50, 95, 99)},
            "completed": len(ttfts),
            "refused": sum(1 for line in mine if line.get("outcome") != "ok"),
        }
    return {"classes": classes}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def compare(virtual_run: dict[str, Any], real_run: dict[str, Any]) -> dict[str, Any]:
    """Per class: both P99s and the gap as a share of the real one."""
    out = {}
    for cls, fig in real_run["classes"].items():
        mine = virtual_run["classes"].get(cls)
        real_p99 = fig["ttft_ms"]["p99"]
        virt_p99 = None if mine is None else mine["ttft_ms"]["p99"]
        gap = None if not real_p99 or virt_p99 is None else (virt_p99 - real_p99) / real_p99
        out[cls] = {"real_p99_ms": real_p99, "virtual_p99_ms": virt_p99,
                    "gap": None if gap is None else round(gap, 3),
                    "real": fig, "virtual": mine}  # fmt: skip
    return out


def print_fidelity(label: str, rows: dict[str, Any]) -> None:
    print(f"\n{label}")
    print(f"  {'class':<12} {'real p50':>9} {'virt p50':>9} {'real p99':>9} {'virt p99':>9} "
          f"{'gap':>7} {'real n':>7} {'virt n':>7} {'real ref':>8} {'virt ref':>8}")  # fmt: skip
    for cls, row in rows.items():
        real_fig, virt = (
            row["real"],
            row["virtual"] or {"ttft_ms": {}, "completed": 0, "refused": 0},
        )
        gap = "-" if row["gap"] is None else f"{row['gap']:+.1%}"
        print(
            f"  {cls:<12} {real_fig['ttft_ms']['p50'] or 0:>9.0f} "
            f"{virt['ttft_ms'].get('p50') or 0:>9.0f} {row['real_p99_ms'] or 0:>9.0f} "
            f"{row['virtual_p99_ms'] or 0:>9.0f} {gap:>7} {real_fig['completed']:>7} "
            f"{virt['completed']:>7} {real_fig['refused']:>8} {virt['refused']:>8}"
        )


async def fidelity(trace: Path, start_s: float, seconds: float, load: float, backends: int,
                   work: Path) -> dict[str, Any]:  # fmt: skip
    first, rows = slice_rows(trace, start_s, seconds)
    own = planned(trace, first, rows, 1.0)
    speedup = load * capacity_rps(own, SimulatorConfig(), backends) / source_rps(own)
    arrivals = planned(trace, first, rows, speedup)
    started = time.perf_counter()
    virt = await asyncio.to_thread(virtual, arrivals, backends)  # its own (virtual) loop
    virtual_wall = time.perf_counter() - started
    started = time.perf_counter()
    real_run = await real(trace, first, rows, speedup, backends, work)
    real_wall = time.perf_counter() - started
    rows_out = compare(virt["gateway"], real_run)
    print_fidelity(
        f"{seconds:g}-s slice ({rows} requests) at load {load:g}, {backends} backend(s), "
        f"speedup {speedup:.3g}: virtual {virtual_wall:.1f} s wall, real {real_wall:.1f} s",
        rows_out,
    )
    return {"load": load, "backends": backends, "rows": rows, "speedup": speedup,
            "virtual_wall_s": virtual_wall, "real_wall_s": real_wall, "classes": rows_out,
            "virtual_direct": virt["direct"]}  # fmt: skip


async def sweep(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Capacity planning checked: the fewest backends whose interactive P99 meets the
    target in virtual time, then that many and one fewer in real time."""
    target_ms = args.target_p99 * 1000.0
    first, rows = slice_rows(args.trace, args.start, args.sweep_seconds)
    own = planned(args.trace, first, rows, 1.0)
    speedup = args.sweep_load * capacity_rps(own, SimulatorConfig(), 1) / source_rps(own)
    arrivals = planned(args.trace, first, rows, speedup)
    virtual_p99: dict[int, float | None] = {}

    def meets(n: int) -> bool:
        p99 = virtual(arrivals, n)["gateway"]["classes"]["interactive"]["ttft_ms"]["p99"]
        virtual_p99[n] = p99
        return p99 is not None and p99 <= target_ms

    fewest = await asyncio.to_thread(smallest_fleet, meets, 1, 16)
    print(f"\nsweep: {args.sweep_seconds:g}-s slice ({rows} requests) at {args.sweep_load:g}x one "
          f"backend's capacity; virtual interactive P99 by backends: "
          + ", ".join(f"{n}: {p:.0f} ms" for n, p in sorted(virtual_p99.items()) if p)
          + f"; fewest meeting {args.target_p99:g} s: {fewest}")  # fmt: skip
    checks: dict[int, Any] = {}
    for n in [x for x in (fewest, (fewest or 1) - 1) if x]:
        work = tmp / f"sweep{n}"
        work.mkdir()
        real_run = await real(args.trace, first, rows, speedup, n, work)
        fig = real_run["classes"].get("interactive", {}).get("ttft_ms", {})
        p99 = fig.get("p99")
        checks[n] = {"ttft_ms": fig, "meets": p99 is not None and p99 <= target_ms,
                     "virtual_p99_ms": virtual_p99.get(n)}  # fmt: skip
        print(f"  real time, {n} backend(s): interactive P99 {p99} ms (virtual "
              f"{virtual_p99.get(n)}): {'meets' if checks[n]['meets'] else 'misses'} the target")  # fmt: skip
    return {"backends": fewest, "target_s": args.target_p99, "load": args.sweep_load,
            "seconds": args.sweep_seconds, "virtual_p99_ms": virtual_p99, "real": checks}  # fmt: skip


def hour(trace: Path, backends: int) -> float:
    """Wall seconds of the full trace in virtual time (both runs), as `gateway replay` runs it."""
    started = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway",
            "replay",
            str(trace),
            "--load",
            "0.8",
            "--backends",
            str(backends),
        ],  # fmt: skip
        cwd=ROOT,
        check=True,
    )
    return time.perf_counter() - started


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--seconds", type=float, default=600.0, help="slice length (600)")
    parser.add_argument("--start", type=float, default=600.0, help="slice start in the trace")
    parser.add_argument("--loads", default="0.8,1.2", help='loads to check (0.8,1.2; "": none)')
    parser.add_argument("--backends", type=int, default=4, help="engines (4)")
    parser.add_argument("--quick", action="store_true", help="60-s slice at load 0.8 only")
    parser.add_argument("--no-hour", action="store_true", help="skip the full-hour timing")
    parser.add_argument("--target-p99", type=float, help="interactive P99 target, s: sweep "
                        "for the fleet, then check that count and one fewer in real time")  # fmt: skip
    parser.add_argument("--sweep-load", type=float, default=4.0,
                        help="the sweep's traffic, in multiples of one backend's capacity (4)")  # fmt: skip
    parser.add_argument("--sweep-seconds", type=float, default=300.0,
                        help="the sweep's slice length (300)")  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.loads = 60.0, "0.8"
    results: dict[str, Any] = {"fidelity": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i, load in enumerate(float(x) for x in args.loads.split(",") if x.strip()):
            work = Path(tmp) / f"run{i}"
            work.mkdir()
            results["fidelity"].append(
                await fidelity(args.trace, args.start, args.seconds, load, args.backends, work)
            )
        if args.target_p99:
            results["sweep"] = await sweep(args, Path(tmp))
    if not args.no_hour and args.trace.exists():
        results["hour_wall_s"] = hour(args.trace, 4)
        print(f"\nfull hour in virtual time (4 backends, load 0.8): {results['hour_wall_s']:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
