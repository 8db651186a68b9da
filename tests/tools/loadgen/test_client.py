"""The client: retries with Retry-After, and error codes read from every shape a server sends.

A tiny scripted aiohttp server on 127.0.0.1 gives the answers the simulator never
gives (429 then success, error envelopes, a mid-stream error event).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.tools.loadgen import (
    PlannedRequest,
    RetryPolicy,
    TrafficClass,
    closed_schedule,
    format_tables,
    run_open_loop,
    summarize_run,
)
from gateway.tools.loadgen.client import error_from_body


def planned(index: int = 0, max_tokens: int = 3) -> PlannedRequest:
    return closed_schedule([TrafficClass("short", 1, (20, 20), max_tokens)], index + 1, 0)[index]


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[str, list[Handler], list[float]]]:
    """A server whose answers are taken in order from a list; records arrival times."""
    script: list[Handler] = []
    arrivals: list[float] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        arrivals.append(asyncio.get_running_loop().time())
        await request.read()
        return await script.pop(0)(request)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), script, arrivals
    await server.close()


def envelope(status: int, code: str, headers: dict[str, str] | None = None) -> Handler:
    async def answer(request: web.Request) -> web.StreamResponse:
        body = {"error": {"message": f"{code}!", "type": "x", "param": None, "code": code}}
        return web.json_response(body, status=status, headers=headers)

    return answer


def stream(tokens: int, error_code: str | None = None) -> Handler:
    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "x-gateway-lane": "interactive",
                "x-gateway-queue-ms": "12.5",
            }
        )
        await response.prepare(request)
        head = {"id": "c", "object": "chat.completion.chunk", "model": "m"}

        async def send(obj: Any) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await response.write(f"data: {data}\n\n".encode())

        await send({**head, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for i in range(tokens):
            await asyncio.sleep(0.01)
            await send({**head, "choices": [{"index": 0, "delta": {"content": f"w{i} "}}]})
        if error_code:
            await send(
                {"error": {"message": "broke", "type": "x", "param": None, "code": error_code}}
            )
        else:
            usage = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": tokens + 5}
            await send({**head, "choices": [], "usage": usage})
            await send("[DONE]")
        await response.write_eof()
        return response

    return answer


async def test_retry_honours_retry_after(scripted: tuple[str, list[Handler], list[float]]) -> None:
    url, script, arrivals = scripted
    script += [envelope(429, "queue_full", {"Retry-After": "1"}), stream(3)]
    retry = RetryPolicy(max_attempts=3, backoff_s=0.01, max_backoff_s=0.05)
    run = await run_open_loop(url, [planned(max_tokens=3)], retry=retry, timeout_s=10)
    (result,) = run.results
    assert result.ok and result.attempts == 2
    assert arrivals[1] - arrivals[0] >= 0.99
    assert result.ttft_ms is not None and result.ttft_ms >= 1000  # from the first send
    assert result.e2e_ms is not None and result.e2e_ms >= result.ttft_ms
    assert result.completion_tokens == 3
    assert result.lane == "interactive" and result.queue_ms == 12.5
    assert result.reject_ms is None and result.retry_after_s == 1.0


async def test_an_eager_client_retries_at_once_ignoring_retry_after(
    scripted: tuple[str, list[Handler], list[float]],
) -> None:
    url, script, arrivals = scripted
    script += [envelope(429, "queue_full", {"Retry-After": "5"})] * 3 + [stream(2)]
    retry = RetryPolicy(max_attempts=2, backoff_s=1.0, eager_share=1.0, eager_attempts=4)
    run = await run_open_loop(url, [planned(max_tokens=2)], retry=retry, timeout_s=10)
    (result,) = run.results
    assert result.eager and result.ok and result.attempts == 4
    assert arrivals[-1] - arrivals[0] < 0.5  # no backoff, no Retry-After wait


def test_the_eager_share_picks_the_same_requests_every_run() -> None:
    policy = RetryPolicy(eager_share=0.3)
    picked = [i for i in range(1000) if policy.eager(i)]
    assert picked == [i for i in range(1000) if RetryPolicy(eager_share=0.3).eager(i)]
    assert 250 < len(picked) < 350
    assert not any(RetryPolicy().eager(i) for i in range(100))
    with pytest.raises(ValueError):
        RetryPolicy(eager_share=1.5)


async def test_error_code_from_envelope_without_retries(
    scripted: tuple[str, list[Handler], list[float]],
) -> None:
    url, script, _ = scripted
    script += [envelope(429, "queue_full", {"Retry-After": "3"}), envelope(400, "prompt_bad")]
    run = await run_open_loop(url, [planned(0)], timeout_s=10)
    (result,) = run.results
    assert (result.status, result.error_code, result.attempts) == (429, "queue_full", 1)
    assert result.retry_after_s == 3.0 and not result.ok
    assert result.reject_ms is not None and result.reject_ms < 2_000
    assert result.ttft_ms is None

    # A 400 is not worth retrying, whatever the policy.
    run = await run_open_loop(url, [planned(0)], retry=RetryPolicy(max_attempts=3), timeout_s=10)
    (result,) = run.results
    assert (result.status, result.error_code, result.attempts) == (400, "prompt_bad", 1)
    summary = summarize_run(run)
    assert summary["all"]["errors"] == {"400/prompt_bad": 1}
    assert summary["all"]["reject_ms"]["p99"] is not None


async def test_error_code_from_a_mid_stream_event(
    scripted: tuple[str, list[Handler], list[float]],
) -> None:
    url, script, _ = scripted
    script.append(stream(2, error_code="backend_timeout"))
    run = await run_open_loop(url, [planned(0)], timeout_s=10)
    (result,) = run.results
    assert result.status == 200 and result.error_code == "backend_timeout" and not result.ok
    assert result.error_message == "broke"
    assert result.ttft_ms is not None and result.content_chunks == 2
    assert summarize_run(run)["short"]["errors"] == {"200/backend_timeout": 1}


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (
            b'{"error": {"message": "m", "type": "t", "param": null, "code": "queue_full"}}',
            "queue_full",
        ),
        (
            b'{"object": "error", "message": "m", "type": "BadRequestError", "code": 400}',
            "BadRequestError",
        ),
        (
            b'{"error": {"code": 400, "message": "m", "type": "invalid_request_error"}}',
            "invalid_request_error",
        ),
        (b'{"error": "Input validation error", "error_type": "validation"}', "validation"),
        (b"<html>502 Bad Gateway</html>", None),
    ],
)
def test_error_code_from_known_error_bodies(body: bytes, code: str | None) -> None:
    assert error_from_body(body)[0] == code


async def test_connection_errors_are_retried() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    retry = RetryPolicy(max_attempts=3, backoff_s=0.01, max_backoff_s=0.02)
    run = await run_open_loop(f"http://127.0.0.1:{port}", [planned(0)], retry=retry)
    (result,) = run.results
    assert result.status is None and result.error_code == "connection_error"
    assert result.attempts == 3 and result.reject_ms is None
    assert "-/connection_error" in format_tables([("x", summarize_run(run))])
