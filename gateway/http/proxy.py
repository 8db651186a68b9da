"""The path every generation request takes: parse, admit, queue, relay, record.

One function for all API dialects (OpenAI chat and completions, TGI): they
differ only in how the body is measured and shaped, which admission knows,
and in the stream format, which the relay knows. No policy lives here.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from gateway.admission.admit import TGI, Admission, RequestShape, admit
from gateway.admission.auth import check_lane_allowed, lane_override
from gateway.admission.tokens import TokenCounter
from gateway.config import Settings
from gateway.errors import GatewayError, invalid_request
from gateway.http.errors import error_response
from gateway.observability.record import RequestRecord
from gateway.scheduling.scheduler import Grant
from gateway.state import GATEWAY, GatewayState
from gateway.upstream.pool import Backend
from gateway.upstream.relay import STREAM_ERROR_CODE, BackendFailure, RelayPlan, relay

MAX_REQUEST_ID_LENGTH = 128
#: A request that failed before its first byte is retried once, on another backend.
MAX_ATTEMPTS = 2

#: Validates and counts a body: `measure(body, settings, counter)`.
Measure = Callable[[dict[str, Any], Settings, TokenCounter], Awaitable[RequestShape]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Route:
    """One generation route of the gateway and where it goes on the backend."""

    backend_path: str
    measure: Measure


def route_handler(backend_path: str, measure: Measure) -> Handler:
    """An aiohttp handler sending requests measured by `measure` to `backend_path`."""
    route = Route(backend_path, measure)

    async def handle(request: web.Request) -> web.StreamResponse:
        return await proxy(request, request.app[GATEWAY], route)

    return handle


def request_id_of(request: web.Request) -> str:
    """The client's x-request-id when it is sane, else a new one."""
    given = request.headers.get("x-request-id")
    if given and len(given) <= MAX_REQUEST_ID_LENGTH and given.isprintable():
        return given
    return uuid.uuid4().hex


async def read_json_object(
    request: web.Request, max_bytes: int, read_timeout_s: float = 30.0
) -> dict[str, Any]:
    """The body as a JSON object; 413 before reading when it is too big, 400 when not JSON.

    A body declared as something other than JSON gets 415; no Content-Type at all
    is read as JSON (some minimal clients send none).
    """
    content_type = request.headers.get("Content-Type")
    if content_type is not None and not _is_json_type(request.content_type):
        raise GatewayError(
            415,
            "unsupported_media_type",
            "Send the body as JSON with 'Content-Type: application/json'.",
        )
    if request.headers.get("Content-Encoding", "identity").lower() != "identity":
        raise GatewayError(
            415,
            "unsupported_media_type",
            "Compressed request bodies are not accepted; send the JSON as is.",
        )
    length = request.content_length
    if length is not None and length > max_bytes:
        raise body_too_large(max_bytes)
    try:
        async with asyncio.timeout(read_timeout_s):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(max_bytes) from None
    except TimeoutError:
        raise GatewayError(
            408, "request_timeout", f"The request body did not arrive within {read_timeout_s:g} s."
        ) from None
    except aiohttp.ClientError:  # the body broke off or could not be decoded
        raise invalid_request("The request body could not be read.") from None
    try:
        # Strict UTF-8 first: json.loads(bytes) would let CESU-8 surrogates through.
        body = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        raise invalid_request("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    return body


def _is_json_type(media_type: str) -> bool:
    return media_type == "application/json" or media_type.endswith("+json")


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


def backend_request(
    state: GatewayState,
    route: Route,
    shape: RequestShape,
    admission: Admission,
    grant: Grant,
    record: RequestRecord,
    response_headers: dict[str, str],
) -> RelayPlan:
    """What to send to the backend the grant landed on."""
    backend: Backend = grant.slot.backend
    body = admission.backend_body
    if backend.priority_field:
        # vLLM's priority scheduling: lower runs first; the lane's index is its priority.
        body = {**body, "priority": state.settings.lanes.index(admission.lane)}
    headers = {
        "Content-Type": "application/json",
        "Accept": "text/event-stream" if shape.stream else "application/json",
        "X-Request-Id": record.request_id,
    }
    if backend.api_key:
        headers["Authorization"] = f"Bearer {backend.api_key}"
    return RelayPlan(
        backend=backend,
        path=route.backend_path,
        body=json.dumps(body).encode(),
        headers=headers,
        stream=shape.stream,
        strip_usage=not shape.client_wants_usage,
        stream_format="tgi" if shape.kind == TGI else "openai",
        response_headers=response_headers,
        on_first_byte=lambda: state.scheduler.prefill_done(grant),
    )


async def proxy(request: web.Request, state: GatewayState, route: Route) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    record = RequestRecord(request_id_of(request), request.path, loop.time())
    headers = {"x-request-id": record.request_id}
    grant: Grant | None = None
    try:
        if state.draining:
            raise shutting_down()
        client = state.keys.identify(request.headers.get("Authorization"))
        if client is not None:
            record.client = client.name
        server = state.settings.server
        body = await read_json_object(request, server.max_body_bytes, server.read_timeout_s)
        shape = await route.measure(body, state.settings, state.counter)
        record.model = shape.model
        record.stream = shape.stream
        record.prompt_tokens = shape.prompt_tokens
        record.max_tokens_requested = shape.requested_max_tokens
        headers["x-gateway-prompt-tokens"] = str(shape.prompt_tokens)
        requested_lane = request.headers.get("X-Gateway-Lane")
        override = lane_override(client, requested_lane, state.settings.lanes)
        if requested_lane and override is None:
            state.events.warning(
                "lane_override_ignored",
                request_id=record.request_id,
                client=record.client,
                requested=requested_lane[:64],
            )
        admission = admit(shape, state.settings, override)
        check_lane_allowed(client, admission.lane)
        lane = admission.lane.name
        record.lane = lane
        record.max_tokens = admission.budget.max_tokens
        headers.update(admission_headers(admission))
        if not state.pool.has_available(lane):
            raise GatewayError(
                503,
                "no_backend",
                f"No healthy backend serves the '{lane}' lane right now.",
                retry_after_s=state.settings.health.interval_s,
                outcome="no_backend",
            )

        record.enqueued = loop.time()
        grant = await state.scheduler.acquire(lane, shape.prompt_tokens, admission.budget.total)
        record.dispatched = loop.time()
        headers.update(queue_headers(record.queue_ms))
        while True:
            record.attempts += 1
            record.backend = grant.slot.backend.name
            plan = backend_request(state, route, shape, admission, grant, record, headers)
            try:
                response = await relay(request, plan, record, state.upstream)
            except BackendFailure as failure:
                state.pool.report_failure(plan.backend)
                retried = record.attempts < MAX_ATTEMPTS and state.scheduler.reassign(
                    grant, shape.prompt_tokens, admission.budget.total
                )
                if retried:
                    continue
                if failure.passthrough is None:
                    raise
                return failure.passthrough
            report_outcome(state, plan.backend, record)
            return response
    except GatewayError as error:
        record.status = error.status
        record.outcome = error.outcome
        record.error_code = error.code
        if record.end is None:
            record.end = loop.time()
        headers.update(queue_headers(record.queue_ms))
        if error.outcome == "backend_timeout" and grant is not None:
            state.pool.report_failure(grant.slot.backend)
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


def shutting_down() -> GatewayError:
    return GatewayError(
        503,
        "shutting_down",
        "This gateway is shutting down; retry on another instance.",
        retry_after_s=1,
        outcome="rejected_shutting_down",
    )


def report_outcome(state: GatewayState, backend: Backend, record: RequestRecord) -> None:
    """Passive health: what this request says about its backend.

    An error the backend reported inside a 200 stream (TGI's validation errors,
    for one) is about the request, not the server: it does not count.
    """
    if record.outcome == "backend_timeout" or (
        record.outcome == "backend_error" and record.error_code != STREAM_ERROR_CODE
    ):
        state.pool.report_failure(backend)
    elif record.outcome in ("ok", "backend_rejected"):
        state.pool.report_success(backend)
