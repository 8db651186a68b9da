"""A tiny multi-turn run against the real simulator, seen from the wire in between.

A relay between the load generator and the simulator keeps each request's
headers and body and the answer's bytes as they went by, so the test checks
what was really sent (turn 2 carries turn 1's reply as streamed, the session
header and `user` field) rather than what the client believes it sent.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.tools.loadgen import MULTI_TURN, plan_conversations, run_conversations
from gateway.tools.loadgen.conversations import FIRST_TURN, LATER_TURN
from tests.conftest import StartSimulator, sse_events

TINY = dataclasses.replace(
    MULTI_TURN,
    conversations=2,
    tenants=1,
    system_tokens=(600, 600),
    user_tokens=(60, 80),
    turns=(2, 2),
    max_tokens=(12, 20),
    think_s=0.2,
    start_window_s=0.2,
    one_off_share=0.0,
)

Exchange = dict[str, Any]


@pytest.fixture
async def recording_relay() -> AsyncIterator[
    Callable[[str], Awaitable[tuple[str, list[Exchange]]]]
]:
    """`relay(upstream)`: a URL that forwards chat requests to `upstream`, and the log."""
    runners: list[web.AppRunner] = []
    sessions: list[aiohttp.ClientSession] = []

    async def start(upstream: str) -> tuple[str, list[Exchange]]:
        seen: list[Exchange] = []
        session = aiohttp.ClientSession()
        sessions.append(session)

        async def forward(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            exchange: Exchange = {
                "headers": {k.lower(): v for k, v in request.headers.items()},
                "body": json.loads(body),
            }
            seen.append(exchange)
            headers = {
                "Content-Type": "application/json",
                "x-request-id": request.headers["x-request-id"],
            }
            async with session.post(upstream + request.path, data=body, headers=headers) as up:
                response = web.StreamResponse(
                    status=up.status, headers={"Content-Type": up.headers["Content-Type"]}
                )
                await response.prepare(request)
                raw = b""
                async for chunk in up.content.iter_any():
                    raw += chunk
                    await response.write(chunk)
                exchange["answer"] = raw
                await response.write_eof()
                return response

        app = web.Application()
        app.router.add_post("/v1/chat/completions", forward)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}", seen

    yield start
    for session in sessions:
        await session.close()
    for runner in runners:
        await runner.cleanup()


def streamed_text(raw: bytes) -> str:
    text = ""
    for event in sse_events(raw):
        if isinstance(event, dict):
            for choice in event.get("choices") or ():
                text += (choice.get("delta") or {}).get("content") or ""
    return text


async def test_second_turn_resends_the_first_reply_with_the_session(
    start_simulator_at: StartSimulator,
    recording_relay: Callable[[str], Awaitable[tuple[str, list[Exchange]]]],
) -> None:
    simulator = await start_simulator_at()
    relay, seen = await recording_relay(simulator)
    plan = plan_conversations(TINY, seed=11)
    run = await run_conversations(relay, plan, timeout_s=30)

    assert len(run.results) == plan.requests == 4
    assert all(r.ok for r in run.results), run.results
    by_id = {r.request_id: r for r in run.results}
    exchanges = {e["headers"]["x-request-id"]: e for e in seen}
    assert set(exchanges) == set(by_id)
    for conversation in plan.conversations:
        first, second = (
            next(r for r in run.results if r.conversation == conversation.id and r.turn == n)
            for n in (1, 2)
        )
        assert (first.cls, second.cls) == (FIRST_TURN, LATER_TURN)
        sent_first, sent_second = exchanges[first.request_id], exchanges[second.request_id]
        for sent in (sent_first, sent_second):
            assert sent["headers"]["x-session-id"] == conversation.id
            assert sent["body"]["user"] == conversation.id
            assert sent["body"]["stream"] is True
        reply = streamed_text(sent_first["answer"])  # what went over the wire
        assert reply and first.reply == reply
        messages = sent_second["body"]["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
        assert messages[:2] == sent_first["body"]["messages"]
        assert messages[2] == {"role": "assistant", "content": reply}
        assert second.prompt_tokens > first.prompt_tokens + first.tokens
        assert second.e2e_ms is not None and second.sent_ms is not None
        assert first.e2e_ms is not None and first.sent_ms is not None
        # Think time runs from the end of the first answer.
        assert second.sent_ms >= first.sent_ms + first.e2e_ms

    # Both conversations open with the one system prompt, tagged for this run.
    systems = {e["body"]["messages"][0]["content"] for e in seen}
    assert len(systems) == 1 and next(iter(systems)).startswith(f"Session {run.run_tag} ")

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{simulator}/sim/requests") as resp:
            logged = {r["request_id"]: r for r in (await resp.json())["requests"]}
    for result in run.results:
        # The history's size as the loadgen counts it is the simulator's count too.
        assert logged[result.request_id]["prompt_tokens"] == result.prompt_tokens
    # The simulator's prefix cache serves a second turn its history: the usage says so.
    later = [r for r in run.results if r.turn == 2]
    assert all(r.cached_tokens is not None and r.cached_tokens >= 512 for r in later), later
