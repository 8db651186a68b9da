"""Answers carried over mid-stream (`upstream/resume.py`): simulators as processes, killed.

Each test starts simulators as real processes (so SIGKILL and SIGSTOP do to them
what they do to an engine) behind a gateway, streams answers slow enough to be
surely mid-answer, kills or stops the backend that holds them, and reads the
whole answer the client got: one id/created/model, every token once, one
finish_reason, one [DONE], one usage counting every token. The surviving
simulator says what it was asked to continue (`/sim/requests`: `continued`,
`continue_form`, `max_tokens`, `reply`), which must be exactly the text the
client had, with the budget reduced.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from gateway.config import Settings
from tests.conftest import StartGateway, chat, free_port, sse_events
from tests.helpers import eventually

ROOT = Path(__file__).resolve().parents[2]
#: 40 ms a step: 25 tokens a second, so a 60-token answer takes ~2.5 s.
SLOW = ("--step-base-ms", "40", "--decode-ms-per-seq", "0.5", "--prefill-ms-per-token", "0.05")
MAX_TOKENS = 60


@dataclass
class Sim:
    url: str
    process: asyncio.subprocess.Process

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)


StartSims = Callable[..., Any]


@pytest.fixture
async def sims(http: aiohttp.ClientSession) -> AsyncIterator[StartSims]:
    started: list[Sim] = []

    async def start(count: int, *flags: str) -> list[Sim]:
        new = []
        for _ in range(count):
            port = free_port()
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "simulate", "--port", str(port), *SLOW, *flags,
                cwd=ROOT, env={k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")},
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            sim = Sim(f"http://127.0.0.1:{port}", process)
            started.append(sim)
            new.append(sim)
        for sim in new:
            await eventually(lambda s=sim: _answers(http, s.url + "/health"), within_s=15)
        return new

    yield start
    for sim in started:
        if sim.process.returncode is None:
            sim.process.send_signal(signal.SIGCONT)  # nothing is left stopped
            sim.process.kill()
            await sim.process.wait()


async def _answers(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=1)) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def _gateway(start_gateway: StartGateway, sims: list[Sim], **engine: str) -> Any:
    def configure(settings: Settings) -> Settings:
        backends = [msgspec.structs.replace(b, **engine) for b in settings.backends]
        return msgspec.structs.replace(settings, backends=backends)

    gateway = await start_gateway([s.url for s in sims], configure=configure)
    # What each engine is: from its /props at the first health round (or the config).
    await eventually(lambda: all(b.engine for b in gateway.state.pool.backends), within_s=10)
    return gateway


class Stream:
    """One streamed answer, read as it comes."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.request_id = resp.headers["x-request-id"]
        self.raw = b""
        self.tokens = 0

    async def read_tokens(self, count: int) -> None:
        """Until `count` token events have arrived (the answer is surely mid-way)."""
        while self.tokens < count:
            chunk = await asyncio.wait_for(self.resp.content.readany(), 10)
            assert chunk, "the stream ended early"
            self.raw += chunk
            self.tokens = self.raw.count(b'"content":"') + self.raw.count(b'"text":"')

    async def read_all(self) -> list[Any]:
        self.raw += await asyncio.wait_for(self.resp.read(), 20)
        return sse_events(self.raw)


def check_whole_chat(events: list[Any], *, usage: bool) -> str:
    """The checks of one unbroken answer; returns its text."""
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    assert not [c for c in chunks if "error" in c], chunks
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]
    roles = [c for c in chunks for ch in c["choices"] if ch.get("delta", {}).get("role")]
    assert len(roles) == 1
    texts = [ch["delta"].get("content") or "" for c in chunks for ch in c["choices"]]
    tokens = sum(1 for t in texts if t)
    assert tokens == MAX_TOKENS  # the simulator always writes max_tokens: none lost, none twice
    usages = [c["usage"] for c in chunks if c.get("usage")]
    if usage:
        assert len(usages) == 1 and usages[0]["completion_tokens"] == tokens
    else:
        assert not usages
    return "".join(texts)


async def _received(http: aiohttp.ClientSession, sim: Sim) -> list[dict[str, Any]]:
    async with http.get(sim.url + "/sim/requests") as resp:
        return list((await resp.json())["requests"])


async def _holder(gateway: Any, sims: list[Sim]) -> Sim:
    backends = gateway.state.pool.backends
    busiest = max(range(len(backends)), key=lambda i: backends[i].in_flight)
    return sims[busiest]


async def test_sigkill_mid_answer_every_stream_completes_whole_elsewhere(
    sims: StartSims, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    three = await sims(3)
    gateway = await _gateway(start_gateway, three)
    url = gateway.url + "/v1/chat/completions"
    streams = []
    for i in range(12):
        body = chat(f"Tell me story {i}.", max_tokens=MAX_TOKENS, stream=True)
        if i % 2:
            body["stream_options"] = {"include_usage": True}
        streams.append(Stream(await http.post(url, json=body)))
    await asyncio.gather(*(s.read_tokens(5) for s in streams))
    victim = await _holder(gateway, three)
    victim_name = f"b{three.index(victim)}"
    loop = asyncio.get_running_loop()
    killed_at = loop.time()
    victim.kill()
    answers = await asyncio.gather(*(s.read_all() for s in streams))
    assert loop.time() - killed_at < 8  # ~2.3 s of tokens were left at most

    lines = {line["request_id"]: line for line in gateway.request_lines()}
    survivors = [s for s in three if s is not victim]
    received = [r for s in survivors for r in await _received(http, s)]
    resumed = 0
    for i, (stream, events) in enumerate(zip(streams, answers, strict=True)):
        text = check_whole_chat(events, usage=bool(i % 2))
        line = lines[stream.request_id]
        assert line["outcome"] == "ok" and line["completion_tokens"] == MAX_TOKENS
        if not line["resumes"]:
            assert line["resumed_from"] is None
            continue
        resumed += 1
        assert line["resumes"] == 1 and line["resumed_from"] == [victim_name]
        assert line["resume_reason"] == "broken"
        (leg,) = [r for r in received if r["request_id"] == stream.request_id and r["continued"]]
        assert leg["continue_form"] == "continue_final_message"
        # Exactly the text the client had, the budget less the tokens it had got.
        assert text == leg["continued"] + leg["reply"]
        had = text[: len(leg["continued"])]
        assert leg["max_tokens"] == MAX_TOKENS - len(had.split()) > 0
    assert resumed >= 2  # the victim held the most streams
