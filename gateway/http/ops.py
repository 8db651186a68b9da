"""Operational routes: liveness, readiness, Prometheus metrics."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.state import GATEWAY


async def healthz(request: web.Request) -> web.Response:
    """The process is up and its loop answers."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready to take traffic: the tokenizer is loaded and a backend is configured."""
    state = request.app[GATEWAY]
    if not state.pool.backends:
        return web.json_response({"status": "not_ready", "reason": "no backend"}, status=503)
    return web.json_response({"status": "ready", "backends": len(state.pool.backends)})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    return web.Response(
        body=generate_latest(state.metrics.registry),
        headers={"Content-Type": CONTENT_TYPE_LATEST},
    )
