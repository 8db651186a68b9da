"""What an engine keeps of a prompt whose request was dropped mid-prefill, and how soon
it serves a short request after the drop.

Preemption (#53) closes a long request's connection while its prompt is in prefill and
sends it again; what that buys and costs depends on the engine. The script sends a long
prompt (streamed), drops the connection after `--after` seconds, sends a short chat turn
at once (its time to first token: does the drop free the engine before the prefill
ends?), then the same long prompt again (its time, and what the engine says it reused:
vLLM's prefix-cache hit counter, llama.cpp's `timings.cache_n`).

    python scripts/abort_cache.py --url http://127.0.0.1:8101 --after 0.5 1.2
    python scripts/abort_cache.py --url http://127.0.0.1:8001 --engine llama.cpp --after 2 5

vLLM 0.32 (its CPU build, Gemma 3 270M, 512-token chunks; a 2,500-token prompt in
~1.45 s): dropped after 0.5, 0.9 or 1.05 s, 0 tokens hit and the second request took
the whole prefill again; dropped after 1.2 s (its prefill over), 2,432 hit. llama.cpp:
see docs/benchmarks.md ("Preemption in prefill").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import aiohttp

VLLM_HITS = "vllm:prefix_cache_hits_total"
#: llama.cpp's answer timings that say what a request's prompt cost.
TIMING_KEYS = ("cache_n", "prompt_n", "prompt_ms")


def prompt_timings(answer: dict[str, Any]) -> str:
    """llama.cpp's `timings` of an answer: what its prompt reused and prefilled."""
    timings = answer.get("timings") or {}
    return f"timings {json.dumps({k: timings.get(k) for k in TIMING_KEYS})}"


async def counter(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url + "/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def chat(model: str, content: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


async def first_token_s(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    """Seconds to the first content byte of a streamed answer (read to its end)."""
    start = time.monotonic()
    took = None
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        async for line in resp.content:
            if took is None and b'"content"' in line:
                took = time.monotonic() - start
    return took if took is not None else time.monotonic() - start


async def trial(args: argparse.Namespace, after_s: float) -> None:
    url = args.url
    long_body = chat(args.model, f"[{time.time_ns()}]" + " hello" * args.words, 2, True)
    short_body = chat(args.model, f"[{time.time_ns()}] Say hello.", 2, True)
    # A connection per request: llama.cpp closes a kept-alive one after a dropped request.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        hits = await counter(session, url, VLLM_HITS) if args.engine == "vllm" else 0.0

        async def dropped() -> None:
            async with session.post(url + "/v1/chat/completions", json=long_body) as resp:
                await resp.read()

        task = asyncio.create_task(dropped())
        await asyncio.sleep(after_s)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        short_s = await first_token_s(session, url, short_body)
        start = time.monotonic()
        async with session.post(
            url + "/v1/chat/completions", json=dict(long_body, stream=False)
        ) as resp:
            answer = await resp.json()
        again_s = time.monotonic() - start
        if args.engine == "vllm":
            await asyncio.sleep(0.5)
            reused = f"prefix cache hits {await counter(session, url, VLLM_HITS) - hits:.0f}"
        else:
            reused = prompt_timings(answer)
    print(
        f"dropped after {after_s:g} s: a short turn's first token {short_s:.2f} s later; "
        f"the long prompt sent again took {again_s:.2f} s; {reused}",
        flush=True,
    )


async def alone(args: argparse.Namespace) -> None:
    """The long prompt's own time, undisturbed (the baseline of each trial)."""
    body = chat(args.model, f"[{time.time_ns()}]" + " hello" * args.words, 2, False)
    async with aiohttp.ClientSession() as session:
        start = time.monotonic()
        async with session.post(args.url + "/v1/chat/completions", json=body) as resp:
            answer = await resp.json()
        took = time.monotonic() - start
    extra = f"; {prompt_timings(answer)}" if answer.get("timings") else ""
    print(f"the long prompt alone: {took:.2f} s{extra}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8101")
    parser.add_argument("--engine", choices=("vllm", "llama.cpp"), default="vllm")
    parser.add_argument("--model", default="gemma")
    parser.add_argument("--words", type=int, default=2500, help="the prompt's length")
    parser.add_argument("--after", type=float, nargs="+", default=[0.5, 1.2])
    args = parser.parse_args()
    asyncio.run(alone(args))
    for after_s in args.after:
        asyncio.run(trial(args, after_s))


if __name__ == "__main__":
    main()
