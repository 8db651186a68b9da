"""`python -m gateway replay SOURCE`: what would the gateway change for this traffic?

Replays the source twice on a virtual clock, straight to N simulated engines and through
the gateway's own admission, scheduler and pool (built from the same settings as
`serve`), and prints per-class TTFT percentiles, refusals and goodput side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import msgspec

from gateway.app import build_pools
from gateway.config import ConfigError, Settings, load_settings
from gateway.observability.logs import make_logger
from gateway.outcomes import ModelNotFound
from gateway.tools.replay.model import capacity_rps, scaled, source_rps, speed_for_load
from gateway.tools.replay.report import meets, smallest_fleet, summary, table
from gateway.tools.replay.report_html import render_html
from gateway.tools.replay.runs import classify, run_direct, run_gateway
from gateway.tools.replay.sources import Arrival, Source, load_source, time_slice
from gateway.tools.simulator.config import SimulatorConfig

#: Where the sweep stops looking for a fleet that meets the target.
MAX_SWEEP_BACKENDS = 64

#: From this many arrivals the two runs go to two processes (below, starting them costs
#: more than it saves).
PARALLEL_FROM = 2000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="our request log (JSON lines) or a trace .csv "
                        "(TIMESTAMP,ContextTokens,GeneratedTokens)")  # fmt: skip
    parser.add_argument("--config", default=os.environ.get("GATEWAY_CONFIG"),
                        help="the gateway's TOML config (default: the built-in defaults)")  # fmt: skip
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument("--load", type=float,
                      help="offer this multiple of the modelled engines' capacity for this mix")  # fmt: skip
    rate.add_argument("--speed", type=float, help="multiply the source's own arrival rate")
    parser.add_argument("--backends", type=int,
                        help="engines (default: the config's backends, else 1)")  # fmt: skip
    parser.add_argument("--start", type=float, default=0.0, help="slice start, seconds")
    parser.add_argument("--duration", type=float, help="slice length, seconds (default: all)")
    parser.add_argument("--slots", type=int, help="engine batch size (default 8)")
    parser.add_argument("--prefill-tokens-per-s", type=float,
                        help="engine prefill rate (default: from the log, else 2000)")  # fmt: skip
    parser.add_argument("--decode-ms-per-token", type=float,
                        help="time per output token with a full batch (default: from the log, "
                        "else the simulator's 9 ms)")  # fmt: skip
    parser.add_argument("--target-p99", metavar="CLASS=SECONDS",
                        help="sweep: the fewest backends whose CLASS P99 TTFT through the "
                        "gateway is at most this, e.g. interactive=2s")  # fmt: skip
    parser.add_argument("--json", metavar="FILE", help='write {"direct": RUN, "gateway": RUN}')
    parser.add_argument("--html", metavar="FILE", help="write the table as an HTML page")
    parser.add_argument("--log", metavar="FILE",
                        help="write the gateway run's request log (JSON lines stamped with the "
                        "virtual clock from 2026-01-01), for `gateway analyze`")  # fmt: skip


def engine_model(
    args: argparse.Namespace, source: Source
) -> tuple[SimulatorConfig, dict[str, str]]:
    """The simulator's knobs from the flags, else the source's measured figures, else defaults;
    with where each figure came from."""
    base = SimulatorConfig()
    origin: dict[str, str] = {}
    slots = args.slots or base.max_batch
    origin["slots"] = "flag" if args.slots else "default"
    if args.prefill_tokens_per_s:
        prefill, origin["prefill"] = 1000.0 / args.prefill_tokens_per_s, "flag"
    elif source.prefill_ms_per_token:
        prefill, origin["prefill"] = source.prefill_ms_per_token, "log"
    else:
        prefill, origin["prefill"] = base.prefill_ms_per_token, "default"
    tpot = args.decode_ms_per_token or source.tpot_ms
    origin["decode"] = (
        "flag" if args.decode_ms_per_token else "log" if source.tpot_ms else "default"
    )
    step_base = base.step_base_ms
    if tpot:  # a full batch's step takes `tpot`: its fixed part is what the sequences leave
        step_base = max(0.1, tpot - slots * base.decode_ms_per_seq)
    config = dataclasses.replace(
        base, max_batch=slots, prefill_ms_per_token=prefill, step_base_ms=step_base,
        prefix_cache=False,
    )  # fmt: skip
    return config, origin


def describe(config: SimulatorConfig, origin: dict[str, str]) -> str:
    tpot = config.step_base_ms + config.max_batch * config.decode_ms_per_seq
    return (
        f"engine model: {config.max_batch} slots ({origin['slots']}), prefill "
        f"{1000.0 / config.prefill_ms_per_token:.0f} tokens/s ({origin['prefill']}), "
        f"{tpot:.1f} ms per output token at a full batch ({origin['decode']})"
    )


def settings_for(config_path: str | None, backends: int | None, slots: int) -> Settings:
    """`serve`'s settings with `backends` engines (named replay-0...) whose slots, unless the
    config sets them, are the engine's batch (what the sizer learns from the engine)."""
    settings = load_settings(config_path)
    count = backends or len(settings.backends) or 1
    configured = list(settings.backends)
    made = []
    for i in range(count):
        template = configured[i % len(configured)] if configured else None
        concurrency = template.max_concurrency if template is not None else None
        fields: dict[str, Any] = {} if template is None else msgspec.structs.asdict(template)
        fields.update(url=f"http://replay-{i}.invalid", name=f"replay-{i}",
                      max_concurrency=concurrency or slots)  # fmt: skip
        made.append(type(configured[0])(**fields) if configured else _backend(fields))
    return msgspec.structs.replace(settings, backends=made)


def pool_lines(arrivals: list[Arrival], settings: Settings, config: SimulatorConfig) -> list[str]:
    """With several model pools, what each sustains of its own requests: the pools share
    no backend, so the sum over all backends says nothing of one model's overload."""
    router = build_pools(settings, make_logger(io.StringIO(), "error"))
    if len(router.pools) < 2:
        return []
    by_pool: dict[str, list[Arrival]] = {each.name: [] for each in router.pools}
    unserved = 0
    for arrival in arrivals:
        try:
            by_pool[router.resolve(arrival.model).pool.name].append(arrival)
        except ModelNotFound:
            unserved += 1
    lines = []
    for each in router.pools:
        mine, backends = by_pool[each.name], len(each.pool.backends)
        if not mine:
            lines.append(f"  pool {each.name}: {backends} backends, no requests of its models")
            continue
        lines.append(
            f"  pool {each.name}: {len(mine)} requests ({source_rps(mine):.2f}/s); "
            f"{backends} backends sustain {capacity_rps(mine, config, backends):.2f}/s of them"
        )
    if unserved:
        lines.append(f"  {unserved} requests name a model no pool serves (404 model_not_found)")
    return lines


def _backend(fields: dict[str, Any]) -> Any:
    from gateway.config import BackendSettings

    return BackendSettings(**fields)


def replay(
    arrivals: list[Arrival], settings: Settings, config: SimulatorConfig, log: str | None = None
) -> dict[str, Any]:
    """Both runs, summarised; `log`: a file for the gateway run's request lines. The two
    are independent, so a long source runs them in two processes at once: the hour of the
    Azure trace took 118 s one after the other on a 2-core machine, its target is under 2
    minutes."""
    classes = [classify(a, settings) for a in arrivals]
    if len(arrivals) < PARALLEL_FROM or (os.cpu_count() or 1) < 2:
        return {
            "direct": _direct_summary(arrivals, classes, settings, config),
            "gateway": _gateway_summary(arrivals, classes, settings, config, log),
        }
    # forkserver: a clean child (no copy of a caller's threads or event loop) that is
    # cheaper to start than spawn once its server runs.
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("forkserver")) as pool:
        direct = pool.submit(_direct_summary, arrivals, classes, settings, config)
        gateway = pool.submit(_gateway_summary, arrivals, classes, settings, config, log)
        return {"direct": direct.result(), "gateway": gateway.result()}


def _direct_summary(arrivals: list[Arrival], classes: list[str], settings: Settings,
                    config: SimulatorConfig) -> dict[str, Any]:  # fmt: skip
    return summary(run_direct(arrivals, classes, len(settings.backends), config))


def _gateway_summary(arrivals: list[Arrival], classes: list[str], settings: Settings,
                     config: SimulatorConfig, log: str | None = None) -> dict[str, Any]:  # fmt: skip
    if log is None:
        return summary(run_gateway(arrivals, classes, settings, config))
    with open(log, "w") as lines:
        return summary(run_gateway(arrivals, classes, settings, config, lines))


def _target(spec: str) -> tuple[str, float]:
    cls, _, value = spec.partition("=")
    value = value.strip().lower()
    scale = 1000.0 if value.endswith("ms") else 1.0
    number = value.removesuffix("ms").removesuffix("s")
    try:
        seconds = float(number) / scale
    except ValueError:
        seconds = 0.0
    if not cls or not seconds > 0:
        raise ValueError(f"--target-p99 wants CLASS=SECONDS (e.g. interactive=2s), got {spec!r}")
    return cls.strip(), seconds


def main(args: argparse.Namespace) -> int:
    try:
        source = load_source(args.source)
        arrivals = time_slice(source.arrivals, args.start, args.duration)
        if not arrivals:
            raise ValueError("no arrivals in the requested slice")
        config, origin = engine_model(args, source)
        settings = settings_for(args.config, args.backends, config.max_batch)
        target = _target(args.target_p99) if args.target_p99 else None
    except (OSError, ValueError, ConfigError) as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    backends = len(settings.backends)
    factor = 1.0
    if args.load:
        factor = speed_for_load(arrivals, config, backends, args.load)
    elif args.speed:
        factor = args.speed
    arrivals = scaled(arrivals, factor)
    engine_line = describe(config, origin)
    traffic_line = (
        f"traffic: {len(arrivals)} requests over {arrivals[-1].at_s:.0f} s "
        f"({source_rps(arrivals):.2f}/s, rate x{factor:.3g}); {backends} backends sustain "
        f"{capacity_rps(arrivals, config, backends):.2f}/s of this mix"
    )
    print(engine_line)
    print(traffic_line)
    for line in pool_lines(arrivals, settings, config):
        print(line)
    started = time.perf_counter()
    result = replay(arrivals, settings, config, args.log)
    print(table(result))
    print(f"replayed in {time.perf_counter() - started:.1f} s wall")
    if target is not None:
        cls, seconds = target

        def meets_with(n: int) -> bool:
            run = replay(arrivals, settings_for(args.config, n, config.max_batch), config)
            ok = meets(run["gateway"], cls, seconds * 1000.0)
            print(f"  sweep: {n} backends: {cls} P99 "
                  f"{run['gateway']['classes'].get(cls, {}).get('ttft_ms', {}).get('p99')} ms "
                  f"{'meets' if ok else 'misses'} {seconds:g} s")  # fmt: skip
            return ok

        fewest = smallest_fleet(meets_with, 1, MAX_SWEEP_BACKENDS)
        result["sweep"] = {"class": cls, "target_s": seconds, "backends": fewest}
        print(
            f"smallest fleet meeting {cls} P99 TTFT <= {seconds:g} s through the gateway: "
            + (f"{fewest} backends" if fewest else f"none up to {MAX_SWEEP_BACKENDS}")
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.html:
        with open(args.html, "w") as f:
            f.write(render_html(result, engine_line, traffic_line))
    return 0
