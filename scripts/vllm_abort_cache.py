"""Does a vLLM keep what it prefilled of a prompt whose request was aborted mid-prefill?

Preemption (#53) closes a long request's connection while its prompt is in prefill and
sends it again; what that costs depends on this. The script sends a long prompt
(streamed), drops the connection after `--after` seconds, sends the same prompt again
and reads vLLM's prefix-cache hit counter and the second request's time.

    python scripts/vllm_abort_cache.py --url http://127.0.0.1:8101 --after 0.5 1.2

vLLM 0.32 (its CPU build, Gemma 3 270M, 512-token chunks; a 2,500-token prompt in
~1.45 s): dropped after 0.5, 0.9 or 1.05 s, 0 tokens hit and the second request took
the whole prefill again; dropped after 1.2 s (its prefill over), 2,432 hit.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp


async def counter(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url + "/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def trial(url: str, model: str, after_s: float, words: int) -> None:
    prompt = f"[{time.time_ns()}]" + " hello" * words
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
    }
    async with aiohttp.ClientSession() as session:
        hits = await counter(session, url, "vllm:prefix_cache_hits_total")

        async def first() -> None:
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                await resp.read()

        task = asyncio.create_task(first())
        await asyncio.sleep(after_s)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.5)  # the abort reaches the engine
        start = time.monotonic()
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            await resp.read()
        took = time.monotonic() - start
        await asyncio.sleep(0.5)
        hit = await counter(session, url, "vllm:prefix_cache_hits_total") - hits
    print(f"dropped after {after_s:g} s: sent again, {took:.2f} s; prefix cache hits {hit:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8101")
    parser.add_argument("--model", default="gemma")
    parser.add_argument("--words", type=int, default=2500, help="the prompt's length")
    parser.add_argument("--after", type=float, nargs="+", default=[0.5, 1.2])
    args = parser.parse_args()
    for after_s in args.after:
        asyncio.run(trial(args.url, args.model, after_s, args.words))


if __name__ == "__main__":
    main()
