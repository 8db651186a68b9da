"""Leak checks shared by the tests: what a gateway, and this process, still hold afterwards.

"Nothing left behind" means: no lane holds a slot or a queue entry, no backend an
in-flight request or a token budget, the queue and in-flight gauges (what /metrics
shows) read zero, and this process has no asyncio task and no open file descriptor
that it did not have at the baseline taken before the traffic.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any, Protocol

import pytest
from prometheus_client import CollectorRegistry

from gateway.state import GatewayState

#: The gauges that must read zero once every request has ended.
IDLE_GAUGES = ("gateway_queue_depth", "gateway_lane_in_flight", "gateway_backend_in_flight")


class HasState(Protocol):
    """A running gateway (`RunningGateway`, `LiveGateway`): its state is what is checked."""

    @property
    def state(self) -> GatewayState: ...


def open_fds() -> int:
    """File descriptors this process has open right now (Linux: /proc/self/fd)."""
    return len(os.listdir("/proc/self/fd"))


@dataclass
class Baseline:
    """The tasks and fds of an idle process, taken before the traffic a test sends."""

    tasks: set[asyncio.Task[Any]]
    fds: int


def baseline() -> Baseline:
    """Note the running loop's tasks and the open fds (call it from the test's loop)."""
    return Baseline(set(asyncio.all_tasks()), open_fds())


def held(state: GatewayState) -> list[str]:
    """Every slot, queue entry or token budget a request still holds, one line each."""
    found = []
    for lane in state.scheduler.lanes:
        if lane.in_flight or lane.queue:
            found.append(f"lane {lane.name}: in_flight={lane.in_flight} queued={len(lane.queue)}")
    for backend in state.pool.backends:
        if backend.in_flight or backend.prefilling_tokens or backend.outstanding_tokens:
            found.append(
                f"backend {backend.name}: in_flight={backend.in_flight} "
                f"prefilling_tokens={backend.prefilling_tokens} "
                f"outstanding_tokens={backend.outstanding_tokens}"
            )
    return found


def live_gauges(registry: CollectorRegistry) -> dict[str, float]:
    """The queue and in-flight gauges as /metrics would show them, by name and labels."""
    values = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name in IDLE_GAUGES:
                values[f"{sample.name}{sorted(sample.labels.values())}"] = sample.value
    return values


def leftovers(gateway: HasState, before: Baseline) -> list[str]:
    """What is held now that was not at `before`: gateway state, gauges, tasks, fds."""
    state = gateway.state
    problems = held(state)
    problems += [f"{k}={v}" for k, v in live_gauges(state.metrics.registry).items() if v]
    new_tasks = [t for t in asyncio.all_tasks() if t not in before.tasks and not t.done()]
    if new_tasks:
        problems.append(f"{len(new_tasks)} new tasks: {[t.get_coro() for t in new_tasks][:5]}")
    fds = open_fds()
    if fds > before.fds:
        problems.append(f"open fds {before.fds} -> {fds}")
    return problems


async def assert_nothing_left(
    gateway: HasState,
    before: Baseline,
    *,
    within_s: float = 5.0,
    poll_s: float = 0.05,
    after: str = "the request",
) -> None:
    """Fail unless nothing is left held within `within_s` (things take a moment to settle:
    a handler ends after its client read the last byte, a pooled connection expires)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while problems := leftovers(gateway, before):
        if loop.time() > deadline:
            pytest.fail(f"left behind after {after}: " + "; ".join(problems))
        await asyncio.sleep(poll_s)


async def eventually(check: Any, within_s: float = 5.0, step_s: float = 0.02) -> float:
    """Seconds until `check()` (sync, or async returning bool) holds; fails past `within_s`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return loop.time() - start
        if loop.time() - start > within_s:
            pytest.fail(f"condition not met within {within_s} s")
        await asyncio.sleep(step_s)


def require(what: str, found: bool, install: str) -> None:
    """Skip without `what`, or fail when running under CI (where it must be installed)."""
    if found:
        return
    why = f"{what} is not installed ({install})"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}, and CI=true: CI must have it", pytrace=False)
    pytest.skip(why)
