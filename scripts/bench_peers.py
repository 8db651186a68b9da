#!/usr/bin/env python3
"""The peers benchmark: the routers users would pick instead, beside this gateway, same traffic.

Each target gets, in simulator mode, its own fresh pair of vLLM-like engines
(`python -m gateway simulate --max-batch 16 --prefill chunked
--prefill-tokens-per-step 512`, on free loopback ports), and the same seeded
Poisson schedule at ~80% and 120% of the pair's measured capacity:

  direct        no router: the client spreads requests round robin over the two engines
  vllm-router   vllm-router 0.1.17 (PyPI): `--worker-urls A B --disable-retries`, all
                else default (policy cache_aware; `--max-concurrent-requests` left at
                its 32768: its help calls it a rate limit, "for rate limiting", with a
                token bucket refilled at `--rate-limit-tokens-per-second`, not a batch
                size, and on this version 2 of it let 5 simultaneous streams start at once,
                so setting it to the engines' 32 slots would change nothing)
  smg           SGLang Model Gateway (smg 1.13.0, PyPI): `smg launch --worker-urls A B`,
                all defaults (retries on: they only act on failed sends, which the
                simulator never gives)
  smg-priority  smg with its priority scheduler, as a well-informed user runs it:
                `--priority-scheduler-enabled --priority-scheduler-default-max-class
                interactive` (without the second flag every tenant not listed in a
                scheduler YAML is clamped to `default`: an `interactive` label silently
                becomes `default`), each engine registered with `POST /workers
                {"url": ..., "labels": {"max_running_requests": "16"}}` (the scheduler's
                slots are the sum of that label, 64 per worker when absent; it is not
                `--max-concurrent-requests`), and every request labelled by the client
                with `x-smg-priority`: shorts `interactive`, longs `bulk`. A request it
                preempts before it started gets an empty 200: counted as broken. Its
                built-in class defaults (no `--priority-scheduler-config`) reserve slots
                for system and interactive and none for bulk: on 2 x 16 slots it logs
                15 system, 15 interactive, 1 default, 0 bulk, 1 unreserved, and runs the
                longs about one at a time (the peaks it prints show it)
  gateway       this gateway, fresh, its default config with the two engines as two
                `[[backends]]` (url and name only: slots as it finds them)

Traffic: 80% shorts (~50-token prompts, 64 tokens out), 20% longs (~3000-token
prompts, 512 out), streamed chat completions with unique prompt openings and
`ignore_eos` (`--no-ignore-eos` to leave it out). Capacity is measured as
bench_tail does: a closed loop (2 x slots workers) straight on each engine, the two
at once, summed (`--capacity` skips it).

Per target and load it reports short and long TTFT P50/P99 (of completed answers),
completions, refusals by status, broken answers (a 200 whose stream carried no
content token, ended before `[DONE]` or carried an error event), client timeouts,
and completed tokens/s; a markdown table, and JSON in `--out`. For smg-priority it
also keeps the scheduler's own counters (admissions and clamps per class), for
the gateway the lane each request took and `/debug/backends` after the run.

    python scripts/bench_peers.py                                # simulators, 120 s per run
    python scripts/bench_peers.py --duration 30 --targets direct,smg-priority,gateway
    python scripts/bench_peers.py --backend http://A:8000 --backend http://B:8000 --slots 64
    python scripts/bench_peers.py --backend http://127.0.0.1:8101 --slots 8 --model gemma \
        --mix config/mix-vllm.toml --capacity 1.42       # one real vLLM, bench_tail's mix
    python scripts/bench_peers.py --overhead                     # per-request cost, mock backend

With `--backend` (real engines, twice or a comma list) the targets run one after
another against the same engines, `--pause` seconds apart. `--overhead` measures
instead what each router adds per request in front of one fast mock backend
(`scripts/overhead_mock_backend.py`), beside direct, in interleaved rounds
(`scripts/bench_overhead.py` has a fixed set of targets and takes no URLs).

The routers come from `--peers-venv` (default `.venv-peers` in the repository,
installed by `scripts/peers.sh` when missing). Everything listens on 127.0.0.1;
every process started is stopped by its PID at the end, errors included, and the
whole run is bounded by `--max-seconds`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from benchlib import Process, free_port, wait_ready
from benchlib import start_gateway as start_gateway_process
from benchlib import start_simulator as start_simulator_process

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.tools.loadgen import (  # noqa: E402
    DEFAULT_MIX,
    PlannedRequest,
    RequestResult,
    RetryPolicy,
    RunResult,
    TrafficClass,
    closed_schedule,
    poisson_schedule,
    resolve_mix,
    run_closed_loop,
)
from gateway.tools.loadgen.client import Client  # noqa: E402
from gateway.tools.stats import percentile  # noqa: E402

TARGETS = ("direct", "vllm-router", "smg", "smg-priority", "gateway")
#: 80% ~50-token prompts with 64 out, 20% ~3000-token prompts with 512 out (`--mix`
#: names another, or a TOML file of classes as bench_tail takes).
MIX: list[TrafficClass] = list(DEFAULT_MIX)
BATCH = 16
SIMULATOR_FLAGS = (
    *("--max-batch", str(BATCH)),
    *("--prefill", "chunked", "--prefill-tokens-per-step", "512"),
)
#: smg-priority's labels, as a client that knows its traffic sets them.
SMG_CLASSES = {"short": "interactive", "long": "bulk"}
SMG_PRIORITY_HEADER = "x-smg-priority"
#: smg-priority's gauges sampled during a run: the most in flight and queued per class.
SMG_PEAK_GAUGES = ("smg_scheduler_inflight{", "smg_scheduler_queue_depth{")
PEER_VERSIONS = {"vllm-router": "0.1.17", "smg": "1.13.0"}


# ------------------------------------------------------------------------- processes


def die_with_parent() -> None:
    """In a router child: SIGTERM when this script dies without cleaning up."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class Router(Process):
    """A router child; `metrics_url`: its Prometheus listener."""

    metrics_url: str | None = None


def start_child(
    name: str, argv: Sequence[str], url: str, log_path: Path, metrics_url: str | None = None
) -> Router:
    """A router binary on 127.0.0.1, its output to `log_path`, stopped by PID (`Process.stop`)."""
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            list(argv),
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
    return Router(name, url, popen, log_path, metrics_url)


def peer_binaries(venv: Path) -> dict[str, Path]:
    """The two routers' binaries in `venv`; installed there by scripts/peers.sh when missing."""
    wanted = {name: venv / "bin" / name for name in ("vllm-router", "smg")}
    if not all(path.exists() for path in wanted.values()):
        print(f"installing the peers into {venv} (scripts/peers.sh) ...", flush=True)
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "peers.sh")],
            env={**os.environ, "VENV": str(venv)},
            check=True,
            stdout=subprocess.DEVNULL,
        )
    missing = [str(path) for path in wanted.values() if not path.exists()]
    if missing:
        raise SystemExit(f"missing peer binaries: {', '.join(missing)}")
    return wanted


def vllm_router_argv(
    binary: Path, port: int, metrics_port: int, backends: Sequence[str]
) -> list[str]:
    """vllm-router with its defaults, retries off (a failed send is not resent elsewhere)."""
    return [
        str(binary),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)),
        "--worker-urls",
        *backends,
        "--disable-retries",
    ]


def smg_argv(
    binary: Path, port: int, metrics_port: int, backends: Sequence[str], priority: bool
) -> list[str]:
    """`smg launch` with its defaults; with `priority`, the scheduler on and no workers
    (they are registered with their slots by `register_smg_workers`)."""
    argv = [
        str(binary),
        "launch",
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)),
    ]
    if priority:
        return argv + [
            "--priority-scheduler-enabled",
            *("--priority-scheduler-default-max-class", "interactive"),
        ]
    return argv + ["--worker-urls", *backends]


def gateway_config(backends: Sequence[str]) -> str:
    """The default config; the engines as `[[backends]]`, url and name only."""
    return "".join(
        f'[[backends]]\nurl = "{url}"\nname = "engine-{chr(ord("a") + i)}"\n\n'
        for i, url in enumerate(backends)
    )


async def smg_workers(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with session.get(url + "/workers") as resp:
        data = await resp.json(content_type=None)
    workers = data.get("workers") if isinstance(data, dict) else None
    return workers if isinstance(workers, list) else []


async def wait_smg_workers(
    url: str, backends: Sequence[str], check: Any, timeout_s: float = 60
) -> list[dict[str, Any]]:
    """Poll smg's `GET /workers` until every backend is there, healthy."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            check()
            try:
                workers = await smg_workers(session, url)
            except (aiohttp.ClientError, ValueError):
                workers = []
            ready = {w.get("url") for w in workers if w.get("is_healthy")}
            if set(backends) <= ready:
                return workers
            await asyncio.sleep(0.25)
    raise SystemExit(f"smg at {url} did not list {list(backends)} as healthy in {timeout_s:g} s")


async def register_smg_workers(url: str, backends: Sequence[str], slots: int) -> None:
    """`POST /workers` per engine, its `max_running_requests` label set to its batch."""
    async with aiohttp.ClientSession() as session:
        for backend in backends:
            body = {"url": backend, "labels": {"max_running_requests": str(slots)}}
            async with session.post(url + "/workers", json=body) as resp:
                if resp.status >= 300:
                    text = await resp.text()
                    raise SystemExit(f"smg POST /workers {backend}: {resp.status} {text[:300]}")


async def start_target(
    name: str,
    backends: Sequence[str],
    binaries: dict[str, Path],
    slots: int,
    out_dir: Path,
    tag: str,
) -> Process | None:
    """The router of target `name` in front of `backends` (None for direct)."""
    if name == "direct":
        return None
    if name == "gateway":
        return await start_gateway_process(
            name,
            gateway_config(backends),
            out_dir / f"{tag}-gateway.toml",
            out_dir / f"{tag}-gateway.log",
        )
    port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = out_dir / f"{tag}-{name}.log"
    if name == "vllm-router":
        argv = vllm_router_argv(binaries["vllm-router"], port, metrics_port, backends)
    elif name in ("smg", "smg-priority"):
        argv = smg_argv(binaries["smg"], port, metrics_port, backends, name == "smg-priority")
    else:
        raise SystemExit(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
    process = start_child(name, argv, url, log_path, f"http://127.0.0.1:{metrics_port}")
    try:
        await wait_ready(url, "/health", check=process.check_alive)
        if name == "smg-priority":
            await register_smg_workers(url, backends, slots)
        if name.startswith("smg"):
            await wait_smg_workers(url, backends, process.check_alive)
    except BaseException:
        process.stop()
        raise
    return process


# ------------------------------------------------------------------------------ runs


def _session(headers: dict[str, str]) -> aiohttp.ClientSession:
    # As loadgen's open loop: no connection limit, so the client never queues requests.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=None),
        headers=headers,
    )


def route_of(
    planned: PlannedRequest, urls: Sequence[str], class_headers: dict[str, dict[str, str]]
) -> tuple[str, str]:
    """(URL, header set key) of a request: the URLs taken round robin by index (a client
    spreading its own requests), the headers by its class (smg's priority label)."""
    url = urls[planned.index % len(urls)]
    return url, planned.cls if planned.cls in class_headers else ""


async def run_schedule(
    target: str,
    urls: Sequence[str],
    schedule: Sequence[PlannedRequest],
    *,
    class_headers: dict[str, dict[str, str]] | None = None,
    timeout_s: float,
    model: str,
    extra_body: dict[str, Any],
) -> RunResult:
    """Open loop (loadgen's `Client`, one clock): each request at its `at_s`, to its route."""
    class_headers = class_headers or {}
    run_tag = str(secrets.randbelow(900_000) + 100_000)
    header_sets = {"": {}, **class_headers}
    sessions = {key: _session(headers) for key, headers in header_sets.items()}
    try:
        clients = {
            (url, key): Client(
                session,
                url,
                retry=RetryPolicy(),
                timeout_s=timeout_s,
                model=model,
                extra_body=extra_body,
                run_tag=run_tag,
            )
            for url in urls
            for key, session in sessions.items()
        }
        loop = asyncio.get_running_loop()
        start = loop.time()
        for client in clients.values():
            client.start = start
        tasks: list[asyncio.Task[RequestResult]] = []
        try:
            for planned in sorted(schedule, key=lambda p: p.at_s):
                delay = start + planned.at_s - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                client = clients[route_of(planned, urls, class_headers)]
                tasks.append(asyncio.create_task(client.send(planned)))
            results = list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
        wall_s = loop.time() - start
    finally:
        for session in sessions.values():
            await session.close()
    results.sort(key=lambda r: r.index)
    return RunResult(target, results, wall_s, run_tag)


async def measure_capacity(
    mix: Sequence[TrafficClass],
    backends: Sequence[str],
    sample_size: int,
    slots: int,
    model: str,
    seed: int,
    extra: dict[str, Any],
) -> float:
    """Requests/s the engines complete for this mix when never idle: a closed loop of
    2 x slots workers on each engine (as bench_tail does on one), all at once, summed."""
    runs = await asyncio.gather(
        *(
            run_closed_loop(
                url,
                closed_schedule(list(mix), sample_size, seed + 1 + i),
                concurrency=2 * slots,
                model=model,
                extra_body=extra,
            )
            for i, url in enumerate(backends)
        )
    )
    return sum(sum(r.ok for r in run.results) / run.wall_s for run in runs)


# --------------------------------------------------------------------------- figures


def outcome(result: RequestResult) -> str:
    """completed, refused (a 4xx/5xx), broken (a 200 without an answer), timeout or no_answer.

    Broken: the status was 200 but the stream carried no content token (smg's answer
    to a request it preempted), ended before `[DONE]`, or carried an error event.
    """
    if result.error_code == "client_timeout":
        return "timeout"
    if result.status is None:
        return "no_answer"
    if result.status != 200:
        return "refused"
    if result.error_code is not None or result.content_chunks == 0:
        return "broken"
    return "completed"


def ms(values: Sequence[float], q: float, digits: int = 1) -> float | None:
    value = percentile(values, q)
    return None if value is None else round(value, digits)


def class_figures(results: Sequence[RequestResult]) -> dict[str, Any]:
    """One class's (or all requests') counts and TTFT percentiles of completed answers."""
    outcomes = [outcome(r) for r in results]
    ttfts = [
        r.ttft_ms
        for r, o in zip(results, outcomes, strict=True)
        if o == "completed" and r.ttft_ms is not None
    ]
    refused: dict[str, int] = {}
    for r, o in zip(results, outcomes, strict=True):
        if o == "refused":
            refused[str(r.status)] = refused.get(str(r.status), 0) + 1
    return {
        "count": len(results),
        "completed": outcomes.count("completed"),
        "refused": dict(sorted(refused.items())),
        "broken": outcomes.count("broken"),
        "timeout": outcomes.count("timeout"),
        "no_answer": outcomes.count("no_answer"),
        "ttft_p50_ms": ms(ttfts, 50),
        "ttft_p99_ms": ms(ttfts, 99),
        "tokens": sum(r.tokens for r, o in zip(results, outcomes, strict=True) if o == "completed"),
    }


def summarize(run: RunResult) -> dict[str, Any]:
    by_class: dict[str, list[RequestResult]] = {}
    for r in run.results:
        by_class.setdefault(r.cls, []).append(r)
    summary = {cls: class_figures(rs) for cls, rs in sorted(by_class.items())}
    summary["all"] = class_figures(run.results)
    summary["all"]["tokens_per_s"] = round(summary["all"]["tokens"] / max(run.wall_s, 1e-9), 1)
    summary["all"]["wall_s"] = round(run.wall_s, 1)
    broken_codes: dict[str, int] = {}
    for r in run.results:
        if outcome(r) == "broken":
            code = r.error_code or "no_content"
            broken_codes[code] = broken_codes.get(code, 0) + 1
    summary["all"]["broken_by_kind"] = broken_codes
    lanes: dict[str, dict[str, int]] = {}
    for r in run.results:
        if r.lane is not None:
            per = lanes.setdefault(r.cls, {})
            per[r.lane] = per.get(r.lane, 0) + 1
    if lanes:
        summary["all"]["gateway_lanes_by_class"] = lanes
    return summary


def seconds(value_ms: float | None) -> str:
    if value_ms is None or math.isnan(value_ms):
        return "-"
    value = value_ms / 1000.0
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def table(rows: Sequence[tuple[float, str, dict[str, Any]]]) -> str:
    """Markdown, one row per (load, target); TTFT in seconds, of completed answers."""
    lines = [
        "| load | target | short TTFT p50 | short p99 | long TTFT p50 | long p99 "
        "| short done | long done | refused | broken | timed out | tok/s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for load, target, summary in rows:
        short, long_, all_ = summary.get("short", {}), summary.get("long", {}), summary["all"]
        refused = " ".join(f"{k}: {v}" for k, v in all_["refused"].items()) or "0"
        lines.append(
            f"| {load:.0%} | {target} | {seconds(short.get('ttft_p50_ms'))} "
            f"| {seconds(short.get('ttft_p99_ms'))} | {seconds(long_.get('ttft_p50_ms'))} "
            f"| {seconds(long_.get('ttft_p99_ms'))} "
            f"| {short.get('completed', 0)}/{short.get('count', 0)} "
            f"| {long_.get('completed', 0)}/{long_.get('count', 0)} | {refused} "
            f"| {all_['broken']} | {all_['timeout'] + all_['no_answer']} "
            f"| {all_['tokens_per_s']:.0f} |"
        )
    return "\n".join(lines)


async def smg_scheduler_counters(metrics_url: str) -> dict[str, float]:
    """smg's non-zero `smg_scheduler_*_total` samples (admissions, clamps, preemptions ...)."""
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(metrics_url + "/metrics") as resp:
                text = await resp.text()
    except aiohttp.ClientError:
        return {}
    return parse_counters(text, "smg_scheduler_")


def parse_counters(text: str, prefix: str) -> dict[str, float]:
    """Prometheus text: the non-zero `*_total` samples whose name starts with `prefix`."""
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix) or "_total" not in line.split(" ", 1)[0].split("{", 1)[0]:
            continue
        sample, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        if number:
            counters[sample] = number
    return counters


def parse_gauges(text: str, prefix: str) -> dict[str, float]:
    """Prometheus text: every sample whose name starts with `prefix`, by its labels."""
    gauges: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            sample, _, value = line.rpartition(" ")
            try:
                gauges[sample] = float(value)
            except ValueError:
                continue
    return gauges


async def sample_peaks(metrics_url: str, prefixes: Sequence[str], peaks: dict[str, float]) -> None:
    """Until cancelled: every 0.5 s, the highest value seen of each gauge (smg's in-flight
    requests and queue depth per class), into `peaks`."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while True:
            try:
                async with session.get(metrics_url + "/metrics") as resp:
                    text = await resp.text()
                for prefix in prefixes:
                    for sample, value in parse_gauges(text, prefix).items():
                        peaks[sample] = max(value, peaks.get(sample, value))
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.5)


async def gateway_backends(url: str) -> Any:
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/debug/backends") as resp:
                return await resp.json(content_type=None)
    except (aiohttp.ClientError, ValueError):
        return None


# ------------------------------------------------------------------------------ main


@dataclass
class Bench:
    args: argparse.Namespace
    out_dir: Path
    binaries: dict[str, Path]
    extra_body: dict[str, Any]
    processes: list[Process] = field(default_factory=list)

    def stop(self, process: Process | None) -> None:
        if process is not None:
            process.stop()
            if process in self.processes:
                self.processes.remove(process)

    async def engines(self) -> tuple[list[str], list[Process]]:
        """The real engines' URLs, or a fresh pair of simulators."""
        if self.args.backend:
            return list(self.args.backend), []
        sims = []
        for i in range(2):
            sim = await start_simulator_process(SIMULATOR_FLAGS, name=f"simulator-{i}")
            self.processes.append(sim)
            sims.append(sim)
        return [s.url for s in sims], sims


async def one_run(
    bench: Bench, target: str, load: float, schedule: list[PlannedRequest]
) -> dict[str, Any]:
    args = bench.args
    tag = f"{int(load * 100)}"
    backends, sims = await bench.engines()
    router = None
    try:
        router = await start_target(
            target, backends, bench.binaries, args.slots, bench.out_dir, tag
        )
        if router is not None:
            bench.processes.append(router)
        urls = backends if router is None else [router.url]
        class_headers = (
            {cls: {SMG_PRIORITY_HEADER: label} for cls, label in SMG_CLASSES.items()}
            if target == "smg-priority"
            else None
        )
        print(f"    {target:<13} {len(schedule)} requests ...", flush=True)
        peaks: dict[str, float] = {}
        sampler = None
        if isinstance(router, Router) and router.metrics_url and target == "smg-priority":
            sampler = asyncio.create_task(sample_peaks(router.metrics_url, SMG_PEAK_GAUGES, peaks))
        try:
            run = await run_schedule(
                target,
                urls,
                schedule,
                class_headers=class_headers,
                timeout_s=args.timeout,
                model=args.model,
                extra_body=bench.extra_body,
            )
        finally:
            if sampler is not None:
                sampler.cancel()
        if router is not None:
            router.check_alive()
        summary = summarize(run)
        extras: dict[str, Any] = {}
        if isinstance(router, Router) and router.metrics_url and target == "smg-priority":
            extras["smg_scheduler"] = await smg_scheduler_counters(router.metrics_url)
            extras["smg_scheduler_peaks"] = peaks
        if target == "gateway" and router is not None:
            extras["debug_backends"] = await gateway_backends(router.url)
        if router is not None and router.log_path is not None:
            extras["log"] = str(router.log_path)
        return {"summary": summary, "extras": extras}
    finally:
        bench.stop(router)
        for sim in sims:
            bench.stop(sim)


def print_smg_check(entry: dict[str, Any]) -> None:
    counters = entry["extras"].get("smg_scheduler") or {}
    admitted = {k: v for k, v in counters.items() if "admit_total" in k}
    other = {k: v for k, v in counters.items() if "admit_total" not in k}
    print(f"  smg-priority scheduler: {admitted or 'no admissions counted'}")
    peaks = entry["extras"].get("smg_scheduler_peaks") or {}
    if peaks:
        print(f"  smg-priority peaks (in flight, queued): {peaks}")
    if other:
        print(f"  smg-priority other counters: {other}")


async def bench_main(args: argparse.Namespace) -> int:
    out_dir = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        raise SystemExit(f"unknown targets {sorted(unknown)}; known: {', '.join(TARGETS)}")
    peers = {"vllm-router", "smg", "smg-priority"} & set(targets)
    binaries = peer_binaries(Path(args.peers_venv)) if peers else {}
    extra_body = {"ignore_eos": True} if args.ignore_eos else {}
    bench = Bench(args, out_dir, binaries, extra_body)
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv[1:],
        "backends": args.backend or "two fresh simulators per run: " + " ".join(SIMULATOR_FLAGS),
        "slots_per_engine": args.slots,
        "mix": [vars_of(c) for c in args.mix_classes],
        "duration_s": args.duration,
        "seed": args.seed,
        "extra_body": extra_body,
        "peers": {"versions": PEER_VERSIONS, "binaries": {k: str(v) for k, v in binaries.items()}},
        "load_average_before": os.getloadavg(),
        "loads": {},
    }
    try:
        capacity = args.capacity
        if capacity is None:
            print("calibrating: closed loop on the engines directly ...", flush=True)
            backends, sims = await bench.engines()
            try:
                capacity = await measure_capacity(
                    args.mix_classes,
                    backends,
                    args.calibration_requests,
                    args.slots,
                    args.model,
                    args.seed,
                    extra_body,
                )
            finally:
                for sim in sims:
                    bench.stop(sim)
        report["capacity_req_s"] = capacity
        print(f"capacity of the pair: {capacity:.2f} req/s (load average {os.getloadavg()[0]:.1f})")
        rows: list[tuple[float, str, dict[str, Any]]] = []
        first = True
        for load in (float(x) for x in args.loads.split(",")):
            rate = load * capacity
            schedule = poisson_schedule(args.mix_classes, rate, args.duration, args.seed)
            print(
                f"\nload {load:.0%}: {rate:.2f} req/s, {len(schedule)} requests over "
                f"{args.duration:g} s",
                flush=True,
            )
            entries: dict[str, Any] = {}
            for target in targets:
                if args.backend and not first:
                    await asyncio.sleep(args.pause)  # let the real engines drain and settle
                first = False
                entry = await one_run(bench, target, load, schedule)
                entries[target] = entry
                rows.append((load, target, entry["summary"]))
                if target == "smg-priority":
                    print_smg_check(entry)
            report["loads"][f"{load:g}"] = {
                "rate_req_s": rate,
                "requests": len(schedule),
                "targets": entries,
            }
        report["load_average_after"] = os.getloadavg()
        text = table(rows)
        print(f"\n{text}")
        print(
            "TTFT in seconds, of completed answers; refused = 4xx/5xx by status; broken = a 200 "
            "with no content token, cut before [DONE] or with an error event; timed out = "
            f"no complete answer within {args.timeout:g} s (or no answer at all)"
        )
        report["table_markdown"] = text
        path = out_dir / "peers.json"
        path.write_text(json.dumps(report, indent=2, default=str))
        print(f"\nwrote {path}")
        return 0
    finally:
        for process in list(bench.processes):
            bench.stop(process)


def vars_of(cls: TrafficClass) -> dict[str, Any]:
    return {
        "name": cls.name,
        "share": cls.share,
        "prompt_tokens": list(cls.prompt_tokens),
        "max_tokens": cls.max_tokens,
    }


# --------------------------------------------------------------------------- overhead


async def overhead_main(args: argparse.Namespace) -> int:
    """What each router adds per request in front of one fast mock backend, beside direct."""
    from bench_overhead import chat_body, client_session, one_request

    out_dir = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    binaries = peer_binaries(Path(args.peers_venv))
    processes: list[Process] = []
    try:
        port = free_port()
        mock_url = f"http://127.0.0.1:{port}"
        mock = start_child(
            "mock",
            [
                sys.executable,
                str(ROOT / "scripts" / "overhead_mock_backend.py"),
                "--port",
                str(port),
            ],
            mock_url,
            out_dir / "overhead-mock.log",
        )
        processes.append(mock)
        await wait_ready(mock_url, "/health", check=mock.check_alive)
        urls = {"direct": mock_url}
        for name in ("vllm-router", "smg"):
            router = await start_target(name, [mock_url], binaries, BATCH, out_dir, "overhead")
            assert router is not None
            processes.append(router)
            urls[name] = router.url
        # The default config, only the slots raised so that they are never the limit
        # (as bench_overhead runs it).
        gateway = await start_gateway_process(
            "gateway",
            f'[[backends]]\nurl = "{mock_url}"\nname = "mock"\nmax_concurrency = 256\n',
            out_dir / "overhead-gateway.toml",
            out_dir / "overhead-gateway.log",
        )
        processes.append(gateway)
        urls["gateway"] = gateway.url
        names = list(urls)
        body = chat_body(16, 0)
        ttft: dict[tuple[str, int], list[float]] = {}
        e2e: dict[tuple[str, int], list[float]] = {}
        errors: dict[tuple[str, int], int] = {}
        async with client_session() as session:
            for url in urls.values():  # open the connections, warm every path
                for _ in range(20):
                    await one_request(session, url, body)
            for round_index in range(args.overhead_rounds):
                shift = round_index % len(names)
                for name in names[shift:] + names[:shift]:
                    for concurrency in (1, 16):
                        per_worker = max(1, args.overhead_requests // concurrency)

                        async def worker(url: str = urls[name], n: int = per_worker) -> list[Any]:
                            return [await one_request(session, url, body) for _ in range(n)]

                        batches = await asyncio.gather(*(worker() for _ in range(concurrency)))
                        key = (name, concurrency)
                        for result in (r for batch in batches for r in batch):
                            if result.status == 200 and result.done and result.ttft_ms is not None:
                                ttft.setdefault(key, []).append(result.ttft_ms)
                                e2e.setdefault(key, []).append(result.e2e_ms)
                            else:
                                errors[key] = errors.get(key, 0) + 1
                print(f"  round {round_index + 1}/{args.overhead_rounds} done", flush=True)
        report = overhead_report(names, ttft, e2e, errors)
        text = overhead_table(report)
        print(f"\n{text}")
        print(
            "16-token streams from the mock (no delay); ms; added = the target's minus direct's, "
            "same percentile; interleaved rounds, pooled"
        )
        path = out_dir / "overhead.json"
        path.write_text(
            json.dumps(
                {"rows": report, "load_average": os.getloadavg(), "table_markdown": text},
                indent=2,
            )
        )
        print(f"\nwrote {path}")
        return 0
    finally:
        for process in processes:
            process.stop()


def overhead_report(
    names: Sequence[str],
    ttft: dict[tuple[str, int], list[float]],
    e2e: dict[tuple[str, int], list[float]],
    errors: dict[tuple[str, int], int],
) -> list[dict[str, Any]]:
    rows = []
    for concurrency in (1, 16):
        base = ttft.get(("direct", concurrency), [])
        base_e2e = e2e.get(("direct", concurrency), [])
        for name in names:
            key = (name, concurrency)
            values, ends = ttft.get(key, []), e2e.get(key, [])
            row: dict[str, Any] = {
                "target": name,
                "concurrency": concurrency,
                "requests": len(values) + errors.get(key, 0),
                "errors": errors.get(key, 0),
            }
            for q in (50, 99):
                row[f"ttft_p{q}_ms"] = ms(values, q, 3)
                row[f"e2e_p{q}_ms"] = ms(ends, q, 3)
                added = _minus(percentile(values, q), percentile(base, q))
                row[f"added_ttft_p{q}_ms"] = added
                row[f"added_e2e_p{q}_ms"] = _minus(percentile(ends, q), percentile(base_e2e, q))
            rows.append(row)
    return rows


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def overhead_table(rows: Sequence[dict[str, Any]]) -> str:
    def f(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [
        "| concurrency | target | TTFT p50 | p99 | added p50 | added p99 | e2e p50 | e2e p99 "
        "| added e2e p50 | added e2e p99 | errors |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['target']} | {f(r['ttft_p50_ms'])} | {f(r['ttft_p99_ms'])} "
            f"| {f(r['added_ttft_p50_ms'])} | {f(r['added_ttft_p99_ms'])} | {f(r['e2e_p50_ms'])} "
            f"| {f(r['e2e_p99_ms'])} | {f(r['added_e2e_p50_ms'])} | {f(r['added_e2e_p99_ms'])} "
            f"| {r['errors']}/{r['requests']} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------ CLI


def backend_list(values: Sequence[str] | None) -> list[str] | None:
    """`--backend` given several times and/or as comma lists, trailing slashes dropped."""
    if not values:
        return None
    urls = [u.strip().rstrip("/") for v in values for u in v.split(",") if u.strip()]
    return urls or None


def default_max_seconds(args: argparse.Namespace) -> float:
    """A bound for the whole run: per run its arrivals, the client timeout and start-up."""
    if args.overhead:
        return 900.0
    runs = len(args.loads.split(",")) * len([t for t in args.targets.split(",") if t.strip()])
    per_run = args.duration + args.timeout + 120 + (args.pause if args.backend else 0)
    return 600 + runs * per_run


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma list (default all)")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per run")
    parser.add_argument("--loads", default="0.8,1.2", help="fractions of the pair's capacity")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--backend",
        action="append",
        help="a real engine's base URL (give two: twice, or a comma list) instead of simulators",
    )
    parser.add_argument(
        "--slots", type=int, default=BATCH, help="each engine's batch (smg's max_running_requests)"
    )
    parser.add_argument("--model", default="sim-model")
    parser.add_argument(
        "--mix", help="a named mix or a TOML file of traffic classes (default: 80/20 above)"
    )
    parser.add_argument("--capacity", type=float, help="requests/s of the pair; skips calibration")
    parser.add_argument(
        "--calibration-requests", type=int, default=40, help="closed-loop requests per engine"
    )
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help='send "ignore_eos": true (fixed-length answers)',
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="client timeout per request")
    parser.add_argument(
        "--pause", type=float, default=15.0, help="seconds between runs on real engines"
    )
    parser.add_argument(
        "--peers-venv",
        default=str(ROOT / ".venv-peers"),
        help="virtualenv holding vllm-router and smg (installed by scripts/peers.sh if missing)",
    )
    parser.add_argument("--out", default="results/bench_peers", help="folder for JSON and logs")
    parser.add_argument(
        "--overhead", action="store_true", help="measure each router's per-request cost instead"
    )
    parser.add_argument(
        "--overhead-requests", type=int, default=1000, help="per target, concurrency and round"
    )
    parser.add_argument("--overhead-rounds", type=int, default=5)
    parser.add_argument("--max-seconds", type=float, help="hard stop for the whole run")
    args = parser.parse_args(argv)
    args.backend = backend_list(args.backend)
    args.mix_classes = resolve_mix(args.mix) if args.mix else MIX
    if args.max_seconds is None:
        args.max_seconds = default_max_seconds(args)
    return args


async def main() -> int:
    args = parse_args()
    runner = overhead_main(args) if args.overhead else bench_main(args)
    try:
        async with asyncio.timeout(args.max_seconds):
            return await runner
    except TimeoutError:
        print(f"stopped: the run took longer than --max-seconds {args.max_seconds:g}")
        return 2


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop children


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    sys.exit(asyncio.run(main()))
