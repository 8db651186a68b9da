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
    from gateway.tools import sim_tgi  # its handlers import this module's state types

    app.router.add_post("/generate", sim_tgi.tgi_generate)
    app.router.add_post("/generate_stream", sim_tgi.tgi_generate_stream)
    app.router.add_post("/", sim_tgi.tgi_compat_generate)
    app.router.add_get("/info", sim_tgi.tgi_info)
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
