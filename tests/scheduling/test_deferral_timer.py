"""The scheduler's own timer for a deferred look at its queues, on uvloop (the gateway's
loop): uvloop answers a `call_at` due within half a millisecond with a plain `Handle`
(no `when()`). Under load the time between reading the clock and scheduling can be
that long, and the next deferral then raised AttributeError inside dispatch, which
became a 500 for a short request (`make bench`, 120%)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvloop

from gateway.scheduling import scheduler as scheduler_module
from tests.scheduling.test_scheduler import make


class LateLoop:
    """The running loop, read 10 ms before it schedules (a busy moment between the two)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def time(self) -> float:
        return self._loop.time() - 0.01

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)


def test_a_deferral_due_at_once_on_uvloop_does_not_break_the_next_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario() -> None:
        scheduler, _ = make(2)
        late = LateLoop(asyncio.get_running_loop())
        monkeypatch.setattr(scheduler_module.asyncio, "get_running_loop", lambda: late)
        scheduler._serve_again_in(0.0)
        first = scheduler._deferral_timer
        assert first is not None and not hasattr(first, "when")  # what uvloop gives
        scheduler._serve_again_in(0.0)  # raised AttributeError: 'Handle' ... 'when'
        scheduler._serve_again_in(5.0)  # a later one keeps the earlier
        assert scheduler._deferral_timer is first
        monkeypatch.undo()
        await asyncio.sleep(0.01)
        assert scheduler._deferral_timer is None  # it ran and looked at the queues

    uvloop.run(scenario())
