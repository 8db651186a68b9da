#!/usr/bin/env python3
"""What does the gateway cost on the hot path, next to the backend alone and to bare proxies?

Starts, each in its own process on 127.0.0.1: a fast mock OpenAI backend
(`scripts/overhead_mock_backend.py`, raw asyncio on uvloop when installed),
a minimal aiohttp passthrough proxy (`scripts/overhead_passthrough.py`, the
floor for any aiohttp proxy), the gateway with its default config (only the
backend's `max_concurrency` raised so slots are never the limit), and nginx
with `proxy_buffering off` when the binary is installed. The load client runs
in this process (aiohttp, `limit=0`, uvloop when installed) and measures TTFT
as the arrival of the first content chunk.

Scenarios, each repeated in interleaved rounds (A B C D, B C D A, ...) so that
machine drift hits every target alike; the tables show medians of the rounds:

  S1  concurrency 1, 16-token streams: TTFT and what each proxy adds over direct
  S2  concurrency 64, 64-token streams at 10 ms/token: TTFT, req/s, proxy CPU/request;
      workers staggered so that arrivals spread out over a request's length
  S2w S2 in synchronized waves: all 64 workers start at once and send back to back, so
      arrivals come 64 in the same millisecond (an agent fanning out, a UI reconnecting):
      the gateway's own per-request cost adds up inside each wave
  S3  concurrency 32, 512-token streams with no delay: chunks/s, proxy CPU/100k chunks
  S4  the gateway under S2 while 100k-token prompts arrive (3 each second, refused
      with 413 after counting) vs the gateway under S2 alone
  mem RSS per open stream: 1000 streams held open, (RSS open - RSS idle) / 1000

`--profile` runs py-spy on the gateway during one more S2, S3 and S4 each (not
counted in the tables) and writes, per scenario, a speedscope file, collapsed
stacks and an SVG flame graph next to the JSON, and prints the hottest functions
(own and total share of the busy samples).

`--baseline REV` runs the gateway at an earlier git revision too (its files from
`git archive`, this checkout's virtualenv), in the same interleaved rounds, with a
"gateway / gateway@base" row in each table: a change's before and after in one run.

    python scripts/bench_overhead.py [--quick] [--profile] [--baseline REV] [--json FILE]

Full run about 6 minutes (+30 s with --profile), `--quick` about 2. Loopback only;
every process it starts is stopped on exit, Ctrl-C and errors included. The
figures are only as quiet as the machine: the load average before and after
is printed and stored; compare ratios within one run, not across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import html
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from benchlib import checkout, free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.tools.stats import percentile  # noqa: E402

HOST = "127.0.0.1"
#: Bytes that open a content chunk (the mock's role chunk has "role" first, so it never matches).
CONTENT_MARKER = b'"delta":{"content"'
DONE_MARKER = b"data: [DONE]"
JSON_HEADERS = {"Content-Type": "application/json"}
PROFILE_RATE_HZ = 250
BIG_PROMPT_WORDS = 100_000  # "word " is ~1 token: ~100k tokens, over the default 32k cap
CLK_TCK = os.sysconf("SC_CLK_TCK")
DIRECT, PASSTHROUGH, NGINX, GATEWAY = "direct", "passthrough", "nginx", "gateway"
#: `--baseline REV`: the gateway's code at an earlier revision, measured beside this one.
BASELINE = "gateway@base"
GATEWAYS = (GATEWAY, BASELINE)
S4_WITH, S4_WITHOUT = "gateway, 100k prompts", "gateway, none"


# --------------------------------------------------------------------------- processes


class Fleet:
    """Every process this script starts, each in its own session so its children go too."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        cwd: Path = ROOT,
    ) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        process = subprocess.Popen(
            argv,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL if name in GATEWAYS else log,
            stderr=log,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        log.close()
        self.processes.append((name, process))
        return process

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.workdir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def check_alive(self) -> None:
        for name, process in self.processes:
            if not name.startswith("py-spy") and process.poll() is not None:
                raise SystemExit(f"{name} exited with {process.returncode}:\n{self.log_tail(name)}")

    @staticmethod
    def signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
        try:
            os.killpg(process.pid, sig)  # the group this script created for it
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, process: subprocess.Popen[bytes], first: int = signal.SIGTERM) -> None:
        if process.poll() is None:
            self.signal_group(process, first)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.signal_group(process, signal.SIGKILL)  # leftovers of the group, if any
        if process.poll() is None:
            process.wait(timeout=5)

    def stop_all(self) -> None:
        for _, process in reversed(self.processes):
            if process.poll() is None:
                self.signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _, process in reversed(self.processes):
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self.signal_group(process, signal.SIGKILL)
            if process.poll() is None:
                process.wait(timeout=5)


def die_with_parent() -> None:
    """In the child: get SIGTERM if this script dies without cleaning up (SIGKILL)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (nginx: master and workers)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(parents.get(current, []))
    return tree


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its descendants, from /proc/<pid>/stat."""
    total = 0.0
    for member in process_tree(pid):
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


def rss_kib(pid: int) -> int:
    total = 0
    for member in process_tree(pid):
        try:
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


async def wait_fleet_ready(url: str, path: str, fleet: Fleet, timeout_s: float = 40) -> None:
    await wait_ready(url, path, timeout_s, check=fleet.check_alive)


# --------------------------------------------------------------------------- targets


@dataclass
class Target:
    name: str
    url: str
    #: The process whose CPU and memory are the proxy's (None for direct).
    pid: int | None


def gateway_config(port: int, backend_url: str, slots: int) -> str:
    return (
        "# bench_overhead: the default config, only the backend's slots raised\n"
        f'[server]\nhost = "{HOST}"\nport = {port}\n\n'
        f'[[backends]]\nurl = "{backend_url}"\nname = "mock"\nmax_concurrency = {slots}\n'
    )


def nginx_config(workdir: Path, port: int, backend_port: int) -> str:
    user = "user root root;\n" if os.geteuid() == 0 else ""
    return f"""{user}worker_processes 1;
daemon off;
master_process on;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
worker_rlimit_nofile 16384;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {workdir}/nginx-client-body;
    proxy_temp_path {workdir}/nginx-proxy;
    fastcgi_temp_path {workdir}/nginx-fastcgi;
    uwsgi_temp_path {workdir}/nginx-uwsgi;
    scgi_temp_path {workdir}/nginx-scgi;
    client_max_body_size 16m;
    client_body_buffer_size 1m;
    upstream mock {{ server {HOST}:{backend_port}; keepalive 1024; }}
    server {{
        listen {HOST}:{port} backlog=2048;
        location / {{
            proxy_pass http://mock;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


# --------------------------------------------------------------------------- client


@dataclass(slots=True)
class Result:
    status: int
    ttft_ms: float | None
    e2e_ms: float
    chunks: int
    done: bool


def chat_body(max_tokens: int, delay_ms: float, content: str = "Say something short.") -> bytes:
    return json.dumps(
        {
            "model": "mock",
            "stream": True,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}],
            "mock_delay_ms": delay_ms,
        }
    ).encode()


async def one_request(session: aiohttp.ClientSession, url: str, body: bytes) -> Result:
    """One streamed chat completion: TTFT at the first content chunk, chunks counted."""
    marker_len = len(CONTENT_MARKER)
    started = time.perf_counter()
    ttft = None
    chunks = 0
    done = False
    try:
        async with session.post(
            url + "/v1/chat/completions", data=body, headers=JSON_HEADERS
        ) as resp:
            if resp.status != 200:
                await resp.read()
                return Result(resp.status, None, (time.perf_counter() - started) * 1000, 0, False)
            tail = b""
            async for data in resp.content.iter_any():
                # markers inside `data`, plus one spanning the previous read's end
                found = data.count(CONTENT_MARKER)
                if tail:
                    found += (tail + data[: marker_len - 1]).count(CONTENT_MARKER)
                if found:
                    if ttft is None:
                        ttft = (time.perf_counter() - started) * 1000
                    chunks += found
                if not done and (DONE_MARKER in data or DONE_MARKER in tail + data[:16]):
                    done = True
                tail = data[-(marker_len - 1) :]
            return Result(200, ttft, (time.perf_counter() - started) * 1000, chunks, done)
    except (aiohttp.ClientError, TimeoutError):
        return Result(0, ttft, (time.perf_counter() - started) * 1000, chunks, False)


def client_session(timeout_s: float = 120) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=False),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        auto_decompress=False,
    )


async def closed_loop(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    concurrency: int,
    duration_s: float,
    max_requests: int,
    stagger_s: float = 0.0,
) -> tuple[list[Result], float]:
    """`concurrency` workers back to back until the deadline (or the request cap).

    Worker k starts k * stagger_s / concurrency late: with stagger_s one request's
    length, arrivals stay spread out instead of 64 requests landing in the same
    millisecond every round trip (which would measure the burst, not the proxy).
    """
    results: list[Result] = []
    started = time.perf_counter()
    deadline = started + duration_s

    async def worker(index: int) -> None:
        if stagger_s:
            await asyncio.sleep(index * stagger_s / concurrency)
        while time.perf_counter() < deadline and len(results) < max_requests:
            results.append(await one_request(session, url, body))

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return results, time.perf_counter() - started


async def warm_up(session: aiohttp.ClientSession, url: str, concurrency: int) -> None:
    """Open the connections (client->proxy, proxy->backend) before anything is measured."""
    body = chat_body(1, 0)
    await asyncio.gather(*(one_request(session, url, body) for _ in range(concurrency)))


@dataclass
class Meter:
    """CPU of the proxy, the mock and this client over one measured stretch."""

    proxy_pid: int | None
    mock_pid: int
    values: dict[str, float] = field(default_factory=dict)

    def __enter__(self) -> Meter:
        self._proxy = cpu_seconds(self.proxy_pid) if self.proxy_pid else 0.0
        self._mock = cpu_seconds(self.mock_pid)
        self._own = own_cpu_seconds()
        self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._wall
        self.values = {
            "wall_s": wall,
            "proxy_cpu_s": (cpu_seconds(self.proxy_pid) - self._proxy) if self.proxy_pid else 0.0,
            "mock_cpu_s": cpu_seconds(self.mock_pid) - self._mock,
            "client_cpu_s": own_cpu_seconds() - self._own,
        }


def latency_metrics(results: list[Result]) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200 and r.done and r.ttft_ms is not None]
    ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "e2e_p50_ms": percentile([r.e2e_ms for r in ok], 50),
        "chunks": sum(r.chunks for r in results),
    }


def cpu_metrics(meter: Meter, per: float, unit: str, has_proxy: bool) -> dict[str, Any]:
    wall = meter.values["wall_s"]
    per = max(per, 1.0)
    return {
        f"proxy_cpu_{unit}": meter.values["proxy_cpu_s"] / per * UNIT_SCALE[unit]
        if has_proxy
        else None,
        f"mock_cpu_{unit}": meter.values["mock_cpu_s"] / per * UNIT_SCALE[unit],
        "proxy_cpu_pct": 100 * meter.values["proxy_cpu_s"] / wall if has_proxy else None,
        "mock_cpu_pct": 100 * meter.values["mock_cpu_s"] / wall,
        "client_cpu_pct": 100 * meter.values["client_cpu_s"] / wall,
        "wall_s": wall,
    }


#: proxy CPU per request in milliseconds; per 100k chunks in seconds
UNIT_SCALE = {"ms_per_req": 1000.0, "s_per_100k_chunks": 100_000.0}


# --------------------------------------------------------------------------- scenarios


@dataclass
class Bench:
    args: argparse.Namespace
    fleet: Fleet
    mock_pid: int
    mock_url: str
    targets: dict[str, Target]


async def run_s1(bench: Bench, target: Target) -> dict[str, Any]:
    body = chat_body(16, 0)
    async with client_session() as session:
        for _ in range(20):
            await one_request(session, target.url, body)
        results = []
        with Meter(target.pid, bench.mock_pid) as meter:
            for _ in range(bench.args.s1_requests):
                results.append(await one_request(session, target.url, body))
    out = latency_metrics(results)
    out.update(cpu_metrics(meter, len(results), "ms_per_req", target.pid is not None))
    return out


async def run_stream_load(
    bench: Bench,
    target: Target,
    *,
    concurrency: int,
    tokens: int,
    delay_ms: float,
    duration_s: float,
    big_prompts: bool = False,
    wave: bool = False,
) -> dict[str, Any]:
    body = chat_body(tokens, delay_ms)
    big: list[Result] = []
    async with client_session() as session:
        await warm_up(session, target.url, concurrency)
        with Meter(target.pid, bench.mock_pid) as meter:
            load = asyncio.ensure_future(
                closed_loop(
                    session,
                    target.url,
                    body,
                    concurrency,
                    duration_s,
                    100_000,
                    stagger_s=0.0 if wave else tokens * delay_ms / 1000,
                )
            )
            if big_prompts:
                raw = json.dumps(
                    {
                        "model": "mock",
                        "max_tokens": 1,
                        "messages": [{"role": "user", "content": "word " * BIG_PROMPT_WORDS}],
                    }
                ).encode()
                end = time.perf_counter() + duration_s - 0.5
                while time.perf_counter() < end and not load.done():
                    burst = [one_request(session, target.url, raw) for _ in range(3)]
                    tick = asyncio.ensure_future(asyncio.sleep(1.0))
                    big += await asyncio.gather(*burst)
                    await tick
            results, wall = await load
    out = latency_metrics(results)
    out["req_per_s"] = len(results) / wall
    out["chunks_per_s"] = out["chunks"] / wall
    out.update(cpu_metrics(meter, len(results), "ms_per_req", target.pid is not None))
    out.update(cpu_metrics(meter, out["chunks"], "s_per_100k_chunks", target.pid is not None))
    if big_prompts:
        out["big_prompts"] = len(big)
        out["big_prompt_statuses"] = sorted({r.status for r in big})
        out["big_prompt_p50_ms"] = percentile([r.e2e_ms for r in big], 50)
    return out


async def run_s2(bench: Bench, target: Target, big_prompts: bool = False) -> dict[str, Any]:
    return await run_stream_load(
        bench,
        target,
        concurrency=64,
        tokens=64,
        delay_ms=10,
        duration_s=bench.args.s2_duration,
        big_prompts=big_prompts,
    )


async def run_s2_wave(bench: Bench, target: Target) -> dict[str, Any]:
    return await run_stream_load(
        bench,
        target,
        concurrency=64,
        tokens=64,
        delay_ms=10,
        duration_s=bench.args.s2_duration,
        wave=True,
    )


async def run_s3(bench: Bench, target: Target) -> dict[str, Any]:
    return await run_stream_load(
        bench, target, concurrency=32, tokens=512, delay_ms=0, duration_s=bench.args.s3_duration
    )


async def mock_open_streams(session: aiohttp.ClientSession, mock_url: str) -> int:
    async with session.get(mock_url + "/stats") as resp:
        return int((await resp.json())["open_streams"])


async def run_memory(bench: Bench, target: Target) -> dict[str, Any]:
    """(RSS with N streams open - RSS idle) / N, streams held by a mock that waits 60 s/token."""
    assert target.pid is not None
    count = bench.args.open_streams
    body = chat_body(4, 60_000)
    responses: list[aiohttp.ClientResponse] = []
    failures = 0
    async with client_session(timeout_s=60) as session:
        await warm_up(session, target.url, 64)
        await asyncio.sleep(1.0)
        idle = rss_kib(target.pid)

        async def open_stream() -> None:
            nonlocal failures
            try:
                resp = await session.post(
                    target.url + "/v1/chat/completions", data=body, headers=JSON_HEADERS
                )
            except (aiohttp.ClientError, TimeoutError):
                failures += 1
                return
            responses.append(resp)
            if resp.status != 200:
                failures += 1
                return
            try:
                await resp.content.readany()  # the role chunk and the first token
            except (aiohttp.ClientError, TimeoutError):
                failures += 1

        try:
            for start in range(0, count, 100):
                await asyncio.gather(*(open_stream() for _ in range(min(100, count - start))))
            await asyncio.sleep(1.0)
            samples = []
            for _ in range(3):
                samples.append(rss_kib(target.pid))
                await asyncio.sleep(0.3)
            held = await mock_open_streams(session, bench.mock_url)
        finally:
            for resp in responses:
                resp.close()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # let every proxy close its backend streams
            if not await mock_open_streams(session, bench.mock_url):
                break
            await asyncio.sleep(0.2)
    opened = count - failures
    peak = max(samples)
    return {
        "streams": count,
        "opened": opened,
        "held_at_backend": held,
        "rss_idle_mib": idle / 1024,
        "rss_open_mib": peak / 1024,
        "kib_per_stream": (peak - idle) / max(opened, 1),
    }


async def mock_capacity(bench: Bench) -> dict[str, Any]:
    """Is the mock fast enough? S3's load straight at it, with everyone's CPU."""
    out = await run_stream_load(
        bench,
        bench.targets[DIRECT],
        concurrency=32,
        tokens=512,
        delay_ms=0,
        duration_s=bench.args.capacity_duration,
    )
    mock_cpu = out["mock_cpu_s_per_100k_chunks"]
    out["mock_chunks_per_cpu_s"] = 100_000 / mock_cpu if mock_cpu else None
    return out


# --------------------------------------------------------------------------- rounds


async def interleaved(
    bench: Bench,
    label: str,
    names: list[str],
    run: Callable[[str], Awaitable[dict[str, Any]]],
) -> dict[str, list[dict[str, Any]]]:
    """Rounds of every target, the order rotated each round (A B C, B C A, ...)."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_index in range(bench.args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            bench.fleet.check_alive()
            started = time.perf_counter()
            result = await run(name)
            runs[name].append(result)
            print(
                f"  {label} round {round_index + 1}/{bench.args.rounds} {name:<14} "
                f"{summary_line(result)} ({time.perf_counter() - started:.1f} s)",
                flush=True,
            )
    return runs


def summary_line(result: dict[str, Any]) -> str:
    parts = []
    for key in ("ttft_p50_ms", "ttft_p99_ms", "req_per_s", "chunks_per_s", "errors"):
        value = result.get(key)
        if value is not None:
            parts.append(f"{key}={value:.2f}" if isinstance(value, float) else f"{key}={value}")
    return " ".join(parts)


def median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return percentile(present, 50) if present else None


def medians(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, rows in runs.items():
        keys = [k for k, v in rows[0].items() if isinstance(v, (int, float)) or v is None]
        out[name] = {k: median(r.get(k) for r in rows) for k in keys}
    return out


def stream_load_table(runs: dict[str, list[dict[str, Any]]], title: str) -> dict[str, Any]:
    """S2 and S2w: medians of the rounds, p99 over direct paired by round, printed."""
    table = medians(runs)
    for name in table:
        table[name]["added_p99_ms"] = paired_delta(runs, name, DIRECT, "ttft_p99_ms")
    print_table(
        title,
        table,
        [
            ("ttft_p50_ms", "TTFT p50 ms", ".3f"),
            ("ttft_p99_ms", "TTFT p99 ms", ".3f"),
            ("added_p99_ms", "+p99 vs dir", ".3f"),
            ("req_per_s", "req/s", ".1f"),
            ("proxy_cpu_ms_per_req", "CPU ms/req", ".3f"),
            ("proxy_cpu_pct", "proxy CPU%", ".0f"),
            ("mock_cpu_pct", "mock CPU%", ".0f"),
            ("errors", "errors", ".0f"),
        ],
        ratio_rows(table),
    )
    return table


def ratio_of(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    return a[key] / b[key] if a.get(key) and b.get(key) else None


def paired_delta(
    runs: dict[str, list[dict[str, Any]]], name: str, base: str, key: str
) -> float | None:
    """Median over rounds of (name - base) in the same round: drift cancels pairwise."""
    deltas = [
        a[key] - b[key]
        for a, b in zip(runs[name], runs[base], strict=False)
        if a.get(key) is not None and b.get(key) is not None
    ]
    return median(deltas)


# --------------------------------------------------------------------------- report

Column = tuple[str, str, str]  # key, header, format
#: Columns that are counts, not measurements: no ratio row for them.
COUNTS = frozenset({"errors", "opened", "held_at_backend", "big_prompts", "streams"})


def print_table(
    title: str,
    table: dict[str, dict[str, Any]],
    columns: list[Column],
    ratio_rows: list[tuple[str, str, str]] = (),  # type: ignore[assignment]
) -> None:
    width = max(len(name) for name in [*table, *(label for label, _, _ in ratio_rows), "x"]) + 2
    print(f"\n{title}")
    header = f"{'':<{width}}" + "".join(f"{h:>14}" for _, h, _ in columns)
    print(header)
    print("-" * len(header))
    for name, values in table.items():
        cells = []
        for key, _, fmt in columns:
            value = values.get(key)
            cells.append(f"{'-':>14}" if value is None else f"{value:>14{fmt}}")
        print(f"{name:<{width}}" + "".join(cells))
    for label, num, den in ratio_rows:
        if num not in table or den not in table:
            continue
        cells = []
        for key, _, _ in columns:
            if key in COUNTS:
                cells.append(f"{'':>14}")
                continue
            a, b = table[num].get(key), table[den].get(key)
            ratio = a / b if a is not None and b not in (None, 0) else None
            cells.append(f"{'-':>14}" if ratio is None else f"{ratio:>13.2f}x")
        print(f"{label:<{width}}" + "".join(cells))


def ratio_rows(names: Iterable[str]) -> list[tuple[str, str, str]]:
    rows = []
    if GATEWAY in names and BASELINE in names:
        rows.append(("gateway / gateway@base", GATEWAY, BASELINE))
    if GATEWAY in names and PASSTHROUGH in names:
        rows.append(("gateway / passthrough", GATEWAY, PASSTHROUGH))
    if GATEWAY in names and DIRECT in names:
        rows.append(("gateway / direct", GATEWAY, DIRECT))
    return rows


@dataclass
class Check:
    name: str
    value: float | None
    limit: float
    text: str
    smaller_is_better: bool = True

    @property
    def passed(self) -> bool | None:
        if self.value is None:
            return None
        return self.value <= self.limit if self.smaller_is_better else self.value >= self.limit

    def line(self) -> str:
        verdict = {True: "PASS", False: "FAIL", None: "N/A "}[self.passed]
        shown = "not measured" if self.value is None else f"{self.value:.3f}"
        sign = "<=" if self.smaller_is_better else ">="
        return f"  [{verdict}] {self.name}: {shown} ({sign} {self.limit:g}) - {self.text}"


# --------------------------------------------------------------------------- profile


def short_file(path: str) -> str:
    for marker in (str(ROOT) + "/", "site-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    if "/lib/python" in path:
        return path.split("/lib/", 1)[1].split("/", 1)[-1]
    return path


def read_speedscope(path: Path) -> dict[tuple[str, ...], float]:
    """Stacks (root first) -> sample count, over all threads."""
    data = json.loads(path.read_text())
    frames = [f"{f['name']} ({short_file(f.get('file') or '?')})" for f in data["shared"]["frames"]]
    stacks: dict[tuple[str, ...], float] = {}
    for profile in data["profiles"]:
        for sample in profile.get("samples", []):
            key = tuple(frames[i] for i in sample)
            stacks[key] = stacks.get(key, 0) + 1
    return stacks


def hottest(stacks: dict[tuple[str, ...], float], top: int) -> list[dict[str, Any]]:
    total = sum(stacks.values()) or 1
    own: dict[str, float] = {}
    inclusive: dict[str, float] = {}
    for stack, count in stacks.items():
        if stack:
            own[stack[-1]] = own.get(stack[-1], 0) + count
        for frame in set(stack):
            inclusive[frame] = inclusive.get(frame, 0) + count
    ranked = sorted(own, key=lambda f: own[f], reverse=True)[:top]
    return [
        {
            "function": f,
            "own_pct": 100 * own[f] / total,
            "total_pct": 100 * inclusive[f] / total,
            "own_samples": own[f],
        }
        for f in ranked
    ]


def flame_svg(stacks: dict[tuple[str, ...], float], title: str) -> str:
    """A plain SVG flame graph (root at the bottom); hover a box for its share."""
    tree: dict[str, Any] = {"n": 0.0, "c": {}}
    for stack, count in stacks.items():
        node = tree
        node["n"] += count
        for frame in stack:
            node = node["c"].setdefault(frame, {"n": 0.0, "c": {}})
            node["n"] += count

    def depth(node: dict[str, Any]) -> int:
        return 1 + max((depth(c) for c in node["c"].values()), default=0)

    width, row = 1400.0, 17
    levels = depth(tree)
    height = levels * row + 40
    total = tree["n"] or 1
    boxes: list[str] = []

    def draw(name: str, node: dict[str, Any], x: float, level: int) -> None:
        w = width * node["n"] / total
        if w < 0.3:
            return
        y = height - (level + 1) * row - 5
        hue = zlib.crc32(name.encode()) % 60
        share = 100 * node["n"] / total
        label = html.escape(name if w > 7 * len(name) else name[: max(0, int(w / 7) - 2)] + "..")
        tip = html.escape(f"{name}: {share:.2f}% ({node['n']:.0f} samples)")
        boxes.append(
            f'<g><title>{tip}</title><rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 1}" '
            f'fill="hsl({hue},85%,60%)" rx="2"/>'
            + (f'<text x="{x + 3:.1f}" y="{y + 12}">{label}</text>' if w > 25 else "")
            + "</g>"
        )
        child_x = x
        for child_name, child in sorted(node["c"].items()):
            draw(child_name, child, child_x, level + 1)
            child_x += width * child["n"] / total

    x = 0.0
    for name, child in sorted(tree["c"].items()):
        draw(name, child, x, 0)
        x += width * child["n"] / total
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" '
        f'font-family="monospace" font-size="11">'
        f'<text x="5" y="20" font-size="14">{html.escape(title)}</text>' + "".join(boxes) + "</svg>"
    )


#: Stacks that end in a wait: the loop in epoll_wait, a pool thread parked in
#: `work_queue.get()` (the leaf is `_worker` itself, in C), the request-log writer
#: parked in its queue's `get()`. py-spy's idle detection misses them on this kind of
#: VM; they are not CPU the gateway spends, so they are left out (a busy loop's
#: epoll_wait(0) calls go with them, ~2% of a busy profile, and the writer's own
#: writes, one per burst of lines).
IDLE_LEAVES = frozenset(
    {
        "_worker (concurrent/futures/thread.py)",
        "EpollSelector.select (selectors.py)",
        "RequestLog._write_lines (gateway/observability/logs.py)",
    }
)


async def profile_gateway(bench: Bench, out_dir: Path) -> dict[str, Any]:
    """py-spy on the gateway during one S2, one S3 and one S4 (a recording each).

    Not part of the measured rounds: py-spy pauses the process to sample it.
    """
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        return {"error": "py-spy is not installed (pip install py-spy)"}
    gateway = bench.targets[GATEWAY]
    assert gateway.pid is not None
    out_dir.mkdir(parents=True, exist_ok=True)
    profiles: dict[str, Any] = {}

    async def run_s4(bench: Bench, target: Target) -> dict[str, Any]:
        return await run_s2(bench, target, big_prompts=True)

    scenarios = {
        "s2": ("S2: concurrency 64, 64 tokens at 10 ms/token", run_s2),
        "s2w": ("S2w: S2 in synchronized waves", run_s2_wave),
        "s3": ("S3: concurrency 32, 512 tokens, no delay", run_s3),
        "s4": ("S4: S2 plus 3 100k-token prompts each second", run_s4),
    }
    for key, (title, scenario) in scenarios.items():
        speedscope = out_dir / f"gateway-profile-{key}.speedscope.json"
        speedscope.unlink(missing_ok=True)
        name = f"py-spy-{key}"
        spy = bench.fleet.start(
            name,
            [
                py_spy,
                "record",
                "--pid",
                str(gateway.pid),
                "--rate",
                str(PROFILE_RATE_HZ),
                "--nolineno",
                *(["--gil"] if bench.args.profile_gil else []),
                "--format",
                "speedscope",
                "--output",
                str(speedscope),
                "--duration",
                str(int(max(bench.args.s2_duration, bench.args.s3_duration) + 30)),
            ],
        )
        await asyncio.sleep(1.0)
        if spy.poll() is not None:
            return {"error": f"py-spy exited at once: {bench.fleet.log_tail(name)}"}
        load = await scenario(bench, gateway)
        bench.fleet.stop(spy, first=signal.SIGINT)  # SIGINT: py-spy writes its file and exits
        if not speedscope.exists():
            return {"error": f"py-spy wrote nothing: {bench.fleet.log_tail(name)}"}
        all_stacks = read_speedscope(speedscope)
        stacks = {k: v for k, v in all_stacks.items() if not k or k[-1] not in IDLE_LEAVES}
        collapsed = out_dir / f"gateway-profile-{key}.collapsed.txt"
        collapsed.write_text(
            "".join(f"{';'.join(stack)} {count:.0f}\n" for stack, count in sorted(stacks.items()))
        )
        svg = out_dir / f"gateway-profile-{key}.svg"
        svg.write_text(flame_svg(stacks, f"gateway under {title} (py-spy, busy samples)"))
        profiles[key] = {
            "title": title,
            "files": [str(speedscope), str(collapsed), str(svg)],
            "samples": sum(stacks.values()),
            "idle_wait_samples_removed": sum(all_stacks.values()) - sum(stacks.values()),
            "wall_s": load["wall_s"],
            "load_while_profiled": {
                "ttft_p50_ms": load["ttft_p50_ms"],
                "ttft_p99_ms": load["ttft_p99_ms"],
                "chunks_per_s": load["chunks_per_s"],
                "proxy_cpu_pct": load["proxy_cpu_pct"],
            },
            "hottest": hottest(stacks, bench.args.profile_top),
        }
    return profiles


# --------------------------------------------------------------------------- main


async def start_everything(args: argparse.Namespace, fleet: Fleet) -> Bench:
    python = sys.executable
    mock_port = free_port()
    mock_url = f"http://{HOST}:{mock_port}"
    mock = fleet.start(
        "mock",
        [python, str(ROOT / "scripts/overhead_mock_backend.py"), "--port", str(mock_port)]
        + (["--no-uvloop"] if args.no_uvloop else []),
    )
    targets = {DIRECT: Target(DIRECT, mock_url, None)}

    port = free_port()
    passthrough = fleet.start(
        PASSTHROUGH,
        [
            python,
            str(ROOT / "scripts/overhead_passthrough.py"),
            "--port",
            str(port),
            "--backend",
            mock_url,
        ],
    )
    targets[PASSTHROUGH] = Target(PASSTHROUGH, f"http://{HOST}:{port}", passthrough.pid)

    nginx = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if nginx and not args.no_nginx:
        port = free_port()
        conf = fleet.workdir / "nginx.conf"
        conf.write_text(nginx_config(fleet.workdir, port, mock_port))
        process = fleet.start(
            NGINX,
            [
                nginx,
                "-p",
                str(fleet.workdir),
                "-c",
                str(conf),
                "-e",
                str(fleet.workdir / "nginx-error.log"),
            ],
        )
        targets[NGINX] = Target(NGINX, f"http://{HOST}:{port}", process.pid)

    port = free_port()
    conf = fleet.workdir / "gateway.toml"
    conf.write_text(gateway_config(port, mock_url, max(2048, args.open_streams + 256)))
    gateway = fleet.start(GATEWAY, [python, "-m", "gateway", "serve", "--config", str(conf)])
    targets[GATEWAY] = Target(GATEWAY, f"http://{HOST}:{port}", gateway.pid)
    if args.baseline:
        source = checkout(args.baseline, fleet.workdir / "baseline")
        port = free_port()
        conf = fleet.workdir / "baseline.toml"
        conf.write_text(gateway_config(port, mock_url, max(2048, args.open_streams + 256)))
        process = fleet.start(
            BASELINE, [python, "-m", "gateway", "serve", "--config", str(conf)], cwd=source
        )
        targets[BASELINE] = Target(BASELINE, f"http://{HOST}:{port}", process.pid)

    await wait_fleet_ready(mock_url, "/health", fleet)
    for name, target in targets.items():
        await wait_fleet_ready(target.url, "/readyz" if name in GATEWAYS else "/health", fleet)
    return Bench(args, fleet, mock.pid, mock_url, targets)


def environment_notes(bench: Bench) -> dict[str, Any]:
    notes: dict[str, Any] = {
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "cpus": os.cpu_count(),
        "client_loop": type(asyncio.get_running_loop()).__module__,
        "targets": {n: t.url for n, t in bench.targets.items()},
        "load_average_at_start": os.getloadavg(),
    }
    try:
        import uvloop

        notes["uvloop"] = uvloop.__version__
    except ImportError:
        notes["uvloop"] = None
    if NGINX in bench.targets:
        version = subprocess.run(
            [shutil.which("nginx") or "/usr/sbin/nginx", "-v"], capture_output=True, text=True
        )
        notes["nginx"] = version.stderr.strip()
    else:
        notes["nginx"] = None
    return notes


async def run(args: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    only = set(args.only.split(",")) if args.only else {"s1", "s2", "s2w", "s3", "s4", "mem"}
    args.profile = args.profile or "profile" in only
    bench = await start_everything(args, fleet)
    names = [n for n in (DIRECT, PASSTHROUGH, NGINX, BASELINE, GATEWAY) if n in bench.targets]
    proxies = [n for n in names if n != DIRECT]
    report: dict[str, Any] = {"environment": environment_notes(bench), "settings": vars(args)}
    if NGINX not in bench.targets:
        report["notes"] = [
            "nginx not measured: "
            + (
                "--no-nginx given"
                if args.no_nginx
                else "binary not installed (apt-get install nginx)"
            )
        ]
    print(
        f"targets: {', '.join(names)}; rounds: {args.rounds}; machine load average "
        f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (before any load of ours)",
        flush=True,
    )

    capacity = await mock_capacity(bench)
    report["mock_capacity"] = capacity
    print(
        f"\nmock backend alone (S3 load: concurrency 32, 512 tokens, no delay): "
        f"{capacity['chunks_per_s']:,.0f} chunks/s through the client; mock CPU "
        f"{capacity['mock_cpu_pct']:.0f}% of a core, client {capacity['client_cpu_pct']:.0f}%; "
        f"mock capacity ~{capacity['mock_chunks_per_cpu_s'] or 0:,.0f} chunks per CPU second",
        flush=True,
    )

    tables: dict[str, Any] = {}
    if "mem" in only:
        print(f"\nmemory: {args.open_streams} open streams per proxy", flush=True)
        memory = {}
        for name in proxies:
            memory[name] = await run_memory(bench, bench.targets[name])
            print(f"  {name:<12} {memory[name]}", flush=True)
        tables["memory"] = memory
    if "s1" in only:
        print("\nS1: concurrency 1, 16-token streams", flush=True)
        tables["s1"] = await interleaved(
            bench, "S1", names, lambda name: run_s1(bench, bench.targets[name])
        )
    if "s2" in only:
        print("\nS2: concurrency 64, 64-token streams at 10 ms/token", flush=True)
        tables["s2"] = await interleaved(
            bench, "S2", names, lambda name: run_s2(bench, bench.targets[name])
        )
    if "s2w" in only:
        print("\nS2w: S2 in synchronized waves (all workers start at once)", flush=True)
        tables["s2w"] = await interleaved(
            bench, "S2w", names, lambda name: run_s2_wave(bench, bench.targets[name])
        )
    if "s3" in only:
        print("\nS3: concurrency 32, 512-token streams, no delay", flush=True)
        tables["s3"] = await interleaved(
            bench, "S3", names, lambda name: run_s3(bench, bench.targets[name])
        )
    if "s4" in only:
        print("\nS4: the gateway under S2, with and without 100k-token prompts (3/s)", flush=True)
        tables["s4"] = await interleaved(
            bench,
            "S4",
            [S4_WITH, S4_WITHOUT],
            lambda name: run_s2(bench, bench.targets[GATEWAY], big_prompts=name == S4_WITH),
        )
    if args.profile:
        print("\nprofile: py-spy on the gateway during one S2, S2w, S3 and S4", flush=True)
        report["profile"] = await profile_gateway(bench, Path(args.json).parent)
    report["raw"] = tables
    report["environment"]["load_average_at_end"] = os.getloadavg()
    return report


def render(report: dict[str, Any], args: argparse.Namespace) -> list[Check]:
    raw = report["raw"]
    checks: list[Check] = []
    summary: dict[str, Any] = {}
    if "s1" in raw:
        table = medians(raw["s1"])
        for name in table:
            table[name]["added_p50_ms"] = paired_delta(raw["s1"], name, DIRECT, "ttft_p50_ms")
            table[name]["added_p99_ms"] = paired_delta(raw["s1"], name, DIRECT, "ttft_p99_ms")
        summary["s1"] = table
        print_table(
            "S1  concurrency 1, 16-token streams (ms; medians of rounds; added = paired vs direct)",
            table,
            [
                ("ttft_p50_ms", "TTFT p50", ".3f"),
                ("ttft_p99_ms", "TTFT p99", ".3f"),
                ("added_p50_ms", "added p50", ".3f"),
                ("added_p99_ms", "added p99", ".3f"),
                ("e2e_p50_ms", "e2e p50", ".3f"),
                ("proxy_cpu_ms_per_req", "CPU ms/req", ".3f"),
                ("errors", "errors", ".0f"),
            ],
            ratio_rows(table),
        )
        gw = table.get(GATEWAY, {})
        checks.append(
            Check("S1 added TTFT p50 (ms)", gw.get("added_p50_ms"), 0.5, "gateway over direct")
        )
        checks.append(
            Check("S1 added TTFT p99 (ms)", gw.get("added_p99_ms"), 2.0, "gateway over direct")
        )
    if "s2" in raw:
        table = stream_load_table(
            raw["s2"], "S2  concurrency 64, 64-token streams at 10 ms/token (medians of rounds)"
        )
        summary["s2"] = table
        gw, pt = table.get(GATEWAY, {}), table.get(PASSTHROUGH, {})
        checks.append(
            Check("S2 TTFT p99 over direct (ms)", gw.get("added_p99_ms"), 3.0, "paired by round")
        )
        checks.append(
            Check(
                "S2 CPU/request gateway / passthrough",
                ratio_of(gw, pt, "proxy_cpu_ms_per_req"),
                1.2,
                "ratio of medians",
            )
        )
    if "s2w" in raw:
        table = stream_load_table(
            raw["s2w"],
            "S2w concurrency 64, 64-token streams at 10 ms/token, synchronized waves (medians)",
        )
        summary["s2w"] = table
        gw, pt = table.get(GATEWAY, {}), table.get(PASSTHROUGH, {})
        over_passthrough = paired_delta(raw["s2w"], GATEWAY, PASSTHROUGH, "ttft_p99_ms")
        checks.append(
            Check("S2w TTFT p99 over the passthrough's (ms)", over_passthrough, 5.0, "paired")
        )
        checks.append(
            Check(
                "S2w CPU/request gateway / passthrough",
                ratio_of(gw, pt, "proxy_cpu_ms_per_req"),
                1.2,
                "ratio of medians",
            )
        )
    if "s3" in raw:
        table = medians(raw["s3"])
        summary["s3"] = table
        print_table(
            "S3  concurrency 32, 512-token streams, no delay (medians of rounds)",
            table,
            [
                ("chunks_per_s", "chunks/s", ",.0f"),
                ("proxy_cpu_s_per_100k_chunks", "CPU s/100k", ".3f"),
                ("ttft_p50_ms", "TTFT p50 ms", ".3f"),
                ("proxy_cpu_pct", "proxy CPU%", ".0f"),
                ("mock_cpu_pct", "mock CPU%", ".0f"),
                ("client_cpu_pct", "client CPU%", ".0f"),
                ("errors", "errors", ".0f"),
            ],
            ratio_rows(table),
        )
        gw, pt = table.get(GATEWAY, {}), table.get(PASSTHROUGH, {})
        ratio = ratio_of(gw, pt, "chunks_per_s")
        checks.append(
            Check("S3 chunks/s gateway / passthrough", ratio, 1.0, "ratio of medians", False)
        )
        checks.append(
            Check(
                "S3 new request's TTFT p50, gateway / direct",
                ratio_of(gw, table.get(DIRECT, {}), "ttft_p50_ms"),
                2.0,
                "admission not starved by the relay",
            )
        )
    if "s4" in raw:
        runs = raw["s4"]
        table = medians(runs)
        with_big, without = S4_WITH, S4_WITHOUT
        rise = paired_delta(runs, with_big, without, "ttft_p99_ms")
        table[with_big]["p99_rise_ms"] = rise
        statuses = sorted({s for r in runs[with_big] for s in r.get("big_prompt_statuses", [])})
        summary["s4"] = {**table, "big_prompt_statuses": statuses}
        print_table(
            "S4  gateway under S2 with/without 100k-token prompts, 3 each second (medians)",
            table,
            [
                ("ttft_p50_ms", "TTFT p50 ms", ".3f"),
                ("ttft_p99_ms", "TTFT p99 ms", ".3f"),
                ("p99_rise_ms", "p99 rise ms", ".3f"),
                ("req_per_s", "req/s", ".1f"),
                ("proxy_cpu_ms_per_req", "CPU ms/req", ".3f"),
                ("big_prompts", "big sent", ".0f"),
                ("big_prompt_p50_ms", "big p50 ms", ".1f"),
                ("errors", "errors", ".0f"),
            ],
        )
        print(f"  big prompts answered with status {statuses}")
        checks.append(Check("S4 other requests' TTFT p99 rise (ms)", rise, 10.0, "paired by round"))
        if statuses != [413]:
            print("  note: expected every 100k-token prompt to get 413 prompt_too_long")
    if "memory" in raw:
        table = raw["memory"]
        summary["memory"] = table
        print_table(
            f"memory  RSS with {args.open_streams} open streams (the mock waits 60 s per token)",
            table,
            [
                ("rss_idle_mib", "idle MiB", ".1f"),
                ("rss_open_mib", "open MiB", ".1f"),
                ("kib_per_stream", "KiB/stream", ".1f"),
                ("opened", "opened", ".0f"),
                ("held_at_backend", "at backend", ".0f"),
            ],
            [("gateway / passthrough", GATEWAY, PASSTHROUGH)],
        )
        checks.append(
            Check(
                "RSS per open stream (KiB)",
                table.get(GATEWAY, {}).get("kib_per_stream"),
                64.0,
                f"{args.open_streams} streams",
            )
        )
    profiles = report.get("profile") or {}
    if "error" in profiles:
        print(f"\nprofile: {profiles['error']}")
    for profile in profiles.values() if "error" not in profiles else []:
        load = profile["load_while_profiled"]
        print(
            f"\nprofile of the gateway, {profile['title']}: {profile['samples']:.0f} busy samples "
            f"(py-spy {PROFILE_RATE_HZ} Hz, {profile['wall_s']:.1f} s; gateway CPU "
            f"{load['proxy_cpu_pct']:.0f}%, TTFT p99 {load['ttft_p99_ms']:.1f} ms, "
            f"{load['chunks_per_s']:,.0f} chunks/s while sampled)"
        )
        print(f"  files: {', '.join(profile['files'])}")
        if profile["idle_wait_samples_removed"]:
            print(
                f"  ({profile['idle_wait_samples_removed']:.0f} samples waiting in epoll or in an "
                "idle pool thread left out)"
            )
        print(
            f"  {'own %':>7} {'total %':>8}  function (own: on top of the stack; total: anywhere)"
        )
        for row in profile["hottest"]:
            print(f"  {row['own_pct']:>7.2f} {row['total_pct']:>8.2f}  {row['function']}")
    report["summary"] = summary
    print("\ntargets:")
    for check in checks:
        print(check.line())
    for note in report.get("notes", []):
        print(f"note: {note}")
    report["checks"] = [
        {"name": c.name, "value": c.value, "limit": c.limit, "passed": c.passed} for c in checks
    ]
    return checks


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, shorter runs (~2 min)")
    parser.add_argument("--rounds", type=int, help="repeats of each scenario (default 5, quick 3)")
    parser.add_argument("--s1-requests", type=int, help="sequential requests per S1 run (500/200)")
    parser.add_argument("--s2-duration", type=float, help="seconds per S2/S4 run (6/3)")
    parser.add_argument("--s3-duration", type=float, help="seconds per S3 run (5/3)")
    parser.add_argument("--capacity-duration", type=float, help="seconds of the mock check (3/2)")
    parser.add_argument("--open-streams", type=int, default=1000, help="streams for the RSS test")
    parser.add_argument("--only", help="comma list of s1,s2,s2w,s3,s4,mem,profile (default: all)")
    parser.add_argument("--no-nginx", action="store_true", help="leave nginx out")
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also run the gateway at git revision REV (e.g. main, HEAD~3) beside this one",
    )
    parser.add_argument(
        "--no-uvloop", action="store_true", help="mock and client on asyncio's loop"
    )
    parser.add_argument("--profile", action="store_true", help="py-spy the gateway under S2+S3")
    parser.add_argument(
        "--profile-gil", action="store_true", help="sample only the thread holding the GIL"
    )
    parser.add_argument("--profile-top", type=int, default=15, help="hottest functions to print")
    parser.add_argument("--max-seconds", type=float, default=900, help="hard stop for the run")
    parser.add_argument("--json", default="results/bench_overhead.json")
    args = parser.parse_args()
    defaults = (
        {
            "rounds": 3,
            "s1_requests": 200,
            "s2_duration": 3.0,
            "s3_duration": 3.0,
            "capacity_duration": 2.0,
        }
        if args.quick
        else {
            "rounds": 5,
            "s1_requests": 500,
            "s2_duration": 6.0,
            "s3_duration": 5.0,
            "capacity_duration": 3.0,
        }
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main() -> int:
    args = parse_args()
    runner: Callable[[Any], Any] = asyncio.run
    if not args.no_uvloop:
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:
            pass

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGHUP, terminate)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_overhead-") as workdir:
        fleet = Fleet(Path(workdir))
        try:
            report = runner(asyncio.wait_for(run(args, fleet), timeout=args.max_seconds))
        except TimeoutError:
            print(f"stopped: the run took longer than --max-seconds {args.max_seconds:g}")
            return 1
        finally:
            fleet.stop_all()
    checks = render(report, args)
    report["elapsed_s"] = time.monotonic() - started
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {path} ({report['elapsed_s']:.0f} s)")
    del checks  # a benchmark, not a test: the verdicts are printed, the exit code is 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
