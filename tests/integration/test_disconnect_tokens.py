"""A client gone mid-stream: its log line counts the tokens it was relayed (issue #51).

The engine's usage chunk comes only at a stream's end, so a stream cut short has none;
the gateway then counts the token events it relayed. The simulator steps slowly here
(50 ms a token), so the client leaves long before its `max_tokens` are generated.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from gateway.upstream.sse import OpenAIStreamWatcher
from tests.conftest import StartGateway, StartSimulator, chat
from tests.helpers import eventually

MAX_TOKENS = 200
#: Token events the client reads before it goes away.
READ_TOKENS = 3
#: The simulator's step: one token per sequence every 50 ms (+ 0.5 ms per sequence).
SLOW_STEP_MS = 50.0


def payload(event: bytes) -> Any:
    """The JSON `data:` of one SSE event (TGI writes `data:` without the space); None for
    `[DONE]` and events without data."""
    for line in event.decode().splitlines():
        if line.startswith("data:"):
            data = line[len("data:") :].strip()
            return None if data == "[DONE]" else json.loads(data)
    return None


def chat_tokens(event: Any) -> int:
    """Choices with content in an OpenAI chat chunk (the role chunk has none)."""
    if not isinstance(event, dict):
        return 0
    return sum(1 for choice in event.get("choices") or () if choice["delta"].get("content"))


def tgi_tokens(event: Any) -> int:
    return 1 if isinstance(event, dict) and isinstance(event.get("token"), dict) else 0


CASES = {
    "chat": (
        "/v1/chat/completions",
        chat("Tell me a long story.", max_tokens=MAX_TOKENS, stream=True),
        chat_tokens,
    ),
    "tgi": (
        "/generate_stream",
        {"inputs": "Tell me a long story.", "parameters": {"max_new_tokens": MAX_TOKENS}},
        tgi_tokens,
    ),
}


async def request_line(gateway: Any) -> dict[str, Any]:
    """The one request's log line, once the gateway has written it (bounded wait)."""
    await eventually(lambda: len(gateway.request_lines()) == 1, within_s=5)
    return gateway.request_lines()[0]


async def sim_request(http: aiohttp.ClientSession, sim: str) -> dict[str, Any]:
    async with http.get(sim + "/sim/requests") as resp:
        requests = (await resp.json())["requests"]
    assert len(requests) == 1
    return requests[0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(CASES))
async def test_a_client_gone_mid_stream_is_logged_with_the_tokens_it_was_relayed(
    case: str,
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    path, body, tokens_in = CASES[case]
    sim = await start_simulator_at(step_base_ms=SLOW_STEP_MS)
    gateway = await start_gateway([sim])
    read = 0
    resp = await http.post(gateway.url + path, json=body)
    try:
        assert resp.status == 200
        while read < READ_TOKENS:
            event = await resp.content.readuntil(b"\n\n")
            assert event, "the stream ended before the client left"
            read += tokens_in(payload(event))
    finally:
        resp.close()  # the client goes away mid-stream

    line = await request_line(gateway)
    assert line["outcome"] == "client_disconnected"
    assert line["status"] == 200
    tokens = line["completion_tokens"]
    assert isinstance(tokens, int), line
    assert READ_TOKENS <= tokens <= MAX_TOKENS, line
    # Never more than the engine generated (counted, not made up), which stopped early.
    await eventually(lambda: _aborted(http, sim), within_s=5)
    generated = (await sim_request(http, sim))["completion_tokens"]
    assert tokens <= generated < MAX_TOKENS, (tokens, generated)


async def _aborted(http: aiohttp.ClientSession, sim: str) -> bool:
    return (await sim_request(http, sim))["outcome"] == "aborted"


@pytest.mark.timeout(30)
async def test_a_client_gone_before_the_first_byte_has_no_completion_count(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """Nothing was relayed: null, not 0 (no number is made up)."""
    sim = await start_simulator_at(step_base_ms=SLOW_STEP_MS)
    gateway = await start_gateway([sim])
    prompt = "hello " * 6000  # ~3 s of prefill (longer with the slow step): no byte yet
    body = chat(prompt, max_tokens=10, stream=True)
    task = asyncio.create_task(http.post(gateway.url + "/v1/chat/completions", json=body))
    await eventually(lambda: _running(http, sim), within_s=5)
    task.cancel()  # the client closes its connection while the backend prefills
    line = await request_line(gateway)
    assert (line["status"], line["outcome"]) == (499, "client_disconnected")
    assert line["completion_tokens"] is None, line


async def _running(http: aiohttp.ClientSession, sim: str) -> bool:
    async with http.get(sim + "/sim/stats") as resp:
        return (await resp.json())["running"] == 1


# ------------------------------------------------ the count itself, without the servers
# (kept here, beside the test it backs; the watcher's own tests are tests/upstream/test_sse.py)

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"word "},"finish_reason":null}]}\n\n'
#: A token whose text holds an SSE line of its own: not a second event.
SSE_TEXT = b'data: {"choices":[{"index":0,"delta":{"content":"\\ndata: x"}}]}\n\n'
#: vLLM's last token carries its finish_reason; llama.cpp's finish event has no token.
LAST = b'data: {"choices":[{"index":0,"delta":{"content":"end"},"finish_reason":"length"}]}\n\n'
FINISH = b'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":9}}\n\n'
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("stream", "relayed"),
    [
        (ROLE + TOKEN * 4, 4),  # cut short
        (ROLE + TOKEN * 3 + SSE_TEXT + LAST + DONE, 5),  # no usage (not asked for)
        (ROLE + TOKEN * 6 + FINISH + DONE, 6),
        ((ROLE + TOKEN * 3 + FINISH + DONE).replace(b"\n", b"\r\n"), 3),
        (ROLE + TOKEN * 6 + FINISH + USAGE + DONE, 9),  # the engine's count wins
        (ROLE, 0),  # started, no token yet
    ],
    ids=["cut", "last-token-finishes", "finish-without-token", "crlf", "usage", "role-only"],
)
def test_the_watcher_counts_the_token_events_it_relayed_in_any_chunking(
    stream: bytes, relayed: int
) -> None:
    for size in (1, 2, 5, 13, 64, len(stream)):
        watcher = OpenAIStreamWatcher(strip_usage=True)
        for at in range(0, len(stream), size):
            watcher.feed(stream[at : at + size])
        watcher.flush()
        assert watcher.relayed_tokens == relayed, size
