"""What bench_replicas needs besides benchlib: a Redis process (the tests' `RedisServer`),
a fleet of gateway replicas, and the witnesses that do not take the gateway's word (the
simulator's own peak, Redis's own lease set, the request log lines, `/metrics` scraped
from outside).

Every child is started here and stopped by its PID (`Children.stop_all`), however the
benchmark ends.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from benchlib import ROOT, Process, start_gateway, start_simulator

sys.path.insert(0, str(ROOT))

from gateway.tools.loadgen import (  # noqa: E402
    PlannedRequest,
    RequestResult,
    RunResult,
    run_open_loop,
)

# The tests' redis-server launcher, one copy for both.
from tests.redis_server import RedisServer  # noqa: E402

#: The backend names every replica's config gives the simulators (leases are keyed by URL,
#: so the names only make the logs readable).
SIM_NAMES = ("sim0", "sim1")


# ----------------------------------------------------------------------------- Redis


def redis_binary() -> str | None:
    return shutil.which("redis-server") or shutil.which("redis-server", path="/usr/sbin:/usr/bin")


# --------------------------------------------------------------------------- children


@dataclass
class Children:
    """Every process a benchmark started, stopped by PID at the end (or earlier)."""

    processes: list[Process] = field(default_factory=list)
    redis: RedisServer | None = None

    def add(self, *processes: Process) -> None:
        self.processes.extend(processes)

    def stop(self, processes: Sequence[Process]) -> None:
        """SIGTERM all at once, then wait for each (a gateway drains in parallel, not in turn)."""
        for process in processes:
            if process.popen.poll() is None:
                process.popen.terminate()
        for process in processes:
            try:
                process.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait(timeout=5)
        for process in processes:
            if process in self.processes:
                self.processes.remove(process)

    def stop_all(self) -> None:
        self.stop(list(self.processes))
        if self.redis is not None:
            self.redis.cleanup()


async def start_simulators(children: Children, count: int = len(SIM_NAMES)) -> list[Process]:
    """Simulators with their default knobs (max_batch 8), started together."""
    sims = await asyncio.gather(*(start_simulator(name=SIM_NAMES[i]) for i in range(count)))
    children.add(*sims)
    return list(sims)


def gateway_toml(
    sims: Sequence[Process],
    slots: int,
    *,
    redis_url: str = "",
    key_prefix: str = "llmgw",
    extra: str = "",
) -> str:
    """The default config but for the backends (`slots` each), `[redis]` and `extra`."""
    parts = [
        f'[[backends]]\nurl = "{sim.url}"\nname = "{sim.name}"\nmax_concurrency = {slots}\n'
        for sim in sims
    ]
    if redis_url:
        parts.append(f'[redis]\nurl = "{redis_url}"\nkey_prefix = "{key_prefix}"\n')
    if extra:
        parts.append(extra)
    return "\n".join(parts)


async def start_replicas(
    children: Children, tag: str, count: int, config_toml: str, out_dir: Path
) -> list[Process]:
    """`count` gateway processes with the same config, started together; logs in `out_dir`."""
    replicas = await asyncio.gather(
        *(
            start_gateway(
                f"{tag}-r{i}",
                config_toml,
                out_dir / f"{tag}-r{i}.toml",
                out_dir / f"{tag}-r{i}.log",
            )
            for i in range(count)
        )
    )
    children.add(*replicas)
    return list(replicas)


# ------------------------------------------------------------------------- witnesses


async def sim_stats(session: aiohttp.ClientSession, sim: Process) -> dict[str, Any]:
    async with session.get(sim.url + "/sim/stats") as resp:
        resp.raise_for_status()
        data: dict[str, Any] = await resp.json()
        return data


async def reset_peaks(session: aiohttp.ClientSession, sims: Sequence[Process]) -> None:
    for sim in sims:
        async with session.post(sim.url + "/sim/stats/reset-peaks") as resp:
            resp.raise_for_status()


async def peaks(session: aiohttp.ClientSession, sims: Sequence[Process]) -> dict[str, int]:
    """Each simulator's own peak of requests held at once (batch + its queue)."""
    return {sim.name: int((await sim_stats(session, sim))["in_flight_peak"]) for sim in sims}


async def wait_sims_idle(
    session: aiohttp.ClientSession, sims: Sequence[Process], within_s: float = 30.0
) -> bool:
    """Until no simulator holds a request and none arrived for half a second (the
    replicas' start-up probes are over, the last run's tail is gone)."""
    deadline = time.monotonic() + within_s
    last: tuple[int, ...] | None = None
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        stats = [await sim_stats(session, sim) for sim in sims]
        now = tuple(int(s["submitted"]) for s in stats)
        busy = any(s["in_flight"] for s in stats)
        if busy or now != last:
            quiet_since, last = time.monotonic(), now
        elif time.monotonic() - quiet_since >= 0.5:
            return True
        await asyncio.sleep(0.1)
    return False


class LeaseWatcher:
    """Reads the slot leases in Redis itself (gateway/fleet/leases.py's layout: a sorted
    set `<prefix>:slots:<backend url>` of `<replica id>:<n>` scored by expiry in Redis
    milliseconds; replica id `<host>-<pid>-<hex>`), never through a gateway."""

    def __init__(self, redis_url: str, key_prefix: str) -> None:
        self.client = aioredis.Redis.from_url(redis_url, socket_timeout=1.0)
        self.key_prefix = key_prefix

    async def live(self, backend_url: str) -> list[str]:
        """Lease members not expired by Redis's own clock."""
        seconds, micros = await self.client.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        key = f"{self.key_prefix}:slots:{backend_url}"
        members = await self.client.zrangebyscore(key, f"({now_ms}", "+inf")
        return [m.decode() if isinstance(m, bytes) else str(m) for m in members]

    @staticmethod
    def pid_of(member: str) -> int | None:
        replica = member.rsplit(":", 1)[0]
        parts = replica.rsplit("-", 2)
        try:
            return int(parts[-2]) if len(parts) == 3 else None
        except ValueError:
            return None

    async def close(self) -> None:
        await self.client.aclose()


_REDIS_UP = re.compile(r"^gateway_redis_up(?:\{[^}]*\})? (\S+)$", re.MULTILINE)


async def redis_up_gauge(session: aiohttp.ClientSession, replica: Process) -> float | None:
    """`gateway_redis_up` as a scrape of the replica's /metrics shows it (None: absent)."""
    try:
        async with session.get(replica.url + "/metrics") as resp:
            text = await resp.text()
    except aiohttp.ClientError:
        return None
    match = _REDIS_UP.search(text)
    return float(match.group(1)) if match else None


def json_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = []
    for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(parsed, dict):
            lines.append(parsed)
    return lines


def request_lines(replicas: Sequence[Process]) -> list[dict[str, Any]]:
    """The `event="request"` lines of every replica's stdout log."""
    return [
        line
        for replica in replicas
        if replica.log_path is not None
        for line in json_lines(replica.log_path)
        if line.get("event") == "request"
    ]


def events(replica: Process, name: str) -> list[dict[str, Any]]:
    """The replica's stderr events named `name` (redis_unavailable, redis_rejoined ...)."""
    assert replica.log_path is not None
    return [
        e for e in json_lines(replica.log_path.with_suffix(".events")) if e.get("event") == name
    ]


# --------------------------------------------------------------------------- traffic


async def run_spread(
    urls: Sequence[str], schedule: Sequence[PlannedRequest], timeout_s: float
) -> RunResult:
    """One seeded open-loop schedule, request i to replica i mod n (a round-robin load
    balancer), all replicas at once on their own clocks started together."""
    parts = [[p for p in schedule if p.index % len(urls) == i] for i in range(len(urls))]
    runs = await asyncio.gather(
        *(
            run_open_loop(url, part, timeout_s=timeout_s)
            for url, part in zip(urls, parts, strict=True)
            if part
        )
    )
    results: list[RequestResult] = sorted(
        (r for run in runs for r in run.results), key=lambda r: r.index
    )
    return RunResult(
        target=",".join(urls),
        results=results,
        wall_s=max(run.wall_s for run in runs),
        run_tag=",".join(run.run_tag for run in runs),
    )
