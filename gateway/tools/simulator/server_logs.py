"""The simulator writing the logs a real TGI or vLLM would, with its own real times.

`simulate --log-format tgi|tgi-json|vllm [--log-file F]` makes the simulator a
stand-in for those servers' logs, so `gateway analyze` can be checked against a
log whose truth is known. The shapes are the servers' documented ones:

- TGI's router logs "Success" inside the request's span, whose fields hold Rust
  `Debug` durations (`total_time="1.2s" queue_time="35.1ms" ...`); `tgi` is the
  default text format, `tgi-json` the `--json-output` one (tracing's JSON: the
  span's fields under `span` and `spans`).
- vLLM logs engine stats every few seconds ("Avg prompt throughput: ... Running:
  N reqs, Waiting: N reqs, GPU KV cache usage: X%, Prefix cache hit rate: Y%")
  and uvicorn an access line per request.

Written by an aiohttp middleware when a handler returns (a stream's handler
returns after its last event), so no API module knows about it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any, TextIO

from aiohttp import web

from gateway.tools.simulator.state import INFO_KEY, STATE_KEY, RequestInfo

LOG_FORMATS: tuple[str, ...] = ("tgi", "tgi-json", "vllm")
#: vLLM's own default interval between two stats lines is a few seconds.
DEFAULT_INTERVAL_S = 5.0
#: TGI's span name for each of the simulator's routes.
SPAN = {
    "chat": "chat_completions",
    "completions": "completions",
    "tgi_generate": "generate",
    "tgi_generate_stream": "generate_stream",
    "tgi_compat": "compat_generate",
}


def rust_debug(seconds: float) -> str:
    """`std::time::Duration`'s Debug text: `1.2s`, `35.1ms`, `812µs`, `120ns` (trailing zeros cut)."""
    nanos = max(0, round(seconds * 1e9))
    for unit, size in (("s", 1_000_000_000), ("ms", 1_000_000), ("µs", 1_000)):
        if nanos >= size:
            whole, frac = divmod(nanos, size)
            digits = len(str(size)) - 1
            tail = f"{frac:0{digits}d}".rstrip("0")
            return f"{whole}.{tail}{unit}" if tail else f"{whole}{unit}"
    return f"{nanos}ns"


class ServerLog:
    """Writes one format's lines to a stream; one per simulator app."""

    def __init__(
        self, fmt: str, stream: TextIO | None = None, interval_s: float = DEFAULT_INTERVAL_S
    ):
        if fmt not in LOG_FORMATS:
            raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
        self.format = fmt
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self._seen: dict[int, tuple[int, int]] = {}
        self._task: asyncio.Task[None] | None = None

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    # ---------------------------------------------------------------- per request

    def request_done(self, request: web.Request, status: int, info: RequestInfo | None) -> None:
        if self.format == "vllm":
            peer = request.transport.get_extra_info("peername") if request.transport else None
            host, port = (peer[0], peer[1]) if peer else ("127.0.0.1", 0)
            phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
            self._write(
                f'INFO:     {host}:{port} - "{request.method} {request.path_qs} '
                f'HTTP/{request.version.major}.{request.version.minor}" {status} {phrase}'
            )
            return
        seq = info.seq if info is not None else None
        if status != 200 or info is None or seq is None or seq.admitted is None:
            return  # TGI logs Success only for requests that were served
        end = seq.end if seq.end is not None else info.arrival
        queue = seq.admitted - info.arrival
        inference = max(0.0, end - seq.admitted)
        total = max(0.0, end - info.arrival)
        validation = max(0.0, total - queue - inference)
        fields = {
            "total_time": rust_debug(total),
            "validation_time": rust_debug(validation),
            "queue_time": rust_debug(queue),
            "inference_time": rust_debug(inference),
            "time_per_token": rust_debug(inference / max(1, seq.generated)),
            "seed": "None",
        }
        span = SPAN.get(info.route, "generate")
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        if self.format == "tgi-json":
            span_obj = {**fields, "name": span}
            self._write(
                json.dumps(
                    {
                        "timestamp": stamp,
                        "level": "INFO",
                        "message": "Success",
                        "target": "text_generation_router::server",
                        "filename": "router/src/server.rs",
                        "line_number": 422,
                        "span": span_obj,
                        "spans": [span_obj],
                    },
                    ensure_ascii=False,
                )
            )
            return
        parameters = f"parameters=GenerateParameters {{ max_new_tokens: Some({info.max_tokens}) }}"
        text = " ".join(f'{k}="{v}"' for k, v in fields.items())
        self._write(
            f"{stamp}  INFO {span}{{{parameters} {text}}}: text_generation_router::server: "
            "router/src/server.rs:422: Success"
        )

    # ---------------------------------------------------------------- vLLM's stats

    def stats_line(self, app: web.Application, elapsed_s: float) -> str:
        state = app[STATE_KEY]
        engine = state.engine
        prompt = generated = 0
        for info in state.requests:
            seq = info.seq
            if seq is None:
                continue
            before = self._seen.get(id(seq), (0, 0))
            prompt += max(0, seq.prefilled - before[0])
            generated += max(0, seq.generated - before[1])
            self._seen[id(seq)] = (seq.prefilled, seq.generated)
        live = {id(i.seq) for i in state.requests if i.seq is not None}
        self._seen = {k: v for k, v in self._seen.items() if k in live}
        queries = engine.prefix_cache_queries
        hit_rate = 100.0 * engine.prefix_cache_hits / queries if queries else 0.0
        stamp = datetime.now().strftime("%m-%d %H:%M:%S")
        return (
            f"INFO {stamp} [loggers.py:118] Engine 000: "
            f"Avg prompt throughput: {prompt / elapsed_s:.1f} tokens/s, "
            f"Avg generation throughput: {generated / elapsed_s:.1f} tokens/s, "
            f"Running: {len(engine.running)} reqs, Waiting: {len(engine.waiting)} reqs, "
            f"GPU KV cache usage: {100 * engine.kv_cache_usage():.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%"
        )

    async def _periodic(self, app: web.Application) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            self._write(self.stats_line(app, max(1e-9, now - last)))
            last = now

    async def context(self, app: web.Application) -> Any:
        """cleanup_ctx: the periodic stats task of the vllm format, for the app's lifetime."""
        if self.format == "vllm":
            self._task = asyncio.get_running_loop().create_task(self._periodic(app))
        try:
            yield
        finally:
            if self._task is not None:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)

    def middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        @web.middleware
        async def log_request(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                self.request_done(request, exc.status, request.get(INFO_KEY))
                raise
            self.request_done(request, response.status, request.get(INFO_KEY))
            return response

        return log_request


def install(app: web.Application, log: ServerLog) -> None:
    """Hook `log` into an app built by `build_simulator_app` (before it starts)."""
    app.middlewares.append(log.middleware())
    app.cleanup_ctx.append(log.context)
