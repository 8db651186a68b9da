"""Helpers the benchmark scripts share: free loopback ports, waiting for a server, children.

The children are the project's own `python -m gateway simulate` and `serve`,
started from the repository root with the caller's interpreter; a benchmark
stops every one it started, however it ends (`Process.stop`).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]


def request_log_lines(path: Path, since: int = 0) -> list[dict[str, Any]]:
    """The gateway log's per-request lines from line `since` on (one run's); others skipped."""
    lines = []
    for text in path.read_text().splitlines()[since:]:
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if isinstance(line, dict) and line.get("event") == "request":
            lines.append(line)
    return lines


def free_port() -> int:
    """A port nobody listens on right now, on 127.0.0.1."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def wait_ready(
    url: str, path: str, timeout_s: float = 90, check: Callable[[], None] | None = None
) -> None:
    """Poll `url + path` until it answers 200; `check` may raise when a child died. The
    default leaves room for a gateway's /readyz, which waits up to 60 s for its start-up
    probe of a slow (CPU) engine."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if check is not None:
                check()
            try:
                async with session.get(url + path) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit(f"{url}{path} did not answer 200 within {timeout_s:g} s")


@dataclass
class Process:
    """A child server: its name, base URL and, for a gateway, the file its log goes to."""

    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log_path: Path | None = None

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()

    def check_alive(self) -> None:
        """Raise when the child has exited (for `wait_ready`: fail at once, not at the timeout)."""
        code = self.popen.poll()
        if code is not None:
            raise SystemExit(f"{self.name} exited with status {code} before it was ready")


def _child_env() -> dict[str, str]:
    """The environment without GATEWAY_* overrides: a benchmark's config is its TOML alone;
    and no learned state kept from an earlier run: its gateways start fresh, as the ones
    they are compared with do."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    return {**env, "GATEWAY_HEALTH_STATE_FILE": "off"}


async def start_simulator(flags: Sequence[str] = (), name: str = "simulator") -> Process:
    """`python -m gateway simulate` on a free port, with extra `flags` (`--step-base-ms 20`)."""
    port = free_port()
    popen = subprocess.Popen(
        [sys.executable, "-m", "gateway", "simulate", "--port", str(port), *flags],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    process = Process(name, f"http://127.0.0.1:{port}", popen)
    try:
        await wait_ready(process.url, "/health", check=process.check_alive)
    except BaseException:
        process.stop()
        raise
    return process


def checkout(revision: str, into: Path) -> Path:
    """The repository's files at `revision` (`git archive`), to run its gateway from
    (`start_gateway(..., source=...)`): a change's before and after in one run."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", revision],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        raise SystemExit(f"--baseline {revision}: {archive.stderr.decode(errors='replace')}")
    into.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


async def start_gateway(
    name: str, config_toml: str, config_path: Path, log_path: Path, source: Path = ROOT
) -> Process:
    """`python -m gateway serve` with this TOML (written to `config_path`); its request log
    to `log_path`, its own events (what it learned, warnings) next to it (`.events`).
    `source`: the tree whose gateway runs (`checkout` for an earlier revision)."""
    port = free_port()
    config_path.write_text(config_toml)
    with log_path.open("w") as log, log_path.with_suffix(".events").open("w") as events:
        popen = subprocess.Popen(
            [
                *(sys.executable, "-m", "gateway", "serve"),
                *("--config", str(config_path), "--port", str(port)),
            ],
            cwd=source,
            stdout=log,
            stderr=events,
            env=_child_env(),
        )
    process = Process(name, f"http://127.0.0.1:{port}", popen, log_path)
    try:
        await wait_ready(process.url, "/readyz", check=process.check_alive)
    except BaseException:
        process.stop()
        raise
    return process


@dataclass
class Tally:
    """Statuses and first-token times of a benchmark's streamed requests."""

    ttft_s: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)

    def note(self, status: int, ttft: float | None) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if status == 200 and ttft is not None:
            self.ttft_s.append(ttft)

    def ms(self, q: float) -> float | None:
        """The `q`th percentile TTFT in ms (None before any answer)."""
        from gateway.tools.stats import percentile  # benchlib loads none of the gateway

        value = percentile(self.ttft_s, q)
        return None if value is None else round(value * 1000.0, 1)

    def summary(self) -> dict[str, Any]:
        return {
            "statuses": dict(sorted(self.statuses.items())),
            "ttft_p50_ms": self.ms(50),
            "ttft_p99_ms": self.ms(99),
        }


async def stream_chat(
    session: aiohttp.ClientSession, url: str, model: str, kind: dict[str, int], tally: Tally
) -> int:
    """One streamed chat of `kind["words"]` words (a unique opening, so no prompt cache
    flatters it) and `kind["max_tokens"]`; its status (0: no answer) and TTFT into `tally`."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"{random.random()} " + "word " * kind["words"]}],
        "max_tokens": kind["max_tokens"],
        "stream": True,
    }
    start, first = time.monotonic(), None
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            async for line in resp.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.monotonic() - start
            tally.note(resp.status, first)
            return resp.status
    except (aiohttp.ClientError, TimeoutError):
        tally.note(0, None)
        return 0
