"""The simulator as an aiohttp app: one engine and one counter behind both APIs.

This is the one module that knows about both the OpenAI and the TGI routes, so
neither API module needs the other. It also owns the lifecycle (the engine and
the tokenizer live exactly as long as the app) and the simulator's own routes:
`/health`, and `/sim/stats` and `/sim/requests`, which let tests check what the
gateway actually forwarded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from gateway.tools.simulator import openai_api, tgi_api
from gateway.tools.simulator.config import SimulatorConfig
from gateway.tools.simulator.engine import Engine
from gateway.tools.simulator.state import CONFIG_KEY, STATE_KEY, SimulatorState
from gateway.tools.simulator.tokens import ENCODING_NAME, PromptCounter, load_encoding

MAX_BODY_BYTES = 64 * 1024 * 1024
#: Seconds `runner.cleanup()` waits for handlers; they end at once when the engine stops.
SHUTDOWN_TIMEOUT_S = 5.0


def build_simulator_app(config: SimulatorConfig) -> web.Application:
    """The simulator as an aiohttp app; the engine and tokenizer live for the app's lifetime."""
    # Long prompts are the point of the simulator: allow bodies far above aiohttp's 1 MiB default.
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[CONFIG_KEY] = config
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_stop_engine)
    openai_api.add_routes(app)
    tgi_api.add_routes(app)
    app.router.add_get("/health", _health)
    app.router.add_get("/sim/stats", _stats)
    app.router.add_get("/sim/requests", _requests)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG_KEY]
    counter = PromptCounter(load_encoding(ENCODING_NAME))
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


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _stats(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return web.json_response(
        {"received": state.received, "rejected": state.rejected, **state.engine.stats()}
    )


async def _requests(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return web.json_response({"requests": [info.to_json() for info in state.requests]})
