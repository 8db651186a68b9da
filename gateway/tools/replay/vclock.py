"""An asyncio event loop on a virtual clock: when nothing is ready, time jumps to the next timer.

The gateway's scheduler, the pool and the simulator's engine all run on asyncio (futures,
`asyncio.sleep`, `call_later` for queue timeouts). Running them unchanged on a loop whose
clock is virtual replays an hour of traffic in seconds with the very code that serves it,
in the same order of calls; only the waiting is skipped.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any


class _SkippingSelector(selectors.BaseSelector):
    """Never waits: a wait for `timeout` moves the clock by `timeout` instead."""

    def __init__(self, loop_clock: VirtualClock) -> None:
        self._inner = selectors.DefaultSelector()
        self._clock = loop_clock

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise RuntimeError("virtual clock: nothing scheduled and nothing ready (a deadlock)")
        if timeout > 0:
            self._clock.now += timeout
        # The loop's only descriptor is its self-pipe (call_soon_threadsafe, signals), which
        # a replay never uses: polling it every iteration cost more than the step itself.
        return []

    def get_map(self) -> Any:
        return self._inner.get_map()

    def close(self) -> None:
        self._inner.close()


class VirtualClock:
    """The time of a virtual loop, in seconds from its start."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class VirtualLoop(asyncio.SelectorEventLoop):
    """`time()` is the virtual clock; an idle wait advances it at once."""

    def __init__(self, clock: VirtualClock | None = None) -> None:
        self.clock = clock or VirtualClock()
        super().__init__(_SkippingSelector(self.clock))
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self.clock.now


def run_virtual(main: Coroutine[Any, Any, Any], clock: VirtualClock | None = None) -> Any:
    """Run `main` to completion on a fresh virtual loop; returns its result."""
    loop = VirtualLoop(clock)
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()
