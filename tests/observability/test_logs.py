"""The per-request log line: one JSON object per line, ASCII only, never the prompt."""

from __future__ import annotations

import asyncio
import io
import json
import time
from enum import StrEnum
from typing import Any

import aiohttp

from gateway.observability.logs import HANDOFF_S, RequestLog, make_logger
from gateway.observability.record import RequestRecord
from tests.conftest import DOCUMENTED_LOG_FIELDS, StartGateway, StartSimulator, chat


def record(**changes: Any) -> RequestRecord:
    fields: dict[str, Any] = {
        "request_id": "r-1",
        "route": "/v1/chat/completions",
        "arrival": 10.0,
        "model": "sim-model",
        "lane": "interactive",
        "status": 200,
        "outcome": "ok",
        "enqueued": 10.0,
        "dispatched": 10.5,
        "first_token": 11.0,
        "end": 12.0,
        "completion_tokens": 3,
    }
    fields.update(changes)
    return RequestRecord(**fields)


def strict_utf8_stream() -> tuple[io.TextIOWrapper, io.BytesIO]:
    """Like stdout: a line it cannot encode raises instead of being written."""
    raw = io.BytesIO()
    return io.TextIOWrapper(raw, encoding="utf-8", errors="strict", newline="\n"), raw


def written_lines(stream: io.TextIOWrapper, raw: io.BytesIO) -> list[str]:
    stream.flush()
    return raw.getvalue().decode("ascii").split("\n")


def test_each_request_is_one_json_object_on_one_line() -> None:
    stream, raw = strict_utf8_stream()
    log = RequestLog(stream)
    log.request(record(request_id="r-1"))
    log.request(record(request_id="r-2", model="line\nbreak", outcome="queue_timeout"))
    *lines, tail = written_lines(stream, raw)
    assert tail == ""  # every line ends with a newline
    assert len(lines) == 2
    parsed = [json.loads(line) for line in lines]
    assert [p["request_id"] for p in parsed] == ["r-1", "r-2"]
    assert all(p["event"] == "request" and p["level"] == "info" for p in parsed)
    assert all(p["timestamp"].endswith("Z") for p in parsed)  # ISO 8601, UTC
    assert parsed[1]["model"] == "line\nbreak"  # escaped, so it could not split the line
    assert parsed[1]["outcome"] == "queue_timeout"


def test_the_line_has_the_documented_fields_and_null_for_absent_values() -> None:
    stream, raw = strict_utf8_stream()
    RequestLog(stream).request(record(first_token=None, completion_tokens=None))
    (line, _) = written_lines(stream, raw)
    parsed = json.loads(line)
    assert DOCUMENTED_LOG_FIELDS <= set(parsed)
    assert parsed["queue_ms"] == 500.0
    assert parsed["e2e_ms"] == 2000.0
    assert parsed["ttft_ms"] is None and parsed["backend_ttft_ms"] is None
    assert parsed["tpot_ms"] is None and parsed["completion_tokens"] is None
    assert parsed["engine_queue_ms"] is None and parsed["timing_source"] is None
    assert "null" in line  # absent, not left out and not made up


def test_a_lone_surrogate_in_the_model_name_cannot_break_the_log_stream() -> None:
    stream, raw = strict_utf8_stream()
    log = RequestLog(stream)
    log.request(record(request_id="bad", model="\ud800x\udfff"))  # what JSON can spell
    log.request(record(request_id="next", model="Modèle-é"))
    lines = written_lines(stream, raw)[:-1]  # decodes as ASCII, or this raises
    parsed = [json.loads(line) for line in lines]
    assert [p["request_id"] for p in parsed] == ["bad", "next"]
    assert parsed[0]["model"] == "\ud800x\udfff"
    assert parsed[1]["model"] == "Modèle-é"
    assert "\\ud800" in lines[0] and "\\u00e8" in lines[1]


def test_a_string_enum_outcome_is_logged_as_its_value() -> None:
    class Outcome(StrEnum):
        QUEUE_TIMEOUT = "queue_timeout"

    stream, raw = strict_utf8_stream()
    RequestLog(stream).request(record(outcome=Outcome.QUEUE_TIMEOUT))
    (line, _) = written_lines(stream, raw)
    assert json.loads(line)["outcome"] == "queue_timeout"


def test_the_level_filters_lifecycle_events() -> None:
    stream = io.StringIO()
    logger = make_logger(stream, level="warning")
    logger.info("started")
    logger.warning("redis_unavailable", detail="x")
    (line,) = stream.getvalue().splitlines()
    assert json.loads(line)["event"] == "redis_unavailable"


async def test_prompt_text_is_never_logged(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await start_gateway([await start_simulator_at()])
    secret = "zebra-quartz-7731 is the password"
    for body in (
        chat(secret, max_tokens=2),
        chat(secret, max_tokens=2, stream=True),
        {"model": "sim-model", "prompt": secret, "max_tokens": 2},
    ):
        route = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        async with http.post(gateway.url + route, json=body) as resp:
            await resp.read()
            assert resp.status == 200
    log = gateway.log.getvalue()
    assert len(gateway.request_lines()) == 3
    assert "zebra" not in log
    for line in gateway.request_lines():
        assert not {"messages", "prompt", "content", "inputs"} & set(line)
        assert line["prompt_tokens"] > 0  # counted, not copied


class CountingStream(io.StringIO):
    """A stdout stand-in that counts the writes the writer thread makes."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


async def test_a_background_log_hands_a_burst_of_lines_to_its_writer_at_once() -> None:
    # Waking the writer thread for every line cost the loop more than the line itself.
    stream = CountingStream()
    log = RequestLog(stream, background=True)
    for n in range(50):
        log.request(record(request_id=f"r-{n}"))
    assert stream.getvalue() == ""  # held for HANDOFF_S, not written line by line
    await asyncio.sleep(HANDOFF_S * 4)
    log.close()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["request_id"] for line in lines] == [f"r-{n}" for n in range(50)]
    assert stream.writes == 1


async def test_closing_a_background_log_writes_the_lines_it_still_holds() -> None:
    stream = CountingStream()
    log = RequestLog(stream, background=True)
    log.request(record(request_id="last"))
    log.close()  # at shutdown, well before HANDOFF_S
    assert json.loads(stream.getvalue())["request_id"] == "last"


def test_a_background_log_used_outside_the_loop_hands_each_line_over_at_once() -> None:
    stream = CountingStream()
    log = RequestLog(stream, background=True)
    log.request(record(request_id="sync"))  # no loop: no timer to hold it for
    deadline = time.monotonic() + 2.0
    while not stream.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert json.loads(stream.getvalue())["request_id"] == "sync"
    log.close()
