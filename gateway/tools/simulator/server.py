"""The simulator as an aiohttp app: one engine and one counter behind both APIs.

This is the one module that knows about both the OpenAI and the TGI routes, so
neither API module needs the other. It also owns the lifecycle (the engine and
the tokenizer live exactly as long as the app) and the routes that are about the
server rather than one API: `/health`; `/metrics` and `/props`, where real engines
tell their load and their size (the gateway reads both, and a witness should answer
them the way the engines do); and `/sim/stats` and `/sim/requests`, which let tests
check what the gateway actually forwarded (`/sim/stats` keeps the peak of requests
held at once; `POST /sim/stats/reset-peaks` starts it again).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from gateway.tools.simulator import openai_api, tgi_api
from gateway.tools.simulator.config import SimulatorConfig
from gateway.tools.simulator.engine import Engine
from gateway.tools.simulator.server_logs import ServerLog, install
from gateway.tools.simulator.state import CONFIG_KEY, STATE_KEY, SimulatorState
from gateway.tools.simulator.tokens import ENCODING_NAME, PromptCounter, load_encoding

MAX_BODY_BYTES = 64 * 1024 * 1024
#: Seconds `runner.cleanup()` waits for handlers; they end at once when the engine stops.
SHUTDOWN_TIMEOUT_S = 5.0
#: The exposition format vLLM and llama.cpp answer /metrics with.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def build_simulator_app(
    config: SimulatorConfig, server_log: ServerLog | None = None
) -> web.Application:
    """The simulator as an aiohttp app; the engine and tokenizer live for the app's lifetime."""
    # Long prompts are the point of the simulator: allow bodies far above aiohttp's 1 MiB default.
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[CONFIG_KEY] = config
    app.cleanup_ctx.append(_lifecycle)
    if server_log is not None:
        install(app, server_log)
    app.on_shutdown.append(_stop_engine)
    openai_api.add_routes(app)
    tgi_api.add_routes(app)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    if config.pose_as in ("simulator", "llama.cpp"):  # vLLM and TGI have no /props
        app.router.add_get("/props", _props)
    app.router.add_get("/sim/stats", _stats)
    app.router.add_post("/sim/stats/reset-peaks", _reset_peaks)
    app.router.add_get("/sim/requests", _requests)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG_KEY]
    counter = PromptCounter(load_encoding(ENCODING_NAME))
    encode = counter.encoding.encode_ordinary
    # A reply's blocks are cached as the next turn's prompt encodes the reply's text.
    engine = Engine(config, reply_token_ids=lambda text: config.backend_token_ids(encode(text)))
    engine.start()
    app[STATE_KEY] = SimulatorState(config=config, engine=engine, counter=counter)
    try:
        yield
    finally:
        await engine.stop()
        counter.close()


async def _stop_engine(app: web.Application) -> None:
    # on_shutdown runs before aiohttp waits for in-flight handlers: stopping the engine here
    # ends open streams (with an error event) instead of holding shutdown until they finish.
    await app[STATE_KEY].engine.stop()


async def start_simulator(
    config: SimulatorConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    server_log: ServerLog | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve the simulator (port 0: an ephemeral one); the caller owns `runner.cleanup()`."""
    # handler_cancellation: a client that disconnects cancels its handler even before any
    # byte was written, which is how the engine learns to drop a waiting prompt.
    runner = web.AppRunner(
        build_simulator_app(config, server_log),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _stats(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return web.json_response(
        {
            "received": state.received,
            "rejected": state.rejected,
            "by_model": state.by_model,
            **state.engine.stats(),
        }
    )


async def _reset_peaks(request: web.Request) -> web.Response:
    # A benchmark measures the peak of one phase (after Redis came back, say), not of the run.
    return web.json_response(request.app[STATE_KEY].engine.reset_peaks())


async def _requests(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return web.json_response({"requests": [info.to_json() for info in state.requests]})


class _EngineGauges:
    """The engine's load under both vLLM's and llama.cpp's gauge names, read at each scrape.

    running: sequences in the batch (prefilling or decoding); waiting: sequences queued
    FIFO for a batch place. vLLM labels its series by model name; llama.cpp has none.

    The prefix cache, as each engine tells it: vLLM V1's `vllm:prefix_cache_queries` and
    `vllm:prefix_cache_hits` counters (prompt tokens looked up, and found; exposed with
    `_total`, as prometheus_client exposes vLLM's Counters) and its `vllm:cache_config_info`
    (block size, blocks, whether caching is on); llama.cpp's `llamacpp:prompt_tokens_total`
    (prompt tokens computed, cached ones excluded) and `llamacpp:prompt_tokens_cached_total`.
    Neither engine has a gauge of cached blocks: `sim:prefix_cache_blocks` (and its pinned
    share) is the simulator's own.

    Where the completed requests' time went, as vLLM's histograms tell it (unless the
    `timings` knob is "none"): `vllm:request_queue_time_seconds` (arrival to the batch),
    `vllm:request_prefill_time_seconds` (to the first token) and
    `vllm:request_decode_time_seconds` (first token to last), in vLLM's buckets.
    """

    def __init__(self, state: SimulatorState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        engine = self.state.engine
        model = self.state.config.model
        running, waiting = len(engine.running), len(engine.waiting)
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             waiting),
            ("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.",
             engine.kv_cache_usage()),
        ):  # fmt: skip
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            yield family
        yield from self._prefix_cache(model)
        yield from self._lora_info()
        if self.state.config.timings != "none":
            yield from self._request_times(model)
        yield GaugeMetricFamily(
            "llamacpp:requests_processing", "Number of requests processing.", value=running
        )
        yield GaugeMetricFamily(
            "llamacpp:requests_deferred", "Number of requests deferred.", value=waiting
        )
        yield CounterMetricFamily(
            "llamacpp:prompt_tokens",
            "Number of prompt tokens processed, excluding cached tokens",
            value=engine.prefilled_tokens,
        )
        yield CounterMetricFamily(
            "llamacpp:prompt_tokens_cached",
            "Number of prompt tokens reused from the cache",
            value=engine.prefix_cache_hits,
        )

    def _lora_info(self) -> Iterator[Metric]:
        """vLLM's `vllm:lora_requests_info` (with LoRA on): one series per label set ever
        current (vLLM never removes one), valued at the wall time it was last current, so
        the newest is the one with the largest value. Labels: `max_lora`, and the distinct
        adapters of the running and of the waiting requests, comma-joined."""
        adapters = self.state.engine.adapters
        if adapters is None:
            return
        engine = self.state.engine
        adapters.note_batch(
            (s.adapter for s in engine.running), (s.adapter for s in engine.waiting)
        )
        family = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        for (running, waiting), stamp in adapters.info_history.items():
            family.add_metric([str(adapters.max_lora), waiting, running], stamp)
        yield family

    def _request_times(self, model: str) -> Iterator[Metric]:
        times = self.state.engine.request_times
        for name, doc, histogram in (
            ("vllm:request_queue_time_seconds",
             "Histogram of time spent in WAITING phase for request.", times.queue),
            ("vllm:request_prefill_time_seconds",
             "Histogram of time spent in PREFILL phase for request.", times.prefill),
            ("vllm:request_decode_time_seconds",
             "Histogram of time spent in DECODE phase for request.", times.decode),
        ):  # fmt: skip
            family = HistogramMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], histogram.cumulative(), sum_value=histogram.sum_s)
            yield family

    def _prefix_cache(self, model: str) -> Iterator[Metric]:
        engine, config = self.state.engine, self.state.config
        for name, doc, value in (
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.",
             engine.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             engine.prefix_cache_hits),
        ):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([model], value)
            yield counter
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        info.add_metric(
            [str(config.block_tokens), str(config.prefix_cache_blocks), str(config.prefix_cache)],
            1.0,
        )
        yield info
        cache = engine.prefix_cache
        for name, doc, value in (
            ("sim:prefix_cache_blocks", "KV blocks in the prefix cache, pinned or evictable.",
             len(cache) if cache is not None else 0),
            ("sim:prefix_cache_pinned_blocks",
             "Prefix cache blocks pinned by running sequences (not evictable).",
             cache.pinned_blocks if cache is not None else 0),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([model], value)
            yield gauge


async def _metrics(request: web.Request) -> web.Response:
    # A registry of its own per scrape: nothing global, so two simulators in one process
    # (as tests run them) never share or clash over series.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineGauges(request.app[STATE_KEY]))
    return web.Response(
        body=generate_latest(registry), headers={"Content-Type": METRICS_CONTENT_TYPE}
    )


async def _props(request: web.Request) -> web.Response:
    """llama.cpp's /props, the fields that say the server's size (slots and their context),
    and what it is: `build_info` (llama.cpp's names its build) and a `simulator` object
    with the engine it models, so nobody mistakes it for a llama.cpp server (posing as
    llama.cpp: without that object), and whether it is strict about model names."""
    config = request.app[CONFIG_KEY]
    props: dict[str, Any] = {
        "total_slots": config.max_batch,
        "default_generation_settings": {"n_ctx": config.max_model_len},
        "model_path": config.model,
        "build_info": config.describe(),
    }
    if config.pose_as == "simulator":
        props["simulator"] = {
            "prefill": config.prefill,
            "prefill_tokens_per_step": config.prefill_tokens_per_step,
            "max_batch": config.max_batch,
            "step_base_ms": config.step_base_ms,
            "prefill_ms_per_token": config.prefill_ms_per_token,
            "decode_ms_per_seq": config.decode_ms_per_seq,
            "strict_model": config.strict,
        }
    return web.json_response(props)
