"""One command line: serve | simulate | check-config | loadgen | analyze.

`serve` with no backend configured starts the built-in simulator in a child
process, so `make run` shows a working gateway on a fresh machine.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from aiohttp import web

from gateway.admission.tokens import EncodingUnavailable
from gateway.config import (
    BackendSettings,
    ConfigError,
    Settings,
    consistency_warnings,
    load_settings,
)
from gateway.http.door import DoorSite
from gateway.observability.logs import make_logger

SIMULATOR_START_TIMEOUT_S = 20.0
#: Net new container objects before the collector's young pass (CPython's default: 700).
#: Requests in flight hold hundreds each, so a burst of 64 crossed 700 again and again
#: and paid 0.1-2 ms pauses mid-admission (101 of them in 10 s of synchronized waves,
#: and a 27 ms full pass); at 10,000 the same run had one. Cycles are still collected:
#: 10,000 young objects are about a megabyte.
GC_YOUNG_THRESHOLD = 10_000
#: At shutdown, after the drain: the longest a request's handler may still take.
SHUTDOWN_GRACE_S = 5.0
#: The distribution name in pyproject.toml, whose metadata holds the version.
PACKAGE = "llm-tail-gateway"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-gateway", description="LLM tail-latency gateway (OpenAI-compatible)."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gateway")
    _add_config_arguments(serve)
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8080)")
    serve.add_argument(
        "--backend",
        action="append",
        metavar="URL",
        help="backend base URL, e.g. http://127.0.0.1:8000 (repeatable; replaces [[backends]])",
    )

    from gateway.tools import simulator

    simulate = commands.add_parser("simulate", help="run the continuous-batching backend simulator")
    simulator.add_arguments(simulate)

    check = commands.add_parser("check-config", help="print the effective config and warnings")
    _add_config_arguments(check)
    check.add_argument(
        "--probe",
        action="store_true",
        help="also ask each backend what it is and measure its prefill (a few one-token "
        "requests), and say which lane deadlines the engine cannot meet",
    )
    check.add_argument(
        "--nginx",
        metavar="FILE",
        help="also read this nginx config (in front of the gateway) and warn where its "
        "timeouts, body size or buffering do not fit the gateway's",
    )
    api_doc = commands.add_parser(
        "api-doc", help="write the API page for callers (Markdown) from the effective config"
    )
    _add_config_arguments(api_doc)
    api_doc.add_argument("--output", metavar="FILE", help="write it here (default: stdout)")

    from gateway.tools import analyze, loadgen

    load = commands.add_parser("loadgen", help="send mixed traffic and measure TTFT, e2e, errors")
    loadgen.add_arguments(load)
    report = commands.add_parser(
        "analyze", help="read the gateway's log: is P99 slow in the queue or in the model?"
    )
    analyze.add_arguments(report)
    from gateway.tools import replay

    replayed = commands.add_parser(
        "replay", help="replay traffic in virtual time: direct to engines vs through the gateway"
    )
    replay.add_arguments(replayed)
    from gateway.tools import matrix

    matrixed = commands.add_parser(
        "matrix",
        help="the defaults on a matrix of engines, mixes and loads in virtual time: direct, "
        "gateway and the ideal scheduler against the engine floor",
    )
    matrix.add_arguments(matrixed)
    # On the command and every subcommand, so whatever a user typed, `--version` after it
    # answers (a bug report names the version it ran).
    for command in (parser, *commands.choices.values()):
        command.add_argument("--version", action="version", version=f"{PACKAGE} {version()}")
    return parser


def version() -> str:
    """The installed package's version: the one place it is written is pyproject.toml."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:  # run from a tree that was never installed
        return "unknown (not installed)"


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=os.environ.get("GATEWAY_CONFIG"),
        help="TOML config file (default: $GATEWAY_CONFIG; built-in defaults when unset)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("simulate", "loadgen", "analyze", "replay", "matrix"):
        from gateway.tools import analyze, loadgen, matrix, replay, simulator

        tool = {
            "simulate": simulator,
            "loadgen": loadgen,
            "analyze": analyze,
            "replay": replay,
            "matrix": matrix,
        }[args.command]
        return int(tool.main(args))
    overrides = {
        "server.host": getattr(args, "host", None),
        "server.port": getattr(args, "port", None),
        "backends": getattr(args, "backend", None),
    }
    try:
        settings = load_settings(args.config, overrides=overrides)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"config error: {problem}", file=sys.stderr)
        return 2
    if args.command == "check-config":
        from gateway.checks.probe import probe_backends
        from gateway.checks.settings import check_config

        status = check_config(settings)
        if status == 0 and args.probe:
            status = probe_backends(settings)
        if status == 0 and args.nginx:
            from gateway.checks.nginx import check_nginx_file

            status = check_nginx_file(settings, args.nginx)
        return status
    if args.command == "api-doc":
        from gateway.apidoc import write_page

        return write_page(settings, args.config, args.output)
    return serve(
        settings,
        reload=lambda: load_settings(args.config, overrides=overrides),
        config_path=args.config,
    )


def serve(
    settings: Settings,
    reload: Callable[[], Settings] | None = None,
    config_path: str | None = None,
) -> int:
    """Run the gateway until SIGTERM; `reload` reads the config again (SIGHUP)."""
    log = make_logger(sys.stderr, settings.logging.level)
    settings = _with_state_file(settings)
    simulator: subprocess.Popen[bytes] | None = None
    simulator_url = ""

    def reload_as_started() -> Settings:
        """The config read again, completed as at start (the state file, the simulator)."""
        assert reload is not None
        fresh = _with_state_file(reload())
        return (
            _with_backend(fresh, simulator_url) if simulator_url and not fresh.backends else fresh
        )

    try:
        if not settings.backends:
            simulator, url = start_simulator_process(settings.server.host)
            simulator_url = url
            settings = _with_backend(settings, url)
            log.warning(
                "no_backend_configured",
                simulator=url,
                hint="pass --backend URL to use a real model server",
            )
        from gateway.app import build_app

        try:
            app = build_app(
                settings,
                reload=reload_as_started if reload is not None else None,
                config_path=config_path,
            )
        except EncodingUnavailable as exc:
            print(f"startup error: {exc}", file=sys.stderr)
            return 2
        for warning in consistency_warnings(settings):
            log.warning("config_warning", detail=warning)
        try:
            with asyncio.Runner(loop_factory=_loop_factory(settings)) as runner:
                runner.run(_run(app, settings, log))
        except CannotListen as exc:
            print(f"startup error: {exc}", file=sys.stderr)
            return 2
        return 0
    finally:
        if simulator is not None:
            simulator.terminate()
            try:
                simulator.wait(timeout=5)
            except subprocess.TimeoutExpired:
                simulator.kill()


def _with_state_file(settings: Settings) -> Settings:
    """The learned state's default file where the config names none."""
    if settings.health.state_file:
        return settings
    from gateway.upstream.learned_state import default_path

    health = msgspec.structs.replace(settings.health, state_file=str(default_path()))
    return msgspec.structs.replace(settings, health=health)


def _with_backend(settings: Settings, url: str) -> Settings:
    return msgspec.structs.replace(settings, backends=[BackendSettings(url=url, name="simulator")])


def _loop_factory(settings: Settings) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when asked for and installed; else asyncio's default."""
    if not settings.server.uvloop:
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _run(app: web.Application, settings: Settings, log: Any) -> None:
    from gateway.state import GATEWAY

    # handler_cancellation: a client that goes away cancels its handler at once (and so
    # the backend request).
    # shutdown_timeout: after `drain` (which cut what was still running at its deadline),
    # how long a handler left may take before it is cancelled (aiohttp's 60 s would keep a
    # pod past its grace period, and its slot leases past their TTL).
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    server = settings.server
    # The site builds the client connections (http/door.py: the header deadline), so it
    # takes their settings. auto_decompress off: compressed bodies are refused with 415
    # by the handler rather than decoded (or rejected in plain text) by aiohttp.
    site = DoorSite(
        runner,
        server.host,
        server.port,
        header_timeout_s=server.header_timeout_s,
        closed=app[GATEWAY].metrics.connections_closed,
        backlog=2048,
        keepalive_timeout=server.keepalive_timeout_s,
        access_log=None,
        auto_decompress=False,
    )
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()  # the app's cleanup_ctx closes its client sessions
        raise CannotListen(server.host, server.port, exc) from None
    # Everything built so far lives as long as the process: out of the collector's sight,
    # so a full collection under load scans only what requests allocate.
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD)
    log.info(
        "gateway_started",
        event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0],
        url=f"http://{settings.server.host}:{settings.server.port}",
        backends=[b.url or f"dns:{b.dns}" for b in settings.backends],
        lanes=[lane.name for lane in settings.lanes],
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # SIGHUP: the config read again and applied to new requests (`reload.py`).
    loop.add_signal_handler(signal.SIGHUP, app[GATEWAY].reloader.request, "sighup")
    await stop.wait()
    from gateway.app import drain

    left = await drain(app, settings.server.drain_timeout_s)
    log.info("gateway_stopping", in_flight_cut=left)
    await runner.cleanup()


class CannotListen(Exception):
    """`serve` could not open its port: one line naming the address, not a traceback."""

    def __init__(self, host: str, port: int, error: OSError) -> None:
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        # The OS's reason, without asyncio's "error while attempting to bind on ...".
        reason = os.strerror(error.errno) if error.errno and error.errno > 0 else error.strerror
        super().__init__(f"cannot listen on {address}: {(reason or str(error)).lower()}")


def start_simulator_process(host: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start `python -m gateway simulate` on a free port; return it and its URL.

    The child ends with this process however it ends (`tools/child.py`): `serve`'s own
    `finally` stops it on a clean exit, but nothing of ours runs on a SIGKILL.
    """
    from gateway.tools.child import die_with_parent

    with socket.socket() as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "simulate", "--host", host, "--port", str(port)],
        stdout=sys.stderr,
        preexec_fn=die_with_parent(),
    )
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + SIMULATOR_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the built-in simulator exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return process, url
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit("the built-in simulator did not start within 20 s")
