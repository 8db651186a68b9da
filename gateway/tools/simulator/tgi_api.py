"""The simulator's Hugging Face TGI native API: /generate, /generate_stream, / and /info.

It shares the OpenAI routes' engine, so TGI and OpenAI requests queue for the
same batch and the same first-come-first-served prefill. Shapes, status codes
and framing follow TGI's router (axum; see docs/simulator.md): `/generate`
answers a GenerateResponse, `/generate_stream` an SSE stream of StreamResponse
events written as `data:{json}` (no space, no `[DONE]`; the last event carries
`generated_text` and, when asked, `details`), `/` switches on `stream` and
answers a one-element list when not streaming, `/info` describes the server.
Validation errors are `{"error": ..., "error_type": "validation"}` with a 422,
or an in-band SSE event with a 200 on the streaming routes; a body that does not
deserialize gets axum's plain-text rejection (see `tgi_request`).

TGI 3 caches prefixes too (its router's radix allocator), and so do these routes,
through the shared engine; like TGI, they report nothing of it: its responses,
headers and usage have no cached-token field.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from gateway.tools.simulator.engine import VOCABULARY, EngineStopped, Sequence
from gateway.tools.simulator.errors import TgiError, TgiRejection
from gateway.tools.simulator.state import CONFIG_KEY, STATE_KEY, Route, SimulatorState
from gateway.tools.simulator.tgi_request import (
    TGI_JSON,
    TGI_MAX_STOP_SEQUENCES,
    TGI_PIPELINE_TAG,
    TgiParams,
    read_body,
    settle_size,
    validate_parameters,
)

TGI_VERSION = "3.0.0"
TGI_ROUTER = "text-generation-router"
TGI_COMPUTE_TYPE = "gpu+optimized"
#: TGI launcher defaults, reported by /info.
TGI_MAX_CONCURRENT_REQUESTS = 128
TGI_MAX_BEST_OF = 2
TGI_VALIDATION_WORKERS = 2
TGI_MAX_CLIENT_BATCH_SIZE = 4
#: axum's `KeepAlive::default()`: an empty SSE comment after this long without an event.
TGI_KEEP_ALIVE_S = 15.0
#: Token ids of the fake vocabulary (any stable numbers do; TGI reports the model's ids).
_TGI_TOKEN_IDS = {word + " ": 1000 + i for i, word in enumerate(VOCABULARY)}
#: Prompts above this many characters are split into prefill tokens off the event loop.
_TGI_OFFLOAD_CHARS = 16_384

_TGI_STOPPING = TgiError(
    424, "generation", "Request failed during generation: the simulator is stopping"
)


def add_routes(app: web.Application) -> None:
    """TGI's routes: `/generate`, `/generate_stream`, `/` (compat) and `/info`."""
    app.router.add_post("/generate", tgi_generate)
    app.router.add_post("/generate_stream", tgi_generate_stream)
    app.router.add_post("/", tgi_compat_generate)
    if app[CONFIG_KEY].pose_as in ("simulator", "tgi"):  # vLLM and llama.cpp have no /info
        app.router.add_get("/info", tgi_info)


def _dumps(obj: Any) -> str:
    # serde_json's output: compact, UTF-8 left as is.
    return json.dumps(obj, separators=(",", ":"))


def _json_response(
    obj: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(text=_dumps(obj), status=status, content_type=TGI_JSON, headers=headers)


def _sse(obj: Any) -> bytes:
    # axum's `Event::json_data`: `data:` and the JSON with no space between them.
    return b"data:" + _dumps(obj).encode() + b"\n\n"


def _token(text: str) -> dict[str, Any]:
    token_id = _TGI_TOKEN_IDS.get(text, 999)
    logprob = -round(0.05 + 0.17 * (token_id % 11), 4)
    return {"id": token_id, "text": text, "logprob": logprob, "special": False}


def _prefill(encoding: Any, inputs: str, truncate: int | None) -> list[dict[str, Any]]:
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
    # Its batch's KV budget in tokens: told when bounded, or when posing as TGI.
    told = bool(config.max_batch_tokens) or config.pose_as == "tgi"
    batch_tokens = config.tgi_batch_tokens if told else None
    return _json_response(
        {
            "model_id": config.model,
            "model_sha": None,
            "model_pipeline_tag": TGI_PIPELINE_TAG,
            "max_concurrent_requests": TGI_MAX_CONCURRENT_REQUESTS,
            "max_best_of": TGI_MAX_BEST_OF,
            "max_stop_sequences": TGI_MAX_STOP_SEQUENCES,
            "max_input_tokens": config.max_model_len - 1,
            "max_total_tokens": config.max_model_len,
            **({} if batch_tokens is None else {"max_batch_total_tokens": batch_tokens}),
            "validation_workers": TGI_VALIDATION_WORKERS,
            "max_client_batch_size": TGI_MAX_CLIENT_BATCH_SIZE,
            "router": TGI_ROUTER,
            "version": TGI_VERSION,
            "sha": None,
            "docker_label": None,
        }
    )


async def tgi_generate(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "tgi_generate")


async def tgi_generate_stream(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "tgi_generate_stream")


async def tgi_compat_generate(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "tgi_compat")


async def _handle(request: web.Request, route: Route) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    engine = state.engine
    info = state.receive(request, route, model=state.config.model)
    compat = route == "tgi_compat"
    response: web.StreamResponse
    try:
        inputs, stream, parameters = await read_body(request, compat)
    except TgiRejection as exc:
        state.rejected += 1
        info.status = exc.status
        info.error_code = exc.code
        return web.Response(text=exc.message, status=exc.status, content_type="text/plain")
    stream = stream if compat else route == "tgi_generate_stream"
    info.stream = stream
    try:
        params = validate_parameters(inputs, stream, parameters, compat)
        await settle_size(params, parameters, state.config, state.counter)
    except TgiError as exc:
        state.rejected += 1
        info.error_code = exc.error_type
        response = await _error_response(request, exc, stream)
        info.status = response.status
        return response
    info.max_tokens = params.max_new_tokens
    info.prompt_tokens = params.prompt_tokens
    info.continued = inputs

    try:
        seq = engine.submit(params.prompt_tokens, params.max_new_tokens, params.blocks)
    except EngineStopped:
        response = await _error_response(request, _TGI_STOPPING, stream)
        info.status = response.status
        return response
    info.seq = seq
    try:
        if stream:
            response = await _stream(request, params, seq)
        else:
            response = await _complete(params, seq, info.arrival, state, compat)
    except EngineStopped:
        response = _json_response(_TGI_STOPPING.body(), _TGI_STOPPING.status)
    finally:
        # Cancelled (client gone), failed write, or engine stop: free the batch slot now.
        engine.abort(seq)
    info.status = response.status
    return response


async def _error_response(request: web.Request, exc: TgiError, stream: bool) -> web.StreamResponse:
    if not stream:
        return _json_response(exc.body(), exc.status)
    # TGI's streaming routes have sent their 200 and headers before validating: the error
    # is the stream's one event.
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    try:
        await response.write(_sse(exc.body()))
        await response.write_eof()
    except ConnectionResetError:
        pass
    return response


async def _complete(
    params: TgiParams, seq: Sequence, received: float, state: SimulatorState, compat: bool
) -> web.Response:
    tokens: list[dict[str, Any]] = []
    while True:
        event = await seq.next_event()
        tokens.append(_token(event.text))
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
                prefill = _prefill(encoding, params.inputs, params.truncate)
            else:
                prefill = await asyncio.to_thread(
                    _prefill, encoding, params.inputs, params.truncate
                )
        body["details"] = {
            "finish_reason": event.finish_reason,
            "generated_tokens": seq.generated,
            "seed": params.seed,
            "prefill": prefill,
            "tokens": tokens,
        }
    return _json_response(
        [body] if compat else body, headers=_timing_headers(params, seq, received)
    )


def _timing_headers(params: TgiParams, seq: Sequence, received: float) -> dict[str, str]:
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


async def _stream(request: web.Request, params: TgiParams, seq: Sequence) -> web.StreamResponse:
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
        await _write_events(response, params, seq)
    except ConnectionResetError:
        pass  # the client left; the caller aborts the sequence
    return response


async def _write_events(response: web.StreamResponse, params: TgiParams, seq: Sequence) -> None:
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
            await response.write(_sse(_TGI_STOPPING.body()))
            await response.write_eof()
            return
        index += 1
        texts.append(event.text)
        payload: dict[str, Any] = {
            "index": index,
            "token": _token(event.text),
            "generated_text": None,
            "details": None,
        }
        if event.finish_reason is None:
            await response.write(_sse(payload))
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
        await response.write(_sse(payload))
        break
    await response.write_eof()
