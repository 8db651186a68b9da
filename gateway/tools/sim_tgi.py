"""The simulator's Hugging Face TGI native API: /generate, /generate_stream, / and /info.

It shares the OpenAI routes' engine, so TGI and OpenAI requests queue for the same
batch and the same first-come-first-served prefill. Shapes, status codes and
framing follow TGI's router (see docs/simulator.md).
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.admission.tokens import (
    completion_prompt_parts,
)
from gateway.tools.sim_engine import (
    VOCABULARY,
    EngineStopped,
    Sequence,
)
from gateway.tools.simulator import (
    CONFIG_KEY,
    STATE_KEY,
    RequestInfo,
    Route,
    SimulatorState,
)

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


async def tgi_info(request: web.Request) -> web.Response:
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


async def tgi_generate(request: web.Request) -> web.StreamResponse:
    return await _tgi_handle(request, "tgi_generate")


async def tgi_generate_stream(request: web.Request) -> web.StreamResponse:
    return await _tgi_handle(request, "tgi_generate_stream")


async def tgi_compat_generate(request: web.Request) -> web.StreamResponse:
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
