"""The path every generation request takes: read, admit, queue, dispatch, record.

One handler for all API dialects (OpenAI chat and completions, TGI): a route
is a backend path and a `Dialect`, which knows how its bodies are measured and
shaped. The handler only wires the stages together and turns refusals into
answers; policy lives in admission (caps, lanes, rights), scheduling (queues,
slots) and upstream (retry, health).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from gateway.admission.admit import Admission, RequestShape, admit, calibrated
from gateway.admission.deadline import DEADLINE_HEADER, client_deadline_s
from gateway.admission.retries import Fingerprint, Retry, Seen, fingerprint, retried_outcome
from gateway.dialects.base import Dialect
from gateway.fleet.leases import SlotLeases, leased
from gateway.fleet.quotas import QuotaReservation
from gateway.http.errors import error_response, in_band_error, refusal_body, status_of
from gateway.http.keepalive import WAITING, EarlyStream
from gateway.observability.record import RequestRecord, clock
from gateway.observability.trace_context import TraceContext
from gateway.observability.tracing import incoming_trace
from gateway.outcomes import (
    BodyTooLarge,
    InvalidRequest,
    Outcome,
    Refusal,
    RequestTimeout,
    ShuttingDown,
    UnsupportedMediaType,
)
from gateway.scheduling.scheduler import Grant, Scheduler, WaitNote
from gateway.state import GATEWAY, GatewayState
from gateway.upstream.affinity import SESSION_HEADER, session_key
from gateway.upstream.dispatch import dispatch
from gateway.upstream.learn import learn_from, split_time
from gateway.upstream.pool import Backend, RouteHint
from gateway.upstream.relay import RelayPlan

MAX_REQUEST_ID_LENGTH = 128

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_decode_json = msgspec.json.Decoder().decode
_encode_json = msgspec.json.Encoder().encode


def route_handler(dialect: Dialect) -> Handler:
    """An aiohttp handler for requests of `dialect`."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return await proxy(request, request.app[GATEWAY], dialect)

    return handle


def client_request_id(request: web.Request) -> str | None:
    """The client's own x-request-id when it sent a sane one."""
    given = request.headers.get("x-request-id")
    if given and len(given) <= MAX_REQUEST_ID_LENGTH and given.isprintable():
        return given
    return None


def request_id_of(request: web.Request) -> str:
    """The client's x-request-id when it is sane, else a new one: 128 random bits as 32
    hex digits (the length the counter ids had).

    From the kernel's generator, not a counter: a client that sees one id cannot guess
    the next one (ids reach the backend, logs and traces, and a retry is matched by
    the client's id). It costs about 0.45 µs a request (a counter cost 0.2 µs).
    """
    return client_request_id(request) or os.urandom(16).hex()


async def read_json_object(
    request: web.Request, max_bytes: int, read_timeout_s: float = 30.0
) -> tuple[dict[str, object], bytes]:
    """The body as a JSON object, and its bytes; 413 before reading when it is too big,
    400 when not JSON.

    A body declared as something other than JSON gets 415; no Content-Type at all
    is read as JSON (some minimal clients send none). The decoder is strict UTF-8
    (CESU-8 surrogates and lone `\\ud800` escapes are refused) and refuses NaN.
    """
    content_type = request.headers.get("Content-Type")
    if content_type is not None and not _is_json_type(content_type, request):
        raise UnsupportedMediaType("Send the body as JSON with 'Content-Type: application/json'.")
    if request.headers.get("Content-Encoding", "identity").lower() != "identity":
        raise UnsupportedMediaType(
            "Compressed request bodies are not accepted; send the JSON as is."
        )
    length = request.content_length
    if length is not None and length > max_bytes:
        raise body_too_large(max_bytes)
    try:
        if request.content.is_eof():  # the whole body came with the headers: no timer
            raw = await request.read()
        else:
            async with asyncio.timeout(read_timeout_s):
                raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(max_bytes) from None
    except TimeoutError:
        raise RequestTimeout(
            f"The request body did not arrive within {read_timeout_s:g} s."
        ) from None
    except aiohttp.ClientError:  # the body broke off or could not be decoded
        raise InvalidRequest("The request body could not be read.") from None
    try:
        body = _decode_json(raw)
    except (msgspec.DecodeError, RecursionError):
        raise InvalidRequest("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return body, raw


def _is_json_type(header: str, request: web.Request) -> bool:
    """JSON or `+json`; the plain header is checked first (aiohttp's parse costs µs)."""
    if header == "application/json" or header.startswith("application/json;"):
        return True
    media_type = request.content_type
    return media_type == "application/json" or media_type.endswith("+json")


def body_too_large(max_bytes: int) -> BodyTooLarge:
    return BodyTooLarge(f"The request body is over {max_bytes} bytes.")


def shutting_down() -> ShuttingDown:
    return ShuttingDown(
        "This gateway is shutting down; retry on another instance.", retry_after_s=1
    )


def encode_backend_body(body: dict[str, object]) -> bytes:
    """Compact UTF-8 JSON: a Chinese prompt goes as its own bytes, not as \\uXXXX escapes.

    Encoded before the request queues, so a body the decoder took but the encoder
    cannot write (nesting at the parser's limit) is refused without taking a slot.
    """
    try:
        return _encode_json(body)
    except RecursionError:
        raise InvalidRequest("The request body is nested too deeply.") from None


def with_member(body: bytes, key: str, value: int) -> bytes:
    """`body` (an encoded JSON object) with one more member, last, so that it wins."""
    member = _encode_json(key) + b":" + _encode_json(value)
    return body[:-1] + (b"," if body != b"{}" else b"") + member + b"}"


#: Share of a request's queue deadline it may spend waiting for a better backend.
WAIT_FOR_SOONER_SHARE = 0.5


def route_hint(
    request: web.Request, shape: RequestShape, client: str | None, deadline_s: float
) -> RouteHint:
    """What the pool may route by besides load: the prompt's blocks, its session, its model."""
    return RouteHint(
        shape.prefix,
        session_key(request.headers.get(SESSION_HEADER), shape.body.get("user"), client),
        wait_budget_s=WAIT_FOR_SOONER_SHARE * deadline_s,
        model=model if isinstance(model := shape.body.get("model"), str) else None,
    )


def queue_budget_s(client_deadline: float, own_prefill_s: float) -> float:
    """How long a client's deadline lets its request queue: less its own prefill."""
    return max(0.0, client_deadline - own_prefill_s)


#: A non-streamed answer's prefill counts as over this many times its predicted time
#: after dispatch (its first byte comes only with the whole answer).
NON_STREAM_PREFILL_MARGIN = 1.5


def end_prefill_when_predicted(scheduler: Scheduler, grant: Grant) -> asyncio.TimerHandle:
    """A non-streamed request's first byte is its last: without this its prompt would
    hold the backend's prefill budget until the whole answer is generated."""
    return asyncio.get_running_loop().call_later(
        grant.slot.prefill_s * NON_STREAM_PREFILL_MARGIN, scheduler.prefill_done, grant
    )


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


def relay_plan(
    backend: Backend,
    body: bytes,
    *,
    dialect: Dialect,
    shape: RequestShape,
    request_id: str,
    priority: int,
    response_headers: dict[str, str],
    on_first_byte: Callable[[], None],
    early: EarlyStream | None = None,
    trace: TraceContext | None = None,
) -> RelayPlan:
    """What to send to `backend` for one attempt (the body was encoded once, before)."""
    if backend.priority_field:
        # vLLM's priority scheduling: lower runs first; the lane's index is its priority.
        body = with_member(body, "priority", priority)
    headers = {
        "Content-Type": "application/json",
        "Accept": "text/event-stream" if shape.stream else "application/json",
        "X-Request-Id": request_id,
    }
    if trace is not None:  # W3C traceparent (and tracestate): vLLM and TGI read them
        headers.update(trace.backend_headers())
    if backend.api_key:
        headers["Authorization"] = f"Bearer {backend.api_key}"
    return RelayPlan(
        backend=backend,
        body=body,
        headers=headers,
        dialect=dialect,
        shape=shape,
        response_headers=response_headers,
        error_event=lambda refusal: dialect.error_event(refusal_body(refusal)),
        on_first_byte=on_first_byte,
        early_response=None if early is None else early.response,
        stop_early=None if early is None else early.stop,
    )


def retry_fingerprint(
    request: web.Request, raw: bytes, body: dict[str, object], record: RequestRecord
) -> Fingerprint:
    """Who sent this request and a hash of its bytes (`admission/retries.py` says why)."""
    headers = request.headers
    return fingerprint(
        raw,
        client=record.client,
        tenant=record.tenant,
        session=headers.get(SESSION_HEADER),
        user=body.get("user"),
        peer=request.remote,
        forwarded=headers.get("X-Forwarded-For"),
        request_id=client_request_id(request),
    )


def note_retry(record: RequestRecord, retry: Retry) -> Refusal | None:
    """Stamp a retry on its record; the refusal it gets at once when it is damped."""
    record.retry_of, record.retry_gap_ms = retry.of, retry.gap_ms
    record.retried_outcome = retry.outcome
    refusal = retry.refusal()
    if refusal is not None:
        record.retry_damped = True
        record.lane = retry.lane  # the lane its copy was refused in: same body, same lane
    return refusal


def served_tokens(record: RequestRecord) -> tuple[int, int]:
    """What the engine did for a request, its tenant's charge: the prompt's uncached part
    (as the backend reported its cache, else as routing expected it) and the output
    tokens; nothing when no byte came back (the backend failed before serving it)."""
    if record.first_byte is None:
        return 0, 0
    cached = record.cached_tokens
    if cached is None:
        cached = record.cached_tokens_expected or 0
    return max(0, (record.prompt_tokens or 0) - cached), record.completion_tokens or 0


def moved(reassigned: bool, leases: SlotLeases | None, grant: Grant) -> bool:
    """After a retry moved `grant` to another backend of its pool: its new slot is
    leased too, in that pool's leases."""
    if reassigned and leases is not None:
        leases.adopt(grant.slot)
    return reassigned


async def settled(
    early: EarlyStream, answer: web.StreamResponse, record: RequestRecord, dialect: Dialect
) -> web.StreamResponse:
    """The answer, or, when keep-alive comments had started the stream, the answer's
    error as the stream's last event (what the client then got is a 200), with the
    retry hint and queue time its headers could no longer carry."""

    def in_band(error: dict[str, Any]) -> bytes:
        return dialect.error_event(
            in_band_error(error, retry_after_s=record.retry_after_s, queue_ms=record.queue_ms)
        )

    response = await early.settle(answer, in_band)
    if response is not answer:
        record.status = 200
    return response


async def proxy(request: web.Request, state: GatewayState, dialect: Dialect) -> web.StreamResponse:
    record = RequestRecord(request_id_of(request), request.path, clock())
    record.trace = incoming_trace(request.headers, state.tracer)
    headers = {"x-request-id": record.request_id}
    grant: Grant | None = None
    quota: QuotaReservation | None = None
    prefill_timer: asyncio.TimerHandle | None = None
    early: EarlyStream | None = None
    seen: Seen | None = None
    scheduler = state.scheduler  # the default pool's, until the request's model says
    try:
        if state.draining:
            raise shutting_down()
        client = state.keys.identify(request.headers.get("Authorization"))
        if client is not None:
            record.client = client.name
        server = state.settings.server
        body, raw = await read_json_object(request, server.max_body_bytes, server.read_timeout_s)
        asked = body.get("model")
        record.model = asked if isinstance(asked, str) else None
        route = state.pools.resolve(record.model)  # before counting: no pool, no work
        record.pool = route.pool.name
        pool, scheduler = route.pool.pool, route.pool.scheduler
        tenant = state.tenants.identify(client, request.headers, body)
        record.tenant, record.tenant_weight = tenant.name, tenant.weight
        if state.retries.enabled:
            seen, retry = state.retries.arrive(
                retry_fingerprint(request, raw, body, record), record.request_id, record.arrival
            )
            damped = None if retry is None else note_retry(record, retry)
            if damped is not None:
                raise damped
        # The model's caps (its [[models]] limits, else [limits]), tightened by its pool.
        limits = route.pool.sizer.in_force(route.limits)
        shape = await dialect.measure(body, limits, state.counter)
        record.model = shape.model
        record.stream = shape.stream
        record.prompt_tokens = shape.prompt_tokens
        record.max_tokens_requested = shape.requested_max_tokens
        headers["x-gateway-prompt-tokens"] = str(shape.prompt_tokens)
        requested_lane = request.headers.get("X-Gateway-Lane")
        client_deadline = client_deadline_s(request.headers.get(DEADLINE_HEADER))
        admission = admit(
            shape,
            state.settings,
            client,
            requested_lane,
            limits=limits,
            token_ratio=pool.token_ratio(None),
            cached_tokens=pool.expected_cached_tokens(shape.prefix)
            if state.settings.routing.lane_by_uncached_tokens
            else 0,
        )
        if admission.override_ignored:
            state.events.warning(
                "lane_override_ignored",
                request_id=record.request_id,
                client=record.client,
                requested=(requested_lane or "")[:64],
            )
        lane = admission.lane.name
        record.lane = lane
        record.max_tokens = admission.budget.max_tokens
        headers.update(admission_headers(admission))
        pool.require_available(lane)
        backend_fields = dialect.backend_body(shape, admission.budget)
        if route.target is not None:  # an alias: the backend is asked for its target
            backend_fields["model"] = route.target
        backend_body = encode_backend_body(backend_fields)
        quota = await state.quotas.reserve(  # the key's requests and tokens per minute
            client,
            calibrated(shape.prompt_tokens, pool.token_ratio(None)),
            admission.budget.total,
        )
        if quota is not None:
            headers.update(quota.headers)
            quota.check()
            record.quota_tokens = quota.tokens
        route.pool.sizer.prompt_sizes.add(lane, shape.prompt_tokens)
        if shape.stream and server.sse_keepalive_s > 0:
            early = EarlyStream(request, headers, server.sse_keepalive_s)
        record.enqueued = clock()
        budget = admission.budget
        note = WaitNote()
        queue_deadline = (
            None
            if client_deadline is None
            else queue_budget_s(client_deadline, pool.prefill_s(lane, shape.prompt_tokens))
        )
        hint = route_hint(
            request, shape, record.client, scheduler.deadline_for(lane, queue_deadline)
        )
        try:
            grant = held = await scheduler.acquire(
                lane,
                shape.prompt_tokens,
                budget.total,
                client_deadline_s=queue_deadline,
                note=note,
                hint=hint,
                tenant=tenant.name,
                weight=tenant.weight,
            )
        finally:
            record.predicted_wait_s, record.deadline_s = note.predicted_wait_s, note.deadline_s
        leases = None if state.fleet is None else state.fleet.leases_of(route.pool.name)
        if leases is not None:
            grant = held = await leased(
                leases,
                scheduler,
                held,
                record,
                prompt_tokens=shape.prompt_tokens,
                output_tokens=budget.total,
                deadline_s=note.deadline_s or 0.0,
                hint=hint,
            )
        record.dispatched = clock()
        record.cached_tokens_expected = held.slot.cached_tokens
        record.routed_by = held.slot.reason
        if early is not None:
            early.phase = WAITING
            early.queue_ms = record.queue_ms
        if not shape.stream:
            prefill_timer = end_prefill_when_predicted(scheduler, held)
        headers.update(queue_headers(record.queue_ms))
        priority = state.settings.lanes.index(admission.lane)

        def plan_for(backend: Backend) -> RelayPlan:
            return relay_plan(
                backend,
                backend_body,
                dialect=dialect,
                shape=shape,
                request_id=record.request_id,
                priority=priority,
                response_headers=headers,
                on_first_byte=lambda: scheduler.prefill_done(held),
                early=early,
                trace=record.trace,
            )

        state.shadow.offer(record, dialect, shape, backend_body, route)  # sync: its own task
        response = await dispatch(
            request,
            record,
            upstream=state.upstream,
            pool=pool,
            backend=lambda: held.slot.backend,
            plan_for=plan_for,
            move_elsewhere=lambda: moved(
                scheduler.reassign(held, shape.prompt_tokens, budget.total, hint), leases, held
            ),
        )
        return response if early is None else await settled(early, response, record, dialect)
    except Refusal as refusal:
        record.status = status_of(refusal)
        record.outcome = refusal.outcome
        record.error_code = refusal.code
        record.retry_after_s = refusal.retry_after_s
        record.end = clock()
        headers.update(queue_headers(record.queue_ms))
        answer = error_response(refusal, headers)
        return answer if early is None else await settled(early, answer, record, dialect)
    except asyncio.CancelledError:
        record.outcome = Outcome.CLIENT_DISCONNECTED
        if record.status is None:
            record.status = 499  # nothing was sent: nginx's code for "client closed"
        raise
    except Exception:
        record.outcome = Outcome.INTERNAL_ERROR
        record.status = 500
        raise
    finally:
        if early is not None:
            early.cancel()
        if prefill_timer is not None:
            prefill_timer.cancel()
        if record.end is None:
            record.end = clock()
        if grant is not None:
            try:
                record.timings = split_time(record, grant.slot)
                learn_from(record, grant.slot)
            finally:
                scheduler.release(grant, *served_tokens(record))
                record.cost_tokens = grant.cost
        state.quotas.give_back(quota, record)  # in the background: never delays the answer
        if seen is not None:
            state.retries.end(
                seen,
                retried_outcome(record.outcome, record.error_code),
                record.retry_after_s,
                record.lane,
                record.end if record.end is not None else clock(),
            )
        state.finish(record)
