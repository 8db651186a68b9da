#!/usr/bin/env python3
"""Fair share between tenants: can one client take a lane from the others?

Issue #25's proof. One simulator (4 slots, ~0.6 s a short request) and two gateway
processes in front of it with the default config plus API keys, one with
`[tenants] fair_share = true` (the default) and one with it off (first come). Each
tenant sends streamed short chats (~50 prompt tokens, 32 out: the interactive
lane) on its own seeded Poisson schedule.

  flood    tenant A at 3x what the backend serves, B and C at 0.5 req/s each, in
           three runs: A absent (B and C alone), first come, fair. B's and C's P99
           TTFT against their P99 alone plus the wait for one slot to free (a
           request's service time over the slots: no scheduler that does not
           preempt can avoid it), their refusals, and A's throughput.
  weights  two tenants with weights 2 and 1, both backlogged (each at 1.5x capacity):
           the work each was served (the log's cost_tokens, by dispatch time) in
           every 30 s window, first come and fair.
  return   tenant D backlogged throughout; E backlogged, then idle for a minute,
           then backlogged again: E's share in each 10 s window after it returns
           (its share is half; a counter that banked its idle minute would give it
           all of the backend for a while).

    python scripts/bench_fairness.py            # ~12 min
    python scripts/bench_fairness.py --quick    # shorter runs, ~5 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
from benchlib import ROOT, Process, request_log_lines, start_gateway, start_simulator

sys.path.insert(0, str(ROOT))

from gateway.tools.stats import percentile  # noqa: E402

SLOTS = 4
#: Simulator step time: 33 steps of a 32-token answer take ~0.6 s at 4 in the batch.
STEP_BASE_MS = 16.0
PROMPT_WORDS = 40  # ~50 tokens with the chat template
#: Answers of 16 to 48 tokens (32 on average), as chat turns vary: all of one length,
#: the simulator's batch would end a flood's requests in lockstep, four at a time.
MAX_TOKENS = (16, 48)
KEYS = {name: f"bench-key-{name}-0000" for name in ("A", "B", "C", "W2", "W1", "D", "E")}
WEIGHTS = {"W2": 2.0}
CONFIGS = ("fcfs", "fair")


def gateway_config(backend: str, fair: bool) -> str:
    keys = "".join(
        f'[[api_keys]]\nname = "{name}"\nkey = "{key}"\nweight = {WEIGHTS.get(name, 1.0)}\n'
        for name, key in KEYS.items()
    )
    return (
        f"[tenants]\nfair_share = {'true' if fair else 'false'}\n"
        f'[[backends]]\nurl = "{backend}"\nname = "sim"\nmax_concurrency = {SLOTS}\n' + keys
    )


@dataclass
class Result:
    tenant: str
    sent_at: float
    status: int = 0
    code: str | None = None
    ttft_s: float | None = None


@dataclass
class Load:
    """Each tenant's arrival times (seconds from the start of the run)."""

    arrivals: dict[str, list[float]] = field(default_factory=dict)

    def add(self, tenant: str, rate: float, start: float, end: float, seed: int) -> None:
        rng = random.Random(seed)
        times, t = [], start
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            times.append(t)
        self.arrivals.setdefault(tenant, []).extend(times)


def has_content(line: bytes) -> bool:
    """An SSE line carrying the answer's first text (not the role chunk, not [DONE])."""
    if not line.startswith(b"data:") or b'"content"' not in line:
        return False
    try:
        event = json.loads(line[5:])
    except ValueError:
        return False
    return bool(event.get("choices") and event["choices"][0].get("delta", {}).get("content"))


async def send(
    session: aiohttp.ClientSession, url: str, tenant: str, t0: float, max_tokens: int
) -> Result:
    result = Result(tenant, time.monotonic() - t0)
    body = {
        "model": "sim-model",
        "stream": True,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": " ".join(["word"] * PROMPT_WORDS)}],
    }
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    started = time.monotonic()
    try:
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            result.status = r.status
            if r.status != 200:
                result.code = r.headers.get("x-gateway-refusal")
                await r.read()
                return result
            async for line in r.content:
                if result.ttft_s is None and has_content(line):
                    result.ttft_s = time.monotonic() - started
    except (aiohttp.ClientError, TimeoutError) as error:
        result.code = type(error).__name__
    return result


async def run(url: str, load: Load) -> list[Result]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.monotonic()

        async def at(when: float, tenant: str, max_tokens: int) -> Result:
            await asyncio.sleep(max(0.0, when - (time.monotonic() - t0)))
            return await send(session, url, tenant, t0, max_tokens)

        rng = random.Random(len(load.arrivals))
        tasks = [
            at(when, tenant, rng.randint(*MAX_TOKENS))
            for tenant, times in load.arrivals.items()
            for when in times
        ]
        return list(await asyncio.gather(*tasks))


def tenant_figures(results: list[Result], tenant: str) -> dict[str, Any]:
    mine = [r for r in results if r.tenant == tenant]
    ttfts = [r.ttft_s * 1000 for r in mine if r.ttft_s is not None]
    return {
        "sent": len(mine),
        "ok": sum(r.status == 200 for r in mine),
        "refused": dict(Counter(r.code or str(r.status) for r in mine if r.status != 200)),
        "ttft_p50_ms": percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_ms": percentile(ttfts, 99) if ttfts else None,
    }


def light_p99(results: list[Result]) -> float | None:
    ttfts = [r.ttft_s * 1000 for r in results if r.tenant in ("B", "C") and r.ttft_s is not None]
    return percentile(ttfts, 99) if ttfts else None


def dispatched_at(line: dict[str, Any]) -> float | None:
    if line.get("queue_ms") is None or line.get("e2e_ms") is None:
        return None
    end = datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()
    return end - line["e2e_ms"] / 1000 + line["queue_ms"] / 1000


def service_by_window(
    lines: list[dict[str, Any]], tenants: tuple[str, ...], window_s: float
) -> list[dict[str, float]]:
    """The work each tenant was served (cost_tokens), by the window of its dispatch."""
    served = [
        (dispatched_at(x), x) for x in lines if x.get("cost_tokens") and x["tenant"] in tenants
    ]
    served = [(t, x) for t, x in served if t is not None]
    if not served:
        return []
    start = min(t for t, _ in served)
    windows: dict[int, dict[str, float]] = {}
    for t, line in served:
        bucket = windows.setdefault(int((t - start) // window_s), dict.fromkeys(tenants, 0.0))
        bucket[line["tenant"]] += line["cost_tokens"]
    return [windows[k] for k in sorted(windows)]


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


async def measure_service_s(url: str) -> float:
    """One short request's time on the backend with all its slots busy (closed loop)."""
    async with aiohttp.ClientSession() as session:
        body = {
            "model": "sim-model",
            "max_tokens": sum(MAX_TOKENS) // 2,
            "messages": [{"role": "user", "content": " ".join(["word"] * PROMPT_WORDS)}],
        }

        async def one() -> float:
            started = time.monotonic()
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                await r.read()
            return time.monotonic() - started

        times: list[float] = []
        for _ in range(3):
            times += await asyncio.gather(*(one() for _ in range(SLOTS)))
        return statistics.median(times)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (~5 min)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/bench_fairness", help="folder for JSON, logs")
    args = parser.parse_args()
    flood_s = 60.0 if args.quick else 120.0
    weights_s = 60.0 if args.quick else 120.0
    idle_s = 30.0 if args.quick else 60.0
    out_dir = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    processes: list[Process] = []
    summary: dict[str, Any] = {"args": vars(args)}
    try:
        simulator = await start_simulator(
            ["--max-batch", str(SLOTS), "--step-base-ms", str(STEP_BASE_MS)]
        )
        processes.append(simulator)
        gateways = {}
        for name in CONFIGS:
            gateways[name] = await start_gateway(
                name,
                gateway_config(simulator.url, name == "fair"),
                out_dir / f"{name}.toml",
                out_dir / f"{name}.log",
            )
            processes.append(gateways[name])
        service_s = await measure_service_s(simulator.url)
        capacity = SLOTS / service_s
        summary.update(service_s=service_s, capacity_rps=capacity)
        print(
            f"backend: {SLOTS} slots, a short request {service_s * 1000:.0f} ms with all busy "
            f"-> capacity {capacity:.1f} req/s; one slot frees every "
            f"{service_s / SLOTS * 1000:.0f} ms",
            flush=True,
        )

        # -- flood: A at 3x capacity, B and C at 0.5 req/s -------------------------------
        light = Load()
        light.add("B", 0.5, 0.0, flood_s, args.seed + 1)
        light.add("C", 0.5, 0.0, flood_s, args.seed + 2)
        flooded = Load({k: list(v) for k, v in light.arrivals.items()})
        flooded.add("A", 3.0 * capacity, 0.0, flood_s, args.seed + 3)
        flood_runs: dict[str, list[Result]] = {}
        for name, url, load in (
            ("alone", gateways["fair"].url, light),
            ("fcfs", gateways["fcfs"].url, flooded),
            ("fair", gateways["fair"].url, flooded),
        ):
            print(
                f"flood: {name} ({sum(map(len, load.arrivals.values()))} requests) ...", flush=True
            )
            flood_runs[name] = await run(url, load)
            await asyncio.sleep(2.0)
        flood = {
            name: {t: tenant_figures(results, t) for t in ("A", "B", "C")}
            | {"light_p99_ms": light_p99(results)}
            for name, results in flood_runs.items()
        }
        summary["flood"] = flood
        alone_p99 = flood["alone"]["light_p99_ms"] or 0.0
        one_slot_ms = service_s / SLOTS * 1000
        print(f"\n== flood: A at 3x capacity ({3 * capacity:.1f} req/s), B and C at 0.5 req/s")
        print(f"{'run':<7}{'tenant':>7}{'sent':>6}{'ok':>6}{'p50 ms':>8}{'p99 ms':>8}  refused")
        for name in ("alone", "fcfs", "fair"):
            for tenant in ("A", "B", "C"):
                f = flood[name][tenant]
                if not f["sent"]:
                    continue
                print(
                    f"{name:<7}{tenant:>7}{f['sent']:>6}{f['ok']:>6}{fmt(f['ttft_p50_ms']):>8}"
                    f"{fmt(f['ttft_p99_ms']):>8}  {f['refused'] or ''}"
                )
        fair_p99, fcfs_p99 = flood["fair"]["light_p99_ms"], flood["fcfs"]["light_p99_ms"]
        bound = alone_p99 + one_slot_ms
        a_ratio = flood["fair"]["A"]["ok"] / max(1, flood["fcfs"]["A"]["ok"])
        served = {
            name: sum(flood[name][t]["ok"] for t in ("A", "B", "C")) for name in ("fcfs", "fair")
        }
        total_ratio = served["fair"] / max(1, served["fcfs"])
        # What B and C leave of what the backend serves in the run (its measured capacity).
        left = capacity * flood_s - flood["fair"]["B"]["ok"] - flood["fair"]["C"]["ok"]
        light_refused = sum(sum(flood["fair"][t]["refused"].values()) for t in ("B", "C"))
        print(
            f"B+C P99 TTFT: alone {fmt(alone_p99)} ms, first come {fmt(fcfs_p99)} ms, fair "
            f"{fmt(fair_p99)} ms; bound alone + one slot's wait {fmt(bound)} ms "
            f"(alone + a whole request's time {fmt(alone_p99 + service_s * 1000)} ms)"
        )
        if fair_p99 and fcfs_p99:
            print(f"  first come / fair: {fcfs_p99 / fair_p99:.1f}x (target >= 5x)")
        print(
            f"  B and C refused under fair: {light_refused}; A refused under fair: "
            f"{sum(flood['fair']['A']['refused'].values())}; A served fair/first come: "
            f"{a_ratio:.1%}; all served fair/first come: {total_ratio:.1%}; A got "
            f"{flood['fair']['A']['ok']} of the ~{left:.0f} B and C left "
            f"({flood['fair']['A']['ok'] / left:.0%})"
        )
        summary["flood_checks"] = {
            "bound_ms": bound,
            "fair_p99_ms": fair_p99,
            "fcfs_p99_ms": fcfs_p99,
            "light_refused_fair": light_refused,
            "a_served_ratio": a_ratio,
            "all_served_ratio": total_ratio,
        }

        # -- weights: 2 and 1, both backlogged -------------------------------------------
        both = Load()
        both.add("W2", 1.5 * capacity, 0.0, weights_s, args.seed + 4)
        both.add("W1", 1.5 * capacity, 0.0, weights_s, args.seed + 5)
        print(f"\n== weights 2:1, both at 1.5x capacity, {weights_s:.0f} s", flush=True)
        weights: dict[str, Any] = {}
        for name in CONFIGS:
            log = gateways[name].log_path
            assert log is not None
            mark = len(log.read_text().splitlines())
            await run(gateways[name].url, both)
            await asyncio.sleep(1.5)
            windows = service_by_window(request_log_lines(log, mark), ("W2", "W1"), 30.0)
            ratios = [w["W2"] / w["W1"] if w["W1"] else None for w in windows]
            weights[name] = {"windows": windows, "ratios": ratios}
            shown = ", ".join("-" if r is None else f"{r:.2f}" for r in ratios)
            print(f"  {name:<5} W2/W1 service per 30 s window: {shown}")
        full = [r for r in weights["fair"]["ratios"][:-1] if r is not None]  # the last is partial
        within = all(abs(r / 2.0 - 1) <= 0.10 for r in full)
        print(f"  fair: every full window within 10% of 2.0: {within}")
        summary["weights"] = weights | {"within_10pct": within}

        # -- return: E idle for a minute comes back --------------------------------------
        back_at = 30.0 + idle_s
        ret = Load()
        ret.add("D", 1.5 * capacity, 0.0, back_at + 30.0, args.seed + 6)
        ret.add("E", 1.5 * capacity, 0.0, 30.0, args.seed + 7)
        ret.add("E", 1.5 * capacity, back_at, back_at + 30.0, args.seed + 8)
        log = gateways["fair"].log_path
        assert log is not None
        mark = len(log.read_text().splitlines())
        print(f"\n== return: E idle for {idle_s:.0f} s, then back", flush=True)
        await run(gateways["fair"].url, ret)
        await asyncio.sleep(1.5)
        windows = service_by_window(request_log_lines(log, mark), ("D", "E"), 10.0)
        shares = [w["E"] / (w["D"] + w["E"]) if w["D"] + w["E"] else None for w in windows]
        first_back = int(back_at // 10)
        after = shares[first_back : first_back + 3]
        shown = ", ".join("-" if s is None else f"{s:.0%}" for s in after)
        print(f"  E's share of the work in the 10 s windows after it returns: {shown}")
        summary["return"] = {"windows": windows, "e_shares": shares, "after_return": after}
    finally:
        for process in reversed(processes):
            process.stop()
    print(f"\n(wall time {time.monotonic() - started:.0f} s; logs and JSON in {out_dir})")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
