#!/usr/bin/env python3
"""Two models behind one gateway: does one model's overload reach the other's clients?

Issue #28's proof. Two simulators, each serving one model strictly (`--strict-model`:
any other name is a 404, as vLLM answers it), behind one gateway process with the
default config plus two `[[backends]]` that say what they serve:

1. **Isolation.** Model B's short chat turns at 30% of B's capacity, measured alone
   and while model A's pool gets long requests at 150% of A's capacity (its queues
   fill, its predicted waits refuse), in alternating phases (alone, shared, control,
   control, shared, alone) of `--seconds` each. Figures: B's short P99 TTFT alone and
   loaded (target: loaded ≤ 1.1x alone), and loaded while A's overload goes through a
   second gateway process that fronts A alone (a control: the same CPU taken, no
   gateway shared), A's outcomes, and requests that reached a backend without its
   model, counted from the simulators' own `/sim/stats` `by_model`
   (target: 0).
2. **An alias moving to a new target.** `[[models]] name = "chat"` with targets
   `alpha` and `beta` weighted 90/10, 50/50, then `beta` alone (a gateway restarted
   for each step, as a config change is rolled out): the share each backend received
   of `--alias-requests` requests (target: within 5 points of the weight) and the
   failed ones (target: 0).

Capacities are measured first, each model alone (a closed loop at twice its slots).

    python scripts/bench_models.py                  # ~2 min
    python scripts/bench_models.py --seconds 8 --reps 1
    python scripts/bench_models.py --json results/bench_models.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import Process, Tally, start_gateway, start_simulator, stream_chat  # noqa: E402

SHORT = {"words": 40, "max_tokens": 32}
LONG = {"words": 1400, "max_tokens": 128}
#: The simulator's slots (its default batch); the calibration runs twice that many.
SLOTS = 8


def gateway_toml(alpha: Process, beta: Process, alias: list[tuple[str, float]] | None) -> str:
    lines = [
        "[[backends]]", f'url = "{alpha.url}"', 'name = "alpha"', 'models = ["alpha"]', "",
        "[[backends]]", f'url = "{beta.url}"', 'name = "beta"', 'models = ["beta"]', "",
    ]  # fmt: skip
    if alias:
        targets = ", ".join(f'{{model = "{m}", weight = {w}}}' for m, w in alias)
        lines += ["[[models]]", 'name = "chat"', f"targets = [{targets}]", ""]
    return "\n".join(lines)


async def open_loop(
    url: str, model: str, kind: dict[str, int], rate: float, seconds: float, seed: int
) -> Tally:
    """Poisson arrivals at `rate` for `seconds`; waits for every answer."""
    rng, tally, tasks = random.Random(seed), Tally(), []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        start, at = time.monotonic(), 0.0
        while at < seconds:
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(stream_chat(session, url, model, kind, tally)))
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return tally


async def capacity(url: str, model: str, kind: dict[str, int], seconds: float) -> float:
    """Requests per second one model's backend completes with twice its slots asking."""
    done, stop_at = 0, time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                tally = Tally()
                await stream_chat(session, url, model, kind, tally)
                done += tally.statuses.get(200, 0)

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(2 * SLOTS)))
    return done / (time.monotonic() - start)


async def closed_loop(url: str, model: str, requests: int, concurrency: int = 8) -> Tally:
    """`requests` short requests, `concurrency` at a time."""
    tally, limit = Tally(), asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:

        async def send() -> None:
            async with limit:
                await stream_chat(session, url, model, SHORT, tally)

        await asyncio.gather(*(send() for _ in range(requests)))
    return tally


async def by_model(url: str) -> dict[str, int]:
    async with aiohttp.ClientSession() as session, session.get(url + "/sim/stats") as resp:
        stats: dict[str, Any] = await resp.json()
    return stats["by_model"]


def minus(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {m: n - before.get(m, 0) for m, n in now.items() if n > before.get(m, 0)}


def misrouted(alpha: dict[str, int], beta: dict[str, int]) -> int:
    return sum(n for m, n in alpha.items() if m != "alpha") + sum(
        n for m, n in beta.items() if m != "beta"
    )


def _add(into: Tally, tally: Tally) -> None:
    into.ttft_s += tally.ttft_s
    for status, n in tally.statuses.items():
        into.statuses[status] = into.statuses.get(status, 0) + n


#: One rep's phases, in an order that spreads drift in the machine over all three kinds.
PHASES = ["alone", "shared", "control", "control", "shared", "alone"]


async def isolation(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """B's shorts alone, with A's overload through the same gateway (`shared`), and with
    A's overload through a second gateway process of its own (`control`): the same work
    on the same 2 cores, but no gateway state in common. shared against alone is the
    issue's target; shared against control is what sharing the door itself costs, apart
    from the CPU the simulators, the client and two relays take from each other."""
    alpha = await start_simulator(["--model", "alpha", "--strict-model"], name="alpha")
    beta = await start_simulator(["--model", "beta", "--strict-model"], name="beta")
    gateway = control = None
    try:
        gateway = await start_gateway(
            "gateway", gateway_toml(alpha, beta, None), work / "iso.toml", work / "iso.log"
        )
        alpha_only = f'[[backends]]\nurl = "{alpha.url}"\nname = "alpha"\nmodels = ["alpha"]\n'
        control = await start_gateway("control", alpha_only, work / "ctl.toml", work / "ctl.log")
        cap_a = await capacity(alpha.url, "alpha", LONG, args.calibrate)
        cap_b = await capacity(beta.url, "beta", SHORT, args.calibrate)
        tallies = {kind: Tally() for kind in ("alone", "shared", "control")}
        long_tally = Tally()
        for rep, phase in enumerate(PHASES * args.reps):
            shorts = open_loop(gateway.url, "beta", SHORT, 0.3 * cap_b, args.seconds, rep)
            if phase == "alone":
                b = await shorts
            else:
                door = gateway.url if phase == "shared" else control.url
                longs = open_loop(door, "alpha", LONG, 1.5 * cap_a, args.seconds, 100 + rep)
                b, a = await asyncio.gather(shorts, longs)
                _add(long_tally, a)
            _add(tallies[phase], b)
        counts_a, counts_b = await by_model(alpha.url), await by_model(beta.url)
    finally:
        for process in (gateway, control):
            if process is not None:
                process.stop()
        alpha.stop()
        beta.stop()
    p99 = {kind: tally.ms(99) for kind, tally in tallies.items()}

    def ratio(a: str, b: str) -> float | None:
        return round(p99[a] / p99[b], 3) if p99[a] and p99[b] else None  # type: ignore[operator]

    return {
        "capacity_req_s": {"alpha_long": round(cap_a, 2), "beta_short": round(cap_b, 2)},
        "beta_short_alone": tallies["alone"].summary(),
        "beta_short_with_alpha_at_150": tallies["shared"].summary(),
        "beta_short_with_alpha_at_150_via_another_gateway": tallies["control"].summary(),
        "alpha_long_at_150": long_tally.summary(),
        "p99_ratio": ratio("shared", "alone"),
        "p99_ratio_control": ratio("control", "alone"),
        "p99_ratio_shared_vs_control": ratio("shared", "control"),
        "received": {"alpha": counts_a, "beta": counts_b},
        "misrouted": misrouted(counts_a, counts_b),
    }


async def alias_steps(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    steps = []
    for new_share in (0.1, 0.5, 1.0):
        weights = [("beta", 1.0)] if new_share == 1.0 else [
            ("alpha", round(1 - new_share, 2)), ("beta", new_share)
        ]  # fmt: skip
        alpha = await start_simulator(["--model", "alpha", "--strict-model"], name="alpha")
        beta = await start_simulator(["--model", "beta", "--strict-model"], name="beta")
        gateway = None
        try:
            stem = f"alias-{int(new_share * 100)}"
            gateway = await start_gateway(
                "gateway", gateway_toml(alpha, beta, weights), work / f"{stem}.toml",
                work / f"{stem}.log",
            )  # fmt: skip
            # The start-up probe's own requests are not the alias's.
            probes_a, probes_b = await by_model(alpha.url), await by_model(beta.url)
            tally = await closed_loop(gateway.url, "chat", args.alias_requests)
            counts_a = minus(await by_model(alpha.url), probes_a)
            counts_b = minus(await by_model(beta.url), probes_b)
        finally:
            if gateway is not None:
                gateway.stop()
            alpha.stop()
            beta.stop()
        to_new = counts_b.get("beta", 0)
        total = to_new + counts_a.get("alpha", 0)
        steps.append(
            {
                "weight_new_percent": round(100 * new_share, 1),
                "received_new_percent": round(100 * to_new / total, 1) if total else None,
                "requests": args.alias_requests,
                "failed": sum(n for s, n in tally.statuses.items() if s != 200),
                "misrouted": misrouted(counts_a, counts_b),
            }
        )
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="each phase (15 s)")
    parser.add_argument(
        "--reps",
        type=int,
        default=1,
        help="rounds of alone, shared, control, control, shared, alone (1)",
    )
    parser.add_argument("--calibrate", type=float, default=6.0, help="capacity runs (6 s)")
    parser.add_argument("--alias-requests", type=int, default=400, help="per alias step (400)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        work = Path(tmp)
        result = {
            "isolation": asyncio.run(isolation(args, work)),
            "alias": asyncio.run(alias_steps(args, work)),
        }
    iso = result["isolation"]
    print(json.dumps(result, indent=2))
    checks = {
        "B's short P99 loaded <= 1.1x alone": iso["p99_ratio"] is not None
        and iso["p99_ratio"] <= 1.1,
        "B's short P99 loaded via the shared gateway <= 1.1x via A's own gateway": (
            iso["p99_ratio_shared_vs_control"] is not None
            and iso["p99_ratio_shared_vs_control"] <= 1.1
        ),
        "no request reached a backend without its model": iso["misrouted"] == 0
        and all(step["misrouted"] == 0 for step in result["alias"]),
        "alias split within 5 points of its weights": all(
            step["received_new_percent"] is not None
            and abs(step["received_new_percent"] - step["weight_new_percent"]) <= 5
            for step in result["alias"]
        ),
        "no alias request failed": all(step["failed"] == 0 for step in result["alias"]),
    }
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**result, "checks": checks}, indent=2) + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
