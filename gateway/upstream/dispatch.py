"""Run a request on its backend, once more on another when the first failed before any byte.

Retry and passive health are upstream policy, not the handler's: a failure
before anything reached the client (connection refused or reset, a 502/503,
a broken answer) is safe to repeat elsewhere, once; after the first byte
nothing is repeated: a stream that breaks off is carried over to another
backend from where it was (`resume.py`) when it can be. Every attempt's result goes to the pool, which decides
health from it.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from gateway.observability.record import RequestRecord
from gateway.outcomes import BackendTimeout, Outcome
from gateway.upstream.pool import Backend, BackendPool
from gateway.upstream.relay import (
    STREAM_ERROR_CODE,
    BackendFailure,
    RelayPlan,
    StreamBroken,
    UpstreamClient,
    relay,
)
from gateway.upstream.resume import Resumer, carry_over, note_broken

#: A request that failed before its first byte is retried once, on another backend.
MAX_ATTEMPTS = 2


async def dispatch(
    request: web.Request,
    record: RequestRecord,
    *,
    upstream: UpstreamClient,
    pool: BackendPool,
    backend: Callable[[], Backend],
    plan_for: Callable[[Backend], RelayPlan],
    move_elsewhere: Callable[[], bool],
    resumer: Resumer | None = None,
) -> web.StreamResponse:
    """Relay on `backend()`; on a failure before the first byte, `move_elsewhere()` and retry.

    `move_elsewhere` moves the request's slot to another backend (False when
    none is free), so `backend()` names the new one afterwards.
    """
    tries = 0  # this dispatch's (a preempted request is dispatched again, afresh)
    while True:
        tries += 1
        record.attempts += 1
        target = backend()
        record.backend = target.name
        record.engine = target.engine
        try:
            response = await relay(request, plan_for(target), record, upstream)
        except BackendFailure as failure:
            pool.record_result(target, Outcome.BACKEND_ERROR)
            if tries < MAX_ATTEMPTS and move_elsewhere():
                continue
            if failure.passthrough is None:
                raise
            return failure.passthrough
        except BackendTimeout:
            pool.record_result(target, Outcome.BACKEND_TIMEOUT)
            raise
        except StreamBroken as broken:  # only raised when the plan kept what was relayed
            note_broken(pool, target, broken)
            assert resumer is not None
            return await carry_over(
                request, record, broken, upstream=upstream, pool=pool, resumer=resumer
            )
        # An error the backend reported inside a 200 stream (TGI's validation
        # errors, for one) is about the request, not the server: it does not count.
        if record.outcome is not None and record.error_code != STREAM_ERROR_CODE:
            pool.record_result(target, record.outcome)
        return response
