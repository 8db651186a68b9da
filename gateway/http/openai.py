"""OpenAI-compatible routes: parse, admit, queue, relay. No policy lives here."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from aiohttp import web

from gateway.admission.admit import CHAT, COMPLETION, Admission, admit, measure_openai
from gateway.errors import GatewayError, invalid_request
from gateway.http.errors import error_response
from gateway.observability.record import RequestRecord
from gateway.state import GATEWAY, GatewayState
from gateway.upstream.relay import RelayPlan, relay

MAX_REQUEST_ID_LENGTH = 128


def request_id_of(request: web.Request) -> str:
    """The client's x-request-id when it is sane, else a new one."""
    given = request.headers.get("x-request-id")
    if given and len(given) <= MAX_REQUEST_ID_LENGTH and given.isprintable():
        return given
    return uuid.uuid4().hex


async def read_json_object(request: web.Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object; 413 before reading when it is too big, 400 when not JSON."""
    length = request.content_length
    if length is not None and length > max_bytes:
        raise body_too_large(max_bytes)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(max_bytes) from None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise invalid_request("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    return body


def body_too_large(max_bytes: int) -> GatewayError:
    return GatewayError(413, "body_too_large", f"The request body is over {max_bytes} bytes.")


def admission_headers(admission: Admission) -> dict[str, str]:
    headers = {
        "x-gateway-lane": admission.lane.name,
        "x-gateway-max-tokens": str(admission.budget.max_tokens),
    }
    if admission.budget.clamped:
        headers["x-gateway-max-tokens-clamped-from"] = str(admission.budget.requested)
    return headers


def queue_headers(queue_ms: float | None) -> dict[str, str]:
    if queue_ms is None:
        return {}
    return {"x-gateway-queue-ms": f"{queue_ms:.1f}", "Server-Timing": f"queue;dur={queue_ms:.1f}"}


async def proxy_openai(
    request: web.Request, state: GatewayState, kind: str, path: str
) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    record = RequestRecord(request_id_of(request), request.path, loop.time())
    headers = {"x-request-id": record.request_id}
    grant = None
    try:
        body = await read_json_object(request, state.settings.server.max_body_bytes)
        shape = await measure_openai(body, kind, state.settings, state.counter)
        record.model = shape.model
        record.stream = shape.stream
        record.prompt_tokens = shape.prompt_tokens
        record.max_tokens_requested = shape.requested_max_tokens
        headers["x-gateway-prompt-tokens"] = str(shape.prompt_tokens)
        admission = admit(shape, state.settings)
        record.lane = admission.lane.name
        record.max_tokens = admission.budget.max_tokens
        headers.update(admission_headers(admission))

        record.enqueued = loop.time()
        grant = await state.scheduler.acquire(admission.lane.name, shape.prompt_tokens)
        record.dispatched = loop.time()
        record.backend = grant.slot.backend.name
        headers.update(queue_headers(record.queue_ms))
        held = grant
        plan = RelayPlan(
            backend=grant.slot.backend,
            path=path,
            body=json.dumps(admission.backend_body).encode(),
            headers={
                "Content-Type": "application/json",
                "Accept": "text/event-stream" if shape.stream else "application/json",
                "X-Request-Id": record.request_id,
            },
            stream=shape.stream,
            strip_usage=not shape.client_wants_usage,
            response_headers=headers,
            on_first_byte=lambda: state.scheduler.prefill_done(held),
        )
        return await relay(request, plan, record, state.upstream)
    except GatewayError as error:
        record.status = error.status
        record.outcome = error.outcome
        record.error_code = error.code
        if record.end is None:
            record.end = loop.time()
        headers.update(queue_headers(record.queue_ms))
        return error_response(error, headers)
    except asyncio.CancelledError:
        if record.outcome is None:
            record.outcome = "client_disconnected"
        if record.status is None:
            record.status = 499  # nothing was sent: nginx's code for "client closed"
        raise
    except Exception:
        record.outcome = "internal_error"
        record.status = 500
        raise
    finally:
        if grant is not None:
            state.scheduler.release(grant)
        record.end = loop.time()
        state.finish(record)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await proxy_openai(request, request.app[GATEWAY], CHAT, "/v1/chat/completions")


async def completions(request: web.Request) -> web.StreamResponse:
    return await proxy_openai(request, request.app[GATEWAY], COMPLETION, "/v1/completions")


async def models(request: web.Request) -> web.Response:
    """The model list of the first backend, passed through."""
    state = request.app[GATEWAY]
    backend = state.pool.any_backend()
    if backend is None:
        return error_response(GatewayError(503, "no_backend", "No backend is configured."))
    try:
        response = await state.upstream.get(
            backend, "/v1/models", {"X-Request-Id": request_id_of(request)}
        )
    except GatewayError as error:
        return error_response(error)
    async with response:
        body = await response.read()
        return web.Response(
            status=response.status,
            body=body,
            content_type=response.content_type or "application/json",
        )
