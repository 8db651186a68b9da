"""build_app(settings): wire the parts together and manage their lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TextIO

import tiktoken
from aiohttp import web

from gateway.admission.auth import ClientKeys
from gateway.admission.retries import RetryMemory
from gateway.admission.tenants import Tenants
from gateway.admission.tokens import TokenCounter, load_encoding
from gateway.config import BackendSettings, Settings, slot_limit
from gateway.fleet.fleet import Fleet
from gateway.fleet.leases import SlotLeases
from gateway.fleet.quotas import TenantQuotas
from gateway.fleet.signals import FleetSignals
from gateway.fleet.store import SharedStore
from gateway.http import admin, cors, openai, openapi, ops, playground, tgi
from gateway.http.middleware import error_envelope
from gateway.http.proxy import shutting_down
from gateway.observability.logs import HANDOFF_S, RequestLog, make_logger
from gateway.observability.loop_lag import LoopLagMonitor
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.model_metrics import ModelMetrics
from gateway.observability.record import clock
from gateway.observability.tenant_metrics import TenantMetrics
from gateway.observability.tracing import build_tracer
from gateway.reload import Reloader
from gateway.scheduling.fitting import PromptSizes
from gateway.scheduling.scheduler import Scheduler
from gateway.state import GATEWAY, GatewayState
from gateway.upstream.health import HealthMonitor
from gateway.upstream.learned_state import OFF as LEARNED_STATE_OFF
from gateway.upstream.learned_state import SAVE_EVERY_S as LEARNED_SAVE_EVERY_S
from gateway.upstream.learned_state import LearnedState, SharedLearnedState
from gateway.upstream.membership import Membership, lane_members
from gateway.upstream.models import CATCH_ALL, ModelPool, ModelRouter, pool_key
from gateway.upstream.pool import Backend, BackendPool
from gateway.upstream.relay import UpstreamClient
from gateway.upstream.shadow import ShadowMirror
from gateway.upstream.sizing import BackendSizer

#: Longest /readyz waits for the start-up probe of the backends. On a CPU engine one
#: 1024-token probe takes ~9 s and the probe sends three: ready before it ends, the
#: first requests met the priors' deadlines (a short one timed out at 5 s behind a
#: 15-s prefill the gateway did not know of yet).
WARM_UP_READY_S = 60.0
#: How long a finished request's log line and metrics may wait for the others ending
#: meanwhile (`GatewayState.finish`): the log's own hand-off to its writer thread.
FINISH_AFTER_S = HANDOFF_S


def build_app(
    settings: Settings,
    *,
    log_stream: TextIO | None = None,
    encoding: tiktoken.Encoding | None = None,
    reload: Callable[[], Settings] | None = None,
    config_path: str | None = None,
) -> web.Application:
    """The gateway as an aiohttp app. Loads the tokenizer now: a missing one fails here.

    `reload` reads the config again as at start (`reload.py`: SIGHUP, POST /admin/reload);
    `config_path` is the file it reads, watched when [discovery] watch_config_s says."""
    counter = TokenCounter(
        encoding or load_encoding(settings.tokenizer.encoding),
        offload_min_chars=settings.tokenizer.offload_min_chars,
    )
    events = make_logger(sys.stderr, settings.logging.level)
    router = build_pools(settings, events)
    default = router.default
    pool, scheduler = default.pool, default.scheduler
    metrics = GatewayMetrics()
    loop_lag = LoopLagMonitor(metrics.registry)
    tenants = Tenants(settings)
    tenant_metrics = TenantMetrics(metrics.registry, tenants.label)
    tenant_metrics.watch(scheduler, metrics.registry)
    state = GatewayState(
        settings=settings,
        counter=counter,
        pool=pool,
        scheduler=scheduler,
        metrics=metrics,
        # On stdout the lines are written by a thread (a stalled pipe never blocks the loop),
        # and a finished request's bookkeeping waits for the requests arriving meanwhile.
        request_log=RequestLog(log_stream, background=log_stream is None),
        finish_after_s=FINISH_AFTER_S if log_stream is None else 0.0,
        upstream=UpstreamClient(settings.timeouts),
        events=events,
        health=default.health,
        keys=ClientKeys(settings.api_keys),
        tenants=tenants,
        tenant_metrics=tenant_metrics,
        loop_lag=loop_lag,
        prompt_sizes=default.sizer.prompt_sizes,
        sizer=default.sizer,
        pools=router,
        shadow=ShadowMirror(
            settings.shadow,
            settings.timeouts,
            default_pool=router.default.name,
            metrics=metrics,
            events=events,
        ),
        retries=RetryMemory(
            settings.retries.window_s,
            settings.retries.max_remembered,
            damp=settings.retries.damp,
        ),
    )
    state.tracer = build_tracer(settings.tracing, events)
    if settings.redis.enabled:
        state.fleet = build_fleet(settings, router, events, metrics)
        # Fleet signals (#11): this replica's queueing published, the fleet's exported,
        # every pool's lanes under the pool names `gateway_pool_*` uses (#28).
        FleetSignals(
            state.fleet.store,
            state.fleet,
            {each.name: each.scheduler for each in router.pools},
            default_pool=default.name,
            draining=lambda: state.draining,
        ).install(metrics.registry)
    # Tenant quotas (#11): in the fleet's Redis, or local without one.
    state.quotas = TenantQuotas.for_fleet(settings.api_keys, state.fleet, metrics.registry)
    metrics.watch(scheduler, pool, state.sizer.floors)
    state.learned_state = restore_learned(settings, router, events, metrics, state.fleet)
    state.model_metrics = ModelMetrics(metrics.registry, router)
    state.reloader = Reloader(
        state,
        reload,
        Membership(
            router,
            lambda name, members, current: _started_pool(state, name, members, current),
            events,
            metrics.registry,
            on_pools_changed=lambda: _follow_default_pool(state),
        ),
        metrics.registry,
        path=config_path,
    )
    # client_max_size makes aiohttp stop reading a chunked body past the limit.
    app = web.Application(
        client_max_size=settings.server.max_body_bytes, middlewares=[error_envelope]
    )
    app[GATEWAY] = state
    app.cleanup_ctx.append(_upstream_lifecycle)
    if state.tracer is not None:
        app.on_cleanup.append(_stop_tracing)
    app.router.add_post("/v1/chat/completions", openai.chat_completions)
    app.router.add_post("/v1/completions", openai.completions)
    app.router.add_get("/v1/models", openai.models)
    app.router.add_post("/generate", tgi.generate)
    app.router.add_post("/generate_stream", tgi.generate_stream)
    app.router.add_post("/", tgi.compat)
    app.router.add_get("/info", tgi.info)
    app.router.add_get("/healthz", ops.healthz)
    app.router.add_get("/readyz", ops.readyz)
    app.router.add_get("/metrics", ops.metrics)
    app.router.add_get("/debug/backends", ops.debug_backends)
    app.router.add_post("/admin/backends/{name}/drain", admin.drain)
    app.router.add_post("/admin/backends/{name}/undrain", admin.undrain)
    app.router.add_post("/admin/reload", admin.reload)
    openapi.install(app, settings)
    playground.install(app, settings.server.playground)
    cors.install(app, settings.server.cors_origins)
    return app


def build_pools(
    settings: Settings, events: Any, clock_of: Callable[[], float] | None = None
) -> ModelRouter:
    """A pool per served-model list (`upstream/models.py`), each with its own backends,
    scheduler, health checks and sizer: one model's queue never delays another's.

    `clock_of`: one clock for the pools and the schedulers (a replay's virtual time);
    by default the pools read the monotonic clock and the schedulers the records' one."""
    groups: dict[str, list[BackendSettings]] = {}
    for backend in settings.backends:
        groups.setdefault(pool_key(backend.models), []).append(backend)
    if not groups:
        groups[CATCH_ALL] = []
    pools = [
        build_pool(name, members, settings, events, clock_of) for name, members in groups.items()
    ]
    return ModelRouter(pools, settings.models, limits=settings.limits)


def build_pool(
    name: str,
    members: list[BackendSettings],
    settings: Settings,
    events: Any,
    clock_of: Callable[[], float] | None = None,
) -> ModelPool:
    """One pool and its machinery: its backends, scheduler, health checks and sizer (at
    start, and for models a reload or DNS brings in: `upstream/membership.py`). A
    `[[backends]] dns` entry has no member yet: its addresses join when resolved."""
    serves = frozenset(members[0].models) if members else frozenset()
    members = [b for b in members if b.url]
    pool = BackendPool(
        [Backend.from_settings(b) for b in members],
        lane_backends=lane_members(settings.lanes, [b.name for b in members]),
        health=settings.health,
        routing=settings.routing,
        clock=clock_of or time.monotonic,
    )
    slots = {lane.name: pool.slots_of(lane.name) for lane in settings.lanes}
    scheduler = Scheduler(
        settings.lanes,
        {lane.name: slot_limit(lane, slots[lane.name]) for lane in settings.lanes},
        pool,
        clock=clock_of or clock,
        competes=pool.shares_backends,
        fair_share=settings.tenants.fair_share,
        capacities=slots,
    )
    # Who may be preempted is decided per backend, as each request is sent (proxy.send).
    scheduler.max_preemptions = settings.preemption.max_per_request
    pool.on_available = scheduler.notify_capacity
    pool.events = events
    health = HealthMonitor(pool, settings.health, events)
    # Its own prompt sizes: another model's long prompts say nothing of this engine floor.
    sizer = BackendSizer(settings, pool, scheduler, events, PromptSizes(), pool_name=name)
    health.after_round = sizer.round
    return ModelPool(name, serves, pool, scheduler, sizer, health)


async def _started_pool(
    state: GatewayState, name: str, members: list[BackendSettings], settings: Settings
) -> ModelPool:
    """A pool for models that a reload or DNS brought in, wired as `build_app` wires those
    of the start (learned state, fleet leases) and its health checks running."""
    each = build_pool(name, members, settings, state.events)
    each.sizer.learned_state = state.learned_state
    if state.fleet is not None:
        leases = SlotLeases(
            state.fleet.store,
            each.pool,
            each.scheduler,
            share=state.fleet.local_share,
            pool_name=name,
        )
        state.fleet.add_leases(name, leases)
    await each.health.start()
    return each


def _follow_default_pool(state: GatewayState) -> None:
    """The state's default pool (TGI routes, leases, shadow) after the pools changed."""
    default = state.pools.default
    state.pool, state.scheduler = default.pool, default.scheduler
    state.sizer, state.health = default.sizer, default.health
    state.prompt_sizes = default.sizer.prompt_sizes


def build_fleet(
    settings: Settings,
    router: ModelRouter,
    events: Any,
    metrics: GatewayMetrics,
) -> Fleet:
    """The parts shared with the other replicas through Redis: slot leases per pool
    (each over its own backends and scheduler; the default pool's under the one-pool
    key names, so an older one-model replica still shares them)."""
    store = SharedStore(settings.redis, events=events, registry=metrics.registry)
    fleet = Fleet(settings.redis, store)
    for each in router.pools:
        default = each is router.default
        leases = SlotLeases(
            store,
            each.pool,
            each.scheduler,
            share=fleet.local_share,
            pool_name=None if default else each.name,
        )
        fleet.add_leases(each.name, leases, default=default)
    return fleet


async def _upstream_lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[GATEWAY]
    await state.upstream.start()
    for each in state.pools.pools:
        await each.health.start()
    await state.reloader.start()  # the DNS names' backends join before the first request
    await state.loop_lag.start()
    await state.shadow.start()
    if state.fleet is not None:
        await state.fleet.start()
    warm_up = None
    if state.settings.health.probe_on_start and state.health.session is not None:
        warm_up = asyncio.create_task(_warm_up_all(state), name="warm-up")
        state.warming_up = True
        warm_up.add_done_callback(lambda _: setattr(state, "warming_up", False))
        # Ready anyway after a while: a very slow engine is learned from traffic instead.
        ready_anyway = asyncio.get_running_loop().call_later(
            WARM_UP_READY_S, setattr, state, "warming_up", False
        )
    keeping = None
    if state.learned_state is not None:
        keeping = asyncio.create_task(_keep_learned(state, state.learned_state))
    yield
    if keeping is not None:
        keeping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeping
        await save_learned(state, state.learned_state)  # type: ignore[arg-type]
    if warm_up is not None:
        ready_anyway.cancel()
        warm_up.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await warm_up
    await state.shadow.stop()  # mirrors still running are aborted, never waited for
    await state.quotas.stop()  # the give-backs in flight, before the store closes
    if state.fleet is not None:
        await state.fleet.stop()
    await state.loop_lag.stop()
    await state.reloader.stop()
    for each in state.pools.pools:
        await each.health.stop()
    await state.upstream.close()
    state.counter.close()
    state.write_finished()
    state.request_log.close()


def restore_learned(
    settings: Settings, router: ModelRouter, events: Any, metrics: GatewayMetrics, fleet: Any
) -> LearnedState | None:
    """What an earlier run learned of these backends, back in their models before the
    first request (`upstream/learned_state.py`), the lanes refitted to it: from the state
    file now, or with [redis] from the fleet's Redis when the fleet starts."""
    path = settings.health.state_file
    if path == LEARNED_STATE_OFF or not (path or fleet is not None):
        return None
    if fleet is not None:
        shared = SharedLearnedState(fleet.store, events)
        for each in router.pools:
            each.sizer.learned_state = shared
        return shared
    learned = LearnedState(path, events, on_failure=metrics.state_file_failures.inc)
    learned.restore(_all_backends(router))
    for each in router.pools:
        each.sizer.learned_state = learned
        each.sizer.refit(quiet=True)  # said at the first round: a start that fails says why only
    return learned


def _all_backends(router: ModelRouter) -> list[Backend]:
    return [backend for each in router.pools for backend in each.pool.backends]


async def _keep_learned(state: GatewayState, learned: LearnedState) -> None:
    """With [redis], the fleet's figures first; then write every SAVE_EVERY_S (and once
    more at shutdown)."""
    if isinstance(learned, SharedLearnedState):
        if await learned.restore_shared(_all_backends(state.pools)):
            for each in state.pools.pools:
                each.sizer.refit()
    while True:
        await asyncio.sleep(LEARNED_SAVE_EVERY_S)
        await save_learned(state, learned)


async def save_learned(state: GatewayState, learned: LearnedState) -> None:
    facts = {
        backend.name: each.sizer.facts_of(backend)
        for each in state.pools.pools
        for backend in each.pool.backends
    }
    if isinstance(learned, SharedLearnedState):
        await learned.save_shared(_all_backends(state.pools), facts)
    else:
        learned.save(_all_backends(state.pools), facts)


async def _warm_up_all(state: GatewayState) -> None:
    """The start-up probe of every pool's backends, one pool after another."""
    for each in state.pools.pools:
        if each.health.session is not None:
            await each.sizer.warm_up(each.health.session)


async def _stop_tracing(app: web.Application) -> None:
    """After the last request: flush the spans still queued, a few seconds at most."""
    state = app[GATEWAY]
    if state.tracer is not None and not await state.tracer.shutdown():
        state.events.warning("tracing_flush_timeout", hint="the span collector did not answer")


#: After the drain deadline, how long the requests cut there have to end (their last
#: event written, their slot and its lease in Redis given back).
CUT_GRACE_S = 2.0


async def drain(app: web.Application, timeout_s: float) -> int:
    """SIGTERM: refuse new work (`/readyz` fails at once, so a load balancer stops
    sending), send the queued away, let in-flight streams finish; at `timeout_s` cut
    those still running, each with a last `shutting_down` event, so that their slots
    (with [redis], their leases) are given back now rather than when the process is
    killed (the other replicas would then wait for the lease TTL).

    Returns how many requests were still in flight when the time ran out.
    """
    state = app[GATEWAY]
    state.draining = True
    refused = sum(each.scheduler.fail_waiting(shutting_down()) for each in state.pools.pools)
    state.events.info("draining", queued_refused=refused, in_flight=state.in_flight)
    await _until_idle(state, timeout_s)
    left = state.in_flight
    if left:
        cut = cut_running(state)
        state.events.warning("drain_deadline", in_flight=left, cut=cut, deadline_s=timeout_s)
        # Cut again at each look: a request that was between its slot and its backend
        # at the deadline reaches its backend after it.
        await _until_idle(state, CUT_GRACE_S, each_look=lambda: cut_running(state))
    return left


def cut_running(state: GatewayState) -> int:
    """End every request on a backend here (`relay.Watchdog.shut_down`); how many."""
    watchdogs = [
        watchdog
        for each in state.pools.pools
        for backend in each.pool.backends
        for watchdog in list(backend.streams)
    ]
    for watchdog in watchdogs:
        watchdog.shut_down()
    return len(watchdogs)


async def _until_idle(
    state: GatewayState, timeout_s: float, each_look: Callable[[], object] | None = None
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    # Polling for a few seconds at shutdown is simpler than an event on every release.
    while state.in_flight and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
        if each_look is not None:
            each_look()
