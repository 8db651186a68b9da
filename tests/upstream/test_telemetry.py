"""What engines say about their load (/metrics) and their size (/props, /info, /v1/models).

The metric texts are the engines' own: sample lines, names, help strings and labels
are taken from their source or docs (each text says where), with values changed.
The fetch helpers are tried against small real servers on 127.0.0.1 that play an
engine, a broken engine, and a hung one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.upstream.telemetry import (
    BackendFacts,
    EngineLoad,
    facts_from_models,
    facts_from_props,
    facts_from_tgi_info,
    fetch_load,
    parse_engine_metrics,
    probe_facts,
)
from tests.conftest import free_port

# ----------------------------------------------------------------------------- engine texts

# llama.cpp, current builds: tools/server/README.md ("GET /metrics", table of available
# metrics) and the emitter in tools/server (`# HELP llamacpp:<name> <description>`,
# `# TYPE llamacpp:<name> <type>`, `llamacpp:<name> <value>`, no labels). The help lines
# are as printed since ggml-org/llama.cpp PR #11512 ("Number of requests processing.").
LLAMACPP_CURRENT = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 6886
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 2903.63
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 3469
# HELP llamacpp:tokens_predicted_seconds_total Predict process time
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 3544.27
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 3520
# HELP llamacpp:n_tokens_max Largest observed n_tokens.
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 4096
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s.
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 2.37151
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s.
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 0.978731
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 3
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 1.58
"""

# llama.cpp, older builds (examples/server/README.md of 2024: "llamacpp:kv_cache_usage_ratio:
# (Gauge) KV-cache usage. 1 means 100 percent usage.", "llamacpp:kv_cache_tokens"), the
# help strings from before PR #11512 ("Number of request processing.").
LLAMACPP_OLDER = """\
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.25
# HELP llamacpp:kv_cache_tokens KV-cache tokens.
# TYPE llamacpp:kv_cache_tokens gauge
llamacpp:kv_cache_tokens 2048
# HELP llamacpp:requests_processing Number of request processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of request deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""

# vLLM V1: vllm/v1/metrics/loggers.py (PrometheusStatLogger): labelnames
# ["model_name", "engine"], one series per data-parallel engine; the help strings are its
# `documentation=`. gpu_cache_usage_perc is the name deprecated in 0.9 for kv_cache_usage_perc.
VLLM_V1_TWO_ENGINES = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 16.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-8B"} 15.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 8.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-8B"} 2.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: Use vllm:kv_cache_usage_perc instead.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.5
vllm:gpu_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.5
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.91
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.42
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-8B"} 123456.0
vllm:prompt_tokens_total{engine="1",model_name="Qwen/Qwen3-8B"} 120000.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-8B"} 12.5
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen3-8B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-8B"} 40.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-8B"} 40.0
"""

# vLLM V0 (docs.vllm.ai "Production Metrics", v0.5-v0.8: labelnames ["model_name"], the
# help strings of vllm/engine/metrics.py): only the old KV name exists.
VLLM_V0 = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="meta-llama/Llama-2-7b-hf"} 3.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="meta-llama/Llama-2-7b-hf"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="meta-llama/Llama-2-7b-hf"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="meta-llama/Llama-2-7b-hf"} 0.125
# HELP vllm:cpu_cache_usage_perc CPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:cpu_cache_usage_perc gauge
vllm:cpu_cache_usage_perc{model_name="meta-llama/Llama-2-7b-hf"} 0.0
"""

# TGI: docs/source/reference/metrics.md (tgi_queue_size "Current queue size",
# tgi_batch_current_size "Current batch size"), set in backends/v3/src/queue.rs and
# backend.rs through the `metrics` crate's Prometheus exporter: no labels, counters
# without a `_total` suffix.
TGI = """\
# TYPE tgi_request_count counter
tgi_request_count 1520
# TYPE tgi_request_success counter
tgi_request_success 1498
# TYPE tgi_queue_size gauge
tgi_queue_size 6
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 32
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 40000
# TYPE tgi_request_queue_duration histogram
tgi_request_queue_duration_bucket{le="0.005"} 1200
tgi_request_queue_duration_bucket{le="+Inf"} 1498
tgi_request_queue_duration_sum 310.5
tgi_request_queue_duration_count 1498
"""

# SGLang: docs/references/production_metrics.md, its example `curl .../metrics`, lines as
# printed there (python/sglang/srt/metrics/collector.py labels them by model_name).
SGLANG = """\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:cache_hit_rate The cache hit rate
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.007507552643049313
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 162.0
# HELP sglang:num_used_tokens The number of used tokens
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 123859.0
# HELP sglang:gen_throughput The generate throughput (token/s)
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="meta-llama/Llama-3.1-8B-Instruct"} 86.50814177726902
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2826.0
"""


# ----------------------------------------------------------------------------- /metrics


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (LLAMACPP_CURRENT, EngineLoad("llama.cpp", waiting=3.0, running=4.0, kv_usage=None)),
        (LLAMACPP_OLDER, EngineLoad("llama.cpp", waiting=0.0, running=1.0, kv_usage=0.25)),
        (VLLM_V1_TWO_ENGINES, EngineLoad("vllm", waiting=10.0, running=31.0, kv_usage=0.91)),
        (VLLM_V0, EngineLoad("vllm", waiting=0.0, running=3.0, kv_usage=0.125)),
        (TGI, EngineLoad("tgi", waiting=6.0, running=32.0, kv_usage=None)),
        (SGLANG, EngineLoad("sglang", waiting=2826.0, running=162.0, kv_usage=0.28)),
    ],
    ids=["llama.cpp", "llama.cpp-older", "vllm-v1-dp2", "vllm-v0", "tgi", "sglang"],
)
def test_each_engines_own_text(text: str, expected: EngineLoad) -> None:
    assert parse_engine_metrics(text) == expected


def test_counts_sum_over_label_sets_and_kv_takes_the_fullest() -> None:
    text = (
        'vllm:num_requests_waiting{model_name="a",engine="0"} 1\n'
        'vllm:num_requests_waiting{model_name="a",engine="1"} 2\n'
        'vllm:num_requests_waiting{model_name="b",engine="0"} 4\n'
        'vllm:num_requests_running{model_name="a",engine="0"} 0.5\n'
        'vllm:kv_cache_usage_perc{model_name="a",engine="0"} 0.7\n'
        'vllm:kv_cache_usage_perc{model_name="b",engine="0"} 0.9\n'
    )  # no TYPE lines: the parser makes each line a family of its own, still summed
    load = parse_engine_metrics(text)
    assert load == EngineLoad("vllm", waiting=7.0, running=0.5, kv_usage=0.9)


def test_the_new_kv_name_wins_over_the_deprecated_one() -> None:
    load = parse_engine_metrics(VLLM_V1_TWO_ENGINES)
    assert load is not None and load.kv_usage == 0.91  # not gpu_cache_usage_perc's 0.5
    only_old = parse_engine_metrics('vllm:gpu_cache_usage_perc{model_name="m"} 0.3\n')
    assert only_old == EngineLoad("vllm", waiting=None, running=None, kv_usage=0.3)


def test_one_field_is_enough_and_the_others_stay_unknown() -> None:
    assert parse_engine_metrics("tgi_queue_size 0\n") == EngineLoad(
        "tgi", waiting=0.0, running=None, kv_usage=None
    )


def test_vllm_names_win_when_a_server_speaks_both() -> None:
    # The simulator answers with vLLM's and llama.cpp's names at once.
    both = VLLM_V0 + LLAMACPP_CURRENT
    load = parse_engine_metrics(both)
    assert load is not None and load.engine == "vllm"
    assert (load.waiting, load.running) == (0.0, 3.0)  # no mixing in llama.cpp's numbers


def test_counter_name_rewriting_does_not_hide_a_gauge() -> None:
    # prometheus_client's parser strips `_total` from counter family names and appends it
    # to counter samples without one (TGI's `tgi_request_count` becomes
    # `tgi_request_count_total`): only sample names of gauges are matched, which it keeps.
    load = parse_engine_metrics(TGI)
    assert load is not None and load.waiting == 6.0


def test_non_finite_values_are_ignored() -> None:
    text = (
        "llamacpp:requests_deferred NaN\n"
        "llamacpp:requests_processing +Inf\n"
        "llamacpp:kv_cache_usage_ratio 0.5\n"
    )
    assert parse_engine_metrics(text) == EngineLoad(
        "llama.cpp", waiting=None, running=None, kv_usage=0.5
    )
    assert parse_engine_metrics("tgi_queue_size NaN\n") is None


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n\n",
        "# just a comment\n",
        'python_gc_objects_collected_total{generation="0"} 12.0\nprocess_open_fds 9\n',
        "<html><body>404 Not Found</body></html>",
        '{"error": "metrics are disabled"}',
        "Not Found",
        "\x00\xff\xfe binary",
        # a scrape cut short mid-line: what came before is not trusted either
        LLAMACPP_CURRENT + "llamacpp:requests_defer",
        'vllm:num_requests_waiting{model_name="m} 1\n',  # unterminated label value
        "vllm:num_requests_waiting 1 2 junk\n",
        "tgi_queue_size lots\n",
    ],
)
def test_garbage_is_none_never_an_exception(text: str) -> None:
    assert parse_engine_metrics(text) is None


def test_not_a_string_is_none() -> None:
    assert parse_engine_metrics(b"tgi_queue_size 1\n") is None  # type: ignore[arg-type]
    assert parse_engine_metrics(None) is None  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- facts

# llama.cpp tools/server/README.md, "GET /props" (fields cut to the ones read and a few).
LLAMACPP_PROPS: dict[str, Any] = {
    "default_generation_settings": {
        "id": 0,
        "id_task": -1,
        "n_ctx": 1024,
        "speculative": False,
        "is_processing": False,
        "params": {"n_predict": -1, "seed": 4294967295, "temperature": 0.800000011920929},
    },
    "total_slots": 1,
    "model_path": "../models/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf",
    "chat_template": "...",
    "modalities": {"vision": False},
    "build_info": "b(build number)-(build commit hash)",
    "is_sleeping": False,
}

# TGI router/src/lib.rs `struct Info`, with its #[schema(example = ...)] values.
TGI_INFO: dict[str, Any] = {
    "model_id": "bigscience/blomm-560m",
    "model_sha": "e985a63cdc139290c5f700ff1929f0b5942cced2",
    "model_pipeline_tag": "text-generation",
    "max_concurrent_requests": 128,
    "max_best_of": 2,
    "max_stop_sequences": 4,
    "max_input_tokens": 1024,
    "max_total_tokens": 2048,
    # Its backend's info, flattened in: the batch's KV tokens (prompt + max_new_tokens each).
    "max_batch_total_tokens": 16000,
    "max_waiting_tokens": 20,
    "max_batch_size": None,
    "validation_workers": 2,
    "max_client_batch_size": 32,
    "router": "text-generation-router",
    "version": "0.5.0",
    "sha": None,
    "docker_label": None,
}

# vLLM vllm/entrypoints/openai/protocol.py `ModelCard` (owned_by "vllm", max_model_len).
VLLM_MODELS: dict[str, Any] = {
    "object": "list",
    "data": [
        {
            "id": "Qwen/Qwen3-8B",
            "object": "model",
            "created": 1750000000,
            "owned_by": "vllm",
            "root": "Qwen/Qwen3-8B",
            "parent": None,
            "max_model_len": 40960,
            "permission": [],
        },
        {"id": "my-lora", "object": "model", "owned_by": "vllm", "max_model_len": 40960},
    ],
}


def test_llama_cpp_props() -> None:
    assert facts_from_props(LLAMACPP_PROPS) == BackendFacts(
        engine="llama.cpp",
        slots=1,
        context_tokens=1024,
        model="../models/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf",
    )


def test_tgi_info() -> None:
    assert facts_from_tgi_info(TGI_INFO) == BackendFacts(
        engine="tgi",
        slots=128,
        context_tokens=2048,
        max_input_tokens=1024,
        batch_tokens=16000,
        model="bigscience/blomm-560m",
    )


def test_tgi_info_before_2_1_says_max_input_length() -> None:
    # TGI's Info had `max_input_length` until "feat: add SchedulerV3 (#1996)" renamed it.
    older = {k: v for k, v in TGI_INFO.items() if k != "max_input_tokens"}
    older["max_input_length"] = 1000
    facts = facts_from_tgi_info(older)
    assert facts is not None and facts.max_input_tokens == 1000
    both = {**TGI_INFO, "max_input_length": 7}
    facts = facts_from_tgi_info(both)
    assert facts is not None and facts.max_input_tokens == 1024  # the new name wins


def test_vllm_models() -> None:
    assert facts_from_models(VLLM_MODELS) == BackendFacts(
        engine="vllm", context_tokens=40960, model="Qwen/Qwen3-8B"
    )


@pytest.mark.parametrize(
    ("owned_by", "engine"),
    [("vllm", "vllm"), ("sglang", "sglang"), ("llamacpp", "llama.cpp"), ("openai", None),
     ("bigscience/blomm-560m", None), (7, None)],
)  # fmt: skip
def test_models_owned_by_names_the_engine_only_when_it_is_one(owned_by: Any, engine: Any) -> None:
    facts = facts_from_models({"data": [{"id": "m", "owned_by": owned_by}]})
    assert facts == BackendFacts(engine=engine, model="m")


@pytest.mark.parametrize(
    "obj",
    [None, [], "props", 3, {}, {"role": "router", "max_instances": 3, "models_autoload": True}],
)
def test_props_that_say_nothing_are_none(obj: Any) -> None:
    assert facts_from_props(obj) is None


def test_props_with_odd_fields() -> None:
    odd = {
        "total_slots": "4",  # a string: not a count
        "default_generation_settings": {"n_ctx": 4096.0},  # an integral float is fine
        "model_path": 12,
    }
    assert facts_from_props(odd) == BackendFacts(engine="llama.cpp", context_tokens=4096)
    for bad in (True, -1, 0, 1.5, float("nan"), float("inf"), None, [4], {"n": 4}):
        facts = facts_from_props(
            {"total_slots": bad, "default_generation_settings": {"n_ctx": bad}}
        )
        assert facts is None, bad
    facts = facts_from_props({"total_slots": 2, "default_generation_settings": [1024]})
    assert facts == BackendFacts(engine="llama.cpp", slots=2)
    # a router's /props: a model alias but no slots; the model is still worth knowing
    assert facts_from_props({"role": "router", "model_alias": "llama-server"}) == BackendFacts(
        model="llama-server"
    )


def test_tgi_info_with_odd_fields() -> None:
    odd = {"model_id": "", "max_concurrent_requests": False, "max_total_tokens": "2048",
           "max_input_tokens": None, "max_input_length": 1023.0,
           "max_batch_total_tokens": -5}  # fmt: skip
    assert facts_from_tgi_info(odd) == BackendFacts(engine="tgi", max_input_tokens=1023)
    assert facts_from_tgi_info({"model_id": "m"}) == BackendFacts(model="m")
    for obj in (None, [TGI_INFO], "info", {}, {"error": "Not Found"}):
        assert facts_from_tgi_info(obj) is None


@pytest.mark.parametrize(
    "obj",
    [None, {}, {"data": []}, {"data": {}}, {"data": ["m"]}, {"data": [None]}, {"data": [{}]},
     {"object": "error", "message": "Not Found"}, [VLLM_MODELS],
     {"data": [{"id": 5, "max_model_len": "4096", "owned_by": None}]}],
)  # fmt: skip
def test_models_that_say_nothing_are_none(obj: Any) -> None:
    assert facts_from_models(obj) is None


def test_models_with_odd_fields() -> None:
    # llama.cpp lists its model with `meta` and no max_model_len; TGI names the owner by model.
    llama = {"object": "list", "data": [{"id": "model.gguf", "object": "model",
             "owned_by": "llamacpp", "meta": {"n_ctx_train": 131072}}]}  # fmt: skip
    assert facts_from_models(llama) == BackendFacts(engine="llama.cpp", model="model.gguf")
    negative = {"data": [{"id": "m", "max_model_len": -4096}]}
    assert facts_from_models(negative) == BackendFacts(model="m")


# ----------------------------------------------------------------------------- fetching

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Serve = Callable[[dict[str, Handler]], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Start a fake engine on 127.0.0.1 answering `routes` (GET); 404 elsewhere."""
    servers: list[TestServer] = []

    async def start(routes: dict[str, Handler]) -> str:
        app = web.Application()
        for path, handler in routes.items():
            app.router.add_get(path, handler)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    yield start
    for server in servers:
        await server.close()


def json_route(obj: Any, status: int = 200) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(obj, status=status)

    return handler


def text_route(text: str, status: int = 200, content_type: str = "text/plain") -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(text=text, status=status, content_type=content_type)

    return handler


async def test_probe_merges_in_order_props_info_models(
    serve: Serve, http: aiohttp.ClientSession
) -> None:
    url = await serve(
        {
            # a llama.cpp-like /props without the model, a TGI-like /info, a vLLM /v1/models
            "/props": json_route(
                {"total_slots": 4, "default_generation_settings": {"n_ctx": 8192}}
            ),
            "/info": json_route(TGI_INFO),
            "/v1/models": json_route(VLLM_MODELS),
        }
    )
    facts = await probe_facts(http, url + "/", None)  # a trailing slash on the base is fine
    assert facts == BackendFacts(
        engine="llama.cpp",  # /props spoke first
        slots=4,  # not /info's 128
        context_tokens=8192,  # not /info's 2048 nor /v1/models' 40960
        max_input_tokens=1024,  # only /info says it
        batch_tokens=16000,  # ... and this
        model="bigscience/blomm-560m",  # /props had none: /info's
    )


async def test_probe_a_vllm_that_has_only_v1_models(
    serve: Serve, http: aiohttp.ClientSession
) -> None:
    url = await serve(
        {"/v1/models": json_route(VLLM_MODELS), "/info": json_route({"detail": "Not Found"}, 404)}
    )
    assert await probe_facts(http, url) == BackendFacts(
        engine="vllm", context_tokens=40960, model="Qwen/Qwen3-8B"
    )


async def test_probe_sends_the_headers(serve: Serve, http: aiohttp.ClientSession) -> None:
    seen: list[str | None] = []

    async def props(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != "Bearer k":
            return web.json_response({"error": "unauthorized"}, status=401)
        return web.json_response(LLAMACPP_PROPS)

    url = await serve({"/props": props})
    facts = await probe_facts(http, url, {"Authorization": "Bearer k"})
    assert facts is not None and facts.slots == 1
    assert seen == ["Bearer k"]
    assert await probe_facts(http, url, None) is None  # 401 says nothing


async def test_probe_swallows_errors_bad_json_and_non_200(
    serve: Serve, http: aiohttp.ClientSession
) -> None:
    async def broken(request: web.Request) -> web.StreamResponse:
        raise RuntimeError("boom")  # aiohttp answers 500

    url = await serve(
        {
            "/props": text_route("{not json", content_type="application/json"),
            "/info": broken,
            "/v1/models": json_route(VLLM_MODELS, status=503),
        }
    )
    assert await probe_facts(http, url) is None
    url = await serve({"/props": text_route("\xff\xfe", content_type="application/json")})
    assert await probe_facts(http, url) is None


async def test_probe_reads_json_whatever_the_content_type(
    serve: Serve, http: aiohttp.ClientSession
) -> None:
    url = await serve({"/props": text_route(json.dumps(LLAMACPP_PROPS))})  # text/plain
    facts = await probe_facts(http, url)
    assert facts is not None and facts.engine == "llama.cpp"


async def test_nothing_listening_is_none(http: aiohttp.ClientSession) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert await probe_facts(http, url) is None
    assert await fetch_load(http, url) is None
    assert await probe_facts(http, "not a url at all") is None
    assert await fetch_load(http, "http://[::1") is None


async def test_a_hung_backend_times_out_to_none(serve: Serve, http: aiohttp.ClientSession) -> None:
    async def hang(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(30)
        return web.Response(text="late")

    url = await serve({"/props": hang, "/info": hang, "/v1/models": hang, "/metrics": hang})
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await fetch_load(http, url, timeout_s=0.2) is None
    assert await probe_facts(http, url, timeout_s=0.2) is None
    assert loop.time() - start < 5.0  # 4 GETs of 0.2 s, not 30 s each


async def test_fetch_load(serve: Serve, http: aiohttp.ClientSession) -> None:
    url = await serve({"/metrics": text_route(SGLANG)})
    assert await fetch_load(http, url) == EngineLoad(
        "sglang", waiting=2826.0, running=162.0, kv_usage=0.28
    )


async def test_fetch_load_of_a_server_without_metrics(
    serve: Serve, http: aiohttp.ClientSession
) -> None:
    # llama.cpp without --metrics answers an error; a gateway's own /metrics has none of these.
    url = await serve({"/metrics": json_route({"error": {"code": 501}}, status=501)})
    assert await fetch_load(http, url) is None
    url = await serve({"/metrics": text_route("gateway_requests_total 3\n")})
    assert await fetch_load(http, url) is None
    url = await serve({"/metrics": text_route("<html>nope</html>")})
    assert await fetch_load(http, url) is None


async def test_fetch_load_refuses_a_huge_body(serve: Serve, http: aiohttp.ClientSession) -> None:
    huge = "tgi_queue_size 1\n" + "# padding " + "x" * (5 * 1024 * 1024) + "\n"
    url = await serve({"/metrics": text_route(huge)})
    assert await fetch_load(http, url) is None


async def test_cancelling_a_fetch_cancels_it(serve: Serve, http: aiohttp.ClientSession) -> None:
    async def hang(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(30)
        return web.Response(text="late")

    url = await serve({"/metrics": hang})
    task = asyncio.create_task(fetch_load(http, url))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_nan_is_not_a_count() -> None:
    assert facts_from_tgi_info({"max_total_tokens": float("nan")}) is None


def test_vllm_cache_config_gives_the_kv_capacity() -> None:
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 3.0\n'
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",'
        'num_gpu_blocks="20000"} 1.0\n'
    )
    load = parse_engine_metrics(text)
    assert load is not None and load.kv_capacity_tokens == 320_000
    before_profiling = text.replace('num_gpu_blocks="20000"', 'num_gpu_blocks="None"')
    load = parse_engine_metrics(before_profiling)
    assert load is not None and load.kv_capacity_tokens is None and load.running == 3.0
