#!/usr/bin/env python3
"""Soak: minutes of steady mixed load; does the gateway's memory, fd or task count creep up?

A leak that costs one socket or one asyncio task per request is invisible in a
test of ten requests and fatal after a week. This runs the gateway for a few
minutes at a steady ~70% of the backend's capacity (the default mix: 80% short,
20% long prompts, Poisson arrivals) and samples, every few seconds:

  rss_mb     resident memory of the gateway's process
  fds        its open file descriptors (/proc/<pid>/fd)
  tasks      its asyncio tasks (len(asyncio.all_tasks()))
  conns      client connections open to it (keep-alive ones included)
  in_flight  requests holding a backend slot, and `queued` in the lanes' queues,
             to tell load from leak

It prints the table and the slope of each series between the warm-up and the
end of the arrivals (least squares, growth per minute), and exits 1 when one
grows beyond its threshold, or when, after the load stops and things settle,
tasks and fds do not come back to what they were before the load (an exact
check: a leak of one per request shows as hundreds).

Each open client connection costs the gateway one fd and one task, and the load
generator's keep-alive pool grows with the highest concurrency seen so far; so
the slopes of fds and tasks are taken net of `conns`, or they would call every
new concurrency peak a leak.

    python scripts/soak.py                 # 180 s of load (plus calibration and settling)
    python scripts/soak.py --quick         # ~30 s smoke
    python scripts/soak.py --gateway subprocess   # `python -m gateway serve` in a child

Where the gateway runs (`--gateway`):

  inprocess (default)  the gateway runs in this process (the same build_app, AppRunner
            with handler_cancellation and listen backlog as `gateway serve`), next
            to a sampler task. This is the default because the asyncio task count is
            the most direct leak signal (an orphaned relay or watchdog shows up as a
            task long before it shows in RSS) and it can be read without adding
            anything to the gateway. The simulator and the load generator each run
            in their own child process, so this process's RSS and fds are the
            gateway's alone (the sampler's share is constant).
  subprocess  the real `python -m gateway serve` process; RSS and fds are read from
            /proc/<pid>; the task count is not visible from outside ("-").

Everything listens on 127.0.0.1 only; the run is bounded in time, and every
process it started is stopped (terminate, then kill) when it ends, however it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchlib import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.tools.loadgen import (  # noqa: E402
    DEFAULT_MIX,
    PlannedRequest,
    TrafficClass,
    closed_schedule,
    poisson_schedule,
    run_closed_loop,
    run_open_loop,
)
from gateway.tools.stats import percentile  # noqa: E402

#: Requests/s of the default mix on the default simulator with 8 slots, as this script's
#: calibration measured it (1.82); scaled by slots / 8 when `--quick` skips the calibration.
DEFAULT_CAPACITY_PER_8_SLOTS = 1.8
#: Growth that counts as a leak after the warm-up: (per minute, and at least this much in
#: total over the measured window, so that a short run's jitter is not called a leak).
THRESHOLDS = {
    "rss_mb": (3.0, 4.0),
    "fds_net": (10.0, 8.0),
    "tasks_net": (10.0, 8.0),
}
#: After the load, idle tasks and fds may differ from the idle state before it by this much
#: (a health check in progress holds one socket and no extra task for a few ms).
IDLE_TOLERANCE = {"fds": 2, "tasks": 0}


def rss_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def open_fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def stop_process(popen: subprocess.Popen[bytes] | asyncio.subprocess.Process | None) -> None:
    if popen is None or popen.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        popen.terminate()
    if isinstance(popen, subprocess.Popen):
        try:
            popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


# --------------------------------------------------------------------------- child roles


def exact_mix_sample(requests: int, seed: int) -> list[PlannedRequest]:
    """`requests` requests with each class at exactly its share, evenly interleaved.

    A random draw of a few dozen requests can hold 30% long ones instead of 20%,
    which moves the measured capacity by a third; this one cannot.
    """
    total = sum(cls.share for cls in DEFAULT_MIX)
    placed: list[tuple[float, PlannedRequest]] = []
    for number, cls in enumerate(DEFAULT_MIX):
        count = max(1, round(requests * cls.share / total))
        alone = TrafficClass(cls.name, 1.0, cls.prompt_tokens, cls.max_tokens)
        for i, planned in enumerate(closed_schedule([alone], count, seed + number)):
            placed.append(((i + 0.5) / count, planned))
    sample = [planned for _, planned in sorted(placed, key=lambda item: item[0])]
    for index, planned in enumerate(sample):
        planned.index = index
    return sample


async def role_calibrate(target: str, slots: int, requests: int, seed: int) -> dict[str, Any]:
    """Requests/s the backend completes for the mix when never idle (closed loop, 2x slots).

    Counted only until the last request was sent: after that the backend runs
    out of work, and the slow drain of the last long requests would make the
    capacity look far lower than it is.
    """
    run = await run_closed_loop(target, exact_mix_sample(requests, seed), concurrency=2 * slots)
    sent = [r.sent_ms for r in run.results if r.sent_ms is not None]
    saturated_ms = max(sent, default=0.0)
    done = sum(
        1
        for r in run.results
        if r.ok
        and r.sent_ms is not None
        and r.e2e_ms is not None
        and r.sent_ms + r.e2e_ms <= saturated_ms
    )
    if saturated_ms <= 0 or done == 0:
        raise SystemExit("calibration: no request completed while the backend was saturated")
    return {
        "capacity_req_s": done / (saturated_ms / 1000),
        "completed": done,
        "window_s": saturated_ms / 1000,
    }


async def role_load(target: str, rate: float, duration_s: float, seed: int) -> dict[str, Any]:
    """The steady load: Poisson arrivals of the default mix, open loop, every request streamed."""
    schedule = poisson_schedule(DEFAULT_MIX, rate, duration_s, seed)
    run = await run_open_loop(target, schedule, timeout_s=120.0)
    statuses = Counter(f"{r.status} {r.error_code or ''}".strip() for r in run.results)
    ttft = {}
    for cls in sorted({r.cls for r in run.results}):
        values = [r.ttft_ms for r in run.results if r.cls == cls and r.ttft_ms is not None]
        ttft[cls] = {"p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99)}
    return {
        "requests": len(run.results),
        "ok": sum(r.ok for r in run.results),
        "by_status": dict(statuses),
        "ttft": ttft,
        "wall_s": run.wall_s,
    }


def run_child_role(args: argparse.Namespace) -> int:
    if args.role == "calibrate":
        result = asyncio.run(role_calibrate(args.target, args.slots, args.requests, args.seed))
    else:
        result = asyncio.run(role_load(args.target, args.rate, args.duration, args.seed))
    print(json.dumps(result), flush=True)
    return 0


async def child(*argv: str, timeout_s: float) -> dict[str, Any]:
    """Run this script in a child role; its last stdout line is its JSON result."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).resolve()), *argv,
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=None,
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(process.communicate(), timeout_s)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    if process.returncode != 0:
        raise SystemExit(f"child {argv[:2]} failed with exit code {process.returncode}")
    return json.loads(out.decode().strip().splitlines()[-1])


# ------------------------------------------------------------------------------ gateways


class InProcessGateway:
    """The gateway app in this process, served as `gateway serve` serves it."""

    def __init__(self, backend: str, slots: int, port: int, log_path: Path) -> None:
        from gateway.app import build_app
        from gateway.config import BackendSettings, ServerSettings, Settings, validate

        settings = validate(
            Settings(
                server=ServerSettings(port=port),
                backends=[BackendSettings(url=backend, name="sim", max_concurrency=slots)],
            )
        )
        self.log = log_path.open("w")
        self.app = build_app(settings, log_stream=self.log)
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.runner: Any = None

    async def start(self) -> None:
        from aiohttp import web

        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, backlog=2048).start()

    def sample(self) -> dict[str, Any]:
        from gateway.state import GATEWAY

        state = self.app[GATEWAY]
        conns = len(self.runner.server.connections) if self.runner is not None else 0
        fds, tasks = open_fds(), len(asyncio.all_tasks())
        return {
            "rss_mb": rss_mb(),
            "fds": fds,
            "tasks": tasks,
            "conns": conns,
            "fds_net": fds - conns,
            "tasks_net": tasks - conns,
            "in_flight": state.in_flight,
            "queued": sum(len(lane.queue) for lane in state.scheduler.lanes),
        }

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        self.log.close()


class SubprocessGateway:
    """`python -m gateway serve` in a child process; sampled through /proc/<pid>."""

    def __init__(self, backend: str, slots: int, port: int, log_path: Path) -> None:
        self.backend, self.slots, self.port, self.log_path = backend, slots, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.popen: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        config = self.log_path.with_suffix(".toml")
        config.write_text(
            f'[[backends]]\nurl = "{self.backend}"\nname = "sim"\nmax_concurrency = {self.slots}\n'
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        with self.log_path.open("w") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "gateway", "serve", "--config", str(config),
                 "--host", "127.0.0.1", "--port", str(self.port)],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        await wait_ready(self.url, "/readyz")

    def sample(self) -> dict[str, Any]:
        assert self.popen is not None
        fds = open_fds(self.popen.pid)
        return {
            "rss_mb": rss_mb(self.popen.pid),
            "fds": fds,
            "tasks": None,
            "conns": None,
            "fds_net": fds,  # connections are not visible from outside
            "tasks_net": None,
            "in_flight": None,
            "queued": None,
        }

    async def stop(self) -> None:
        stop_process(self.popen)


# ------------------------------------------------------------------------------ analysis


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (t_s, value), per minute."""
    if len(points) < 3:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in points)
    if var_t == 0:
        return None
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return cov / var_t * 60.0


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_table(samples: list[dict[str, Any]], warmup_s: float, end_s: float) -> None:
    columns = (
        "t_s",
        "rss_mb",
        "fds",
        "tasks",
        "conns",
        "fds_net",
        "tasks_net",
        "in_flight",
        "queued",
    )
    print("\n" + "  ".join(f"{c:>9}" for c in columns))
    for sample in samples:
        mark = ""
        if sample["t_s"] < warmup_s:
            mark = "  (warm-up)"
        elif sample["t_s"] > end_s:
            mark = "  (draining)"
        print("  ".join(f"{fmt(sample[c]):>9}" for c in columns) + mark)


def analyse(
    samples: list[dict[str, Any]], warmup_s: float, end_s: float
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Slopes over the steady part: after the warm-up, before the arrivals stop.

    After `end_s` the in-flight requests drain and every series falls, which
    would pull a slope down and hide a leak.
    """
    measured = [s for s in samples if warmup_s <= s["t_s"] <= end_s]
    verdicts: dict[str, dict[str, Any]] = {}
    failures = []
    for key, (per_min, minimum) in THRESHOLDS.items():
        points = [(s["t_s"], float(s[key])) for s in measured if s[key] is not None]
        slope = slope_per_min(points)
        window_min = (points[-1][0] - points[0][0]) / 60 if len(points) > 1 else 0.0
        growth = slope * window_min if slope is not None else None
        leaking = slope is not None and slope > per_min and growth is not None and growth > minimum
        verdicts[key] = {
            "slope_per_min": slope,
            "growth_over_window": growth,
            "threshold_per_min": per_min,
            "min_growth": minimum,
            "leaking": leaking,
        }
        if leaking:
            failures.append(f"{key} grows {slope:.2f}/min after the warm-up (limit {per_min}/min)")
    return verdicts, failures


# ----------------------------------------------------------------------------------- run


async def settle_idle(gateway: Any, before: dict[str, Any], within_s: float) -> dict[str, Any]:
    """Sample until tasks and fds are back to `before` or time is up (the caller judges)."""
    deadline = time.monotonic() + within_s
    while True:
        now = gateway.sample()
        back = (
            all(now[k] is None or before[k] is None or now[k] <= before[k] for k in IDLE_TOLERANCE)
            and not now["in_flight"]
            and not now["queued"]
        )
        if back or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.5)


async def soak(args: argparse.Namespace) -> int:
    duration = 30.0 if args.quick and args.duration is None else (args.duration or 180.0)
    interval = args.interval or (2.0 if args.quick else 5.0)
    warmup = args.warmup if args.warmup is not None else min(30.0, duration / 2)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    sim_port = free_port()
    simulator = subprocess.Popen(
        [sys.executable, "-m", "gateway", "simulate", "--host", "127.0.0.1",
         "--port", str(sim_port), "--max-batch", str(args.slots)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    sim_url = f"http://127.0.0.1:{sim_port}"
    gateway: Any = None
    try:
        await wait_ready(sim_url, "/health")
        capacity = args.capacity
        if capacity is None and not args.quick:
            print(f"calibrating: closed loop against the simulator ({args.slots} slots) ...")
            calibration = await child(
                "--role", "calibrate", "--target", sim_url, "--slots", str(args.slots),
                "--requests", str(8 * args.slots), "--seed", "7", timeout_s=300,
            )  # fmt: skip
            capacity = calibration["capacity_req_s"]
        if capacity is None:
            capacity = DEFAULT_CAPACITY_PER_8_SLOTS * args.slots / 8
        rate = args.load * capacity

        port = free_port()
        kind = InProcessGateway if args.gateway == "inprocess" else SubprocessGateway
        log_path = out_dir / ("soak-quick-gateway.log" if args.quick else "soak-gateway.log")
        gateway = kind(sim_url, args.slots, port, log_path)
        await gateway.start()
        await wait_ready(gateway.url, "/readyz")
        await asyncio.sleep(1.0)
        idle_before = gateway.sample()
        print(
            f"capacity {capacity:.2f} req/s -> load {rate:.2f} req/s ({args.load:.0%}) for "
            f"{duration:.0f} s; sampling every {interval:g} s, warm-up {warmup:.0f} s; "
            f"gateway {args.gateway} on {gateway.url}, simulator {sim_url}"
        )

        samples: list[dict[str, Any]] = []
        loop = asyncio.get_running_loop()
        started = loop.time()
        load = asyncio.create_task(
            child(
                "--role",
                "load",
                "--target",
                gateway.url,
                "--rate",
                str(rate),
                "--duration",
                str(duration),
                "--seed",
                str(args.seed),
                timeout_s=duration + 300,
            )  # fmt: skip
        )
        while not load.done():
            sample = {"t_s": round(loop.time() - started, 1), **gateway.sample()}
            samples.append(sample)
            await asyncio.wait({load}, timeout=interval)
        summary = load.result()
        samples.append({"t_s": round(loop.time() - started, 1), **gateway.sample()})

        idle_after = await settle_idle(gateway, idle_before, within_s=20.0)
        print_table(samples, warmup, duration)
        verdicts, failures = analyse(samples, warmup, duration)
        print("\nslopes after the warm-up (least squares):")
        for key, verdict in verdicts.items():
            print(
                f"  {key:<9} {fmt(verdict['slope_per_min'], 2):>8} /min  "
                f"(growth over the window {fmt(verdict['growth_over_window'], 1)}; "
                f"limit {verdict['threshold_per_min']}/min and {verdict['min_growth']} in total)"
                + ("  LEAK" if verdict["leaking"] else "")
            )
        print(
            "idle before the load: "
            + ", ".join(f"{k}={fmt(idle_before[k])}" for k in ("rss_mb", "fds", "tasks"))
            + "; idle after it: "
            + ", ".join(f"{k}={fmt(idle_after[k])}" for k in ("rss_mb", "fds", "tasks"))
        )
        for key, tolerance in IDLE_TOLERANCE.items():
            if idle_before[key] is None:
                continue
            if idle_after[key] > idle_before[key] + tolerance:
                failures.append(
                    f"{key} did not come back after the load: {idle_before[key]} -> {idle_after[key]}"
                )
        outcomes = Counter(
            json.loads(line).get("outcome")
            for line in log_path.read_text().splitlines()
            if line.startswith("{") and '"event":"request"' in line
        )
        print(
            f"load: {summary['requests']} requests, {summary['ok']} ok, by status "
            f"{summary['by_status']}; TTFT {json.dumps(summary['ttft'])}"
        )
        print(f"gateway log outcomes: {dict(outcomes)}")
        result = {
            "params": {
                "duration_s": duration,
                "interval_s": interval,
                "warmup_s": warmup,
                "load": args.load,
                "capacity_req_s": capacity,
                "rate_req_s": rate,
                "slots": args.slots,
                "gateway": args.gateway,
            },
            "samples": samples,
            "slopes": verdicts,
            "idle_before": idle_before,
            "idle_after": idle_after,
            "load_summary": summary,
            "outcomes": dict(outcomes),
            "failures": failures,
        }
        out = out_dir / ("soak-quick.json" if args.quick else "soak.json")
        out.write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {out} and the gateway's request log {log_path}")
        if failures:
            print("\nFAIL: " + "; ".join(failures))
            return 1
        print("\nOK: nothing grows after the warm-up")
        return 0
    finally:
        if gateway is not None:
            await gateway.stop()
        stop_process(simulator)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--duration", type=float, help="seconds of load (default 180; 30 with --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="~30 s smoke, no calibration run")
    parser.add_argument(
        "--interval", type=float, help="seconds between samples (5; 2 with --quick)"
    )
    parser.add_argument("--warmup", type=float, help="seconds excluded from the slopes")
    parser.add_argument("--load", type=float, default=0.7, help="fraction of the capacity")
    parser.add_argument("--capacity", type=float, help="requests/s; skips the calibration run")
    parser.add_argument("--slots", type=int, default=8, help="simulator batch = gateway slots")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--gateway", choices=("inprocess", "subprocess"), default="inprocess",
        help="run the gateway in this process (tasks visible) or as `gateway serve`",
    )  # fmt: skip
    parser.add_argument("--out-dir", default=str(ROOT / "results"), help="where the JSON goes")
    # Internal: this script runs its load generator and calibration as child processes.
    parser.add_argument("--role", choices=("calibrate", "load"), help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=32, help=argparse.SUPPRESS)
    return parser


def main() -> int:
    args = build_parser().parse_args()
    if args.role:
        return run_child_role(args)
    if not (0 < args.load <= 2 and args.slots >= 1):
        raise SystemExit("--load must be in (0, 2] and --slots >= 1")
    try:
        return asyncio.run(soak(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
