"""An OpenAI-compatible model server that simulates continuous batching, for tests and benchmarks.

The gateway's claims (short requests are not stuck behind long prompts, waits
fail fast, streams are relayed as they are produced) can only be shown against
a backend that has the problem. This one does: its engine (`sim_engine`)
prefills prompts first come first served in bounded chunks, so a short prompt
waits for a long one ahead of it, as in vLLM, TGI and llama.cpp. The HTTP side
speaks the shapes of vLLM's OpenAI server closely enough for the gateway, the
`openai` SDK and load generators, and Hugging Face TGI's native API
(`/generate`, `/generate_stream`, `/`, `/info`) closely enough for
`huggingface_hub.InferenceClient`; both kinds of request share one engine. It
records what it received so tests can check what the gateway forwarded
(`/sim/requests`, `/sim/stats`).

See docs/simulator.md for the model and its knobs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import signal
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from gateway.admission.tokens import (
    TokenCounter,
    chat_prompt_parts,
    completion_prompt_parts,
    load_encoding,
)
from gateway.errors import GatewayError, invalid_request
from gateway.tools.sim_engine import (
    VOCABULARY,
    Engine,
    EngineStopped,
    Sequence,
    SimulatorConfig,
    TokenEvent,
)

__all__ = [
    "SimulatorConfig",
    "add_arguments",
    "build_simulator_app",
    "config_from_args",
    "main",
    "start_simulator",
]

Route = Literal["chat", "completions", "tgi_generate", "tgi_generate_stream", "tgi_compat"]

#: How many received requests `/sim/requests` remembers.
REQUEST_LOG_SIZE = 200
ENCODING_NAME = "cl100k_base"
MAX_BODY_BYTES = 64 * 1024 * 1024
#: Seconds `runner.cleanup()` waits for handlers; they end at once when the engine stops.
SHUTDOWN_TIMEOUT_S = 5.0

_CONFIG_HELP = {
    "max_batch": "most sequences running at once; the rest wait FIFO inside the engine",
    "prefill_tokens_per_step": "prompt tokens prefilled per step, FCFS across running sequences",
    "step_base_ms": "fixed time of one engine step",
    "prefill_ms_per_token": "step time added per prompt token prefilled in the step",
    "decode_ms_per_seq": "step time added per sequence decoding in the step",
    "default_max_tokens": "output length when a request sets no max_tokens",
    "max_model_len": "context window; prompt + max_tokens above it gets a 400",
    "seed": "seed of the generated text",
    "model": "model name served by /v1/models",
}


@dataclass(slots=True)
class RequestInfo:
    """What the simulator saw of one request, for `/sim/requests`."""

    request_id: str | None
    route: Route
    arrival: float
    model: str | None = None
    stream: bool | None = None
    max_tokens: int | None = None
    include_usage: bool = False
    prompt_tokens: int | None = None
    status: int | None = None
    error_code: str | None = None
    seq: Sequence | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        seq = self.seq
        outcome = seq.state if seq is not None else ("rejected" if self.status else "received")
        first_token = seq.first_token if seq else None
        end = seq.end if seq else None
        admitted = seq.admitted if seq else None
        return {
            "request_id": self.request_id,
            "route": self.route,
            "model": self.model,
            "stream": self.stream,
            "max_tokens": self.max_tokens,
            "include_usage": self.include_usage,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": seq.generated if seq else None,
            "outcome": outcome,
            "status": self.status,
            "error_code": self.error_code,
            "arrival": self.arrival,
            "admitted": admitted,
            "first_token": first_token,
            "end": end,
            "queue_ms": _ms(self.arrival, admitted),
            "ttft_ms": _ms(self.arrival, first_token),
            "e2e_ms": _ms(self.arrival, end),
        }


def _ms(start: float, end: float | None) -> float | None:
    return None if end is None else round((end - start) * 1000.0, 3)


@dataclass(slots=True)
class SimulatorState:
    """Everything the handlers share; one per app."""

    config: SimulatorConfig
    engine: Engine
    counter: TokenCounter
    received: int = 0
    rejected: int = 0
    requests: deque[RequestInfo] = field(default_factory=lambda: deque(maxlen=REQUEST_LOG_SIZE))


STATE_KEY = web.AppKey("simulator_state", SimulatorState)
CONFIG_KEY = web.AppKey("simulator_config", SimulatorConfig)


@dataclass(slots=True)
class _Params:
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int
    prompt_tokens: int


def build_simulator_app(config: SimulatorConfig) -> web.Application:
    """The simulator as an aiohttp app; the engine and tokenizer live for the app's lifetime."""
    # Long prompts are the point of the simulator: allow bodies far above aiohttp's 1 MiB default.
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[CONFIG_KEY] = config
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_stop_engine)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/generate", _tgi_generate)
    app.router.add_post("/generate_stream", _tgi_generate_stream)
    app.router.add_post("/", _tgi_compat_generate)
    app.router.add_get("/info", _tgi_info)
    app.router.add_get("/health", _health)
    app.router.add_get("/sim/stats", _stats)
    app.router.add_get("/sim/requests", _requests)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG_KEY]
    counter = TokenCounter(load_encoding(ENCODING_NAME))
    engine = Engine(config)
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
    config: SimulatorConfig, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Serve the simulator (port 0: an ephemeral one); the caller owns `runner.cleanup()`."""
    # handler_cancellation: a client that disconnects cancels its handler even before any
    # byte was written, which is how the engine learns to drop a waiting prompt.
    runner = web.AppRunner(
        build_simulator_app(config),
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


# --------------------------------------------------------------------------- handlers


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _models(request: web.Request) -> web.Response:
    config = request.app[CONFIG_KEY]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": config.model,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "simulator",
                    "root": config.model,
                    "parent": None,
                    "max_model_len": config.max_model_len,
                }
            ],
        }
    )


async def _stats(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return web.json_response(
        {"received": state.received, "rejected": state.rejected, **state.engine.stats()}
    )


async def _requests(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return web.json_response({"requests": [info.to_json() for info in state.requests]})


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completions")


async def _generate(request: web.Request, route: Route) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    engine = state.engine
    info = RequestInfo(
        request_id=request.headers.get("x-request-id"), route=route, arrival=engine.now()
    )
    state.received += 1
    state.requests.append(info)
    try:
        params = await _parse(request, route, state)
    except GatewayError as exc:
        state.rejected += 1
        info.status = exc.status
        info.error_code = exc.code
        return _error_response(exc)
    info.model = params.model
    info.stream = params.stream
    info.max_tokens = params.max_tokens
    info.include_usage = params.include_usage
    info.prompt_tokens = params.prompt_tokens

    response: web.StreamResponse
    try:
        seq = engine.submit(params.prompt_tokens, params.max_tokens)
    except EngineStopped:
        response = _error_response(_STOPPING)
        info.status = response.status
        return response
    info.seq = seq
    try:
        if params.stream:
            response = await _stream(request, route, params, seq)
        else:
            response = await _complete(route, params, seq)
    except EngineStopped:
        response = _error_response(_STOPPING)
    finally:
        # Cancelled (client gone), failed write, or engine stop: free the batch slot now.
        engine.abort(seq)
    info.status = response.status
    return response


async def _parse(request: web.Request, route: Route, state: SimulatorState) -> _Params:
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid_request("request body must be a JSON object")

    model = body.get("model")
    if model is None:
        model = state.config.model
    elif not isinstance(model, str):
        raise invalid_request("'model' must be a string", "model")

    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise invalid_request("'stream' must be a boolean", "stream")

    include_usage = False
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not stream:
            raise invalid_request(
                "'stream_options' is only allowed when 'stream' is true", "stream_options"
            )
        if not isinstance(stream_options, dict):
            raise invalid_request("'stream_options' must be an object", "stream_options")
        usage_flag = stream_options.get("include_usage", False)
        if not isinstance(usage_flag, bool) and usage_flag is not None:
            raise invalid_request(
                "'stream_options.include_usage' must be a boolean", "stream_options.include_usage"
            )
        include_usage = bool(usage_flag)

    # vLLM: max_completion_tokens wins over the deprecated max_tokens when both are set.
    max_tokens = state.config.default_max_tokens
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if type(value) is not int or value < 1:
            raise invalid_request(f"'{key}' must be an integer >= 1", key)
        max_tokens = value

    if route == "chat":
        if "messages" not in body:
            raise invalid_request("'messages' is required", "messages")
        parts = chat_prompt_parts(body["messages"], body.get("tools"))
    else:
        if "prompt" not in body:
            raise invalid_request("'prompt' is required", "prompt")
        parts = completion_prompt_parts(body["prompt"])
    prompt_tokens = await state.counter.count_async(parts)

    limit = state.config.max_model_len
    if prompt_tokens + max_tokens > limit:
        raise GatewayError(
            400,
            "context_length_exceeded",
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} "
            "in the completion). Please reduce the length of the prompt or completion.",
            param="max_tokens",
        )
    return _Params(model, stream, include_usage, max_tokens, prompt_tokens)


_STOPPING = GatewayError(503, "engine_stopped", "the simulator is stopping")


def _error_response(exc: GatewayError) -> web.Response:
    body = {
        "error": {
            "message": exc.message,
            "type": exc.error_type,
            "param": exc.param,
            "code": exc.code,
        }
    }
    return web.json_response(body, status=exc.status)


def _usage(params: _Params, seq: Sequence) -> dict[str, int]:
    return {
        "prompt_tokens": params.prompt_tokens,
        "completion_tokens": seq.generated,
        "total_tokens": params.prompt_tokens + seq.generated,
    }


def _sse(obj: dict[str, Any] | str) -> bytes:
    payload = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return b"data: " + payload.encode() + b"\n\n"


async def _stream(
    request: web.Request, route: Route, params: _Params, seq: Sequence
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    # Like vLLM (Starlette's StreamingResponse), the headers leave at once; the first data
    # event only comes with the first token, after the prompt has been prefilled.
    await response.prepare(request)
    chat = route == "chat"
    head: dict[str, Any] = {
        "id": _completion_id(route),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": params.model,
    }
    try:
        await _write_events(response, chat, head, params, seq)
    except ConnectionResetError:
        pass  # the client left; the caller aborts the sequence
    return response


async def _write_events(
    response: web.StreamResponse,
    chat: bool,
    head: dict[str, Any],
    params: _Params,
    seq: Sequence,
) -> None:
    first = True
    while True:
        try:
            event = await seq.next_event()
        except EngineStopped:
            error = {
                "message": _STOPPING.message,
                "type": _STOPPING.error_type,
                "param": None,
                "code": _STOPPING.code,
            }
            await response.write(_sse({"error": error}))
            await response.write_eof()
            return
        if first and chat:
            role = {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            await response.write(_sse({**head, "choices": [role]}))
        first = False
        await response.write(_sse({**head, "choices": [_stream_choice(chat, event)]}))
        if event.finish_reason is not None:
            break
    if params.include_usage:
        await response.write(_sse({**head, "choices": [], "usage": _usage(params, seq)}))
    await response.write(_sse("[DONE]"))
    await response.write_eof()


def _stream_choice(chat: bool, event: TokenEvent) -> dict[str, Any]:
    if chat:
        return {
            "index": 0,
            "delta": {"content": event.text},
            "logprobs": None,
            "finish_reason": event.finish_reason,
        }
    return {"index": 0, "text": event.text, "logprobs": None, "finish_reason": event.finish_reason}


async def _complete(route: Route, params: _Params, seq: Sequence) -> web.Response:
    texts: list[str] = []
    while True:
        event = await seq.next_event()
        texts.append(event.text)
        if event.finish_reason is not None:
            break
    text = "".join(texts)
    chat = route == "chat"
    choice: dict[str, Any]
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": event.finish_reason,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": event.finish_reason}
    return web.json_response(
        {
            "id": _completion_id(route),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": params.model,
            "choices": [choice],
            "usage": _usage(params, seq),
        }
    )


def _completion_id(route: Route) -> str:
    return ("chatcmpl-" if route == "chat" else "cmpl-") + uuid.uuid4().hex


# --------------------------------------------------------------------------- TGI native API
#
# Hugging Face text-generation-inference's own routes, shaped after its router (axum):
# `/generate` answers a GenerateResponse, `/generate_stream` an SSE stream of StreamResponse
# events written as `data:{json}` (no space, no `[DONE]`; the last event carries
# `generated_text` and, when asked, `details`), `/` switches on `stream` and answers a
# one-element list when not streaming, `/info` describes the server. Validation errors are
# `{"error": ..., "error_type": "validation"}` with a 422, or an in-band SSE event with a 200
# on the streaming routes; a body that does not deserialize gets axum's plain-text rejection.

TGI_VERSION = "3.0.0"
TGI_ROUTER = "text-generation-router"
TGI_PIPELINE_TAG = "text-generation"
TGI_COMPUTE_TYPE = "gpu+optimized"
#: TGI launcher defaults, reported by /info and enforced where the simulator can.
TGI_MAX_CONCURRENT_REQUESTS = 128
TGI_MAX_BEST_OF = 2
TGI_MAX_STOP_SEQUENCES = 4
TGI_MAX_TOP_N_TOKENS = 5
TGI_VALIDATION_WORKERS = 2
TGI_MAX_CLIENT_BATCH_SIZE = 4
#: axum's `KeepAlive::default()`: an empty SSE comment after this long without an event.
TGI_KEEP_ALIVE_S = 15.0
#: Token ids of the fake vocabulary (any stable numbers do; TGI reports the model's ids).
_TGI_TOKEN_IDS = {word + " ": 1000 + i for i, word in enumerate(VOCABULARY)}
#: Prompts above this many characters are split into prefill tokens off the event loop.
_TGI_OFFLOAD_CHARS = 16_384

_TGI_JSON = "application/json"


class _TgiRejection(Exception):
    """axum's `Json` extractor refusing a body: plain text, before any handler logic runs."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class _TgiError(Exception):
    """A TGI `InferError`: rendered as `ErrorResponse`, as JSON or as an SSE event."""

    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message

    def body(self) -> dict[str, str]:
        return {"error": self.message, "error_type": self.error_type}


def _tgi_validation(message: str) -> _TgiError:
    return _TgiError(422, "validation", f"Input validation error: {message}")


_TGI_STOPPING = _TgiError(
    424, "generation", "Request failed during generation: the simulator is stopping"
)


@dataclass(slots=True)
class _TgiParams:
    inputs: str
    stream: bool
    details: bool
    decoder_input_details: bool
    return_full_text: bool
    best_of: int
    seed: int | None
    max_new_tokens: int = 0
    prompt_tokens: int = 0
    truncate: int | None = None


# serde's names for the types GenerateParameters declares, and the fields of each kind.
_TGI_BOOL_FIELDS = ("do_sample", "watermark", "details", "decoder_input_details")
_TGI_INT_FIELDS = {
    "max_new_tokens": ("u32", 0, 2**32 - 1),
    "top_n_tokens": ("u32", 0, 2**32 - 1),
    "best_of": ("usize", 0, 2**64 - 1),
    "truncate": ("usize", 0, 2**64 - 1),
    "seed": ("u64", 0, 2**64 - 1),
    "top_k": ("i32", -(2**31), 2**31 - 1),
}
_TGI_FLOAT_FIELDS = ("temperature", "repetition_penalty", "frequency_penalty", "top_p", "typical_p")


def _serde_unexpected(value: Any) -> str:
    """How serde names a JSON value it did not expect."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map"


def _data_error(path: str, message: str) -> _TgiRejection:
    prefix = f"{path}: " if path else ""
    return _TgiRejection(
        422,
        "json_data",
        f"Failed to deserialize the JSON body into the target type: {prefix}{message}",
    )


def _invalid_type(path: str, value: Any, expected: str) -> _TgiRejection:
    return _data_error(path, f"invalid type: {_serde_unexpected(value)}, expected {expected}")


async def _tgi_body(request: web.Request, compat: bool) -> tuple[str, bool, dict[str, Any]]:
    """`inputs`, `stream` and `parameters` of a GenerateRequest, type-checked like serde does."""
    content_type = request.content_type
    if content_type != _TGI_JSON and not (
        content_type.startswith("application/") and content_type.endswith("+json")
    ):
        raise _TgiRejection(
            415, "unsupported_media_type", "Expected request with `Content-Type: application/json`"
        )
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise _TgiRejection(
            400, "json_syntax", f"Failed to parse the request body as JSON: {exc}"
        ) from None
    struct = "struct CompatGenerateRequest" if compat else "struct GenerateRequest"
    if not isinstance(body, dict):
        raise _invalid_type("", body, struct)
    if "inputs" not in body:
        raise _data_error("", "missing field `inputs`")
    inputs = body["inputs"]
    if not isinstance(inputs, str):
        raise _invalid_type("inputs", inputs, "a string")
    parameters = body.get("parameters", {})
    if not isinstance(parameters, dict):
        raise _invalid_type("parameters", parameters, "struct GenerateParameters")
    stream = False
    if compat and "stream" in body:
        stream = body["stream"]
        if not isinstance(stream, bool):
            raise _invalid_type("stream", stream, "a boolean")
    for name in _TGI_BOOL_FIELDS:
        if name in parameters and not isinstance(parameters[name], bool):
            raise _invalid_type(f"parameters.{name}", parameters[name], "a boolean")
    flag = parameters.get("return_full_text")
    if flag is not None and not isinstance(flag, bool):
        raise _invalid_type("parameters.return_full_text", flag, "a boolean")
    for name, (kind, low, high) in _TGI_INT_FIELDS.items():
        value = parameters.get(name)
        if value is None:
            continue
        if type(value) is not int:
            raise _invalid_type(f"parameters.{name}", value, kind)
        if not low <= value <= high:
            raise _data_error(
                f"parameters.{name}", f"invalid value: integer `{value}`, expected {kind}"
            )
    for name in _TGI_FLOAT_FIELDS:
        value = parameters.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise _invalid_type(f"parameters.{name}", value, "f32")
    stop = parameters.get("stop", [])
    if not isinstance(stop, list):
        raise _invalid_type("parameters.stop", stop, "a sequence")
    for index, item in enumerate(stop):
        if not isinstance(item, str):
            raise _invalid_type(f"parameters.stop[{index}]", item, "a string")
    return inputs, stream, parameters


def _tgi_validate_parameters(
    inputs: str, stream: bool, parameters: dict[str, Any], compat: bool
) -> _TgiParams:
    """TGI's router validation up to tokenization, in its order; raises `_TgiError`."""
    best_of = parameters.get("best_of")
    best_of = 1 if best_of is None else best_of
    return_full_text = parameters.get("return_full_text")
    if return_full_text is None:
        # `/` defaults it from the model's pipeline tag ("text-generation": the full text).
        return_full_text = compat and TGI_PIPELINE_TAG == "text-generation"
    if stream:
        if best_of != 1:
            raise _tgi_validation("`best_of` != 1 is not supported when streaming tokens")
        if parameters.get("decoder_input_details", False):
            raise _tgi_validation(
                "`decoder_input_details` == true is not supported when streaming tokens"
            )
    temperature = parameters.get("temperature")
    sampling = bool(parameters.get("do_sample", False)) or any(
        parameters.get(name) is not None for name in ("temperature", "top_k", "top_p", "typical_p")
    )
    if best_of > 1 and not sampling:
        raise _tgi_validation("you must use sampling when `best_of` is > 1")
    if temperature is not None and temperature <= 0:
        raise _tgi_validation("`temperature` must be strictly positive")
    penalty = parameters.get("repetition_penalty")
    if penalty is not None and penalty <= 0:
        raise _tgi_validation("`repetition_penalty` must be strictly positive")
    for name in ("top_p", "typical_p"):
        value = parameters.get(name)
        if value is not None and not 0 < value < 1:
            raise _tgi_validation(f"`{name}` must be > 0.0 and < 1.0")
    top_k = parameters.get("top_k")
    if top_k is not None and top_k <= 0:
        raise _tgi_validation("`top_k` must be strictly positive")
    if parameters.get("max_new_tokens") == 0:
        raise _tgi_validation("`max_new_tokens` must be strictly positive")
    stop = parameters.get("stop", [])
    if len(stop) > TGI_MAX_STOP_SEQUENCES:
        raise _tgi_validation(
            f"`stop` supports up to {TGI_MAX_STOP_SEQUENCES} stop sequences. Given: {len(stop)}"
        )
    seed = parameters.get("seed")
    if seed is not None and best_of > 1:
        raise _tgi_validation("`seed` must not be set when `best_of` > 1")
    top_n = parameters.get("top_n_tokens")
    if top_n is not None and top_n > TGI_MAX_TOP_N_TOKENS:
        raise _tgi_validation(
            f"`top_n_tokens` must be >= 0 and <= {TGI_MAX_TOP_N_TOKENS}. Given: {top_n}"
        )
    if not inputs:
        raise _tgi_validation("`inputs` cannot be empty")
    if not sampling:
        seed = None  # TGI reports a seed only for sampled generations
    elif seed is None:
        seed = random.getrandbits(64)
    return _TgiParams(
        inputs=inputs,
        stream=stream,
        details=bool(parameters.get("details", False)),
        decoder_input_details=bool(parameters.get("decoder_input_details", False)),
        return_full_text=return_full_text,
        best_of=best_of,
        seed=seed,
    )


async def _tgi_size(params: _TgiParams, parameters: dict[str, Any], state: SimulatorState) -> None:
    """Count the prompt with the OpenAI routes' tokenizer and settle `max_new_tokens`."""
    limit = state.config.max_model_len
    max_input = limit - 1
    truncate = parameters.get("truncate")
    if truncate is not None and (truncate == 0 or truncate > max_input):
        raise _tgi_validation(
            f"`truncate` must be strictly positive and less than {max_input}. Given: {truncate}"
        )
    input_length = await state.counter.count_async(completion_prompt_parts(params.inputs))
    if truncate is not None:
        input_length = min(input_length, truncate)
    requested = parameters.get("max_new_tokens")
    if requested is None:
        # TGI's server-side default fills the rest of the window; with no EOS here that
        # would run to max_model_len, so the simulator's default_max_tokens caps it.
        max_new_tokens = max(0, min(state.config.default_max_tokens, limit - input_length))
    else:
        max_new_tokens = requested
    if input_length + max_new_tokens > limit:
        raise _tgi_validation(
            f"`inputs` tokens + `max_new_tokens` must be <= {limit}. Given: {input_length} "
            f"`inputs` tokens and {max_new_tokens} `max_new_tokens`"
        )
    if input_length > max_input:
        raise _tgi_validation(
            f"`inputs` must have less than {max_input} tokens. Given: {input_length}"
        )
    params.prompt_tokens = input_length
    params.max_new_tokens = max_new_tokens
    params.truncate = truncate


def _tgi_dumps(obj: Any) -> str:
    # serde_json's output: compact, UTF-8 left as is.
    return json.dumps(obj, separators=(",", ":"))


def _tgi_json_response(
    obj: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        text=_tgi_dumps(obj), status=status, content_type=_TGI_JSON, headers=headers
    )


def _tgi_sse(obj: Any) -> bytes:
    # axum's `Event::json_data`: `data:` and the JSON with no space between them.
    return b"data:" + _tgi_dumps(obj).encode() + b"\n\n"


def _tgi_token(text: str) -> dict[str, Any]:
    token_id = _TGI_TOKEN_IDS.get(text, 999)
    logprob = -round(0.05 + 0.17 * (token_id % 11), 4)
    return {"id": token_id, "text": text, "logprob": logprob, "special": False}


def _tgi_prefill(encoding: Any, inputs: str, truncate: int | None) -> list[dict[str, Any]]:
    """The prompt's tokens as TGI's `decoder_input_details` reports them (first: no logprob)."""
    ids = encoding.encode_ordinary(inputs)
    if truncate is not None:
        ids = ids[-truncate:]
    tokens = []
    for position, token_id in enumerate(ids):
        text = encoding.decode_single_token_bytes(token_id).decode("utf-8", "replace")
        logprob = None if position == 0 else -round(0.5 + 0.31 * (token_id % 13), 4)
        tokens.append({"id": token_id, "text": text, "logprob": logprob})
    return tokens


async def _tgi_info(request: web.Request) -> web.Response:
    config = request.app[CONFIG_KEY]
    return _tgi_json_response(
        {
            "model_id": config.model,
            "model_sha": None,
            "model_pipeline_tag": TGI_PIPELINE_TAG,
            "max_concurrent_requests": TGI_MAX_CONCURRENT_REQUESTS,
            "max_best_of": TGI_MAX_BEST_OF,
            "max_stop_sequences": TGI_MAX_STOP_SEQUENCES,
            "max_input_tokens": config.max_model_len - 1,
            "max_total_tokens": config.max_model_len,
            "validation_workers": TGI_VALIDATION_WORKERS,
            "max_client_batch_size": TGI_MAX_CLIENT_BATCH_SIZE,
            "router": TGI_ROUTER,
            "version": TGI_VERSION,
            "sha": None,
            "docker_label": None,
        }
    )


async def _tgi_generate(request: web.Request) -> web.StreamResponse:
    return await _tgi_handle(request, "tgi_generate")


async def _tgi_generate_stream(request: web.Request) -> web.StreamResponse:
    return await _tgi_handle(request, "tgi_generate_stream")


async def _tgi_compat_generate(request: web.Request) -> web.StreamResponse:
    return await _tgi_handle(request, "tgi_compat")


async def _tgi_handle(request: web.Request, route: Route) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    engine = state.engine
    info = RequestInfo(
        request_id=request.headers.get("x-request-id"),
        route=route,
        arrival=engine.now(),
        model=state.config.model,
    )
    state.received += 1
    state.requests.append(info)
    compat = route == "tgi_compat"
    response: web.StreamResponse
    try:
        inputs, stream, parameters = await _tgi_body(request, compat)
    except _TgiRejection as exc:
        state.rejected += 1
        info.status = exc.status
        info.error_code = exc.code
        return web.Response(text=exc.message, status=exc.status, content_type="text/plain")
    stream = stream if compat else route == "tgi_generate_stream"
    info.stream = stream
    try:
        params = _tgi_validate_parameters(inputs, stream, parameters, compat)
        await _tgi_size(params, parameters, state)
    except _TgiError as exc:
        state.rejected += 1
        info.error_code = exc.error_type
        response = await _tgi_error_response(request, exc, stream)
        info.status = response.status
        return response
    info.max_tokens = params.max_new_tokens
    info.prompt_tokens = params.prompt_tokens

    try:
        seq = engine.submit(params.prompt_tokens, params.max_new_tokens)
    except EngineStopped:
        response = await _tgi_error_response(request, _TGI_STOPPING, stream)
        info.status = response.status
        return response
    info.seq = seq
    try:
        if stream:
            response = await _tgi_stream(request, params, seq)
        else:
            response = await _tgi_complete(params, seq, info.arrival, state, compat)
    except EngineStopped:
        response = _tgi_json_response(_TGI_STOPPING.body(), _TGI_STOPPING.status)
    finally:
        # Cancelled (client gone), failed write, or engine stop: free the batch slot now.
        engine.abort(seq)
    info.status = response.status
    return response


async def _tgi_error_response(
    request: web.Request, exc: _TgiError, stream: bool
) -> web.StreamResponse:
    if not stream:
        return _tgi_json_response(exc.body(), exc.status)
    # TGI's streaming routes have sent their 200 and headers before validating: the error
    # is the stream's one event.
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    try:
        await response.write(_tgi_sse(exc.body()))
        await response.write_eof()
    except ConnectionResetError:
        pass
    return response


async def _tgi_complete(
    params: _TgiParams, seq: Sequence, received: float, state: SimulatorState, compat: bool
) -> web.Response:
    tokens: list[dict[str, Any]] = []
    while True:
        event = await seq.next_event()
        tokens.append(_tgi_token(event.text))
        if event.finish_reason is not None:
            break
    text = "".join(token["text"] for token in tokens)
    body: dict[str, Any] = {
        "generated_text": params.inputs + text if params.return_full_text else text
    }
    if params.details or params.decoder_input_details:
        prefill: list[dict[str, Any]] = []
        if params.decoder_input_details:
            encoding = state.counter.encoding
            if len(params.inputs) < _TGI_OFFLOAD_CHARS:
                prefill = _tgi_prefill(encoding, params.inputs, params.truncate)
            else:
                prefill = await asyncio.to_thread(
                    _tgi_prefill, encoding, params.inputs, params.truncate
                )
        body["details"] = {
            "finish_reason": event.finish_reason,
            "generated_tokens": seq.generated,
            "seed": params.seed,
            "prefill": prefill,
            "tokens": tokens,
        }
    return _tgi_json_response(
        [body] if compat else body, headers=_tgi_timing_headers(params, seq, received)
    )


def _tgi_timing_headers(params: _TgiParams, seq: Sequence, received: float) -> dict[str, str]:
    """The `x-*` headers TGI puts on a non-streamed answer (times in ms unless noted)."""
    end = seq.end if seq.end is not None else seq.arrival
    start = seq.admitted if seq.admitted is not None else end
    total = end - received
    inference = end - start
    return {
        "x-compute-type": TGI_COMPUTE_TYPE,
        "x-compute-time": str(round(total, 6)),  # seconds, as TGI writes it
        "x-compute-characters": str(len(params.inputs)),
        "x-total-time": str(int(total * 1000)),
        "x-validation-time": str(int((seq.arrival - received) * 1000)),
        "x-queue-time": str(int((start - seq.arrival) * 1000)),
        "x-inference-time": str(int(inference * 1000)),
        "x-time-per-token": str(int(inference * 1000 / max(1, seq.generated))),
        "x-prompt-tokens": str(params.prompt_tokens),
        "x-generated-tokens": str(seq.generated),
    }


async def _tgi_stream(
    request: web.Request, params: _TgiParams, seq: Sequence
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "x-compute-type": TGI_COMPUTE_TYPE,
            "x-compute-characters": str(len(params.inputs)),
            "X-Accel-Buffering": "no",
        }
    )
    # As in TGI (axum's Sse), the headers leave before the first token exists.
    await response.prepare(request)
    try:
        await _tgi_write_events(response, params, seq)
    except ConnectionResetError:
        pass  # the client left; the caller aborts the sequence
    return response


async def _tgi_write_events(
    response: web.StreamResponse, params: _TgiParams, seq: Sequence
) -> None:
    texts: list[str] = []
    index = 0
    while True:
        try:
            async with asyncio.timeout(TGI_KEEP_ALIVE_S):
                event = await seq.next_event()
        except TimeoutError:
            await response.write(b":\n\n")  # axum's keep-alive comment during a long wait
            continue
        except EngineStopped:
            await response.write(_tgi_sse(_TGI_STOPPING.body()))
            await response.write_eof()
            return
        index += 1
        texts.append(event.text)
        payload: dict[str, Any] = {
            "index": index,
            "token": _tgi_token(event.text),
            "generated_text": None,
            "details": None,
        }
        if event.finish_reason is None:
            await response.write(_tgi_sse(payload))
            continue
        text = "".join(texts)
        payload["generated_text"] = params.inputs + text if params.return_full_text else text
        if params.details:
            payload["details"] = {
                "finish_reason": event.finish_reason,
                "generated_tokens": seq.generated,
                "seed": params.seed,
                "input_length": params.prompt_tokens,
            }
        await response.write(_tgi_sse(payload))
        break
    await response.write_eof()


# --------------------------------------------------------------------------- CLI


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--host`, `--port` and one flag per SimulatorConfig knob, defaulting to the config's."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    for f in dataclasses.fields(SimulatorConfig):
        default = f.default
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
    return asyncio.run(_serve(config, args.host, args.port))


async def _serve(config: SimulatorConfig, host: str, port: int) -> int:
    runner, bound = await start_simulator(config, host, port)
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


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description="Continuous-batching model server simulator")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
