"""What a backend engine says about itself (its size) and about its load (its queue).

The gateway's lanes see only the requests the gateway holds. Once a request is
dispatched, the engine may still park it in its own waiting queue (vLLM's
`waiting`, llama.cpp's deferred tasks, TGI's queue, SGLang's queue reqs) until a
batch place frees up; from outside, that request looks "in flight" while it is
really queued, and a short request dispatched behind it waits invisibly, out of
the gateway's reach and ordering. An engine's own `/metrics` shows that queue,
so the gateway can hold dispatch while the engine's queue is not empty and keep
the waiting where its lanes can order it. vLLM's and SGLang's request time
histograms there also say where the time of the requests that ended went
(queue, prefill, decode: `engine_timings.py`). Its `/props`, `/info` and
`/v1/models` say how many requests it runs at once and how long a context it
takes, so slots and context caps need not be guessed in the config.
With LoRA on, vLLM's `/v1/models` lists each adapter with `parent` = its base
model, and its `/metrics` has `vllm:lora_requests_info`, whose labels name the
adapters running and waiting and `max_lora` (`adapters.py` routes by them).

Pure parsing plus two small fetch helpers; no scheduling here. Every helper
answers None for "unknown" rather than raising: a backend that hides its
metrics, answers garbage or times out must cost the gateway that knowledge,
never a request.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.upstream.engine_timings import TIME_SAMPLES, RequestTimeTotals, time_totals

#: How long one telemetry GET may take, connect to last byte, unless the caller says otherwise.
DEFAULT_TIMEOUT_S = 5.0
#: Bodies above this are not read: a vLLM /metrics is ~100 KiB; 4 MiB is something else.
MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """An engine's own view of its load at one scrape; None where it did not say.

    `waiting` are requests the engine accepted but has not given a batch place yet:
    they are queued inside the engine, invisible to the gateway's lanes.
    """

    engine: str
    waiting: float | None
    running: float | None
    kv_usage: float | None
    #: Tokens its KV cache holds (vLLM's `cache_config_info`: block_size x num_gpu_blocks).
    kv_capacity_tokens: int | None = None
    #: Its per-request time histograms (queue, prefill, decode), cumulative; the deltas of
    #: two scrapes split the backend time of requests without timings of their own.
    times: RequestTimeTotals | None = None
    #: Its LoRA adapters at work (vLLM's `lora_requests_info`); None: LoRA off or not said.
    lora: LoraLoad | None = None


@dataclass(frozen=True, slots=True)
class LoraLoad:
    """vLLM's `vllm:lora_requests_info`: the distinct adapters of the running and of the
    waiting requests, and the most one batch may run (`--max-loras`)."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_lora: int | None


@dataclass(frozen=True, slots=True)
class BackendFacts:
    """What a backend says about its size; None where it did not say."""

    engine: str | None = None
    #: Requests it runs at once (llama.cpp `total_slots`, TGI `max_concurrent_requests`).
    slots: int | None = None
    #: Context window of one request, prompt + output, in the engine's own tokens.
    context_tokens: int | None = None
    #: Longest prompt it accepts (TGI), in the engine's own tokens.
    max_input_tokens: int | None = None
    #: The tokens its whole batch may hold, each request's prompt and `max_tokens` reserved
    #: at admission (TGI's `max_batch_total_tokens`); past them requests wait inside it.
    batch_tokens: int | None = None
    model: str | None = None
    #: LoRA adapters it serves on its base model (`/v1/models` entries with a `parent`);
    #: None: it lists none.
    adapters: tuple[str, ...] | None = None
    #: How it prefills, when it says: "chunked" (a long prompt over several steps beside
    #: the batch's decoding) or "whole" (whole prompts in steps of their own).
    prefill: str | None = None

    def merged(self, other: BackendFacts) -> BackendFacts:
        """These facts, with the gaps filled from `other` (the first source that says wins)."""
        return BackendFacts(
            engine=self.engine if self.engine is not None else other.engine,
            slots=self.slots if self.slots is not None else other.slots,
            context_tokens=(
                self.context_tokens if self.context_tokens is not None else other.context_tokens
            ),
            max_input_tokens=(
                self.max_input_tokens
                if self.max_input_tokens is not None
                else other.max_input_tokens
            ),
            batch_tokens=self.batch_tokens if self.batch_tokens is not None else other.batch_tokens,
            model=self.model if self.model is not None else other.model,
            adapters=self.adapters if self.adapters is not None else other.adapters,
            prefill=self.prefill if self.prefill is not None else other.prefill,
        )

    @property
    def empty(self) -> bool:
        return all(
            value is None
            for value in (
                self.engine,
                self.slots,
                self.context_tokens,
                self.max_input_tokens,
                self.batch_tokens,
                self.model,
                self.adapters,
                self.prefill,
            )
        )


# ----------------------------------------------------------------------------- /metrics


@dataclass(frozen=True, slots=True)
class _EngineMetrics:
    """One engine's sample names: for each field, the names in order of preference."""

    engine: str
    waiting: tuple[str, ...]
    running: tuple[str, ...]
    kv_usage: tuple[str, ...]


# Engines in the order they are tried; the first with any recognised sample is the engine.
# vLLM first: the simulator (and vLLM-compatible servers) also export llama.cpp's names,
# and vLLM's are the richer set. Names match *sample* names, which the parser leaves as
# written (it strips `_total` only from counter *family* names; none of these is a counter).
_ENGINES = (
    # vllm/v1/metrics/loggers.py (PrometheusStatLogger): labels model_name and engine (one
    # series per data-parallel engine). gpu_cache_usage_perc was renamed kv_cache_usage_perc
    # in 0.9 and is hidden in later releases; both are read, the new name first.
    _EngineMetrics(
        engine="vllm",
        waiting=("vllm:num_requests_waiting",),
        running=("vllm:num_requests_running",),
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    ),
    # python/sglang/srt/metrics/collector.py: labels model_name (and tp/dp ranks).
    _EngineMetrics(
        engine="sglang",
        waiting=("sglang:num_queue_reqs",),
        running=("sglang:num_running_reqs",),
        kv_usage=("sglang:token_usage",),
    ),
    # TGI router: backends/v3/src/queue.rs (tgi_queue_size), backend.rs
    # (tgi_batch_current_size); no KV usage gauge.
    _EngineMetrics(
        engine="tgi",
        waiting=("tgi_queue_size",),
        running=("tgi_batch_current_size",),
        kv_usage=(),
    ),
    # llama.cpp tools/server (--metrics): requests_deferred are tasks waiting for a free
    # slot. kv_cache_usage_ratio exists only in older builds; current ones dropped it.
    _EngineMetrics(
        engine="llama.cpp",
        waiting=("llamacpp:requests_deferred",),
        running=("llamacpp:requests_processing",),
        kv_usage=("llamacpp:kv_cache_usage_ratio",),
    ),
)
_KNOWN_NAMES = frozenset(
    name for e in _ENGINES for names in (e.waiting, e.running, e.kv_usage) for name in names
)


def parse_engine_metrics(text: str) -> EngineLoad | None:
    """An engine's load from its Prometheus text; None when no engine's gauge is in it.

    Counts are summed over label sets (vLLM has one series per model name and per
    data-parallel engine); the KV usage, a fraction, takes the fullest series, since
    the engine that is full is the one that stalls. The request time histograms' sums
    and counts are summed over label sets too. A body the parser cannot read to
    the end is None as a whole: a truncated scrape would undercount the queue.
    Non-finite values (NaN, ±Inf) are ignored.
    """
    if not isinstance(text, str):
        return None
    samples: dict[str, list[float]] = {}
    times: list[tuple[str, float]] = []
    capacity: int | None = None
    lora: tuple[float, Mapping[str, str]] | None = None
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == LORA_REQUESTS_INFO:
                    # vLLM never removes a label set: the newest (largest time) is current.
                    stamp = float(sample.value)
                    if math.isfinite(stamp) and (lora is None or stamp > lora[0]):
                        lora = (stamp, sample.labels)
                    continue
                if sample.name == CACHE_CONFIG_INFO:
                    capacity = _kv_capacity(sample.labels)
                    continue
                if sample.name in TIME_SAMPLES:
                    times.append((sample.name, float(sample.value)))
                    continue
                if sample.name not in _KNOWN_NAMES:
                    continue
                value = float(sample.value)
                if math.isfinite(value):
                    samples.setdefault(sample.name, []).append(value)
    except Exception:  # the parser raises ValueError, IndexError, ... on malformed text
        return None
    for spec in _ENGINES:
        waiting = _first(samples, spec.waiting, sum)
        running = _first(samples, spec.running, sum)
        kv_usage = _first(samples, spec.kv_usage, max)
        if waiting is not None or running is not None or kv_usage is not None:
            return EngineLoad(
                spec.engine,
                waiting=waiting,
                running=running,
                kv_usage=kv_usage,
                kv_capacity_tokens=capacity,
                times=time_totals(times),
                lora=_lora_load(lora[1]) if lora is not None else None,
            )
    return None


#: vLLM's gauge of the adapters at work, in its labels; valued at the time it was set.
LORA_REQUESTS_INFO = "vllm:lora_requests_info"


def _lora_load(labels: Mapping[str, str]) -> LoraLoad:
    def names(key: str) -> tuple[str, ...]:
        return tuple(n for n in (part.strip() for part in labels.get(key, "").split(",")) if n)

    max_lora = labels.get("max_lora", "")
    return LoraLoad(
        running=names("running_lora_adapters"),
        waiting=names("waiting_lora_adapters"),
        max_lora=int(max_lora) if max_lora.isdigit() and int(max_lora) > 0 else None,
    )


#: vLLM's cache config as labels of a constant gauge (block size, blocks on the GPU).
CACHE_CONFIG_INFO = "vllm:cache_config_info"


def _kv_capacity(labels: Mapping[str, str]) -> int | None:
    """Tokens a vLLM KV cache holds, from `cache_config_info`'s labels; None if unknown."""
    try:
        tokens = int(labels["block_size"]) * int(labels["num_gpu_blocks"])
    except (KeyError, ValueError):  # num_gpu_blocks is "None" before the profiling run
        return None
    return tokens if tokens > 0 else None


def _first(
    samples: dict[str, list[float]],
    names: tuple[str, ...],
    combine: Callable[[Iterable[float]], float],
) -> float | None:
    for name in names:
        values = samples.get(name)
        if values:
            return float(combine(values))
    return None


# ----------------------------------------------------------------------------- facts


def _positive_int(value: Any) -> int | None:
    """A JSON count: an int (or an integral float, as some servers write 4096.0) above 0."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and value > 0:
        return int(value)
    return None


def _name(value: Any) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


#: How the project's own simulator names itself in its /props (`simulator.prefill` there
#: says how it prefills).
SIMULATOR_ENGINE = "simulator"
PREFILL_KINDS = ("chunked", "whole")


def facts_from_props(obj: Any) -> BackendFacts | None:
    """llama.cpp's `GET /props`: `total_slots` (its `--parallel`) and the per-slot context.

    `default_generation_settings.n_ctx` is one slot's context, which is what one request
    can use. In llama.cpp's router mode /props describes the router, not a model, and
    has neither field: that reads as nothing known. The project's simulator answers the
    same fields, and a `simulator` object saying what it models.
    """
    if not isinstance(obj, dict):
        return None
    settings = obj.get("default_generation_settings")
    n_ctx = _positive_int(settings.get("n_ctx")) if isinstance(settings, dict) else None
    slots = _positive_int(obj.get("total_slots"))
    model = _name(obj.get("model_alias")) or _name(obj.get("model_path"))
    if slots is None and n_ctx is None:
        return BackendFacts(model=model) if model is not None else None
    simulator = obj.get("simulator")
    if isinstance(simulator, dict):
        prefill = simulator.get("prefill")
        return BackendFacts(
            engine=SIMULATOR_ENGINE,
            slots=slots,
            context_tokens=n_ctx,
            model=model,
            prefill=prefill if prefill in PREFILL_KINDS else None,
        )
    return BackendFacts(engine="llama.cpp", slots=slots, context_tokens=n_ctx, model=model)


def facts_from_tgi_info(obj: Any) -> BackendFacts | None:
    """TGI's `GET /info`: its concurrency limit and token limits.

    TGI 2.1 renamed `max_input_length` to `max_input_tokens`; both are read.
    `max_concurrent_requests` is its router's limit (requests queued in it count), not its
    batch: that is `max_batch_total_tokens`, in which the router reserves each request's
    prompt and `max_new_tokens` when it joins the batch.
    """
    if not isinstance(obj, dict):
        return None
    slots = _positive_int(obj.get("max_concurrent_requests"))
    total = _positive_int(obj.get("max_total_tokens"))
    max_input = _positive_int(obj.get("max_input_tokens"))
    if max_input is None:
        max_input = _positive_int(obj.get("max_input_length"))
    model = _name(obj.get("model_id"))
    if slots is None and total is None and max_input is None:
        return BackendFacts(model=model) if model is not None else None
    return BackendFacts(
        engine="tgi",
        slots=slots,
        context_tokens=total,
        max_input_tokens=max_input,
        batch_tokens=_positive_int(obj.get("max_batch_total_tokens")),
        model=model,
    )


#: `owned_by` values the servers write about themselves in `/v1/models`.
_OWNED_BY = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llama.cpp"}


def facts_from_models(obj: Any) -> BackendFacts | None:
    """OpenAI's `GET /v1/models` as vLLM and SGLang extend it: `data[0].max_model_len`.

    The first listed model is the served one (vLLM lists LoRA adapters after it, each
    with `parent` = its base model: those are its `adapters`).
    """
    if not isinstance(obj, dict):
        return None
    data = obj.get("data")
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        return None
    first = data[0]
    owned_by = first.get("owned_by")
    facts = BackendFacts(
        engine=_OWNED_BY.get(owned_by) if isinstance(owned_by, str) else None,
        context_tokens=_positive_int(first.get("max_model_len")),
        model=_name(first.get("id")),
        adapters=adapters_from_models(obj),
    )
    return None if facts.empty else facts


def adapters_from_models(obj: Any) -> tuple[str, ...] | None:
    """The LoRA adapters a `/v1/models` answer lists: entries whose `parent` is a model it
    lists too (vLLM's cards of adapters); None when it lists none or is no such answer."""
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list):
        return None
    cards = [card for card in data if isinstance(card, dict) and _name(card.get("id"))]
    bases = {card["id"] for card in cards}
    adapters = tuple(
        card["id"]
        for card in cards
        if isinstance(parent := card.get("parent"), str)
        and parent in bases
        and parent != card["id"]
    )
    return adapters or None


@dataclass(frozen=True, slots=True)
class ModelListing:
    """What an engine says it serves, at one read (`served.py` decides what it means)."""

    #: Every name it lists (`/v1/models` ids, adapters included; TGI: its `/info` model_id).
    names: frozenset[str]
    #: The engine it says it is, where the same answers tell ("vllm", "sglang",
    #: "llama.cpp", "tgi", "simulator"); None: they do not.
    engine: str | None = None
    #: The project's simulator: whether it answers 404 for names it does not serve.
    strict: bool | None = None


def listing_from_models(obj: Any) -> ModelListing | None:
    """A `/v1/models` answer: every card's id, and the engine its first card's `owned_by`
    names (None: no such answer)."""
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list):
        return None
    cards = [card for card in data if isinstance(card, dict) and _name(card.get("id"))]
    owned_by = cards[0].get("owned_by") if cards else None
    engine = (
        (_OWNED_BY | {SIMULATOR_ENGINE: SIMULATOR_ENGINE}).get(owned_by)
        if isinstance(owned_by, str)
        else None
    )
    return ModelListing(frozenset(card["id"] for card in cards), engine)


def listing_from_tgi_info(obj: Any) -> ModelListing | None:
    """TGI's `/info`: the one model it serves (`model_id`)."""
    model = _name(obj.get("model_id")) if isinstance(obj, dict) else None
    return None if model is None else ModelListing(frozenset({model}), "tgi")


def engine_from_props(obj: Any) -> tuple[str | None, bool | None]:
    """llama.cpp's (or the simulator's) `/props`: which of the two it is, and the
    simulator's strictness about names; (None, None) when it is neither."""
    facts = facts_from_props(obj)
    if facts is None or facts.engine is None:
        return None, None
    simulator = obj.get("simulator") if isinstance(obj, dict) else None
    strict = simulator.get("strict_model") if isinstance(simulator, dict) else None
    return facts.engine, strict if isinstance(strict, bool) else None


# ----------------------------------------------------------------------------- fetching


async def _get_body(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str] | None,
    timeout_s: float,
) -> bytes | None:
    """The body of a 200 answer, or None for anything else (errors, timeouts, huge bodies)."""
    try:
        async with session.get(
            url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                return None
            chunks: list[bytes] = []
            size = 0
            async for chunk in resp.content.iter_chunked(64 * 1024):
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    return None
                chunks.append(chunk)
            return b"".join(chunks)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        # ValueError: a malformed URL or header; OSError: what aiohttp did not wrap.
        return None


async def _get_json(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str] | None,
    timeout_s: float,
) -> Any:
    body = await _get_body(session, url, headers, timeout_s)
    if body is None:
        return None
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or absurdly nested
        return None


_FACT_SOURCES: tuple[tuple[str, Callable[[Any], BackendFacts | None]], ...] = (
    ("/props", facts_from_props),
    ("/info", facts_from_tgi_info),
    ("/v1/models", facts_from_models),
)


async def probe_facts(
    session: aiohttp.ClientSession,
    base_url: str,
    headers: dict[str, str] | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> BackendFacts | None:
    """Ask a backend what it is: `/props`, then `/info`, then `/v1/models`.

    Each route fills only what the ones before it left unknown; a route that fails,
    is missing (a vLLM has no /props) or answers garbage just says nothing. None when
    no route said anything. Never raises, except when the caller cancels it.
    """
    base = base_url.rstrip("/")
    facts = BackendFacts()
    for path, parse in _FACT_SOURCES:
        found = parse(await _get_json(session, base + path, headers, timeout_s))
        if found is not None:
            facts = facts.merged(found)
    return None if facts.empty else facts


async def fetch_adapters(
    session: aiohttp.ClientSession,
    base_url: str,
    headers: dict[str, str] | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[str, ...] | None:
    """The adapters a backend lists now (`/v1/models`; empty: none); None: no answer."""
    obj = await _get_json(session, base_url.rstrip("/") + "/v1/models", headers, timeout_s)
    if not isinstance(obj, dict) or not isinstance(obj.get("data"), list):
        return None
    return adapters_from_models(obj) or ()


async def fetch_listing(
    session: aiohttp.ClientSession,
    base_url: str,
    headers: dict[str, str] | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ModelListing | None:
    """What a backend serves now: its `/v1/models`, else TGI's `/info` model_id; and,
    when `owned_by` does not say which engine it is, its `/props` (llama.cpp, the
    simulator). None: neither listing answered. `timeout_s` bounds the routes asked
    together (each gets what is left), so a slow engine costs one timeout, not three.
    Never raises, except when cancelled."""
    base = base_url.rstrip("/")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s

    async def ask(path: str) -> Any:
        left = deadline - loop.time()
        return None if left <= 0 else await _get_json(session, base + path, headers, left)

    listing = listing_from_models(await ask("/v1/models"))
    if listing is None:
        return listing_from_tgi_info(await ask("/info"))
    if listing.engine in (None, SIMULATOR_ENGINE):
        engine, strict = engine_from_props(await ask("/props"))
        if engine is not None:
            listing = ModelListing(listing.names, engine, strict)
    return listing


async def fetch_load(
    session: aiohttp.ClientSession,
    base_url: str,
    headers: dict[str, str] | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> EngineLoad | None:
    """Scrape a backend's `/metrics` and read its load; None when that says nothing.

    llama.cpp serves /metrics only when started with `--metrics`, SGLang only with
    `--enable-metrics`: without, this is None, not an error. Never raises, except when
    the caller cancels it.
    """
    body = await _get_body(session, base_url.rstrip("/") + "/metrics", headers, timeout_s)
    if body is None:
        return None
    return parse_engine_metrics(body.decode("utf-8", errors="replace"))
