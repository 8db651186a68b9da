"""A served gateway's finished requests are written in slices of the loop's turns
(`GatewayState.finish`): never the whole batch in one turn, all of it on a scrape."""

from __future__ import annotations

import asyncio
import io

from gateway.app import build_app
from gateway.config import BackendSettings, Settings
from gateway.observability.record import RequestRecord, clock
from gateway.state import FINISH_SLICE, GATEWAY
from tests.conftest import encoding


def ended(request_id: str) -> RequestRecord:
    record = RequestRecord(request_id, "/v1/chat/completions", clock())
    record.status, record.end = 400, clock()
    return record


async def test_a_batch_goes_a_slice_a_turn_and_a_flush_writes_the_rest_at_once() -> None:
    log = io.StringIO()
    settings = Settings(backends=[BackendSettings(url="http://127.0.0.1:9", name="b")])
    state = build_app(settings, log_stream=log, encoding=encoding())[GATEWAY]
    state.finish_after_s = 0.001
    for n in range(3 * FINISH_SLICE + 2):
        state.finish(ended(f"r{n}"))
    assert log.getvalue() == ""  # held for the batch

    written: list[int] = []
    give_up = asyncio.get_running_loop().time() + 2.0
    while (not written or written[-1] < 3 * FINISH_SLICE + 2) and (
        asyncio.get_running_loop().time() < give_up
    ):
        await asyncio.sleep(0)
        count = log.getvalue().count("\n")
        if count and (not written or count != written[-1]):
            written.append(count)
    assert written == [FINISH_SLICE, 2 * FINISH_SLICE, 3 * FINISH_SLICE, 3 * FINISH_SLICE + 2]

    for n in range(2 * FINISH_SLICE):
        state.finish(ended(f"s{n}"))
    state.write_finished()  # a scrape: everything at once, no timer left behind
    assert log.getvalue().count("\n") == 5 * FINISH_SLICE + 2
    await asyncio.sleep(0.01)
    assert log.getvalue().count("\n") == 5 * FINISH_SLICE + 2
