"""What each dialect sends and reads: UTF-8 bodies, TGI token counts, fine-grained timings."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.conftest import StartGateway, StartSimulator, chat, free_port, wait_ready

ROOT = Path(__file__).resolve().parents[2]
CHINESE = "请用三句话解释排队论。日本語も少し。🙂"


@pytest.fixture
async def recording_backend() -> AsyncIterator[tuple[str, list[bytes]]]:
    """An OpenAI backend that keeps the raw bodies it was sent."""
    bodies: list[bytes] = []

    async def chat_completions(request: web.Request) -> web.Response:
        bodies.append(await request.read())
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "choices": [],
                "usage": {"completion_tokens": 1},
            }
        )

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/health", health)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), bodies
    await server.close()


async def test_non_ascii_prompts_reach_the_backend_as_utf8(
    recording_backend: tuple[str, list[bytes]],
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    url, bodies = recording_backend
    gateway = await start_gateway([url])
    async with http.post(
        gateway.url + "/v1/chat/completions", json=chat(CHINESE, max_tokens=5)
    ) as response:
        assert response.status == 200, await response.text()
    (sent,) = bodies
    assert CHINESE.encode() in sent  # as UTF-8 bytes, not \uXXXX escapes
    assert b"\\u" not in sent
    assert b": " not in sent and b", " not in sent  # compact
    assert json.loads(sent)["messages"][0]["content"] == CHINESE
    assert json.loads(sent)["max_tokens"] == 5


async def _last_request_line(gateway: Any) -> dict[str, Any]:
    for _ in range(100):
        lines = gateway.request_lines()
        if lines:
            return lines[-1]  # type: ignore[no-any-return]
        await asyncio.sleep(0.02)
    raise AssertionError("no request line")


async def test_tgi_compat_with_details_logs_its_generated_tokens(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """huggingface_hub's text_generation(details=True) posts here; TGI answers a list."""
    gateway = await start_gateway([await start_simulator_at()])
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 6, "details": True}}
    async with http.post(gateway.url + "/", json=body) as response:
        assert response.status == 200
        answer = await response.json()
    assert isinstance(answer, list)
    generated = answer[0]["details"]["generated_tokens"]
    line = await _last_request_line(gateway)
    assert line["completion_tokens"] == generated > 0


@pytest.mark.parametrize("path", ["/generate", "/"])
async def test_tgi_without_details_logs_tokens_and_answers_without_details(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
    path: str,
) -> None:
    sim = await start_simulator_at()
    gateway = await start_gateway([sim])
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 6}}
    async with http.post(sim + path, json=body) as response:
        direct = await response.json()
    async with http.post(gateway.url + path, json=body) as response:
        assert response.status == 200
        through = await response.json()
    # The gateway asked the backend for details; the client did not and gets none.
    assert members(through) == members(direct) == members({"generated_text": ""}, path)
    line = await _last_request_line(gateway)
    assert line["completion_tokens"] == 6


async def test_tgi_stream_without_details_counts_its_token_events(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await start_gateway([await start_simulator_at()])
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 7}}
    async with http.post(gateway.url + "/generate_stream", json=body) as response:
        assert response.status == 200
        raw = await response.read()
    token_events = [e for e in raw.split(b"\n\n") if e.startswith(b"data:") and b'"token"' in e]
    line = await _last_request_line(gateway)
    assert line["completion_tokens"] == len(token_events) == 7


def members(answer: Any, path: str | None = None) -> Any:
    """The keys of a TGI answer (a one-element list on `/`); its text is random."""
    if path == "/":
        answer = [answer]
    if isinstance(answer, list):
        return [sorted(item) for item in answer]
    return sorted(answer)


async def test_timings_are_sub_millisecond_under_uvloop(
    start_simulator_at: StartSimulator, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """`serve` runs on uvloop, whose loop.time() ticks in whole ms: records must not use it."""
    pytest.importorskip("uvloop")
    sim = await start_simulator_at()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--backend", sim, "--port", str(port),
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        assert process.stderr is not None and process.stdout is not None
        started = b""
        while b"gateway_started" not in started:
            started = await asyncio.wait_for(process.stderr.readline(), 20)
            assert started, "the gateway exited"
        assert json.loads(started)["event_loop"] == "uvloop"
        await wait_ready(http, url)
        for _ in range(5):
            async with http.post(
                url + "/v1/chat/completions", json=chat(stream=True, max_tokens=3)
            ) as response:
                assert response.status == 200
                await response.read()
        values = []
        for _ in range(5):
            line = json.loads(await asyncio.wait_for(process.stdout.readline(), 10))
            values += [line[key] for key in ("queue_ms", "backend_ttft_ms", "ttft_ms", "e2e_ms")]
        assert all(isinstance(v, float) for v in values), values
        assert any(v != round(v) for v in values), values  # not whole milliseconds
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), 30)
