"""The simulator's OpenAI API, shaped after vLLM's server: chat and text completions, models.

Close enough to vLLM's OpenAI-compatible server for the gateway, the `openai`
SDK and load generators: the same response and chunk shapes, the usage chunk
only when `stream_options.include_usage` asks for it, `max_completion_tokens`
winning over `max_tokens`, and a 400 in the OpenAI envelope when prompt +
max_tokens exceed the context window. A streamed answer sends its headers at
once and its first data event only with the first token, as vLLM does, so
time-to-first-token measured through the gateway is the engine's.

The usage carries `prompt_tokens_details.cached_tokens`, the prompt tokens the
engine's prefix cache served, always (0 on a miss, 0 with the cache off), as
OpenAI and llama.cpp's server do; vLLM adds it only under
`--enable-prompt-tokens-details` and only when non-zero, so a gateway must read
its absence as "not reported".

With the `timings` knob at "llamacpp", every answer also carries llama.cpp's
`timings` object (`prompt_n`, `prompt_ms`, `cache_n`, `predicted_n`,
`predicted_ms` and their rates): in the non-streamed body and on the stream's
last event (the usage chunk when asked for, else the one with `finish_reason`),
where llama.cpp's server puts it. Its figures are the engine's own: prefill from
admission into the batch to the first token, decode from there to the last.

With LoRA serving on, `/v1/models` lists each adapter after the base model with
`parent` = the base model and `root` = its path, a request naming an adapter as its
`model` runs with it, and vLLM's dynamic loading API adds and removes adapters:
`POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}` and
`POST /v1/unload_lora_adapter` `{"lora_name"}`, answering vLLM's plain-text success
line or its 400/404 errors. A model that is neither the base nor a served adapter
is then a 404, as vLLM answers it.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.tools.simulator.config import OWNED_BY
from gateway.tools.simulator.engine import EngineStopped, Sequence, TokenEvent
from gateway.tools.simulator.errors import SimulatorError, invalid_request
from gateway.tools.simulator.prefix_cache import PromptBlocks
from gateway.tools.simulator.state import CONFIG_KEY, STATE_KEY, Route, SimulatorState
from gateway.tools.simulator.tokens import chat_prompt_parts, completion_prompt_parts


def add_routes(app: web.Application) -> None:
    """`/v1/chat/completions`, `/v1/completions` and `/v1/models`."""
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    if app[CONFIG_KEY].pose_as != "tgi":  # TGI's info route is /info
        app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/load_lora_adapter", _load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", _unload_lora_adapter)


@dataclass(slots=True)
class _Params:
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int
    prompt_tokens: int
    blocks: PromptBlocks
    adapter: str | None = None
    #: What it was asked to continue, and how (`RequestInfo.continued`).
    continued: str | None = None
    continue_form: str | None = None
    #: The request's `seed`: the same seed, the same words (as vLLM samples with it).
    seed: int | None = None


async def _models(request: web.Request) -> web.Response:
    config = request.app[CONFIG_KEY]
    adapters = request.app[STATE_KEY].engine.adapters
    created = int(time.time())
    owned_by = OWNED_BY[config.pose_as]
    cards: list[dict[str, Any]] = [
        {
            "id": config.model,
            "object": "model",
            "created": created,
            "owned_by": owned_by,
            "root": config.model,
            "parent": None,
            "max_model_len": config.max_model_len,
        }
    ]
    for name, path in adapters.served.items() if adapters is not None else ():
        # vLLM's card of an adapter: its path as root, the base model as parent.
        cards.append(
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": owned_by,
                "root": path,
                "parent": config.model,
                "max_model_len": None,
            }
        )
    return web.json_response({"object": "list", "data": cards})


async def _lora_body(request: web.Request, *keys: str) -> dict[str, str]:
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise invalid_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict) or not all(
        isinstance(body.get(k), str) and body[k] for k in keys
    ):
        names = " and ".join(f"'{k}'" for k in keys)
        raise invalid_request(f"{names} must be provided.")
    return {k: body[k] for k in keys}


async def _load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's `POST /v1/load_lora_adapter`: serve one more adapter from now on."""
    adapters = request.app[STATE_KEY].engine.adapters
    try:
        if adapters is None:
            raise invalid_request("LoRA is not enabled on this server (--enable-lora).")
        body = await _lora_body(request, "lora_name", "lora_path")
        name = body["lora_name"]
        if name == request.app[CONFIG_KEY].model or not adapters.load(name, body["lora_path"]):
            raise invalid_request(f"The lora adapter '{name}' has already been loaded.")
    except SimulatorError as exc:
        return _error_response(exc)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def _unload_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's `POST /v1/unload_lora_adapter`: stop serving an adapter."""
    adapters = request.app[STATE_KEY].engine.adapters
    try:
        if adapters is None:
            raise invalid_request("LoRA is not enabled on this server (--enable-lora).")
        name = (await _lora_body(request, "lora_name"))["lora_name"]
        if not adapters.unload(name):
            raise SimulatorError(
                404, "not_found", f"The lora adapter '{name}' cannot be found.",
                error_type="NotFoundError",
            )  # fmt: skip
    except SimulatorError as exc:
        return _error_response(exc)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completions")


async def _generate(request: web.Request, route: Route) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    engine = state.engine
    info = state.receive(request, route)
    try:
        params = await _parse(request, route, state)
    except SimulatorError as exc:
        state.rejected += 1
        info.status = exc.status
        info.error_code = exc.code
        return _error_response(exc)
    info.model = params.model
    state.by_model[params.model] = state.by_model.get(params.model, 0) + 1
    info.stream = params.stream
    info.max_tokens = params.max_tokens
    info.include_usage = params.include_usage
    info.prompt_tokens = params.prompt_tokens
    info.continued, info.continue_form = params.continued, params.continue_form

    response: web.StreamResponse
    try:
        seq = engine.submit(
            params.prompt_tokens,
            params.max_tokens,
            params.blocks,
            adapter=params.adapter,
            seed=params.seed,
        )
    except EngineStopped:
        response = _error_response(_STOPPING)
        info.status = response.status
        return response
    info.seq = seq
    try:
        if params.stream:
            response = await _stream(request, route, params, seq)
        else:
            llamacpp = request.app[CONFIG_KEY].timings == "llamacpp"
            response = await _complete(route, params, seq, llamacpp)
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
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # too deep: not ours to parse
        raise invalid_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid_request("request body must be a JSON object")

    model = body.get("model")
    if model is None:
        model = state.config.model
    elif not isinstance(model, str):
        raise invalid_request("'model' must be a string", "model")
    adapters = state.engine.adapters
    adapter = model if adapters is not None and adapters.serves(model) else None
    strict = adapters is not None or state.config.strict
    if strict and adapter is None and model != state.config.model:
        raise SimulatorError(
            404, "model_not_found", f"The model `{model}` does not exist.",
            param="model", error_type="NotFoundError",
        )  # fmt: skip

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
        continued, continue_form = _continuation(body)
    else:
        if "prompt" not in body:
            raise invalid_request("'prompt' is required", "prompt")
        parts = completion_prompt_parts(body["prompt"])
        continued = body["prompt"] if isinstance(body["prompt"], str) else None
        continue_form = None
    # The ids a backend with its own tokenizer would see (token_ratio), not tiktoken's, and
    # their blocks for the prefix cache.
    blocks = await state.counter.encode_async(parts, state.config.backend_prompt)
    prompt_tokens = blocks.tokens

    limit = state.config.max_model_len
    if prompt_tokens + max_tokens > limit:
        raise SimulatorError(
            400,
            "context_length_exceeded",
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} "
            "in the completion). Please reduce the length of the prompt or completion.",
            param="max_tokens",
        )
    seed = body.get("seed")
    if seed is not None and type(seed) is not int:
        raise invalid_request("'seed' must be an integer", "seed")
    return _Params(
        model, stream, include_usage, max_tokens, prompt_tokens, blocks, adapter,
        continued, continue_form, seed,
    )  # fmt: skip


def _continuation(body: dict[str, Any]) -> tuple[str | None, str | None]:
    """The assistant text a chat asks to be continued, and the form it asked in.

    vLLM's and SGLang's form: `continue_final_message: true` with
    `add_generation_prompt: false` (vLLM refuses the two together, and the first without
    a last assistant message). llama.cpp's: a last assistant message, continued by
    default. Either way the answer goes on from that text (the simulator's words are
    random; a test compares what it was given with what the client had).
    """
    flag = body.get("continue_final_message", False)
    if not isinstance(flag, bool):
        raise invalid_request(
            "'continue_final_message' must be a boolean", "continue_final_message"
        )
    generation_prompt = body.get("add_generation_prompt", True)
    messages = body["messages"]
    last = messages[-1] if isinstance(messages, list) and messages else None
    is_assistant = isinstance(last, dict) and last.get("role") == "assistant"
    if flag and generation_prompt:
        raise invalid_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    if flag and not is_assistant:
        raise invalid_request(
            "continue_final_message requires the last message to be from the assistant."
        )
    if not is_assistant:
        return None, None
    content = last.get("content") if isinstance(last, dict) else None
    text = content if isinstance(content, str) else None
    return text, "continue_final_message" if flag else "last_assistant"


_STOPPING = SimulatorError(503, "engine_stopped", "the simulator is stopping")


def _error_response(exc: SimulatorError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


def _usage(params: _Params, seq: Sequence) -> dict[str, Any]:
    return {
        "prompt_tokens": params.prompt_tokens,
        "completion_tokens": seq.generated,
        "total_tokens": params.prompt_tokens + seq.generated,
        "prompt_tokens_details": {"cached_tokens": seq.cached_tokens},
    }


def _timings(seq: Sequence) -> dict[str, Any]:
    """llama.cpp's `timings` of a completed sequence (`result_timings::to_json`)."""
    times = seq.times()
    prefill_s, decode_s = (times[1], times[2]) if times is not None else (0.0, 0.0)
    prompt_n = max(0, seq.prefill_target - seq.cached_tokens)
    prompt_ms, predicted_ms = prefill_s * 1000.0, decode_s * 1000.0
    return {
        "cache_n": seq.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": round(prompt_ms, 3),
        "prompt_per_token_ms": round(prompt_ms / prompt_n, 3) if prompt_n else 0.0,
        "prompt_per_second": round(1000.0 * prompt_n / prompt_ms, 3) if prompt_ms else 0.0,
        "predicted_n": seq.generated,
        "predicted_ms": round(predicted_ms, 3),
        "predicted_per_token_ms": round(predicted_ms / seq.generated, 3) if seq.generated else 0.0,
        "predicted_per_second": round(1000.0 * seq.generated / predicted_ms, 3)
        if predicted_ms
        else 0.0,
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
        llamacpp = request.app[CONFIG_KEY].timings == "llamacpp"
        await _write_events(response, chat, head, params, seq, llamacpp)
    except ConnectionResetError:
        pass  # the client left; the caller aborts the sequence
    return response


async def _write_events(
    response: web.StreamResponse,
    chat: bool,
    head: dict[str, Any],
    params: _Params,
    seq: Sequence,
    llamacpp: bool,
) -> None:
    first = True
    while True:
        try:
            event = await seq.next_event()
        except EngineStopped:
            await response.write(_sse(_STOPPING.body()))
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
        chunk = {**head, "choices": [_stream_choice(chat, event)]}
        if event.finish_reason is not None:
            break
        await response.write(_sse(chunk))
    # llama.cpp puts its timings on the stream's last event.
    last = {**head, "choices": [], "usage": _usage(params, seq)} if params.include_usage else None
    if llamacpp:
        (last if last is not None else chunk)["timings"] = _timings(seq)
    await response.write(_sse(chunk))
    if last is not None:
        await response.write(_sse(last))
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


async def _complete(route: Route, params: _Params, seq: Sequence, llamacpp: bool) -> web.Response:
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
    body = {
        "id": _completion_id(route),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": params.model,
        "choices": [choice],
        "usage": _usage(params, seq),
    }
    if llamacpp:
        body["timings"] = _timings(seq)
    return web.json_response(body)


def _completion_id(route: Route) -> str:
    return ("chatcmpl-" if route == "chat" else "cmpl-") + uuid.uuid4().hex
