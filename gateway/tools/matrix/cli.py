"""`python -m gateway matrix`: the gateway's defaults on every kind of engine, in virtual time.

Every cell (engine x traffic mix x load) replays the same seeded schedules straight to the
engine, through the gateway's own code freshly started, and through the ideal two-lane
scheduler, then checks the product's promises (`cells.py`). Prints the table, writes it
as JSON (and as a Markdown page for the docs site, `docs/matrix.md`), and exits 1 when a promise is missed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from gateway.tools.matrix.cells import Cell, run_cell
from gateway.tools.matrix.engines import BY_NAME, PROFILES
from gateway.tools.matrix.report import FOOTNOTE, markdown_page, summary, table
from gateway.tools.matrix.traffic import MIXES

#: Multiples of each cell's capacity. 150%: a real engine's "120%" is taken against its
#: own calibration, which can read a quarter over the model's (llama.cpp on a CPU: 0.43
#: req/s measured, 0.35 modelled), and a model of that server met the floor at 120% and
#: missed it at 150% (1.8x: promotion, since fixed).
LOADS = (0.5, 0.8, 1.0, 1.2, 1.5)
#: The quick subset: an engine of each kind of prefill and speed, the product's own mix.
QUICK_ENGINES = ("vllm-chunked", "tgi-a10g", "llamacpp-slow-cpu", "simulator")


#: Five schedules a cell. A P99 over a cell's few hundred short requests moves by several
#: percent from one set of seeds to another: with three, four cells read 1.10-1.12x the
#: ideal scheduler, and on seeds 4-6, 1-5 or 1-9 the same cells read 0.93-1.10x.
SEEDS = "1,2,3,4,5"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", help=f"comma-separated (default: all of {', '.join(BY_NAME)})")
    parser.add_argument("--mixes", help=f"comma-separated (default: all of {', '.join(MIXES)})")
    parser.add_argument("--loads", help="comma-separated multiples of capacity (default: "
                        + ",".join(f"{load:g}" for load in LOADS) + ")")  # fmt: skip
    parser.add_argument("--seeds", default=SEEDS, help=f"comma-separated schedule seeds ({SEEDS})")
    parser.add_argument("--requests", type=int, default=600,
                        help="requests per schedule (600)")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="four engines, the chat mix, 80%% and 120%%, two seeds of 400")  # fmt: skip
    parser.add_argument("--config", default=os.environ.get("GATEWAY_CONFIG"),
                        help="the gateway's TOML (default: the built-in defaults)")  # fmt: skip
    parser.add_argument("--json", metavar="FILE", help="write the cells as JSON")
    parser.add_argument("--markdown", metavar="FILE", help="write the table as Markdown")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="cells replayed at once (default: the CPUs)")  # fmt: skip


def cells_of(args: argparse.Namespace) -> list[Cell]:
    engines: tuple[str, ...]
    mixes: tuple[str, ...]
    loads: tuple[float, ...]
    if args.quick:
        engines, mixes, loads = QUICK_ENGINES, ("chat",), (0.8, 1.2)
    else:
        engines = tuple(p.name for p in PROFILES)
        mixes, loads = MIXES, LOADS
    if args.engines:
        engines = tuple(e.strip() for e in args.engines.split(","))
    if args.mixes:
        mixes = tuple(m.strip() for m in args.mixes.split(","))
    if args.loads:
        loads = tuple(float(x) for x in args.loads.split(","))
    unknown = [e for e in engines if e not in BY_NAME] + [m for m in mixes if m not in MIXES]
    if unknown:
        raise ValueError(f"unknown engine or mix: {', '.join(unknown)}")
    return [Cell(e, m, load) for e in engines for m in mixes for load in loads]


def main(args: argparse.Namespace) -> int:
    try:
        cells = cells_of(args)
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError as exc:
        print(f"matrix: {exc}", file=sys.stderr)
        return 2
    requests = args.requests
    if args.quick:
        seeds, requests = seeds[:2], min(requests, 400)
    started = time.perf_counter()
    results = run_cells(cells, seeds, requests, args.config, args.jobs)
    print(table(results))
    if any(not cell["floor_reachable"] for cell in results):
        print(f"\n{FOOTNOTE}")
    found = summary(results)
    print(
        f"\n{found['cells']} cells, {found['checks']} checks, {len(found['missed'])} missed; "
        f"replayed in {time.perf_counter() - started:.0f} s"
    )
    for miss in found["missed"]:
        print(f"  MISS {miss['cell']}: {miss['check']}: {miss['value']} > {miss['bound']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cells": results, "summary": found}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_page(results) + "\n")
    return 1 if found["missed"] else 0


def run_cells(
    cells: list[Cell], seeds: list[int], requests: int, config: str | None, jobs: int
) -> list[dict[str, Any]]:
    if jobs <= 1 or len(cells) == 1:
        return [run_cell(cell, seeds, requests, config) for cell in cells]
    context = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = [pool.submit(run_cell, cell, seeds, requests, config) for cell in cells]
        return [future.result() for future in futures]
