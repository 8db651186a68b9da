"""`python -m gateway loadgen`: the flags, and one schedule run against each target in turn.

Several `--target`s get the very same schedule, one after the other, so the
tables printed at the end compare like with like (the gateway against the
backend behind it, say). Exit codes tell a script what happened: 2 for bad
flags, 1 when a target answered nothing successfully, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from pathlib import Path
from typing import Any

from gateway.tools.loadgen.client import RetryPolicy, RunResult
from gateway.tools.loadgen.conversations import (
    NAMED_CONVERSATION_MIXES,
    ConversationPlan,
    plan_conversations,
    resolve_conversation_mix,
)
from gateway.tools.loadgen.mix import (
    DEFAULT_MIX,
    NAMED_MIXES,
    PlannedRequest,
    TrafficClass,
    closed_schedule,
    parse_class,
    poisson_schedule,
    resolve_mix,
    trace_schedule,
)
from gateway.tools.loadgen.report import (
    format_conversation_tables,
    format_tables,
    summarize_run,
    write_json,
)
from gateway.tools.loadgen.run import run_closed_loop, run_conversations, run_open_loop

DEFAULT_TARGET = "http://127.0.0.1:8080"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `loadgen` flags; `main(args)` runs them."""
    parser.add_argument(
        "--target",
        action="append",
        metavar="URL",
        help=f"base URL to load (repeatable: same schedule on each, in turn; {DEFAULT_TARGET})",
    )
    load = parser.add_argument_group("load shape")
    load.add_argument("--rate", type=float, default=4.0, help="open loop: arrivals per second (4)")
    load.add_argument("--duration", type=float, default=10.0, help="open loop: seconds (10)")
    load.add_argument(
        "--concurrency", type=int, help="closed loop: N workers, each waits for its answer"
    )
    load.add_argument(
        "--requests", type=int, default=100, help="closed loop: requests in all (100)"
    )
    load.add_argument("--seed", type=int, default=0, help="seed of arrivals, sizes, prompts (0)")
    mix = parser.add_argument_group(
        "traffic mix (default: short:0.8:40-60:64, long:0.2:2800-3200:512)"
    )
    mix.add_argument(
        "--mix",
        metavar="FILE|NAME",
        help=f"TOML file of [[class]] tables, or a named mix: {', '.join(NAMED_MIXES)}; "
        f"or a multi-turn mix: {', '.join(NAMED_CONVERSATION_MIXES)} (its own pacing: "
        "--rate, --duration and --concurrency do not apply)",
    )
    mix.add_argument(
        "--conversations", type=int, help="multi-turn: conversations in the run (the mix's: 48)"
    )
    mix.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multi-turn: multiply think times and the conversations' start window (1)",
    )
    mix.add_argument(
        "--class",
        dest="classes",
        action="append",
        metavar="NAME:SHARE:MIN-MAX:MAX_TOKENS",
        help="a traffic class (repeatable); prompt sizes in tokens as the gateway counts them; "
        "MAX_TOKENS may be a range too (8-60)",
    )
    trace = parser.add_argument_group("trace replay (TIMESTAMP,ContextTokens,GeneratedTokens CSV)")
    trace.add_argument("--trace", metavar="FILE", help="replay this trace instead of a mix")
    trace.add_argument("--speedup", type=float, default=1.0, help="divide arrival offsets (1)")
    trace.add_argument("--prompt-scale", type=float, default=1.0, help="multiply prompt sizes (1)")
    trace.add_argument("--output-scale", type=float, default=1.0, help="multiply max_tokens (1)")
    trace.add_argument("--trace-start", type=int, default=0, help="first row to replay (0)")
    trace.add_argument("--trace-limit", type=int, help="rows to replay (all)")
    client = parser.add_argument_group("client")
    client.add_argument("--model", default="sim-model", help="model name sent (sim-model)")
    client.add_argument("--timeout", type=float, default=120.0, help="per-attempt timeout, s (120)")
    client.add_argument(
        "--ignore-eos",
        action="store_true",
        help='send "ignore_eos": true (vLLM/llama.cpp) so replies have max_tokens tokens',
    )
    client.add_argument(
        "--retries", type=int, default=0, help="retries on 429/502/503/504/connection error (0)"
    )
    client.add_argument(
        "--backoff", type=float, default=0.5, help="backoff base, s; full jitter, doubling (0.5)"
    )
    client.add_argument("--max-backoff", type=float, default=10.0, help="backoff cap, s (10)")
    client.add_argument(
        "--eager-retry-share",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="share of requests whose client retries at once: no backoff, Retry-After "
        "ignored (a retry storm; 0)",
    )
    client.add_argument(
        "--eager-retries",
        type=int,
        metavar="N",
        help="retries of those requests (default: --retries)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write per-request results and summaries")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def retry_policy(args: argparse.Namespace) -> RetryPolicy:
    """The clients' retries as the flags say (ValueError on a bad one)."""
    eager = None if args.eager_retries is None else args.eager_retries + 1
    return RetryPolicy(
        args.retries + 1,
        args.backoff,
        args.max_backoff,
        eager_share=args.eager_retry_share,
        eager_attempts=eager,
    )


def _mix(args: argparse.Namespace) -> list[TrafficClass]:
    if args.mix and args.classes:
        raise ValueError("give --mix or --class, not both")
    if args.mix:
        return resolve_mix(args.mix)
    if args.classes:
        mix = [parse_class(spec) for spec in args.classes]
        names = [c.name for c in mix]
        if len(set(names)) != len(names):
            raise ValueError(f"--class names must be unique, got {names}")
        return mix
    return list(DEFAULT_MIX)


def _schedule(args: argparse.Namespace) -> tuple[list[PlannedRequest], str]:
    """The schedule and a one-line description of the load."""
    if args.trace:
        if args.mix or args.classes:
            raise ValueError("--trace replays the trace's sizes: drop --mix/--class")
        schedule = trace_schedule(
            args.trace,
            speedup=args.speedup,
            prompt_scale=args.prompt_scale,
            output_scale=args.output_scale,
            start=args.trace_start,
            limit=args.trace_limit,
            seed=args.seed,
        )
        if args.concurrency:
            return schedule, f"trace sizes, closed loop, concurrency {args.concurrency}"
        span = schedule[-1].at_s
        return schedule, f"trace replay, {span:.1f} s at speedup {args.speedup:g}"
    mix = _mix(args)
    if args.concurrency is not None:
        if args.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
        schedule = closed_schedule(mix, args.requests, args.seed)
        return schedule, f"closed loop, concurrency {args.concurrency}"
    schedule = poisson_schedule(mix, args.rate, args.duration, args.seed)
    return schedule, f"open loop, {args.rate:g} req/s for {args.duration:g} s"


def _params(args: argparse.Namespace, schedule: list[PlannedRequest], mode: str) -> dict[str, Any]:
    params = {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | list | None)}
    params.pop("func", None)
    params["mode"] = mode
    params["requests_planned"] = len(schedule)
    if not args.trace:
        params["mix"] = [dataclasses.asdict(c) for c in _mix(args)]
    return params


def _conversation_plan(args: argparse.Namespace) -> ConversationPlan | None:
    """The plan of `--mix multi-turn` (and the like); None for any other mix."""
    mix = resolve_conversation_mix(args.mix) if args.mix else None
    if mix is None:
        if args.conversations is not None or args.time_scale != 1.0:
            raise ValueError("--conversations and --time-scale need a multi-turn --mix")
        return None
    if args.classes or args.trace or args.concurrency is not None:
        raise ValueError(f"--mix {args.mix} paces itself: drop --class, --trace, --concurrency")
    if args.conversations is not None:
        mix = dataclasses.replace(mix, conversations=args.conversations)
    return plan_conversations(mix.scaled(args.time_scale), args.seed)


async def _run_conversations(
    args: argparse.Namespace, targets: list[str], plan: ConversationPlan
) -> list[RunResult]:
    runs = []
    for target in targets:
        print(f"loadgen: {plan.requests} requests ({plan.describe()}) -> {target}", file=sys.stderr)
        runs.append(
            await run_conversations(
                target,
                plan,
                retry=retry_policy(args),
                timeout_s=args.timeout,
                model=args.model,
                extra_body={"ignore_eos": True} if args.ignore_eos else None,
                progress=not args.no_progress and sys.stderr.isatty(),
            )
        )
    return runs


def _main_conversations(
    args: argparse.Namespace, targets: list[str], plan: ConversationPlan
) -> int:
    try:
        runs = asyncio.run(_run_conversations(args, targets, plan))
    except KeyboardInterrupt:
        print("loadgen: interrupted", file=sys.stderr)
        return 130
    print(format_conversation_tables(runs), end="")
    if args.json:
        params: dict[str, Any] = {
            k: v for k, v in vars(args).items() if isinstance(v, str | int | float | None)
        }
        params.pop("func", None)
        params.update(mode=plan.describe(), requests_planned=plan.requests, plan=plan.to_json())
        write_json(args.json, params, runs)
    return 1 if any(not any(r.ok for r in run.results) for run in runs) else 0


async def _run_all(
    args: argparse.Namespace, targets: list[str], schedule: list[PlannedRequest], mode: str
) -> list[RunResult]:
    retry = retry_policy(args)
    extra_body = {"ignore_eos": True} if args.ignore_eos else None
    progress = not args.no_progress and sys.stderr.isatty()
    runs = []
    for target in targets:
        print(f"loadgen: {len(schedule)} requests ({mode}) -> {target}", file=sys.stderr)
        options: dict[str, Any] = {
            "retry": retry,
            "timeout_s": args.timeout,
            "model": args.model,
            "extra_body": extra_body,
            "progress": progress,
        }
        if args.concurrency:
            runs.append(await run_closed_loop(target, schedule, args.concurrency, **options))
        else:
            runs.append(await run_open_loop(target, schedule, **options))
    return runs


def main(args: argparse.Namespace) -> int:
    """Run the schedule against each target; 2 on bad flags, 1 if a target answered nothing OK."""
    targets = args.target or [DEFAULT_TARGET]
    try:
        if args.retries < 0 or args.timeout <= 0:
            raise ValueError("--retries must be >= 0 and --timeout > 0")
        if args.eager_retries is not None and args.eager_retries < 0:
            raise ValueError("--eager-retries must be >= 0")
        retry_policy(args)  # the share's range
        if args.json and not Path(args.json).resolve().parent.is_dir():
            raise ValueError(f"--json {args.json}: no such directory")
        plan = _conversation_plan(args)
        if plan is None:
            schedule, mode = _schedule(args)
            if not schedule:
                raise ValueError("the schedule is empty: raise --rate, --duration or --requests")
            params = _params(args, schedule, mode)
    except (ValueError, OSError) as exc:
        print(f"loadgen: {exc}", file=sys.stderr)
        return 2
    if plan is not None:
        return _main_conversations(args, targets, plan)
    try:
        runs = asyncio.run(_run_all(args, targets, schedule, mode))
    except KeyboardInterrupt:
        print("loadgen: interrupted", file=sys.stderr)
        return 130
    print(format_tables([(run.target, summarize_run(run)) for run in runs]), end="")
    if args.json:
        write_json(args.json, params, runs)
    return 1 if any(not any(r.ok for r in run.results) for run in runs) else 0
