"""The simulator writes TGI's / vLLM's log (as a process, real traffic); `analyze` reads it back."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

ROOT = Path(__file__).resolve().parents[3]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _traffic(port: int, n: int) -> list[int]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    async with aiohttp.ClientSession() as http:
        for _ in range(100):
            try:
                async with http.get(f"http://127.0.0.1:{port}/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)

        async def one() -> int:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            async with http.post(url, json=body) as r:
                await r.read()
                return r.status

        return await asyncio.gather(*(one() for _ in range(n)))


@pytest.mark.parametrize("fmt", ["tgi", "tgi-json", "vllm"])
def test_simulator_log_read_by_analyze(fmt: str, tmp_path: Path) -> None:
    log = tmp_path / f"{fmt}.log"
    port = _port()
    sim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway",
            "simulate",
            "--port",
            str(port),
            "--max-batch",
            "1",
            "--log-format",
            fmt,
            "--log-file",
            str(log),
            "--log-interval",
            "0.2",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        statuses = asyncio.run(_traffic(port, 6))
        time.sleep(0.5)
    finally:
        sim.terminate()
        sim.wait(timeout=20)
    assert statuses == [200] * 6
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "analyze", str(log)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    if fmt == "vllm":
        assert "verdict: engine queued" in out.stdout  # one slot, six at once: five waited
        assert "200: 7" in out.stdout  # six chats and the health probe
    else:
        assert "TGI log: 6 requests" in out.stdout
        assert "verdict: the slowest 1 request(s) are queueing-bound" in out.stdout
    assert "lines no reader knew: 0" in out.stdout
