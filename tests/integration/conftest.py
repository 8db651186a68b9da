"""Fixtures of the integration tests that run the gateway as a process of its own (a
signal, a config file rewritten, the whole `serve` path)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Gateway:
    url: str
    config: Path
    process: asyncio.subprocess.Process
    stderr_lines: list[dict[str, Any]]

    def hup(self) -> None:
        self.process.send_signal(signal.SIGHUP)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in self.stderr_lines if line.get("event") == name]


StartGateway = Callable[[str], Any]


@pytest.fixture
async def gateway_process(
    http: aiohttp.ClientSession, tmp_path: Path
) -> AsyncIterator[StartGateway]:
    """`python -m gateway serve --config <file>` with the given TOML; its stderr's JSON
    lines collected as they come."""
    started: list[tuple[asyncio.subprocess.Process, asyncio.Task[None]]] = []

    async def start(toml: str) -> Gateway:
        config = tmp_path / "gateway.toml"
        config.write_text(toml)
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--config", str(config),
            "--port", str(port),
            cwd=ROOT, env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        lines: list[dict[str, Any]] = []
        reader = asyncio.create_task(_collect(process, lines))
        started.append((process, reader))
        gateway = Gateway(f"http://127.0.0.1:{port}", config, process, lines)
        await wait_ready(http, gateway.url, timeout_s=30)
        return gateway

    yield start
    for process, reader in started:
        if process.returncode is None:
            process.kill()
            await process.wait()
        reader.cancel()


async def _collect(process: asyncio.subprocess.Process, lines: list[dict[str, Any]]) -> None:
    assert process.stderr is not None
    async for raw in process.stderr:
        try:
            lines.append(json.loads(raw))
        except ValueError:
            lines.append({"event": "text", "text": raw.decode(errors="replace")})


async def metric(http: aiohttp.ClientSession, url: str, name: str) -> float | None:
    """One sample of /metrics (name with its labels, as exposed), None when absent."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return None if found is None else float(found.group(1))
