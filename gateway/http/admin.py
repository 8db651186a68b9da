"""Operator routes that change what the gateway does: drain a backend, and undo it;
reload the config (`POST /admin/reload`, as SIGHUP: `reload.py`).

`POST /admin/backends/{name}/drain` is how a model server is rolled without a
broken answer: the backend gets no new request at once; its streams finish
where they are, and any still running at the drain deadline (`?deadline_s=`,
else [resume] drain_timeout_s) are carried over to another backend of their
pool and cut there (`upstream/resume.py`). With `?wait=true` the answer comes
when the backend is idle (or the deadline passed): a Kubernetes preStop hook
calls it so the engine's pod ends only once nothing runs on it. The drain ends
with `POST /admin/backends/{name}/undrain`, or by itself when the backend comes
back from a failed health check (the restarted engine).

Who may call them: with [[api_keys]], a key with `admin = true`; without keys,
only a caller on this host (loopback), so that an open gateway cannot be
drained from outside.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math

from aiohttp import web

from gateway.http.errors import error_response
from gateway.outcomes import InvalidRequest, Outcome, Refusal, Unauthorized
from gateway.state import GATEWAY, GatewayState
from gateway.upstream.pool import Backend, BackendPool

#: With `?wait=true`, how long past its deadline the answer waits for the streams that
#: were handed over to leave the backend.
WAIT_GRACE_S = 5.0
WAIT_STEP_S = 0.1


class NoSuchBackend(Refusal):
    code = "not_found"
    outcome = Outcome.REJECTED_INVALID_REQUEST


def _admin_refusal(request: web.Request, state: GatewayState) -> Refusal | None:
    try:
        key = state.keys.identify(request.headers.get("Authorization"))
    except Refusal as refusal:
        return refusal
    if key is not None:
        return None if key.admin else Unauthorized("This API key may not use the admin routes.")
    try:
        local = request.remote is not None and ipaddress.ip_address(request.remote).is_loopback
    except ValueError:
        local = False
    if local:
        return None
    return Unauthorized(
        "The admin routes need an admin API key ([[api_keys]] admin = true); without keys "
        "they answer only on this host."
    )


def _backends_named(state: GatewayState, name: str) -> list[tuple[BackendPool, Backend]]:
    return [
        (each.pool, backend)
        for each in state.pools.pools
        for backend in each.pool.backends
        if backend.name == name
    ]


def _deadline_s(request: web.Request, default: float) -> float:
    given = request.query.get("deadline_s")
    if given is None:
        return default
    try:
        value = float(given)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 3600:
        raise InvalidRequest("deadline_s must be a number of seconds from 0 to 3600.")
    return value


def _target(
    request: web.Request,
) -> tuple[GatewayState, str, list[tuple[BackendPool, Backend]], Refusal | None]:
    """The gateway's state, the backend name asked for, the (pool, backend) pairs of that
    name, and the refusal when the caller may not ask or no backend has it."""
    state = request.app[GATEWAY]
    refusal = _admin_refusal(request, state)
    name = request.match_info["name"]
    found = _backends_named(state, name)
    if refusal is None and not found:
        refusal = NoSuchBackend(f"No backend is named '{name}'.")
    return state, name, found, refusal


async def drain(request: web.Request) -> web.Response:
    state, name, found, refusal = _target(request)
    try:
        if refusal is not None:
            raise refusal
        deadline_s = _deadline_s(request, state.settings.resume.drain_timeout_s)
    except Refusal as refused:
        return error_response(refused)
    for pool, backend in found:
        pool.drain(backend, deadline_s)
    in_flight = sum(backend.in_flight for _, backend in found)
    state.events.warning(
        "backend_draining", backend=name, deadline_s=deadline_s, in_flight=in_flight
    )
    if request.query.get("wait", "").lower() in ("1", "true", "yes"):
        # Polled: in-flight counts change in the pool, which signals nothing per backend.
        for _ in range(math.ceil((deadline_s + WAIT_GRACE_S) / WAIT_STEP_S)):
            if not any(backend.in_flight for _, backend in found):
                break
            await asyncio.sleep(WAIT_STEP_S)
    return web.json_response(_state_of(name, found, deadline_s))


async def undrain(request: web.Request) -> web.Response:
    state, name, found, refusal = _target(request)
    if refusal is not None:
        return error_response(refusal)
    for pool, backend in found:
        pool.undrain(backend)
    state.events.info("backend_undrained", backend=name)
    return web.json_response(_state_of(name, found, None))


async def reload(request: web.Request) -> web.Response:
    """`POST /admin/reload`: the config read again and applied, as on SIGHUP (`reload.py`).
    200 with what changed; 422 when the file does not load (the config in force stays)."""
    state = request.app[GATEWAY]
    refusal = _admin_refusal(request, state)
    if refusal is not None:
        return error_response(refusal)
    result = await state.reloader.reload("admin")
    return web.json_response(result.to_json(), status=200 if result.ok else 422)


def _state_of(
    name: str, found: list[tuple[BackendPool, Backend]], deadline_s: float | None
) -> dict[str, object]:
    in_flight = sum(backend.in_flight for _, backend in found)
    return {
        "backend": name,
        "draining": any(backend.draining for _, backend in found),
        "deadline_s": deadline_s,
        "in_flight": in_flight,
        "idle": in_flight == 0,
    }
