#!/usr/bin/env python3
"""Two backends, one 4x slower: does the gateway learn which is which, and route by it?

A pool is rarely uniform: an older GPU, a smaller tensor-parallel group, a
neighbour on the same card. A gateway that balances by counting requests sends
the slow backend its "fair" share and the users who land there pay for it; one
that learns each backend's prefill and decode rates from the requests they serve
(issue #9) should send the slow one only what it can finish in time, so adding
it never makes the tail worse than not having it. This benchmark checks that:

  both        the gateway (default config) in front of a fast simulator and one
              whose step times are all 4x (`--step-base-ms`, `--prefill-ms-per-token`,
              `--decode-ms-per-seq`), both with the same max_concurrency
  fast-only   the gateway in front of the fast simulator alone

on the same seeded Poisson schedule at ~70% of the fast backend's own capacity
(measured as bench_tail does: a closed loop on it directly). It prints the P99
TTFT per lane of both gateways, where the two-backend gateway sent its requests
over time, and what its `GET /debug/backends` said every 15 s (the learned
rates; a 404 is printed as such), then checks:

  * every lane's P99 TTFT with both backends <= with the fast one alone
  * the learned prefill rates of the two backends differ by more than 2x within 60 s

    python scripts/bench_two_speed.py                        # 120 s of arrivals per gateway
    python scripts/bench_two_speed.py --mix prefill-heavy    # long prompts, short outputs
    python scripts/bench_two_speed.py --duration 10 --calibration-requests 10 \\
        --poll-interval 5                                    # a smoke run, under a minute
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
from benchlib import ROOT, Process, start_gateway, start_simulator

sys.path.insert(0, str(ROOT))

from bench_tail import fmt, measure_capacity  # noqa: E402

from gateway.tools.analyze.analyzer import arrival_s, load_records  # noqa: E402
from gateway.tools.loadgen import (  # noqa: E402
    NAMED_MIXES,
    PlannedRequest,
    RunResult,
    closed_schedule,
    poisson_schedule,
    resolve_mix,
    run_open_loop,
)
from gateway.tools.simulator import SimulatorConfig  # noqa: E402
from gateway.tools.stats import percentile  # noqa: E402

#: The step-time knobs multiplied for the slow backend: every part of a step, so the
#: slow one is uniformly slower (prefill and decode), as an older card would be.
SLOW_KNOBS = ("step_base_ms", "prefill_ms_per_token", "decode_ms_per_seq")
DEBUG_PATH = "/debug/backends"


def simulator_flags(config: SimulatorConfig, knobs: tuple[str, ...]) -> list[str]:
    """`--step-base-ms 20 ...`: the simulator's flags are its config's field names."""
    flags: list[str] = []
    for name in knobs:
        flags += ["--" + name.replace("_", "-"), f"{getattr(config, name):g}"]
    return flags


def gateway_config(backends: list[tuple[str, str]], slots: int) -> str:
    """The default config but for the backends, each with the same max_concurrency."""
    return "".join(
        f'[[backends]]\nurl = "{url}"\nname = "{name}"\nmax_concurrency = {slots}\n\n'
        for name, url in backends
    )


# ----------------------------------------------------------------------- /debug/backends


async def poll_backends(
    url: str, interval_s: float, started: float, snapshots: list[dict[str, Any]]
) -> None:
    """GET /debug/backends every `interval_s` from `started` (t = 0) until cancelled."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        tick = 0
        while True:
            await asyncio.sleep(max(0.0, started + tick * interval_s - time.monotonic()))
            snapshots.append(await fetch_backends(session, url, time.monotonic() - started))
            tick += 1


async def fetch_backends(session: aiohttp.ClientSession, url: str, at_s: float) -> dict[str, Any]:
    """One snapshot: the status and whatever JSON came back (None when it was not JSON)."""
    try:
        async with session.get(url + DEBUG_PATH) as resp:
            text = await resp.text()
            try:
                body: Any = json.loads(text)
            except ValueError:
                body = None
            return {"at_s": round(at_s, 1), "status": resp.status, "body": body}
    except (aiohttp.ClientError, TimeoutError) as exc:
        return {"at_s": round(at_s, 1), "status": None, "error": repr(exc), "body": None}


def backend_entries(body: Any) -> list[dict[str, Any]]:
    """The list of backend objects, whether the body is the list or `{"backends": [...]}`."""
    if isinstance(body, dict) and isinstance(body.get("backends"), list):
        body = body["backends"]
    if not isinstance(body, list):
        return []
    return [entry for entry in body if isinstance(entry, dict)]


def learned_rate(entry: dict[str, Any], key: str) -> float | None:
    learned = entry.get("learned")
    value = learned.get(key) if isinstance(learned, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def prefill_ratio(snapshot: dict[str, Any]) -> float | None:
    """The fast backend's learned prefill rate over the slow one's, in one snapshot.

    None unless both are there with a rate and, when the gateway says how many
    samples a rate rests on (`prefill_samples`), at least one each: a prior that
    has seen nothing differing from a learned rate is no sign of learning. A
    ratio below 1 is learning the wrong way round, and fails like no learning.
    """
    rates: dict[str, float] = {}
    for entry in backend_entries(snapshot.get("body")):
        rate = learned_rate(entry, "prefill_tokens_per_s")
        samples = learned_rate(entry, "prefill_samples")
        if rate is None or rate <= 0 or (samples is not None and samples < 1):
            continue
        rates[str(entry.get("name"))] = rate
    if "fast" not in rates or "slow" not in rates:
        return None
    return rates["fast"] / rates["slow"]


def print_snapshots(snapshots: list[dict[str, Any]]) -> None:
    print(f"\n== GET {DEBUG_PATH} on the two-backend gateway")
    for snap in snapshots:
        head = f"  t={snap['at_s']:>6.1f} s"
        if snap["status"] != 200:
            reason = snap.get("error") or f"HTTP {snap['status']}"
            print(
                f"{head}  {reason}" + (" (no such endpoint yet)" if snap["status"] == 404 else "")
            )
            continue
        entries = backend_entries(snap["body"])
        if not entries:
            print(f"{head}  {json.dumps(snap['body'])[:200]}")
            continue
        for i, entry in enumerate(entries):
            prefill = learned_rate(entry, "prefill_tokens_per_s")
            decode = learned_rate(entry, "decode_tokens_per_s")
            learned = entry.get("learned")
            others = (
                {
                    k: v
                    for k, v in learned.items()
                    if k not in ("prefill_tokens_per_s", "decode_tokens_per_s")
                }
                if isinstance(learned, dict)
                else learned
            )
            print(
                f"{head if i == 0 else ' ' * len(head)}  {str(entry.get('name', '?')):<8} "
                f"prefill {fmt(prefill):>7} tok/s  decode {fmt(decode):>6} tok/s"
                + (f"  {json.dumps(others)[:120]}" if others else "")
            )
        ratio = prefill_ratio(snap)
        if ratio is not None:
            print(f"{' ' * len(head)}  learned prefill fast/slow {ratio:.2f}x")


# ------------------------------------------------------------------------------ figures


def lane_p99(run: RunResult) -> dict[str, dict[str, Any]]:
    """Per lane (the gateway's `x-gateway-lane`): requests, completed, P99 TTFT of those."""
    out: dict[str, dict[str, Any]] = {}
    for result in run.results:
        lane = result.lane or "(none)"
        stats = out.setdefault(lane, {"count": 0, "ok": 0, "ttfts": []})
        stats["count"] += 1
        if result.ok:
            stats["ok"] += 1
            if result.ttft_ms is not None:
                stats["ttfts"].append(result.ttft_ms)
    return {
        lane: {
            "count": s["count"],
            "ok": s["ok"],
            "ttft_p50_ms": percentile(s["ttfts"], 50),
            "ttft_p99_ms": percentile(s["ttfts"], 99),
        }
        for lane, s in out.items()
    }


def routing(log_path: Path | None, window_s: float) -> list[tuple[float, Counter[str]]]:
    """Requests dispatched to each backend per `window_s` of arrivals, from the gateway's log."""
    if log_path is None or not log_path.exists():
        return []
    with log_path.open(encoding="utf-8", errors="replace") as stream:
        records, _ = load_records(stream)
    timed = [(t, r) for r in records if (t := arrival_s(r)) is not None and r.get("backend")]
    if not timed:
        return []
    origin = min(t for t, _ in timed)
    windows: dict[int, Counter[str]] = {}
    for t, r in timed:
        windows.setdefault(int((t - origin) // window_s), Counter())[str(r["backend"])] += 1
    return [(k * window_s, windows[k]) for k in sorted(windows)]


def print_lanes(runs: dict[str, dict[str, dict[str, Any]]]) -> None:
    lanes = list(dict.fromkeys(lane for run in runs.values() for lane in run))
    print("\n== TTFT per lane (s), completed requests")
    header = (
        f"{'lane':<14}"
        + "".join(f"{name + ' ok':>16}{'p50':>7}{'p99':>7}" for name in runs)
        + f"{'p99 both/fast':>15}"
    )
    print(header)
    print("-" * len(header))
    for lane in lanes:
        cells = ""
        for run in runs.values():
            s = run.get(lane, {})
            cells += (
                f"{s.get('ok', 0):>8}/{s.get('count', 0):<7}"
                f"{fmt(s.get('ttft_p50_ms'), 1000):>7}{fmt(s.get('ttft_p99_ms'), 1000):>7}"
            )
        both = runs["both"].get(lane, {}).get("ttft_p99_ms")
        fast = runs["fast-only"].get(lane, {}).get("ttft_p99_ms")
        ratio = f"{both / fast:.2f}x" if both and fast else "-"
        print(f"{lane[:13]:<14}{cells}{ratio:>15}")


def print_routing(windows: list[tuple[float, Counter[str]]], window_s: float) -> None:
    if not windows:
        print("\n(no dispatched requests in the two-backend gateway's log)")
        return
    names = sorted({name for _, counts in windows for name in counts})
    print(f"\n== where the two-backend gateway sent requests, per {window_s:g} s of arrivals")
    for start, counts in windows:
        total = sum(counts.values())
        parts = "  ".join(
            f"{name} {counts[name]:>4} ({counts[name] / total:>4.0%})" for name in names
        )
        print(f"  {start:>6.0f}-{start + window_s:<6.0f} s  {parts}")


def check(
    lanes: dict[str, dict[str, dict[str, Any]]],
    snapshots: list[dict[str, Any]],
    learn_within_s: float,
) -> list[tuple[str, bool | None, str]]:
    """The targets as (name, passed or None when it could not be checked, figures)."""
    checks: list[tuple[str, bool | None, str]] = []
    for lane, fast in lanes["fast-only"].items():
        both = lanes["both"].get(lane, {})
        p_both, p_fast = both.get("ttft_p99_ms"), fast.get("ttft_p99_ms")
        if p_fast is None:
            continue
        checks.append(
            (
                f"{lane} P99 TTFT with both backends <= with the fast one alone",
                p_both is not None and p_both <= p_fast,
                f"{fmt(p_both)} ms vs {fmt(p_fast)} ms",
            )
        )
    early = [s for s in snapshots if s["at_s"] <= learn_within_s + 1]
    spreads = [(s["at_s"], ratio) for s in early if (ratio := prefill_ratio(s)) is not None]
    name = f"learned prefill rates (fast/slow) differ by > 2x within {learn_within_s:g} s"
    if not any(s["status"] == 200 for s in snapshots):
        statuses = sorted({str(s["status"]) for s in snapshots})
        checks.append((name, None, f"{DEBUG_PATH} answered {', '.join(statuses)}"))
    elif not spreads:
        checks.append((name, False, "no snapshot in time with both prefill rates learned"))
    else:
        first = next(((t, x) for t, x in spreads if x > 2), None)
        best_t, best = max(spreads, key=lambda item: item[1])
        checks.append(
            (
                name,
                first is not None,
                f"first > 2x at t={first[0]:.0f} s ({first[1]:.2f}x)"
                if first
                else f"at most {best:.2f}x (t={best_t:.0f} s)",
            )
        )
    return checks


# --------------------------------------------------------------------------------- main


async def run_gateway(
    name: str,
    gateway: Process,
    schedule: list[PlannedRequest],
    args: argparse.Namespace,
    snapshots: list[dict[str, Any]] | None,
) -> RunResult:
    print(f"  {name:<10} {len(schedule)} requests -> {gateway.url} ...", flush=True)
    poller = None
    started = time.monotonic()
    if snapshots is not None:
        poller = asyncio.create_task(
            poll_backends(gateway.url, args.poll_interval, started, snapshots)
        )
    try:
        run = await run_open_loop(gateway.url, schedule, model=args.model, timeout_s=args.timeout)
    finally:
        if poller is not None:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
    if snapshots is not None:  # and one after the last answer: what it learned in all
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            snapshots.append(await fetch_backends(session, gateway.url, time.monotonic() - started))
    await asyncio.sleep(1.0)  # let the backends settle
    return run


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mix", default="default", help=f"a named mix ({', '.join(NAMED_MIXES)}) or a TOML file"
    )
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals (120)")
    parser.add_argument(
        "--load", type=float, default=0.7, help="fraction of the fast backend's capacity (0.7)"
    )
    parser.add_argument("--slowdown", type=float, default=4.0, help="the slow backend's factor (4)")
    parser.add_argument(
        "--slots",
        type=int,
        default=SimulatorConfig().max_batch,
        help="max_concurrency of each backend in the gateway (the simulator's batch size)",
    )
    parser.add_argument(
        "--capacity", type=float, help="req/s of the fast backend; skips calibration"
    )
    parser.add_argument("--calibration-requests", type=int, default=40)
    parser.add_argument(
        "--poll-interval", type=float, default=15.0, help=f"seconds between GET {DEBUG_PATH} (15)"
    )
    parser.add_argument(
        "--learn-within", type=float, default=60.0, help="seconds the rates have to differ (60)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="sim-model")
    parser.add_argument("--timeout", type=float, default=60.0, help="client timeout per request")
    parser.add_argument("--out", default="results/bench_two_speed", help="folder for JSON and logs")
    args = parser.parse_args()
    try:
        mix = resolve_mix(args.mix)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    if not (args.slowdown > 0 and args.duration > 0 and args.poll_interval > 0):
        parser.error("--slowdown, --duration and --poll-interval must be > 0")
    out_dir = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    fast_config = SimulatorConfig()
    slow_config = dataclasses.replace(
        fast_config, **{k: getattr(fast_config, k) * args.slowdown for k in SLOW_KNOBS}
    )
    processes: list[Process] = []
    try:
        fast = await start_simulator(name="fast")
        processes.append(fast)
        slow = await start_simulator(simulator_flags(slow_config, SLOW_KNOBS), name="slow")
        processes.append(slow)
        print(f"fast backend {fast.url}; slow backend {slow.url} ({args.slowdown:g}x step times:")
        print("  " + " ".join(simulator_flags(slow_config, SLOW_KNOBS)) + ")")

        capacity = args.capacity
        if capacity is None:
            print("calibrating: closed loop on the fast backend directly ...", flush=True)
            sample = closed_schedule(mix, args.calibration_requests, args.seed + 1)
            capacity = await measure_capacity(fast.url, sample, args.slots, args.model)
        rate = args.load * capacity
        schedule = poisson_schedule(mix, rate, args.duration, args.seed)
        print(
            f"fast backend capacity {capacity:.2f} req/s; load {args.load:.0%} of it = "
            f"{rate:.2f} req/s, {len(schedule)} requests over {args.duration:g} s (mix {args.mix})"
        )

        snapshots: list[dict[str, Any]] = []
        runs: dict[str, RunResult] = {}
        logs: dict[str, Path | None] = {}
        for name, backends in (
            ("both", [("fast", fast.url), ("slow", slow.url)]),
            ("fast-only", [("fast", fast.url)]),
        ):
            gateway = await start_gateway(
                name,
                gateway_config(backends, args.slots),
                out_dir / f"{name}.toml",
                out_dir / f"{name}.log",
            )
            processes.append(gateway)
            try:
                runs[name] = await run_gateway(
                    name, gateway, schedule, args, snapshots if name == "both" else None
                )
            finally:
                gateway.stop()
            logs[name] = gateway.log_path

        lanes = {name: lane_p99(run) for name, run in runs.items()}
        print_lanes(lanes)
        windows = routing(logs["both"], args.poll_interval)
        print_routing(windows, args.poll_interval)
        print_snapshots(snapshots)
        checks = check(lanes, snapshots, args.learn_within)
        print()
        for target, passed, figures in checks:
            label = "n/a " if passed is None else "PASS" if passed else "FAIL"
            print(f"  [{label}] {target}: {figures}")
        print(f"  logs: {logs['both']}, {logs['fast-only']} (python -m gateway analyze FILE)")

        path = out_dir / "two_speed.json"
        report = {
            "mix": args.mix,
            "slots": args.slots,
            "slowdown": args.slowdown,
            "simulators": {
                "fast": dataclasses.asdict(fast_config),
                "slow": dataclasses.asdict(slow_config),
            },
            "fast_capacity_req_s": capacity,
            "rate_req_s": rate,
            "requests": len(schedule),
            "lanes": lanes,
            "routing": [{"from_s": start, "backends": dict(counts)} for start, counts in windows],
            "debug_backends": snapshots,
            "checks": [{"target": n, "passed": p, "figures": f} for n, p, f in checks],
        }
        path.write_text(json.dumps(report, indent=2, default=str))
        print(f"\nwrote {path}")
        return 1 if any(passed is False for _, passed, _ in checks) else 0
    finally:
        for process in processes:
            process.stop()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
