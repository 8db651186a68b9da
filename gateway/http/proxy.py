"""The path every generation request takes, as named stages over one `Flight`.

One handler for all API dialects (OpenAI chat and completions, TGI): a route
is a backend path and a `Dialect`, which knows how its bodies are measured and
shaped. `proxy()` walks a request down the stages (read, route, identify,
retry check, measure, admit, reserve quota, queue, lease; then `send`, which
dispatches and, when a backend fails mid-answer, resumes elsewhere) and back
once: a refusal from any stage is answered by `refused`, and `settle` alone
gives back what was taken (slot, quota, retry memory) and ends the record.
Each stage only wires the request to its room: policy lives in admission
(caps, lanes, rights), scheduling (queues, slots), fleet (leases, quotas) and
upstream (retry, resume, health).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from gateway.admission.admit import Admission, RequestShape, admit, calibrated
from gateway.admission.deadline import DEADLINE_HEADER, client_deadline_s
from gateway.admission.retries import Fingerprint, Retry, Seen, fingerprint, retried_outcome
from gateway.admission.tenants import Tenant
from gateway.config import ApiKeySettings, LimitsSettings
from gateway.dialects.base import Dialect
from gateway.fleet.leases import SlotLeases, leased
from gateway.fleet.quotas import QuotaReservation
from gateway.http.errors import error_response, in_band_error, refusal_body, status_of
from gateway.http.keepalive import QUEUED, WAITING, EarlyStream
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
from gateway.upstream.models import Route as ModelRoute
from gateway.upstream.pool import Backend, BackendPool, RouteHint
from gateway.upstream.relay import Preempted, RelayPlan
from gateway.upstream.resume import Resumer
from gateway.upstream.seam import DISABLED, NO_BACKEND, REQUEST_SHAPE, RelayedEvents, Seam
from gateway.upstream.stall import StallRule

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
    request: web.Request,
    shape: RequestShape,
    client: str | None,
    deadline_s: float,
    model: str | None = None,
) -> RouteHint:
    """What the pool may route by besides load: the prompt's blocks, its session, and the
    model its backend must serve (`model`: an alias's target; else the body's)."""
    if model is None and isinstance(asked := shape.body.get("model"), str):
        model = asked
    return RouteHint(
        shape.prefix,
        session_key(request.headers.get(SESSION_HEADER), shape.body.get("user"), client),
        wait_budget_s=WAIT_FOR_SOONER_SHARE * deadline_s,
        model=model,
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
    relayed: RelayedEvents | None = None,
    resume_blocked: str | None = None,
    stall: StallRule | None = None,
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
        # With its retry hint when it has one (a stream cut at shutdown: Retry-After is
        # out of reach once the 200 went out).
        error_event=lambda refusal: dialect.error_event(
            in_band_error(refusal_body(refusal), retry_after_s=refusal.retry_after_s, queue_ms=None)
        ),
        on_first_byte=on_first_byte,
        early_response=None if early is None else early.response,
        stop_early=None if early is None else early.stop,
        relayed=relayed,
        resume_blocked=resume_blocked,
        stall=stall,
    )


def resume_blocked(
    state: GatewayState, dialect: Dialect, shape: RequestShape, pool: BackendPool
) -> str | None:
    """Why this request's answer could not be carried over should its backend fail
    mid-stream (None: it could, and what the client gets is kept for that)."""
    if not shape.stream:
        return REQUEST_SHAPE
    if not state.settings.resume.enabled:
        return DISABLED
    if len(pool.backends) < 2:
        return NO_BACKEND
    return dialect.not_resumable(shape)


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
        if record.outcome is Outcome.QUEUE_TIMEOUT:
            record.outcome = Outcome.QUEUE_TIMEOUT_IN_STREAM
    return response


@dataclass(slots=True)
class Flight:
    """One request on its way down the stages and back: what each stage leaves for the
    next, and what the unwinding (`settle`) gives back. Fields after `scheduler` are set
    by the stage that names them; those `settle` reads are None until then."""

    request: web.Request
    state: GatewayState
    dialect: Dialect
    record: RequestRecord
    #: The answer's headers, filled in as the stages learn them.
    headers: dict[str, str]
    #: The default pool's, until the request's model says (`route`).
    scheduler: Scheduler
    grant: Grant | None = None
    quota: QuotaReservation | None = None
    prefill_timer: asyncio.TimerHandle | None = None
    early: EarlyStream | None = None
    seen: Seen | None = None
    client: ApiKeySettings | None = None
    body: dict[str, object] = field(default_factory=dict)
    raw: bytes = b""
    route: ModelRoute = field(init=False)
    tenant: Tenant = field(init=False)
    limits: LimitsSettings = field(init=False)
    shape: RequestShape = field(init=False)
    admission: Admission = field(init=False)
    backend_fields: dict[str, object] = field(init=False)
    backend_body: bytes = field(init=False)
    hint: RouteHint = field(init=False)
    leases: SlotLeases | None = None
    #: When its request was last sent to a backend (the time a preemption loses).
    sent_at: float | None = None

    @property
    def pool(self) -> BackendPool:
        return self.route.pool.pool


async def proxy(request: web.Request, state: GatewayState, dialect: Dialect) -> web.StreamResponse:
    """Down the stages, then back once: refusals answered, the unwinding in `settle`."""
    record = RequestRecord(request_id_of(request), request.path, clock())
    record.trace = incoming_trace(request.headers, state.tracer)
    headers = {"x-request-id": record.request_id}
    flight = Flight(request, state, dialect, record, headers, state.scheduler)
    try:
        for stage in STAGES:
            await stage(flight)
        response = await send(flight)
        early = flight.early
        return response if early is None else await settled(early, response, record, dialect)
    except Refusal as refusal:
        return await refused(flight, refusal)
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
        settle(flight)


# --- the stages, in order ------------------------------------------------------------------


async def read(flight: Flight) -> None:
    """Who is calling (their key) and what they sent (a JSON object, within the limits)."""
    state, request = flight.state, flight.request
    if state.draining:
        raise shutting_down()
    flight.client = state.keys.identify(request.headers.get("Authorization"))
    if flight.client is not None:
        flight.record.client = flight.client.name
    server = state.settings.server
    flight.body, flight.raw = await read_json_object(
        request, server.max_body_bytes, server.read_timeout_s
    )


async def route(flight: Flight) -> None:
    """The pool that serves the request's model: before counting, no pool, no work."""
    record = flight.record
    asked = flight.body.get("model")
    record.model = asked if isinstance(asked, str) else None
    flight.route = flight.state.pools.resolve(record.model)
    record.pool = flight.route.pool.name
    flight.scheduler = flight.route.pool.scheduler


async def identify(flight: Flight) -> None:
    """Whose share of a lane it is (`admission/tenants.py`)."""
    tenant = flight.state.tenants.identify(flight.client, flight.request.headers, flight.body)
    flight.tenant = tenant
    flight.record.tenant, flight.record.tenant_weight = tenant.name, tenant.weight


async def check_retry(flight: Flight) -> None:
    """A retry of a request seen shortly before: noted, and refused at once when damped."""
    retries, record = flight.state.retries, flight.record
    if not retries.enabled:
        return
    sender = retry_fingerprint(flight.request, flight.raw, flight.body, record)
    flight.seen, retry = retries.arrive(sender, record.request_id, record.arrival)
    damped = None if retry is None else note_retry(record, retry)
    if damped is not None:
        raise damped


async def measure(flight: Flight) -> None:
    """Validate and count the prompt under the model's caps, tightened by its pool."""
    flight.limits = flight.route.pool.sizer.in_force(flight.route.limits)
    shape = await flight.dialect.measure(flight.body, flight.limits, flight.state.counter)
    flight.shape = shape
    record = flight.record
    record.model, record.stream = shape.model, shape.stream
    record.prompt_tokens = shape.prompt_tokens
    record.max_tokens_requested = shape.requested_max_tokens
    flight.headers["x-gateway-prompt-tokens"] = str(shape.prompt_tokens)


async def admit_request(flight: Flight) -> None:
    """Caps, budget and lane (`admission/admit.py`); the backend's body, encoded once."""
    state, shape, pool, record = flight.state, flight.shape, flight.pool, flight.record
    requested_lane = flight.request.headers.get("X-Gateway-Lane")
    admission = admit(
        shape,
        state.settings,
        flight.client,
        requested_lane,
        limits=flight.limits,
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
    flight.admission = admission
    record.lane = admission.lane.name
    record.max_tokens = admission.budget.max_tokens
    flight.headers.update(admission_headers(admission))
    pool.require_available(admission.lane.name, flight.route.model)
    fields = flight.dialect.backend_body(shape, admission.budget)
    if flight.route.target is not None:  # an alias: the backend is asked for its target
        fields["model"] = flight.route.target
    flight.backend_fields = fields
    flight.backend_body = encode_backend_body(fields)


async def reserve_quota(flight: Flight) -> None:
    """The key's requests and tokens per minute (`fleet/quotas.py`)."""
    shape, budget = flight.shape, flight.admission.budget
    flight.quota = quota = await flight.state.quotas.reserve(
        flight.client, calibrated(shape.prompt_tokens, flight.pool.token_ratio(None)), budget.total
    )
    if quota is not None:
        flight.headers.update(quota.headers)
        quota.check()
        flight.record.quota_tokens = quota.tokens


async def queue(flight: Flight) -> None:
    """Wait in the lane's queue for a slot (`scheduling/scheduler.py`)."""
    state, shape, record, lane = flight.state, flight.shape, flight.record, flight.record.lane
    assert lane is not None
    server = state.settings.server
    flight.route.pool.sizer.note_prompt(lane, shape.prompt_tokens)
    if shape.stream and server.sse_keepalive_s > 0:
        flight.early = EarlyStream(flight.request, flight.headers, server.sse_keepalive_s)
    record.enqueued = clock()
    client_deadline = client_deadline_s(flight.request.headers.get(DEADLINE_HEADER))
    queue_deadline = (
        None
        if client_deadline is None
        else queue_budget_s(client_deadline, flight.pool.prefill_s(lane, shape.prompt_tokens))
    )
    scheduler = flight.scheduler
    flight.hint = route_hint(
        flight.request,
        shape,
        record.client,
        scheduler.deadline_for(lane, queue_deadline),
        flight.route.model,
    )
    note = WaitNote()
    try:
        flight.grant = await scheduler.acquire(
            lane,
            shape.prompt_tokens,
            flight.admission.budget.total,
            client_deadline_s=queue_deadline,
            note=note,
            hint=flight.hint,
            tenant=flight.tenant.name,
            weight=flight.tenant.weight,
        )
    finally:
        record.predicted_wait_s, record.deadline_s = note.predicted_wait_s, note.deadline_s
        record.deadline_grace_s = note.grace_s


async def lease(flight: Flight) -> None:
    """With [redis]: the slot leased across replicas (`fleet/leases.py`)."""
    state, grant = flight.state, flight.grant
    assert grant is not None
    flight.leases = leases = (
        None if state.fleet is None else state.fleet.leases_of(flight.route.pool.name)
    )
    if leases is not None:
        flight.grant = await leased(
            leases,
            flight.scheduler,
            grant,
            flight.record,
            prompt_tokens=flight.shape.prompt_tokens,
            output_tokens=flight.admission.budget.total,
            deadline_s=flight.record.deadline_s or 0.0,
            hint=flight.hint,
        )


#: The stages before the backend, in order: each leaves its part on the flight.
STAGES: tuple[Callable[[Flight], Awaitable[None]], ...] = (
    read,
    route,
    identify,
    check_retry,
    measure,
    admit_request,
    reserve_quota,
    queue,
    lease,
)


async def send(flight: Flight) -> web.StreamResponse:
    """Dispatch on the granted backend: retried elsewhere before its first byte, resumed
    elsewhere after it (`upstream/dispatch.py`, `upstream/resume.py`); preempted before
    its first byte, back in its lane's line and sent again (`scheduling/preemption.py`)."""
    state, shape, record, dialect = flight.state, flight.shape, flight.record, flight.dialect
    scheduler, budget, headers = flight.scheduler, flight.admission.budget, flight.headers

    def held() -> Grant:
        grant = flight.grant
        assert grant is not None
        return grant

    early = flight.early
    # By name: a reload may have changed the lane's settings since it was admitted.
    priority = [lane.name for lane in state.settings.lanes].index(flight.admission.lane.name)
    blocked = resume_blocked(state, dialect, shape, flight.pool)
    stall = None if blocked else state.stall_rule

    def on_sent(preempt: Callable[[], None]) -> None:
        """Sent before its first byte: the scheduler may preempt it there (where this
        backend's engine gains from it), and it preempts for it (the highest lane)."""
        if record.first_byte is not None:
            return  # an answer carried over: past its prefill for good
        grant = held()
        backend = grant.slot.backend
        preemptible = flight.leases is None and state.settings.preemption.applies_to(backend.engine)
        flight.sent_at = clock()
        scheduler.sent(grant, backend.name, preempt if preemptible else None)

    def plan_for(backend: Backend, body: bytes = flight.backend_body) -> RelayPlan:
        plan = relay_plan(
            backend,
            body,
            dialect=dialect,
            shape=shape,
            request_id=record.request_id,
            priority=priority,
            response_headers=headers,
            on_first_byte=lambda: scheduler.prefill_done(held()),
            early=early,
            trace=record.trace,
            relayed=None if blocked else RelayedEvents(state.settings.resume.buffer_bytes),
            resume_blocked=blocked,
            stall=stall,
        )
        plan.on_sent = on_sent
        return plan

    def continue_for(backend: Backend, seam: Seam) -> RelayPlan | None:
        fields = dialect.continuation(
            flight.backend_fields, seam, budget.max_tokens - seam.tokens, backend.engine
        )
        return None if fields is None else plan_for(backend, encode_backend_body(fields))

    def move_elsewhere() -> bool:
        grant = held()
        reassigned = scheduler.reassign(grant, shape.prompt_tokens, budget.total, flight.hint)
        return moved(reassigned, flight.leases, grant)

    def carry_elsewhere() -> bool:
        """For a resume: another backend's free slot, else a place over its limit."""
        if move_elsewhere():
            return True
        lane, grant = record.lane, held()
        slot = None if lane is None else flight.pool.take_over(lane, grant.slot)
        if slot is None:
            return False
        flight.pool.give_back(grant.slot)
        grant.slot = slot
        scheduler.notify_capacity()  # what the old slot freed goes to the queue
        return moved(True, flight.leases, grant)

    state.shadow.offer(record, dialect, shape, flight.backend_body, flight.route)  # own task
    while True:
        dispatched(flight)
        try:
            return await dispatch(
                flight.request,
                record,
                upstream=state.upstream,
                pool=flight.pool,
                backend=lambda: held().slot.backend,
                plan_for=plan_for,
                move_elsewhere=move_elsewhere,
                resumer=Resumer(
                    state.settings.resume.max_resumes,
                    move_elsewhere=carry_elsewhere,
                    backend=lambda: held().slot.backend,
                    continue_for=continue_for,
                ),
            )
        except Preempted:
            await back_in_line(flight)


def dispatched(flight: Flight) -> None:
    """The request leaves the queue for its granted backend (again, after a preemption)."""
    record, grant, early = flight.record, flight.grant, flight.early
    assert grant is not None
    record.dispatched = clock()
    record.cached_tokens_expected = grant.slot.cached_tokens
    record.routed_by = grant.slot.reason
    if early is not None:
        early.phase = WAITING
        early.queue_ms = record.queue_ms
    if not flight.shape.stream:
        flight.prefill_timer = end_prefill_when_predicted(flight.scheduler, grant)
    flight.headers.update(queue_headers(record.queue_ms))


async def back_in_line(flight: Flight) -> None:
    """Preempted before its first byte: its slot back, the time it spent at the engine
    noted, and a slot again from the head of its lane's line within its queue deadline
    (a QueueTimeout past it: the client is answered as any request that waited too
    long). Its stream, if it began, goes on with keep-alive comments meanwhile."""
    record, grant, early = flight.record, flight.grant, flight.early
    assert grant is not None and record.lane is not None
    record.preempted += 1
    if flight.sent_at is not None:
        record.preempted_s += clock() - flight.sent_at
    if flight.prefill_timer is not None:
        flight.prefill_timer.cancel()
        flight.prefill_timer = None
    if early is not None:
        early.phase = QUEUED
    flight.grant = None  # (the scheduler gives it back: settle must not release it again)
    flight.grant = await flight.scheduler.requeue(
        grant,
        flight.shape.prompt_tokens,
        flight.admission.budget.total,
        deadline_s=record.deadline_s or flight.scheduler.deadline_for(record.lane),
        hint=flight.hint,
        preempted=True,
    )


async def refused(flight: Flight, refusal: Refusal) -> web.StreamResponse:
    """A refusal as its answer (or, once keep-alive comments began, as the last event)."""
    record, headers = flight.record, flight.headers
    record.status = status_of(refusal)
    record.outcome = refusal.outcome
    record.error_code = refusal.code
    record.retry_after_s = refusal.retry_after_s
    record.end = clock()
    headers.update(queue_headers(record.queue_ms))
    answer = error_response(refusal, headers)
    early = flight.early
    return answer if early is None else await settled(early, answer, record, flight.dialect)


def settle(flight: Flight) -> None:
    """The one unwinding: timers stopped, what was learned kept, the slot, the quota and
    the retry memory given back, the record ended (its log line and metrics)."""
    state, record, grant = flight.state, flight.record, flight.grant
    if flight.early is not None:
        flight.early.cancel()
    if flight.prefill_timer is not None:
        flight.prefill_timer.cancel()
    if record.end is None:
        record.end = clock()
    if grant is not None:
        try:
            record.timings = split_time(record, grant.slot)
            learn_from(record, grant.slot)
        finally:
            flight.scheduler.release(grant, *served_tokens(record))
            record.cost_tokens = grant.cost
    state.quotas.give_back(flight.quota, record)  # in the background: never delays the answer
    if flight.seen is not None:
        state.retries.end(
            flight.seen,
            retried_outcome(record.outcome, record.error_code),
            record.retry_after_s,
            record.lane,
            record.end,
        )
    state.finish(record)
