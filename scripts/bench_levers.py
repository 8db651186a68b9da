#!/usr/bin/env python3
"""An engine setting's effect on the floor no door can beat, and what it costs.

The gateway decides when a request reaches the engine; inside it, a short prompt that
arrives while a long one is in prefill waits for that prefill (vLLM schedules its
running prefill's chunk first; llama.cpp prefills a prompt a batch at a time). Some
engine settings change that: vLLM's `--long-prefill-token-threshold` (a long prompt
takes at most that many tokens of a step, so a waiting short prompt joins the step),
its `--max-num-batched-tokens`, llama.cpp's `--batch-size`/`--ubatch-size`. This
measures, on one running engine (started with the setting under test):

- the floor: a short prompt's TTFT sent `--delays` after one long prompt (unique
  openings: no prefix-cache hit), `--repeats` times each: median and max;
- the cost: completed requests/s and tokens/s of a closed loop of the mix
  (`--mix`, as bench_tail's calibration: 2 x `--slots` workers, `--requests`).

    python scripts/bench_levers.py --backend http://127.0.0.1:8101 --model gemma \\
        --slots 8 --mix config/mix-vllm.toml --label "vLLM default"

Run it once per setting (restart the engine with it) and set the lines side by side;
`--json FILE` appends one JSON object per run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import uuid
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.tools.loadgen import closed_schedule, resolve_mix, run_closed_loop  # noqa: E402


async def first_token_s(
    http: aiohttp.ClientSession, url: str, model: str, prompt: str, start: float
) -> float:
    """Seconds from `start` (loop time) to the first content token of a streamed chat."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 8,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    loop = asyncio.get_running_loop()
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if b'"content":"' in line and b'"content":""' not in line:
                first = loop.time() - start
                await resp.read()
                return first
    raise RuntimeError("the stream ended without a token")


def long_prompt(words: int) -> str:
    """A unique opening (no cached prefix), then `words` short words (~2 tokens each)."""
    return f"[{uuid.uuid4().hex}] " + " ".join(f"w{i}" for i in range(words))


async def floor(
    url: str, model: str, long_words: int, delays: list[float], repeats: int
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    shorts: dict[float, list[float]] = {d: [] for d in delays}
    longs: list[float] = []
    # A connection per request: llama.cpp's server closes idle keep-alive connections.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        # One unmeasured pair first: the engine's first long prompt pays for warm-up.
        await first_token_s(http, url, model, long_prompt(long_words), loop.time())
        for _ in range(repeats):
            for delay in delays:
                started = loop.time()
                long = asyncio.create_task(
                    first_token_s(http, url, model, long_prompt(long_words), started)
                )
                await asyncio.sleep(delay)
                short = await first_token_s(
                    http, url, model, f"[{uuid.uuid4().hex}] Say hello.", loop.time()
                )
                longs.append(await long)
                shorts[delay].append(short)
                await asyncio.sleep(0.5)
        alone = [
            await first_token_s(http, url, model, f"[{uuid.uuid4().hex}] Say hi.", loop.time())
            for _ in range(repeats)
        ]
    every = [s for values in shorts.values() for s in values]
    return {
        "short_alone_s": statistics.median(alone),
        "long_ttft_s": statistics.median(longs),
        "short_behind_long_median_s": statistics.median(every),
        "short_behind_long_max_s": max(every),
        "by_delay": {str(d): statistics.median(v) for d, v in shorts.items()},
    }


async def cost(url: str, model: str, mix: str, slots: int, requests: int) -> dict[str, Any]:
    schedule = closed_schedule(resolve_mix(mix), requests, seed=7)
    run = await run_closed_loop(
        url, schedule, concurrency=2 * slots, model=model, extra_body={"ignore_eos": True}
    )
    ok = [r for r in run.results if r.ok]
    tokens = sum(r.prompt_tokens + (r.completion_tokens or 0) for r in ok)
    return {
        "requests_per_s": len(ok) / run.wall_s,
        "tokens_per_s": tokens / run.wall_s,
        "completed": len(ok),
        "wall_s": run.wall_s,
    }


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--model", default="gemma")
    parser.add_argument("--label", default="", help="the setting under test, for the table")
    parser.add_argument(
        "--long-words",
        type=int,
        default=750,
        help="the long prompt: ~3,900 tokens for vLLM's Gemma per 1,000",
    )
    parser.add_argument("--delays", default="0.02,0.25,0.5")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mix", default="config/mix-vllm.toml")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--no-cost", action="store_true", help="the floor only")
    parser.add_argument("--json", help="append the result to this file")
    args = parser.parse_args()
    url = args.backend.rstrip("/")
    delays = [float(d) for d in args.delays.split(",")]
    result: dict[str, Any] = {"label": args.label, "backend": url}
    result["floor"] = await floor(url, args.model, args.long_words, delays, args.repeats)
    if not args.no_cost:
        result["cost"] = await cost(url, args.model, args.mix, args.slots, args.requests)
    f = result["floor"]
    line = (
        f"{args.label or url}: short behind a long prefill median {f['short_behind_long_median_s']:.2f} s"
        f" (max {f['short_behind_long_max_s']:.2f} s; alone {f['short_alone_s']:.2f} s;"
        f" the long's TTFT {f['long_ttft_s']:.2f} s)"
    )
    if "cost" in result:
        c = result["cost"]
        line += f"; closed loop {c['requests_per_s']:.2f} req/s, {c['tokens_per_s']:.0f} tokens/s"
    print(line)
    if args.json:
        with open(args.json, "a") as out:
            out.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
