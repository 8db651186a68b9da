#!/usr/bin/env python3
"""Many gateway replicas as one (issue #11's proof): shared slots, quotas and Redis outages.

Real processes on loopback: `redis-server`, two simulators (default knobs: a
batch of 8) and gateway replicas (`python -m gateway serve`, the default config
but for the backends, `max_concurrency` 8 each, and `[redis] url`). Load is the
load generator's seeded default mix (80% short, 20% long), request i sent to
replica i mod 3, as a round-robin load balancer would. The scenarios:

  slots         bursts of 3x the slots within 3 s through 3 replicas with Redis, 3
                without (the control) and 1 gateway, interleaved: the simulators' own
                peak of requests held at once (`/sim/stats` in_flight_peak, batch +
                queue) never above 8 with Redis, above it without; short P99 TTFT over
                the 3 replicas within 10% of the 1 gateway
  quota         an API key with `tokens_per_minute`, a concurrent burst from all 3
                replicas 2.5x over it: tokens admitted (from the request log lines)
                within 1% of the quota
  kill          SIGKILL a replica holding every slot mid-stream while the others queue:
                its leases gone from Redis (read there) and the slots filled by the
                others within the lease TTL + one tick
  redis-outage  SIGTERM Redis under steady traffic, start it again 5 s later on the same
                port: no request fails for it, `redis_unavailable` logged and
                `gateway_redis_up 0` scraped, `redis_rejoined`; then a burst: the
                simulators' peak exactly 8 (global count: neither local shares, which
                cannot fill the slots, nor local counts, which overshoot)
  lease-cost    1 gateway with Redis and 1 without, the same load: `lease_ms` p50/p99 from
                the request log, short TTFT p50/p99 side by side

    python scripts/bench_replicas.py             # ~6 min
    python scripts/bench_replicas.py --quick     # ~3 min, shorter runs, no calibration
    python scripts/bench_replicas.py --scenarios slots,kill --strict

It prints a table and PASS/FAIL per target and writes JSON plus every replica's
config, request log and events to `--out`. It exits 0 whatever the figures (a
benchmark reports them); with `--strict` a FAIL exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from benchlib import Process
from replica_fleet import (
    Children,
    LeaseWatcher,
    RedisServer,
    events,
    gateway_toml,
    peaks,
    redis_binary,
    redis_up_gauge,
    request_lines,
    reset_peaks,
    run_spread,
    sim_stats,
    start_replicas,
    start_simulators,
    wait_sims_idle,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.config import ApiKeySettings, RedisSettings  # noqa: E402
from gateway.tools.loadgen import (  # noqa: E402
    DEFAULT_MIX,
    PlannedRequest,
    RunResult,
    TrafficClass,
    closed_schedule,
    poisson_schedule,
    run_closed_loop,
    summarize_run,
)
from gateway.tools.loadgen.prompts import with_run_tag  # noqa: E402
from gateway.tools.stats import percentile  # noqa: E402

SCENARIOS = ("slots", "quota", "kill", "redis-outage", "lease-cost")
#: Requests/s of the default mix on one default simulator with 8 slots while the other
#: runs too (this script's calibration measured 2.85 for both on a 2-core machine);
#: `--quick` uses it instead of calibrating. It sets the steady loads, not the bursts.
CAPACITY_PER_8_SLOTS = 1.4
#: Refusals a gateway is meant to give under load: not failures.
EXPECTED_429 = ("queue_full", "wait_too_long", "quota_exceeded")
DEFAULTS = RedisSettings()
TENANT_KEY = "bench-replicas-tenant-key"

Check = tuple[str, bool | None, str]


@dataclass
class Context:
    args: argparse.Namespace
    out_dir: Path
    children: Children
    redis: RedisServer
    sims: list[Process]
    session: aiohttp.ClientSession
    capacity: float
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def slots(self) -> int:
        return int(self.args.slots)

    def duration(self, full: float, quick: float) -> float:
        if self.args.duration is not None:
            return float(self.args.duration)
        return quick if self.args.quick else full


# ---------------------------------------------------------------------------- helpers


def fmt_ms(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return (
        f"{value:.0f}"
        if abs(value) >= 100
        else f"{value:.1f}"
        if abs(value) >= 10
        else f"{value:.2f}"
    )


def class_pct(summary: dict[str, Any], cls: str, metric: str, q: str) -> float | None:
    value = summary.get(cls, {}).get(metric, {}).get(q)
    return None if value is None else float(value)


def failures(run: RunResult) -> Counter[str]:
    """Answers that are neither a success nor one of the 429s a gateway is meant to give."""
    return Counter(
        f"{r.status}/{r.error_code}"
        for r in run.results
        if not r.ok and not (r.status == 429 and r.error_code in EXPECTED_429)
    )


def refusals(run: RunResult) -> Counter[str]:
    return Counter(
        str(r.error_code) for r in run.results if r.status == 429 and r.error_code in EXPECTED_429
    )


def counter_text(counts: Counter[str] | dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"


def print_checks(title: str, checks: Sequence[Check]) -> None:
    print(f"  targets ({title}):")
    for name, passed, detail in checks:
        label = "n/a " if passed is None else "PASS" if passed else "FAIL"
        print(f"    [{label}] {name}: {detail}")


async def fleet(
    ctx: Context, tag: str, count: int, *, redis: bool, extra: str = ""
) -> list[Process]:
    """`count` replicas in front of the simulators, then quiet simulators with fresh peaks."""
    toml = gateway_toml(
        ctx.sims,
        ctx.slots,
        redis_url=ctx.redis.url if redis else "",
        key_prefix=f"bench-{tag}",
        extra=extra,
    )
    replicas = await start_replicas(ctx.children, tag, count, toml, ctx.out_dir)
    await wait_sims_idle(ctx.session, ctx.sims)  # the replicas' start-up probes are done
    await reset_peaks(ctx.session, ctx.sims)
    return replicas


def pool_runs(runs: Sequence[RunResult]) -> RunResult:
    """Several runs' results as one (percentiles over all of them)."""
    return RunResult(
        target=runs[0].target if runs else "",
        results=[r for run in runs for r in run.results],
        wall_s=sum(run.wall_s for run in runs),
    )


async def held_by_sims(ctx: Context) -> list[int]:
    """Requests each simulator holds right now (its batch and its queue)."""
    return [int((await sim_stats(ctx.session, sim))["in_flight"]) for sim in ctx.sims]


async def calibrate(ctx_args: argparse.Namespace, sims: Sequence[Process]) -> float:
    """Requests/s the simulators complete for the default mix with every slot busy."""
    requests = 3 * ctx_args.slots
    runs = await asyncio.gather(
        *(
            run_closed_loop(
                sim.url,
                closed_schedule(DEFAULT_MIX, requests, ctx_args.seed + 100 + i),
                concurrency=ctx_args.slots,
            )
            for i, sim in enumerate(sims)
        )
    )
    return sum(sum(r.ok for r in run.results) / run.wall_s for run in runs)


# ------------------------------------------------------------------- 1. slots hold


async def scenario_slots(ctx: Context) -> list[Check]:
    """The same bursts through 1 gateway, 3 replicas with Redis and 3 without, interleaved
    (ABC, CBA, ...) so that whatever else the machine does lands on all of them alike."""
    n, total_slots = ctx.args.replicas, ctx.slots * len(ctx.sims)
    reps = ctx.args.reps or (1 if ctx.args.quick else 3)
    size = round(ctx.args.burst * total_slots)
    window = ctx.args.burst_window
    bursts = [
        poisson_schedule(DEFAULT_MIX, size / window, window, ctx.args.seed + rep)
        for rep in range(reps)
    ]
    print(
        f"\n== slots: {reps} burst(s) of ~{size} requests ({ctx.args.burst:g}x the "
        f"{total_slots} slots) arriving within {window:g} s, {len(ctx.sims)} simulators x "
        f"{ctx.slots} slots"
    )
    targets = {
        "1 gateway": (1, False),
        f"{n} replicas + Redis": (n, True),
        f"{n} replicas, no Redis": (n, False),
    }
    runs: dict[str, list[RunResult]] = {name: [] for name in targets}
    sim_peaks: dict[str, dict[str, int]] = {name: {} for name in targets}
    for rep, burst in enumerate(bursts):
        order = list(targets) if rep % 2 == 0 else list(reversed(targets))
        for name in order:
            count, redis = targets[name]
            tag = f"slots-{count}{'-redis' if redis else ''}-{rep}"
            print(f"  burst {rep + 1}/{reps}: {name}, {len(burst)} requests ...", flush=True)
            replicas = await fleet(ctx, tag, count, redis=redis)
            runs[name].append(await run_spread([r.url for r in replicas], burst, ctx.args.timeout))
            for sim, peak in (await peaks(ctx.session, ctx.sims)).items():
                sim_peaks[name][sim] = max(peak, sim_peaks[name].get(sim, 0))
            ctx.children.stop(replicas)
            await wait_sims_idle(ctx.session, ctx.sims)
    rows: dict[str, dict[str, Any]] = {}
    for name, (count, redis) in targets.items():
        pooled = pool_runs(runs[name])
        rows[name] = {
            "replicas": count,
            "redis": redis,
            "peaks": sim_peaks[name],
            "summary": summarize_run(pooled),
            "refusals": dict(refusals(pooled)),
            "failures": dict(failures(pooled)),
        }
    print(
        f"\n  {'target':<22} {'peak/sim (slots ' + str(ctx.slots) + ')':>22} "
        f"{'short TTFT p50':>14} {'p99':>7} {'long p99':>9} {'ok':>9}  refused / failed"
    )
    for name, row in rows.items():
        s = row["summary"]
        print(
            f"  {name:<22} {'/'.join(str(v) for v in row['peaks'].values()):>22} "
            f"{fmt_ms(class_pct(s, 'short', 'ttft_ms', 'p50')):>14} "
            f"{fmt_ms(class_pct(s, 'short', 'ttft_ms', 'p99')):>7} "
            f"{fmt_ms(class_pct(s, 'long', 'ttft_ms', 'p99')):>9} "
            f"{s['all']['ok']:>4}/{s['all']['count']:<4}  "
            f"{counter_text(row['refusals'])} / {counter_text(row['failures'])}"
        )
    print("  (TTFT in ms, client side; peak = the simulator's own most requests held at once)")
    single, shared, control = (rows[name] for name in targets)
    shared_peak, control_peak = max(shared["peaks"].values()), max(control["peaks"].values())
    p99_single = class_pct(single["summary"], "short", "ttft_ms", "p99")
    p99_shared = class_pct(shared["summary"], "short", "ttft_ms", "p99")
    ratio = p99_shared / p99_single if p99_single and p99_shared else None
    checks: list[Check] = [
        (
            f"with Redis no simulator ever holds more than its {ctx.slots} slots",
            shared_peak <= ctx.slots,
            f"peaks {shared['peaks']}",
        ),
        (
            "the control (no Redis) overshoots: the witness sees what leases prevent",
            control_peak > ctx.slots,
            f"peaks {control['peaks']} ({control_peak / ctx.slots:.1f}x the slots)",
        ),
        (
            f"short P99 TTFT over {n} replicas within 10% of 1 gateway",
            ratio is not None and ratio <= 1.10,
            f"{fmt_ms(p99_shared)} vs {fmt_ms(p99_single)} ms"
            + (f" ({ratio:.2f}x)" if ratio else ""),
        ),
    ]
    ctx.report["slots"] = {
        "bursts": reps,
        "burst_requests": size,
        "window_s": window,
        "targets": rows,
    }
    return checks


# ------------------------------------------------------------------- 2. tenant quota


def quotas_available() -> bool:
    return "tokens_per_minute" in ApiKeySettings.__struct_fields__


async def send_with_key(
    session: aiohttp.ClientSession, url: str, planned: PlannedRequest, tag: str, at_s: float
) -> dict[str, Any]:
    """One non-streamed chat request as the tenant, `at_s` into the burst; what came
    back, headers included."""
    await asyncio.sleep(at_s)
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": with_run_tag(planned.prompt, tag)}],
        "max_tokens": planned.max_tokens,
    }
    headers = {
        "Authorization": f"Bearer {TENANT_KEY}",
        "x-request-id": f"quota-{tag}-{planned.index}",
    }
    out: dict[str, Any] = {"index": planned.index}
    try:
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            out["status"] = resp.status
            out["retry_after"] = resp.headers.get("Retry-After")
            out["limit_tokens"] = resp.headers.get("x-ratelimit-limit-tokens")
            data = await resp.json(content_type=None)
            if resp.status == 200:
                usage = data.get("usage") or {}
                out["usage_tokens"] = int(usage.get("prompt_tokens", 0)) + int(
                    usage.get("completion_tokens", 0)
                )
            else:
                out["code"] = (data.get("error") or {}).get("code")
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out["status"], out["code"] = None, type(exc).__name__
    return out


async def seconds_into_redis_minute(watcher: LeaseWatcher) -> float:
    seconds, micros = await watcher.client.time()
    return (int(seconds) % 60) + int(micros) / 1e6


async def scenario_quota(ctx: Context) -> list[Check]:
    quota = ctx.args.quota_tokens
    prompt_tokens, max_tokens = 40, 10
    size = prompt_tokens + max_tokens
    count = math.ceil(2.5 * quota / size)
    n = ctx.args.replicas
    print(
        f"\n== quota: tokens_per_minute {quota}, a burst of {count} requests of ~{size} "
        f"tokens ({prompt_tokens} prompt + max_tokens {max_tokens}) within "
        f"{ctx.args.quota_window:g} s over {n} replicas"
    )
    if not quotas_available():
        print("  not run: [[api_keys]] has no tokens_per_minute in this tree")
        return [("tokens admitted within 1% of the quota", None, "quotas not built yet")]
    extra = f'[[api_keys]]\nname = "tenant"\nkey = "{TENANT_KEY}"\ntokens_per_minute = {quota}\n'
    replicas = await fleet(ctx, "quota", n, redis=True, extra=extra)
    watcher = LeaseWatcher(ctx.redis.url, "bench-quota")
    try:
        # A burst inside one minute of Redis's clock, whatever window the quota keeps.
        into = await seconds_into_redis_minute(watcher)
        if into > 45:
            await asyncio.sleep(61 - into)
    finally:
        await watcher.close()
    schedule = closed_schedule(
        [TrafficClass("tenant", 1.0, (prompt_tokens, prompt_tokens), max_tokens)],
        count,
        ctx.args.seed + 7,
    )
    before = [await sim_stats(ctx.session, sim) for sim in ctx.sims]
    spacing_s = ctx.args.quota_window / count
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=ctx.args.timeout)
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as burst:
        answers = await asyncio.gather(
            *(
                send_with_key(burst, replicas[p.index % n].url, p, "424242", p.index * spacing_s)
                for p in schedule
            )
        )
    burst_s = time.monotonic() - started
    await wait_sims_idle(ctx.session, ctx.sims)
    after = [await sim_stats(ctx.session, sim) for sim in ctx.sims]
    ctx.children.stop(replicas)
    lines = request_lines(replicas)
    fallbacks = {r.name: len(events(r, "redis_unavailable")) for r in replicas}

    ok_lines = [line for line in lines if line.get("status") == 200]
    field_name = "quota_tokens" if any("quota_tokens" in line for line in lines) else None
    if field_name:
        admitted = sum(int(line.get("quota_tokens") or 0) for line in ok_lines)
        measure = "quota_tokens (reserved: prompt + max_tokens) of the 200 lines"
    else:
        admitted = sum(
            int(line.get("prompt_tokens") or 0) + int(line.get("max_tokens") or 0)
            for line in ok_lines
        )
        measure = "prompt_tokens + max_tokens of the 200 lines"
    outcomes = Counter(str(line.get("outcome")) for line in lines)
    statuses = Counter(f"{a.get('status')}/{a.get('code') or '-'}" for a in answers)
    refused = [a for a in answers if a.get("code") == "quota_exceeded"]
    with_retry_after = sum(1 for a in refused if a.get("retry_after"))
    with_limit = sum(1 for a in refused if a.get("limit_tokens") == str(quota))
    failed = Counter(
        f"{a.get('status')}/{a.get('code')}"
        for a in answers
        if a.get("status") != 200 and not (a.get("status") == 429 and a.get("code") in EXPECTED_429)
    )
    usage_tokens = sum(int(a.get("usage_tokens") or 0) for a in answers)
    reached = sum(
        int(b["received"]) - int(a["received"]) for a, b in zip(before, after, strict=True)
    )
    ok_clients = sum(1 for a in answers if a.get("status") == 200)
    print(f"  burst answered in {burst_s:.1f} s: {counter_text(statuses)}")
    print(f"  log outcomes: {counter_text(outcomes)}")
    print(f"  fallbacks to local quotas during the burst (redis_unavailable): {fallbacks}")
    print(
        f"  tokens admitted: {admitted} ({measure}); usage the clients got back: "
        f"{usage_tokens}; requests that reached the simulators: {reached} (200s: {ok_clients})"
    )
    other = {k: v for k, v in outcomes.items() if k not in ("ok", "rejected_quota_exceeded")}
    checks: list[Check] = [
        (
            "tokens admitted within 1% of the quota",
            abs(admitted - quota) <= 0.01 * quota,
            f"{admitted} of {quota} ({admitted / quota:.2%})"
            + (f"; refused after admission (reservation given back) {other}" if other else "")
            + (f"; fallbacks {fallbacks}" if any(fallbacks.values()) else ""),
        ),
        (
            "over the quota: 429 quota_exceeded with Retry-After and x-ratelimit-limit-tokens",
            bool(refused)
            and all(a.get("status") == 429 for a in refused)
            and with_retry_after == with_limit == len(refused),
            f"{len(refused)} refused, {with_retry_after} with Retry-After, {with_limit} with "
            f"x-ratelimit-limit-tokens {quota}",
        ),
        ("no request failed (other than the 429s)", not failed, counter_text(failed)),
        (
            "the simulators saw exactly the admitted requests",
            reached == ok_clients == len(ok_lines),
            f"{reached} reached, {ok_clients} answered 200, {len(ok_lines)} logged 200",
        ),
    ]
    ctx.report["quota"] = {
        "quota_tokens_per_minute": quota,
        "requests": count,
        "admitted_tokens": admitted,
        "measure": measure,
        "usage_tokens": usage_tokens,
        "statuses": dict(statuses),
        "outcomes": dict(outcomes),
        "burst_s": burst_s,
        "redis_unavailable": fallbacks,
    }
    return checks


# --------------------------------------------------------------- 3. SIGKILL a replica


async def stream_until_cut(session: aiohttp.ClientSession, url: str, max_tokens: int) -> str:
    """One streamed request held open; how it ended (`ok`, `cut`, `status/code`)."""
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                data = await resp.json(content_type=None)
                return f"{resp.status}/{(data.get('error') or {}).get('code')}"
            async for _ in resp.content.iter_any():
                pass
            return "ok"
    except (aiohttp.ClientError, TimeoutError):
        return "cut"


async def scenario_kill(ctx: Context) -> list[Check]:
    n = ctx.args.replicas
    total_slots = ctx.slots * len(ctx.sims)
    ttl, tick = DEFAULTS.lease_ttl_s, DEFAULTS.interval_s
    print(
        f"\n== kill: replica 0 holds all {total_slots} slots with streams, replicas 1-{n - 1} "
        f"queue {total_slots} more; SIGKILL replica 0 (lease TTL {ttl:g} s, tick {tick:.2f} s)"
    )
    replicas = await fleet(ctx, "kill", n, redis=True)
    victim, others = replicas[0], replicas[1:]
    watcher = LeaseWatcher(ctx.redis.url, "bench-kill")
    connector = aiohttp.TCPConnector(limit=0)
    session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120))
    tasks: list[asyncio.Task[str]] = []
    waiters: list[asyncio.Task[str]] = []
    try:

        async def victim_leases() -> tuple[int, int]:
            mine = total = 0
            for sim in ctx.sims:
                for member in await watcher.live(sim.url):
                    total += 1
                    mine += LeaseWatcher.pid_of(member) == victim.popen.pid
            return mine, total

        tasks = [
            asyncio.create_task(stream_until_cut(session, victim.url, 3000))
            for _ in range(total_slots)
        ]
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if (await victim_leases())[0] >= total_slots:
                break
            await asyncio.sleep(0.05)
        held_before, _ = await victim_leases()
        # Bulk-lane requests (max_tokens over the interactive lane's 256): 30 s of patience.
        waiters = [
            asyncio.create_task(stream_until_cut(session, others[i % len(others)].url, 300))
            for i in range(total_slots)
        ]
        await asyncio.sleep(1.0)
        in_flight_before = sum(await held_by_sims(ctx))
        killed = time.monotonic()
        victim.popen.send_signal(signal.SIGKILL)
        victim.popen.wait(timeout=5)
        leases_gone: float | None = None
        refilled: float | None = None
        timeline: list[tuple[float, int, int, int]] = []
        while time.monotonic() - killed < ttl + tick + 10:
            t = time.monotonic() - killed
            mine, total = await victim_leases()
            in_flight = sum(await held_by_sims(ctx))
            timeline.append((round(t, 2), mine, total, in_flight))
            if leases_gone is None and mine == 0:
                leases_gone = t
            if refilled is None and in_flight >= total_slots:
                refilled = t
            if leases_gone is not None and refilled is not None:
                break
            await asyncio.sleep(0.05)
        ended_waiters = Counter(await asyncio.gather(*waiters))
        ended_victims = Counter(await asyncio.gather(*tasks))
    finally:
        for task in [*tasks, *waiters]:
            task.cancel()
        await session.close()
        await watcher.close()
    ctx.children.stop(replicas)
    await wait_sims_idle(ctx.session, ctx.sims)
    bound = ttl + tick
    print(
        f"  before the kill: replica 0 held {held_before} leases; the simulators held "
        f"{in_flight_before} requests (the others' {total_slots} waited)"
    )
    print(
        f"  after SIGKILL: replica 0's leases gone from Redis at "
        f"{'-' if leases_gone is None else f'{leases_gone:.2f} s'}; every slot busy again "
        f"(the others' requests on the simulators) at "
        f"{'-' if refilled is None else f'{refilled:.2f} s'}; bound TTL + tick {bound:.2f} s"
    )
    print(
        f"  replica 0's streams: {counter_text(ended_victims)}; the others' requests: "
        f"{counter_text(ended_waiters)}"
    )
    checks: list[Check] = [
        (
            "the killed replica's leases are gone from Redis within TTL + one tick",
            leases_gone is not None and leases_gone <= bound and held_before == total_slots,
            f"{'-' if leases_gone is None else f'{leases_gone:.2f}'} s (bound {bound:.2f} s; "
            f"it held {held_before}/{total_slots})",
        ),
        (
            "the other replicas fill every slot again within TTL + one tick",
            refilled is not None and refilled <= bound,
            f"{'-' if refilled is None else f'{refilled:.2f}'} s (bound {bound:.2f} s)",
        ),
        (
            "no request on the surviving replicas failed",
            set(ended_waiters) == {"ok"},
            counter_text(ended_waiters),
        ),
    ]
    ctx.report["kill"] = {
        "lease_ttl_s": ttl,
        "tick_s": tick,
        "held_before": held_before,
        "leases_gone_s": leases_gone,
        "refilled_s": refilled,
        "timeline_s_victim_total_inflight": timeline,
        "victim_streams": dict(ended_victims),
        "others": dict(ended_waiters),
    }
    return checks


# ----------------------------------------------------------------- 4. Redis outage


async def scenario_redis_outage(ctx: Context) -> list[Check]:
    """Steady traffic across an outage, then (alone, after the rejoin) a burst."""
    n, total_slots = ctx.args.replicas, ctx.slots * len(ctx.sims)
    down_at, outage = 6.0, 5.0
    duration = ctx.duration(30.0, 16.0)
    rate = ctx.args.outage_load * ctx.capacity
    schedule = poisson_schedule(DEFAULT_MIX, rate, duration, ctx.args.seed + 3)
    window = ctx.args.burst_window
    burst_size = round(ctx.args.burst * total_slots)
    burst = poisson_schedule(DEFAULT_MIX, burst_size / window, window, ctx.args.seed + 4)
    print(
        f"\n== redis-outage: {len(schedule)} requests over {duration:.0f} s ({rate:.2f} req/s) "
        f"on {n} replicas; Redis SIGTERM at {down_at:g} s, back on port {ctx.redis.port} "
        f"{outage:g} s later; then a burst of {len(burst)} within {window:g} s (local shares "
        f"could not fill the {total_slots} slots, local counts would overshoot them)"
    )
    replicas = await fleet(ctx, "outage", n, redis=True)
    urls = [r.url for r in replicas]
    timeline: dict[str, Any] = {}
    seen_down: dict[str, bool] = {r.name: False for r in replicas}
    up_after: dict[str, float | None] = {}
    outage_peaks: dict[str, int] = {}
    start = time.monotonic()

    def now() -> float:
        return round(time.monotonic() - start, 2)

    def all_rejoined() -> bool:
        return all(events(r, "redis_rejoined") for r in replicas)

    async def break_redis() -> None:
        await asyncio.sleep(down_at)
        await asyncio.to_thread(ctx.redis.stop)
        timeline["redis_stopped_s"] = now()
        while time.monotonic() - start < down_at + outage:
            for replica in replicas:
                if await redis_up_gauge(ctx.session, replica) == 0:
                    seen_down[replica.name] = True
            await asyncio.sleep(0.25)
        outage_peaks.update(await peaks(ctx.session, ctx.sims))
        await asyncio.to_thread(ctx.redis.start)
        timeline["redis_started_s"] = now()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if all_rejoined():
                break
            await asyncio.sleep(0.1)
        timeline["all_rejoined_s"] = now() if all_rejoined() else None
        for replica in replicas:
            up_after[replica.name] = await redis_up_gauge(ctx.session, replica)

    breaker = asyncio.create_task(break_redis())
    steady = await run_spread(urls, schedule, ctx.args.timeout)
    await breaker
    timeline["steady_done_s"] = now()
    # Requests dispatched on local shares during the outage are over by now; the burst
    # alone, so that its peak is the global count's and not the steady traffic's tail.
    await wait_sims_idle(ctx.session, ctx.sims)
    await reset_peaks(ctx.session, ctx.sims)
    timeline["burst_at_s"] = now()
    burst_run = await run_spread(urls, burst, ctx.args.timeout)
    timeline["burst_done_s"] = now()
    burst_peaks = await peaks(ctx.session, ctx.sims)
    ctx.children.stop(replicas)
    await wait_sims_idle(ctx.session, ctx.sims)
    if ctx.redis.process is None:
        await asyncio.to_thread(ctx.redis.start)
    unavailable = {r.name: len(events(r, "redis_unavailable")) for r in replicas}
    rejoined = {r.name: len(events(r, "redis_rejoined")) for r in replicas}
    failed, burst_failed = failures(steady), failures(burst_run)
    summary, burst_summary = summarize_run(steady), summarize_run(burst_run)
    print(
        f"  steady: {summary['all']['ok']}/{summary['all']['count']} ok; refused "
        f"{counter_text(refusals(steady))}; failed {counter_text(failed)}"
    )
    print(f"  timeline: {timeline}")
    print(
        f"  redis_unavailable logged {unavailable}; gateway_redis_up 0 scraped {seen_down}; "
        f"redis_rejoined {rejoined}; gateway_redis_up after {up_after}"
    )
    print(
        f"  simulator peaks: up to the end of the outage {outage_peaks}; the burst after the "
        f"rejoin {burst_peaks} (slots {ctx.slots}): {burst_summary['all']['ok']}/"
        f"{burst_summary['all']['count']} ok, refused {counter_text(refusals(burst_run))}, "
        f"failed {counter_text(burst_failed)}"
    )
    checks: list[Check] = [
        ("no request failed because Redis did", not failed, counter_text(failed)),
        (
            "the fallback is logged (redis_unavailable) and scraped (gateway_redis_up 0) "
            "on every replica",
            all(unavailable.values()) and all(seen_down.values()),
            f"logged {unavailable}, scraped {seen_down}",
        ),
        (
            "every replica rejoins (redis_rejoined, gateway_redis_up 1)",
            all(rejoined.values()) and all(v == 1 for v in up_after.values()),
            f"all at {timeline.get('all_rejoined_s')} s; up {up_after}",
        ),
        (
            "after the rejoin the count is global: a burst fills every simulator's slots, "
            "never more",
            all(peak == ctx.slots for peak in burst_peaks.values()),
            f"peaks {burst_peaks} (slots {ctx.slots}); the burst's own failures (an overload "
            f"of {ctx.args.burst:g}x the slots, not Redis): {counter_text(burst_failed)}",
        ),
    ]
    ctx.report["redis_outage"] = {
        "rate_req_s": rate,
        "timeline": timeline,
        "steady": summary["all"],
        "failures": dict(failed),
        "refusals": dict(refusals(steady)),
        "redis_unavailable": unavailable,
        "redis_up_0_scraped": seen_down,
        "redis_rejoined": rejoined,
        "redis_up_after": up_after,
        "outage_peaks": outage_peaks,
        "burst": burst_summary["all"],
        "burst_peaks": burst_peaks,
    }
    return checks


# ------------------------------------------------------------------- 5. lease cost


async def scenario_lease_cost(ctx: Context) -> list[Check]:
    duration = ctx.duration(40.0, 15.0)
    rate = ctx.args.cost_load * ctx.capacity
    schedule = poisson_schedule(DEFAULT_MIX, rate, duration, ctx.args.seed + 5)
    print(
        f"\n== lease-cost: 1 gateway with Redis vs without, {len(schedule)} requests over "
        f"{duration:.0f} s ({rate:.2f} req/s)"
    )
    rows: dict[str, dict[str, Any]] = {}
    for name, redis in (("without Redis", False), ("with Redis", True)):
        print(f"  {name} ...", flush=True)
        replicas = await fleet(ctx, f"cost-{'redis' if redis else 'local'}", 1, redis=redis)
        run = await run_spread([replicas[0].url], schedule, ctx.args.timeout)
        ctx.children.stop(replicas)
        await wait_sims_idle(ctx.session, ctx.sims)
        lines = request_lines(replicas)
        leases = [float(x["lease_ms"]) for x in lines if x.get("lease_ms") is not None]
        queue = [float(x["queue_ms"]) for x in lines if x.get("queue_ms") is not None]
        rows[name] = {
            "summary": summarize_run(run),
            "lease_ms": {
                "count": len(leases),
                "p50": percentile(leases, 50),
                "p99": percentile(leases, 99),
                "max": max(leases, default=None),
            },
            "queue_ms_p50": percentile(queue, 50),
            "failures": dict(failures(run)),
        }
    print(
        f"\n  {'target':<14} {'lease p50':>9} {'p99':>6} {'max':>6} {'n':>5} | "
        f"{'short TTFT p50':>14} {'p99':>6} | {'queue p50':>9} {'ok':>9}"
    )
    for name, row in rows.items():
        s, lease = row["summary"], row["lease_ms"]
        print(
            f"  {name:<14} {fmt_ms(lease['p50']):>9} {fmt_ms(lease['p99']):>6} "
            f"{fmt_ms(lease['max']):>6} {lease['count']:>5} | "
            f"{fmt_ms(class_pct(s, 'short', 'ttft_ms', 'p50')):>14} "
            f"{fmt_ms(class_pct(s, 'short', 'ttft_ms', 'p99')):>6} | "
            f"{fmt_ms(row['queue_ms_p50']):>9} {s['all']['ok']:>4}/{s['all']['count']:<4}"
        )
    print("  (ms; lease_ms from the request log lines, TTFT client side)")
    local, shared = rows["without Redis"], rows["with Redis"]
    lease = shared["lease_ms"]
    p50 = [class_pct(r["summary"], "short", "ttft_ms", "p50") for r in (local, shared)]
    p99 = [class_pct(r["summary"], "short", "ttft_ms", "p99") for r in (local, shared)]
    delta = (
        f"short TTFT with Redis {fmt_ms(p50[1])} / {fmt_ms(p99[1])} ms (p50 / p99) vs "
        f"{fmt_ms(p50[0])} / {fmt_ms(p99[0])} without"
    )
    checks: list[Check] = [
        (
            "every dispatch with Redis logs its lease_ms",
            lease["count"] > 0 and lease["count"] >= shared["summary"]["all"]["ok"],
            f"{lease['count']} lease_ms for {shared['summary']['all']['ok']} ok requests",
        ),
        (
            "lease p99 <= 10 ms on loopback (one Lua round trip, never the fallback timeout)",
            lease["p99"] is not None and lease["p99"] <= 10.0,
            f"p50 {fmt_ms(lease['p50'])} ms, p99 {fmt_ms(lease['p99'])} ms; {delta}",
        ),
    ]
    ctx.report["lease_cost"] = {"rate_req_s": rate, "duration_s": duration, "targets": rows}
    return checks


# ------------------------------------------------------------------------------ main

RUNNERS: dict[str, Callable[[Context], Awaitable[list[Check]]]] = {
    "slots": scenario_slots,
    "lease-cost": scenario_lease_cost,
    "kill": scenario_kill,
    "redis-outage": scenario_redis_outage,
    "quota": scenario_quota,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="shorter runs, no calibration (~3 min)"
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated, of {', '.join(SCENARIOS)} (default: all)",
    )
    parser.add_argument("--replicas", type=int, default=3, help="gateway replicas (3)")
    parser.add_argument("--slots", type=int, default=8, help="max_concurrency per simulator (8)")
    parser.add_argument(
        "--burst",
        type=float,
        default=3.0,
        help="requests in a slots burst, as a multiple of all the slots (3: 48 on 2 x 8)",
    )
    parser.add_argument(
        "--burst-window", type=float, default=3.0, help="seconds a burst arrives within (3)"
    )
    parser.add_argument("--reps", type=int, help="bursts per slots target (3; quick 1)")
    parser.add_argument(
        "--outage-load", type=float, default=0.6, help="steady load during the Redis outage (0.6)"
    )
    parser.add_argument(
        "--cost-load", type=float, default=0.5, help="load of the lease-cost runs (0.5)"
    )
    parser.add_argument(
        "--quota-tokens", type=int, default=6000, help="the tenant's tokens_per_minute (6000)"
    )
    parser.add_argument(
        "--quota-window", type=float, default=2.0, help="seconds the quota burst is sent over (2)"
    )
    parser.add_argument("--duration", type=float, help="seconds of arrivals per run (overrides)")
    parser.add_argument(
        "--capacity", type=float, help="req/s of both simulators; skips calibration"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0, help="client timeout per request")
    parser.add_argument("--out", default="results/bench_replicas", help="folder for logs and JSON")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target FAILs")
    args = parser.parse_args()
    args.scenario_list = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(args.scenario_list) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    if args.replicas < 2 or args.slots < 1:
        parser.error("--replicas must be >= 2 and --slots >= 1")
    return args


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # so that `finally` stops every child by its PID


async def main() -> int:
    args = parse_args()
    binary = redis_binary()
    if binary is None:
        print("redis-server is not installed (Debian: apt-get install redis-server)")
        return 2
    out_dir = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _terminate)
    children = Children()
    started = time.monotonic()
    all_checks: dict[str, list[Check]] = {}
    try:
        children.redis = redis = RedisServer(binary)
        redis.start()
        sims = await start_simulators(children)
        capacity = args.capacity
        if capacity is None and not args.quick:
            print("calibrating: closed loop on both simulators, every slot busy ...", flush=True)
            capacity = await calibrate(args, sims)
        if capacity is None:
            capacity = CAPACITY_PER_8_SLOTS * args.slots / 8 * len(sims)
        print(
            f"redis-server {redis.url}; simulators {', '.join(s.url for s in sims)}; "
            f"{args.slots} slots each; capacity {capacity:.2f} req/s (default mix)"
        )
        async with aiohttp.ClientSession() as session:
            ctx = Context(args, out_dir, children, redis, sims, session, capacity)
            ctx.report.update(params={k: v for k, v in vars(args).items()}, capacity=capacity)
            for name in [s for s in RUNNERS if s in args.scenario_list]:
                checks = await RUNNERS[name](ctx)
                print_checks(name, checks)
                all_checks[name] = checks
            report = ctx.report
    finally:
        children.stop_all()
    print(f"\n== targets (issue #11), whole run {time.monotonic() - started:.0f} s")
    for name, checks in all_checks.items():
        for target, passed, detail in checks:
            label = "n/a " if passed is None else "PASS" if passed else "FAIL"
            print(f"  [{label}] {name}: {target}: {detail}")
    report["checks"] = {
        name: [{"target": t, "passed": p, "figures": d} for t, p, d in checks]
        for name, checks in all_checks.items()
    }
    path = out_dir / ("bench_replicas_quick.json" if args.quick else "bench_replicas.json")
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {path}; configs, request logs and events in {out_dir}")
    failed = any(p is False for checks in all_checks.values() for _, p, _ in checks)
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        sys.exit(130)
