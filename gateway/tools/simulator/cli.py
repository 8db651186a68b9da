"""`python -m gateway simulate`: the simulator's flags and the process that serves it.

Every `SimulatorConfig` knob is a flag of the same name, so a benchmark's
configuration can be reproduced from the command line; the process runs until
SIGINT or SIGTERM and then stops the engine, ending open streams at once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import signal
import sys

from gateway.tools.simulator.config import SimulatorConfig
from gateway.tools.simulator.server import start_simulator
from gateway.tools.simulator.server_logs import DEFAULT_INTERVAL_S, LOG_FORMATS, ServerLog

_CONFIG_HELP = {
    "max_batch": "most sequences running at once; the rest wait FIFO inside the engine",
    "max_batch_tokens": "TGI's max_batch_total_tokens: the batch admits, first come first "
    "served, while the prompts and max_tokens of all it runs fit (0: no such bound)",
    "prefill_tokens_per_step": "prompt tokens prefilled per step, FCFS across running sequences",
    "prefill": "chunked: a long prompt is prefilled over several steps beside the batch's "
    "decoding (vLLM, SGLang, llama.cpp); whole: a step prefills whole prompts up to the "
    "per-step budget and pauses decoding (TGI)",
    "step_base_ms": "fixed time of one engine step",
    "prefill_ms_per_token": "step time added per prompt token prefilled in the step",
    "decode_ms_per_seq": "step time added per sequence decoding in the step",
    "default_max_tokens": "output length when a request sets no max_tokens",
    "max_model_len": "context window; prompt + max_tokens above it gets a 400",
    "seed": "seed of the generated text",
    "model": "model name served by /v1/models",
    "token_ratio": "the simulator's prompt token count is tiktoken's times this, as for a "
    "backend whose tokenizer counts differently from the gateway's",
    "prefix_cache": "automatic prefix caching: cached leading prompt blocks skip prefill and "
    "are reported as usage.prompt_tokens_details.cached_tokens; --no-prefix-cache turns it off",
    "block_tokens": "tokens per KV block of the prefix cache (vLLM's --block-size)",
    "prefix_cache_blocks": "KV blocks the prefix cache holds (LRU; blocks of running sequences "
    "are pinned)",
    "keep_aborted_prefill": "a sequence aborted before its prompt is prefilled leaves the blocks "
    "it filled cached (off: dropped, as vLLM 0.32 was measured to)",
    "lora_adapters": "LoRA adapters served on the base model, comma-separated (listed by "
    "/v1/models with parent = the model; a request names one as its model)",
    "enable_lora": "serve LoRA adapters even with none at start (add them with POST "
    "/v1/load_lora_adapter); implied by --lora-adapters",
    "max_lora": "distinct LoRA adapters in one batch and resident at once (vLLM's --max-loras)",
    "lora_swap_ms": "time added to a step that loads an adapter not resident (a swap)",
    "strict_model": "answer 404 model_not_found for a model it does not serve (vLLM, SGLang); "
    "off: any name is answered (llama.cpp)",
    "pose_as": "answer the info routes as this engine does: simulator, vllm (strict; no "
    "/props nor /info), tgi (/info only) or llama.cpp (/props, /v1/models owned by llamacpp)",
    "timings": "where each request's time went, told as vllm (request time histograms in "
    "/metrics), llamacpp (those, and llama.cpp's `timings` in every OpenAI answer) or none",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--host`, `--port` and one flag per SimulatorConfig knob, defaulting to the config's."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=None,
        help="also write the log a real server would: TGI's text or JSON Success lines, or "
        "vLLM's stats and access lines (default: none)",
    )
    parser.add_argument(
        "--log-file", default=None, help="where --log-format lines go (default: stderr)"
    )
    parser.add_argument(
        "--log-interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        metavar="S",
        help=f"seconds between vLLM stats lines (default {DEFAULT_INTERVAL_S:g})",
    )
    for f in dataclasses.fields(SimulatorConfig):
        default = f.default
        if isinstance(default, bool):  # --prefix-cache / --no-prefix-cache
            parser.add_argument(
                _flag(f.name),
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=f"{_CONFIG_HELP.get(f.name, f.name)} ({'on' if default else 'off'})",
            )
            continue
        parser.add_argument(
            _flag(f.name),
            dest=f.name,
            type=type(default),
            default=default,
            help=f"{_CONFIG_HELP.get(f.name, f.name)} ({default})",
        )


def config_from_args(args: argparse.Namespace) -> SimulatorConfig:
    """Build the config from parsed flags; raises ValueError on a bad value."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(SimulatorConfig)}
    return SimulatorConfig(**values)


def main(args: argparse.Namespace) -> int:
    """Run the simulator until SIGINT/SIGTERM; 0 on a clean stop, 2 on a bad flag."""
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"simulate: {exc}", file=sys.stderr)
        return 2
    fmt = getattr(args, "log_format", None)
    if fmt is None:
        return asyncio.run(_serve(config, args.host, args.port))
    if not (math.isfinite(args.log_interval) and args.log_interval > 0):
        print("simulate: --log-interval must be a positive number of seconds", file=sys.stderr)
        return 2
    try:
        stream = open(args.log_file, "a", encoding="utf-8") if args.log_file else sys.stderr
    except OSError as exc:
        print(f"simulate: cannot open {args.log_file}: {exc}", file=sys.stderr)
        return 2
    try:
        log = ServerLog(fmt, stream, args.log_interval)
        return asyncio.run(_serve(config, args.host, args.port, log))
    finally:
        if stream is not sys.stderr:
            stream.close()


async def _serve(
    config: SimulatorConfig, host: str, port: int, server_log: ServerLog | None = None
) -> int:
    runner, bound = await start_simulator(config, host, port, server_log)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    knobs = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(config).items())
    print(f"simulator listening on http://{host}:{bound} ({knobs})", flush=True)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
    return 0
