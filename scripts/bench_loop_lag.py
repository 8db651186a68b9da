#!/usr/bin/env python3
"""Does counting a 100k-token prompt stall other requests' streams?

Starts the simulator and two gateways (subprocesses, 127.0.0.1): one with the
default tokenizer offload (big prompts are encoded in a worker thread) and one
with offload disabled (everything encoded on the event loop). Against each, in
the same run: a few streams flow steadily while bursts of ~100k-token prompts
arrive; the script measures the largest gap between two chunks of the steady
streams, the thing a user sees as a stutter. A run with no big prompts gives
the baseline. Prints a table and writes JSON.

    python scripts/bench_loop_lag.py [--rounds 3] [--json results/loop_lag.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from benchlib import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.tools.stats import percentile  # noqa: E402

BIG_PROMPT_WORDS = 100_000  # "word " ~ 1 token each: ~100k tokens
STREAM_TOKENS = 400


def start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "gateway", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def steady_stream(session: aiohttp.ClientSession, url: str) -> list[float]:
    """Inter-chunk gaps (ms) of one streamed request."""
    body = {
        "model": "sim-model",
        "stream": True,
        "max_tokens": STREAM_TOKENS,
        "messages": [{"role": "user", "content": "Tell me a story."}],
    }
    gaps: list[float] = []
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        last = None
        async for _ in resp.content.iter_any():
            now = time.perf_counter()
            if last is not None:
                gaps.append((now - last) * 1000)
            last = now
    return gaps


async def big_prompt(session: aiohttp.ClientSession, url: str, raw: bytes) -> int:
    async with session.post(
        url + "/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"}
    ) as resp:
        await resp.read()
        return resp.status


async def scenario(url: str, with_big_prompts: bool) -> dict[str, Any]:
    raw = json.dumps(
        {
            "model": "sim-model",
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "word " * BIG_PROMPT_WORDS}],
        }
    ).encode()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        streams = [asyncio.create_task(steady_stream(session, url)) for _ in range(4)]
        statuses: list[int] = []
        if with_big_prompts:
            await asyncio.sleep(0.3)
            for _ in range(5):  # bursts of 3 big prompts while the streams flow
                statuses += await asyncio.gather(*(big_prompt(session, url, raw) for _ in range(3)))
                await asyncio.sleep(0.1)
        gaps = [gap for task in await asyncio.gather(*streams) for gap in task]
    return {
        "gap_p50_ms": percentile(gaps, 50),
        "gap_p99_ms": percentile(gaps, 99),
        "gap_max_ms": max(gaps),
        "big_prompts": len(statuses),
        "big_prompt_statuses": sorted(set(statuses)),
    }


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="results/loop_lag.json")
    args = parser.parse_args()

    sim_port, offload_port, inline_port = free_port(), free_port(), free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    processes = [start(["simulate", "--port", str(sim_port), "--max-batch", "16"])]
    try:
        await wait_ready(sim_url, "/health")
        gateways = {
            "offload (default)": (offload_port, {}),
            "on the loop": (inline_port, {"GATEWAY_TOKENIZER_OFFLOAD_MIN_CHARS": "1000000000"}),
        }
        for port, env in gateways.values():
            processes.append(start(["serve", "--port", str(port), "--backend", sim_url], env))
        for port, _ in gateways.values():
            await wait_ready(f"http://127.0.0.1:{port}", "/healthz")

        rows: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.rounds):  # interleaved so machine drift hits all alike
            for name, (port, _) in gateways.items():
                url = f"http://127.0.0.1:{port}"
                rows.setdefault(f"{name}, no big prompts", []).append(await scenario(url, False))
                rows.setdefault(f"{name}, 100k-token prompts", []).append(await scenario(url, True))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=10)

    print(
        f"{'configuration':<40} {'gap p50':>9} {'gap p99':>9} {'gap max':>9}  (ms, median of rounds)"
    )
    summary = {}
    for name, runs in rows.items():
        med = {
            key: percentile([r[key] for r in runs], 50)
            for key in ("gap_p50_ms", "gap_p99_ms", "gap_max_ms")
        }
        summary[name] = {"median": med, "runs": runs}
        print(
            f"{name:<40} {med['gap_p50_ms']:>9.1f} {med['gap_p99_ms']:>9.1f} {med['gap_max_ms']:>9.1f}"
        )
    write_json(Path(args.json), summary)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
