"""How late the event loop runs a timer: the gateway's own delay, as a histogram.

Every request's admission, relay and record run on one event loop. When that
work piles up (a burst of arrivals, a huge prompt counted on the loop), every
request waits for the loop, and neither the queue nor the backend is to blame.
A timer that asks to wake every `interval_s` and notes how late it woke
measures exactly that wait; `gateway_event_loop_lag_seconds` lets an operator
see it next to the queue and TTFT histograms.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from prometheus_client import CollectorRegistry, Histogram

#: From "the loop is idle" to "every request is waiting for the gateway itself".
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
INTERVAL_S = 0.25


class LoopLagMonitor:
    def __init__(self, registry: CollectorRegistry, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.histogram = Histogram(
            "gateway_event_loop_lag_seconds",
            "How late the gateway's event loop ran a timer: time every request waits for "
            "the gateway itself.",
            buckets=LAG_BUCKETS,
            registry=registry,
        )
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.histogram.observe(max(0.0, time.perf_counter() - asked - self.interval_s))
