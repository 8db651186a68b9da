"""Operational routes: liveness, readiness, Prometheus metrics, what was learned."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.fleet.leases import describe as describe_leases
from gateway.http.errors import error_response
from gateway.outcomes import Refusal
from gateway.state import GATEWAY


async def healthz(request: web.Request) -> web.Response:
    """The process is up and its loop answers."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready to take traffic: the tokenizer is loaded, the first health checks (and model
    listings) are done, and a backend is available."""
    state = request.app[GATEWAY]
    if state.draining:
        return web.json_response({"status": "not_ready", "reason": "shutting down"}, status=503)
    if state.warming_up:
        return web.json_response(
            {"status": "not_ready", "reason": "measuring the backends' speed"}, status=503
        )
    pools = state.pools.pools
    if not state.backends_read:
        # The first checks read what each engine serves (`upstream/served.py`): ready
        # before that, a model's first requests could go to a backend without it.
        if not all(each.health.checked for each in pools):
            return web.json_response(
                {"status": "not_ready", "reason": "reading what the backends serve"}, status=503
            )
        state.backends_read = True
    if not any(each.pool.has_available() for each in pools):
        configured = any(each.pool.backends for each in pools)
        reason = "no healthy backend" if configured else "no backend configured"
        return web.json_response({"status": "not_ready", "reason": reason}, status=503)
    available = [
        b.name for each in pools for b in each.pool.backends if b.available(each.pool.clock())
    ]
    return web.json_response({"status": "ready", "backends": available})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    state.write_finished()  # the requests that just ended count in this scrape
    return web.Response(
        body=generate_latest(state.metrics.registry),
        headers={"Content-Type": CONTENT_TYPE_LATEST},
    )


async def debug_backends(request: web.Request) -> web.Response:
    """What the gateway knows and learned of each backend, and the lanes' fitted figures.

    Guarded like the pass-through GETs: with API keys configured, it needs one.
    """
    state = request.app[GATEWAY]
    try:
        state.keys.identify(request.headers.get("Authorization"))
    except Refusal as refusal:
        return error_response(refusal)
    limits = state.limits
    backends: list[dict[str, Any]] = []
    # The default pool's backends first, then the others'; each with its pool's leases.
    default = state.pools.default
    for each in [default, *(p for p in state.pools.pools if p is not default)]:
        described = each.sizer.describe()
        leases = None if state.fleet is None else state.fleet.leases_of(each.name)
        if leases is not None:
            for one, backend in zip(described, each.pool.backends, strict=True):
                one["fleet"] = describe_leases(leases, backend)
        backends += described
    return web.json_response(
        {
            "backends": backends,
            "pools": [
                {
                    "name": each.name,
                    "serves": sorted(each.serves) or None,
                    "default": each is state.pools.default,
                    "backends": [b.name for b in each.pool.backends],
                    "lanes": each.sizer.describe_lanes(),
                    "limits": {
                        "max_prompt_tokens": each.sizer.limits_in_force.max_prompt_tokens,
                        "context_window": each.sizer.limits_in_force.context_window,
                    },
                }
                for each in state.pools.pools
            ],
            "aliases": {name: dict(targets) for name, targets in state.pools.aliases.items()},
            "lanes": state.sizer.describe_lanes(),
            "fair_share": {
                "enabled": state.settings.tenants.fair_share,
                "output_token_weight": round(state.scheduler.cost.output_weight, 3),
            },
            "limits": {
                "max_prompt_tokens": limits.max_prompt_tokens,
                "context_window": limits.context_window,
            },
        },
        dumps=lambda obj: msgspec.json.encode(obj).decode(),
    )
