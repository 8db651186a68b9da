#!/usr/bin/env python3
"""A retry storm: 30% of clients retry refusals at once, no backoff, at 120% load.

Issue #27's proof of "Retries, damped". One simulator (8 slots, the default mix: 80%
short chats, 20% 3000-token prompts) and two gateway processes in front of it, the
default config with `[retries] damp = true` (the default) and with `damp = false`.
The same seeded open-loop schedule at 120% of the backend's measured capacity is
sent to each in turn by `loadgen`'s client: 30% of the requests (by index, the same
in both runs) come from clients that retry every refusal at once, without backoff and
ignoring Retry-After (`RetryPolicy.eager_share`), the others from clients that retry
at most twice with backoff and honour Retry-After (the seed's advice). Every client
reuses its x-request-id across attempts, as clients that set one do.

From each gateway's own request log (`retry_of` tells a copy from new work):

  queue share   the share of all queue time (the sum of `queue_ms`: the queue's
                occupancy integrated over the run) held by retries
  attempts      requests the gateway handled per new one, and the refusals
  short P99     TTFT of the short (interactive) requests served as new work
  goodput       new requests served within their lane's TTFT objective (5 s short,
                10 s long, the lanes' queue timeouts), per second of arrivals

and, from the clients' side, how many polite clients' requests were damped (a client
that honours Retry-After must never be) and how many requests of each kind were
served in the end.

    python scripts/bench_retry_storm.py                # ~2.5 min
    python scripts/bench_retry_storm.py --duration 20  # shorter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchlib import ROOT, Process, request_log_lines, start_gateway, start_simulator

sys.path.insert(0, str(ROOT))

from gateway.tools.loadgen import (  # noqa: E402
    DEFAULT_MIX,
    RetryPolicy,
    RunResult,
    closed_schedule,
    poisson_schedule,
    run_closed_loop,
    run_open_loop,
)
from gateway.tools.stats import percentile  # noqa: E402

SLOTS = 8
CONFIGS = ("undamped", "damped")
#: TTFT objective per lane: the default lanes' queue timeouts.
TTFT_SLO_MS = {"interactive": 5_000.0, "bulk": 10_000.0}


#: The default lanes with the bulk lane's queue timeout (and promotion) shortened from
#: 30 s (10 s) to 10 s (5 s): the queue reaches its steady state of refusals within
#: seconds, not a minute, so a bounded run is mostly storm.
LANES = """
[[lanes]]
name = "interactive"
max_prompt_tokens = 1024
max_output_tokens = 256
queue_timeout_s = 5.0

[[lanes]]
name = "bulk"
queue_timeout_s = 10.0
max_queue_depth = 64
promote_after_s = 5.0
"""


def gateway_config(backend: str, damp: bool) -> str:
    return (
        f'[[backends]]\nurl = "{backend}"\nname = "sim"\nmax_concurrency = {SLOTS}\n'
        f"[retries]\ndamp = {'true' if damp else 'false'}\n" + LANES
    )


async def measure_capacity(gateway: str) -> float:
    """Requests/s the backend completes for the mix through the gateway when never idle
    (a closed loop of twice its slots): with lanes and the prefill budget it serves more
    than the backend alone, so 120% of the backend's own figure would be no overload."""
    sample = closed_schedule(DEFAULT_MIX, 80, seed=99)
    run = await run_closed_loop(gateway, sample, concurrency=2 * SLOTS)
    return sum(r.ok for r in run.results) / run.wall_s


def log_length(path: Path) -> int:
    return len(path.read_text().splitlines())


def queued(line: dict[str, Any]) -> bool:
    """Whether a request took a place in its lane's queue (was not refused at arrival)."""
    outcome = line.get("outcome") or ""
    return line.get("queue_ms") is not None and not outcome.startswith("rejected_")


def cpu_s(process: Process) -> float:
    """User + system CPU seconds the child has used so far (Linux /proc)."""
    fields = Path(f"/proc/{process.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def figures(
    lines: list[dict[str, Any]], run: RunResult, duration_s: float, gateway_cpu_s: float
) -> dict[str, Any]:
    """What the gateway's log and the clients say about one run."""
    new = [x for x in lines if x.get("retry_of") is None]
    copies = [x for x in lines if x.get("retry_of") is not None]
    eager_ids = {r.request_id for r in run.results if r.eager}
    eager_copies = [x for x in copies if x["request_id"] in eager_ids]
    queue_all = sum(x.get("queue_ms") or 0.0 for x in lines)
    queue_copies = sum(x.get("queue_ms") or 0.0 for x in copies)
    queue_eager = sum(x.get("queue_ms") or 0.0 for x in eager_copies)
    short_new = [
        x["ttft_ms"]
        for x in new
        if x.get("lane") == "interactive" and x.get("outcome") == "ok" and x.get("ttft_ms")
    ]
    short_all = [
        x["ttft_ms"]
        for x in lines
        if x.get("lane") == "interactive" and x.get("outcome") == "ok" and x.get("ttft_ms")
    ]

    def good(x: dict[str, Any]) -> bool:
        ttft = x.get("ttft_ms")
        slo = TTFT_SLO_MS.get(x.get("lane") or "", 0.0)
        return x.get("outcome") == "ok" and ttft is not None and ttft <= slo

    eager = [r for r in run.results if r.eager]
    polite = [r for r in run.results if not r.eager]
    polite_ids = {r.request_id for r in polite}
    return {
        "requests": len(run.results),
        "attempts": len(lines),
        "retries": len(copies),
        "retries_damped": sum(bool(x.get("retry_damped")) for x in copies),
        "retried_after": dict(Counter(x["retried_outcome"] for x in copies)),
        "new_refused": sum(x.get("status") in (429, 503) for x in new),
        "refusals": dict(
            Counter(
                x["error_code"] for x in lines if x.get("error_code") and not x.get("retry_damped")
            )
        ),
        "queue_s_all": queue_all / 1000.0,
        "queue_s_retries": queue_copies / 1000.0,
        "queue_share_retries": queue_copies / queue_all if queue_all else 0.0,
        "queue_s_eager_copies": queue_eager / 1000.0,
        "queue_share_eager_copies": queue_eager / queue_all if queue_all else 0.0,
        "eager_copies": len(eager_copies),
        "eager_copies_measured": sum(x.get("prompt_tokens") is not None for x in eager_copies),
        "eager_copies_queued": sum(queued(x) for x in eager_copies),
        "gateway_cpu_s": gateway_cpu_s,
        "mean_queued_retries": queue_copies / 1000.0 / duration_s,
        "mean_queued_all": queue_all / 1000.0 / duration_s,
        "short_p99_ttft_new_ms": percentile(short_new, 99) if short_new else None,
        "short_p50_ttft_new_ms": percentile(short_new, 50) if short_new else None,
        "short_p99_ttft_all_ms": percentile(short_all, 99) if short_all else None,
        "new_served": sum(x.get("outcome") == "ok" for x in new),
        "new_goodput_rps": sum(good(x) for x in new) / duration_s,
        "all_goodput_rps": sum(good(x) for x in lines) / duration_s,
        "eager_served": sum(r.ok for r in eager),
        "eager_requests": len(eager),
        "polite_served": sum(r.ok for r in polite),
        "polite_requests": len(polite),
        "polite_damped": sum(
            bool(x.get("retry_damped")) for x in copies if x["request_id"] in polite_ids
        ),
        "wall_s": run.wall_s,
    }


def fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def table(summary: dict[str, dict[str, Any]]) -> str:
    rows = [
        ("requests (new)", "requests", "d"),
        ("attempts the gateway saw", "attempts", "d"),
        ("  of which retries", "retries", "d"),
        ("  retries damped", "retries_damped", "d"),
        ("queue time, all (s)", "queue_s_all", ".1f"),
        ("queue time held by retries (s)", "queue_s_retries", ".1f"),
        ("share of the queue held by retries", "queue_share_retries", ".1%"),
        ("  by eager clients' copies (s)", "queue_s_eager_copies", ".1f"),
        ("  share held by eager copies", "queue_share_eager_copies", ".1%"),
        ("eager copies", "eager_copies", "d"),
        ("  measured and scheduled (not damped)", "eager_copies_measured", "d"),
        ("  that took a place in the queue", "eager_copies_queued", "d"),
        ("gateway CPU during the run (s)", "gateway_cpu_s", ".1f"),
        ("mean requests queued (all)", "mean_queued_all", ".2f"),
        ("mean retries queued", "mean_queued_retries", ".2f"),
        ("short P50 TTFT, new requests (ms)", "short_p50_ttft_new_ms", ".0f"),
        ("short P99 TTFT, new requests (ms)", "short_p99_ttft_new_ms", ".0f"),
        ("short P99 TTFT, all served (ms)", "short_p99_ttft_all_ms", ".0f"),
        ("new requests served", "new_served", "d"),
        ("new requests refused (429/503)", "new_refused", "d"),
        ("goodput of new requests (req/s in SLO)", "new_goodput_rps", ".2f"),
        ("goodput, all attempts (req/s in SLO)", "all_goodput_rps", ".2f"),
        ("eager clients' requests served", "eager_served", "d"),
        ("polite clients' requests served", "polite_served", "d"),
        ("polite clients' attempts damped", "polite_damped", "d"),
    ]
    width = max(len(label) for label, _, _ in rows) + 2
    out = [f"{'':<{width}}" + "".join(f"{name:>12}" for name in CONFIGS)]
    for label, key, spec in rows:
        out.append(
            f"{label:<{width}}" + "".join(f"{fmt(summary[n][key], spec):>12}" for n in CONFIGS)
        )
    return "\n".join(out)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=50.0, help="seconds of arrivals (50)")
    parser.add_argument("--load", type=float, default=1.2, help="share of capacity (1.2)")
    parser.add_argument("--eager-share", type=float, default=0.3, help="eager clients (0.3)")
    parser.add_argument("--eager-retries", type=int, default=50, help="their retries (50)")
    parser.add_argument("--capacity", type=float, help="requests/s; skips the calibration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--reverse", action="store_true", help="run damped first (an order effect shows)"
    )
    parser.add_argument("--out", default="results/bench_retry_storm", help="folder for JSON, logs")
    args = parser.parse_args()
    out_dir = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    processes: list[Process] = []
    summary: dict[str, Any] = {"args": vars(args)}
    try:
        simulator = await start_simulator(["--max-batch", str(SLOTS)])
        processes.append(simulator)
        gateways = {}
        for name in CONFIGS:
            gateways[name] = await start_gateway(
                name,
                gateway_config(simulator.url, name == "damped"),
                out_dir / f"{name}.toml",
                out_dir / f"{name}.log",
            )
            processes.append(gateways[name])
        capacity = args.capacity or await measure_capacity(gateways["undamped"].url)
        rate = args.load * capacity
        schedule = poisson_schedule(DEFAULT_MIX, rate, args.duration, args.seed)
        retry = RetryPolicy(
            max_attempts=3,
            backoff_s=0.5,
            max_backoff_s=10.0,
            eager_share=args.eager_share,
            eager_attempts=args.eager_retries + 1,
        )
        print(
            f"backend: {SLOTS} slots, capacity {capacity:.2f} req/s for the default mix; "
            f"load {args.load:.0%}: {rate:.2f} req/s for {args.duration:g} s "
            f"({len(schedule)} requests), {args.eager_share:.0%} of them from clients that "
            f"retry at once (up to {args.eager_retries} times)",
            flush=True,
        )
        summary.update(capacity_rps=capacity, rate_rps=rate, planned=len(schedule))
        results: dict[str, dict[str, Any]] = {}
        for name in reversed(CONFIGS) if args.reverse else CONFIGS:
            print(f"run: {name} ...", flush=True)
            log = gateways[name].log_path
            assert log is not None
            mark = log_length(log)  # the calibration's lines are not the run's
            cpu_before = cpu_s(gateways[name])
            run = await run_open_loop(gateways[name].url, schedule, retry=retry, timeout_s=120)
            await asyncio.sleep(1.5)  # the last log lines
            used = cpu_s(gateways[name]) - cpu_before
            results[name] = figures(request_log_lines(log, mark), run, args.duration, used)
            await asyncio.sleep(3.0)  # the backend idle again before the next run
        summary["runs"] = results
    finally:
        for process in reversed(processes):
            process.stop()
    print()
    print(table(results))
    for name in CONFIGS:
        print(f"  {name}: refusals, damped ones aside {results[name]['refusals']}")
        print(f"  {name}: retries after {results[name]['retried_after']}")
    print(f"\n(wall time {time.monotonic() - started:.0f} s; logs and JSON in {out_dir})")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
