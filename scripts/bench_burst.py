"""A burst as a new user sends it, twice: does admission tell the truth? (#40 item 4)

Two strict simulators behind the docs' `[[models]]` example (`chat` on one, `code` on the
other), a gateway started fresh with the default lanes; 60 concurrent streams to `chat`
(40 short: a few words, max_tokens 32; 20 long: 2,500-4,000 words, max_tokens 512),
sent twice with a pause between. For each refusal: its code, its `Retry-After`, and when
the refused lane next admitted a request of its kind (a request of the same kind is
sent once a second after the refusal until one is admitted: the wait that really
followed). Then, on the idle gateway, one long and one short request: an idle gateway
refuses nothing.

    python scripts/bench_burst.py [--pause 20] [--json results/bench_burst.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import start_gateway, start_simulator  # noqa: E402

CONFIG = """
[[backends]]
url = "{chat}"
models = ["llama-3-8b"]
max_concurrency = 8
[[backends]]
url = "{code}"
models = ["qwen-coder"]
max_concurrency = 8

[[models]]
name = "chat"
target = "llama-3-8b"
default = true
[[models]]
name = "code"
target = "qwen-coder"
"""
SHORT = {"words": 8, "max_tokens": 32}


def long_kind() -> dict[str, int]:
    return {"words": random.randint(2500, 4000), "max_tokens": 512}


async def one(session: aiohttp.ClientSession, url: str, kind: dict[str, int]) -> dict[str, Any]:
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": f"{random.random()} " + "word " * kind["words"]}],
        "max_tokens": kind["max_tokens"],
        "stream": True,
    }
    started = time.monotonic()
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        text = await resp.read()
        event = None
        if b'"error"' in text:
            for line in text.decode(errors="replace").splitlines():
                if line.startswith("data: {") and '"error"' in line:
                    event = json.loads(line[6:])["error"]
            if resp.status != 200:
                event = json.loads(text)["error"]
        return {
            "status": resp.status,
            "code": None if event is None else event.get("code"),
            "retry_after_s": float(resp.headers["Retry-After"])
            if "Retry-After" in resp.headers
            else (event or {}).get("retry_after"),
            "at": started,
            "ended": time.monotonic(),
            "long": kind["max_tokens"] == 512,
        }


async def admitted_again(
    session: aiohttp.ClientSession, url: str, long: bool, since: float
) -> float:
    """Seconds after `since` until the lane admitted a request of this kind to its queue
    (what Retry-After promises): a probe every second until one is not refused."""
    while True:
        kind = long_kind() if long else SHORT
        body = {
            "model": "chat",
            "messages": [{"role": "user", "content": "probe " + "word " * kind["words"]}],
            "max_tokens": 1,
        }
        sent = time.monotonic()
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            await resp.read()
            if resp.status == 200:
                return sent - since  # admitted to the queue when it was sent
        await asyncio.sleep(1.0)


async def burst(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    """The 60 streams at once; from each kind's first refusal on, a probe of that kind
    every second, at the same time as the rest of the burst, until one is admitted."""
    kinds = [SHORT] * 40 + [long_kind() for _ in range(20)]
    random.shuffle(kinds)
    probes: dict[bool, tuple[float, asyncio.Task[float]]] = {}

    async def sent(kind: dict[str, int]) -> dict[str, Any]:
        result = await one(session, url, kind)
        if result["code"] is not None and result["status"] != 200 and result["long"] not in probes:
            since = result["ended"]
            task = asyncio.create_task(admitted_again(session, url, result["long"], since))
            probes[result["long"]] = (since, task)
        return result

    results = await asyncio.gather(*(sent(k) for k in kinds))
    for long, (since, task) in probes.items():
        wait = await task
        for r in results:
            if r["code"] is not None and r["status"] != 200 and r["long"] == long:
                r["admitted_again_s"] = round(wait - (r["ended"] - since), 2)
    return results


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    refused = [r for r in results if r["code"] is not None]
    by_code: dict[str, int] = {}
    for r in refused:
        by_code[r["code"]] = by_code.get(r["code"], 0) + 1
    pairs = [(r["retry_after_s"], r.get("admitted_again_s")) for r in refused]
    return {
        "requests": len(results),
        "ok": sum(1 for r in results if r["status"] == 200 and r["code"] is None),
        "refused": by_code,
        "in_band_errors": sum(1 for r in refused if r["status"] == 200),
        "retry_after_s_median": statistics.median([a for a, _ in pairs if a is not None])
        if any(a is not None for a, _ in pairs)
        else None,
        "retry_after_s_max": max((a for a, _ in pairs if a is not None), default=None),
        "admitted_again_s_median": statistics.median([b for _, b in pairs if b is not None])
        if any(b is not None for _, b in pairs)
        else None,
    }


async def main(args: argparse.Namespace) -> int:
    random.seed(args.seed)
    flags = ["--strict-model", "--max-batch", "8"]
    chat = await start_simulator([*flags, "--model", "llama-3-8b"], "chat")
    code = await start_simulator([*flags, "--model", "qwen-coder"], "code")
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        gateway = await start_gateway(
            "gateway",
            CONFIG.format(chat=chat.url, code=code.url),
            Path(tmp) / "gateway.toml",
            Path(tmp) / "requests.log",
        )
        try:
            timeout = aiohttp.ClientTimeout(total=300)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                for name in ("first", "second"):
                    out[name] = summary(await burst(session, gateway.url))
                    print(name, json.dumps(out[name]))
                    await asyncio.sleep(args.pause)
                idle = [await one(session, gateway.url, k) for k in (long_kind(), SHORT)]
                out["idle"] = {"refused": [r["code"] for r in idle if r["code"] is not None]}
                print("idle", json.dumps(out["idle"]))
        finally:
            gateway.stop()
            chat.stop()
            code.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pause", type=float, default=20.0, help="seconds between bursts")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write the figures as JSON")
    parser.add_argument("--keep", metavar="DIR", help="keep the gateway's config and logs here")
    raise SystemExit(asyncio.run(main(parser.parse_args())))
