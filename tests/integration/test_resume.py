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
import json
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

from gateway.config import ApiKeySettings, Settings
from tests.conftest import StartGateway, chat, free_port
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
        return [await start_one(flags) for _ in range(count)]

    async def start_one(flags: tuple[str, ...]) -> Sim:
        """A simulator process that answers /health; another port if its own was taken."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        for _ in range(3):
            port = free_port()
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "simulate", "--port", str(port), *SLOW, *flags,
                cwd=ROOT, env=env,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            sim = Sim(f"http://127.0.0.1:{port}", process)
            started.append(sim)
            for _ in range(300):  # 30 s: a loaded 2-core machine starts Python slowly
                if process.returncode is not None:
                    break
                if await _answers(http, sim.url + "/health"):
                    return sim
                await asyncio.sleep(0.1)
        raise AssertionError("no simulator process answered /health")

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


async def _gateway(start_gateway: StartGateway, urls: list[str], **engine: str) -> Any:
    def configure(settings: Settings) -> Settings:
        backends = [msgspec.structs.replace(b, **engine) for b in settings.backends]
        return msgspec.structs.replace(settings, backends=backends)

    gateway = await start_gateway(urls, configure=configure)
    # What each engine is: from its /props at the first health round (or the config).
    await eventually(lambda: all(b.engine for b in gateway.state.pool.backends), within_s=10)
    return gateway


def sse_events(raw: bytes) -> list[Any]:
    """The `data:` payloads of an SSE body (with or without a space after the colon, as
    TGI writes it); `[DONE]` stays a string; every event whole."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    events: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data:"), block
        data = block[5:].lstrip(" ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


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


def check_whole_chat(events: list[Any], *, usage: bool, max_tokens: int = MAX_TOKENS) -> str:
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
    assert tokens == max_tokens  # the simulator always writes max_tokens: none lost, none twice
    usages = [c["usage"] for c in chunks if c.get("usage")]
    if usage:
        assert len(usages) == 1 and usages[0]["completion_tokens"] == tokens
    else:
        assert not usages
    return "".join(texts)


def assert_across_the_seam(whole: str, leg: dict[str, Any]) -> None:
    """The client read the text the other engine was sent to go on from, the whitespace
    the gateway held back from it (`Seam.sent_text`), then that engine's reply."""
    continued, reply = leg["continued"], leg["reply"]
    assert len(whole) >= len(continued) + len(reply), (whole, leg)
    assert whole.startswith(continued) and whole.endswith(reply), (whole, leg)
    assert not whole[len(continued) : len(whole) - len(reply)].strip(), (whole, leg)


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
    gateway = await _gateway(start_gateway, [s.url for s in three])
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
        assert_across_the_seam(text, leg)
        had = text[: len(leg["continued"])]
        assert leg["max_tokens"] == MAX_TOKENS - len(had.split()) > 0
    assert resumed >= 2  # the victim held the most streams
    async with http.get(gateway.url + "/metrics") as resp:
        metrics = await resp.text()
    counted = f'gateway_stream_resumes_total{{backend="{victim_name}",reason="broken"}} {resumed}.0'
    assert counted in metrics


async def _one_answer_killed_mid_way(
    sims: StartSims,
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
    **engine: str,
) -> tuple[list[Any], dict[str, Any], list[dict[str, Any]]]:
    """One streamed answer, its backend killed after 5 tokens: the client's events, the
    request's log line and what the other simulator received."""
    two = await sims(2)
    gateway = await _gateway(start_gateway, [s.url for s in two], **engine)
    stream = Stream(await http.post(gateway.url + path, json=body))
    assert stream.resp.status == 200
    await stream.read_tokens(5)
    victim = await _holder(gateway, two)
    victim.kill()
    events = await stream.read_all()
    (other,) = [s for s in two if s is not victim]
    await eventually(lambda: len(gateway.request_lines()) == 1)
    return events, gateway.request_lines()[0], await _received(http, other)


def _continued(received: list[dict[str, Any]]) -> dict[str, Any]:
    (leg,) = [r for r in received if r["continued"] is not None and r["status"] == 200]
    return leg


async def test_llamacpp_continues_a_last_assistant_message(
    sims: StartSims, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    body = chat("Go on.", max_tokens=MAX_TOKENS, stream=True)
    events, line, received = await _one_answer_killed_mid_way(
        sims, start_gateway, http, "/v1/chat/completions", body, engine="llama.cpp"
    )
    text = check_whole_chat(events, usage=False)
    leg = _continued(received)
    assert leg["continue_form"] == "last_assistant"  # no vLLM flags for llama.cpp
    assert_across_the_seam(text, leg)
    assert leg["max_tokens"] == MAX_TOKENS - len(leg["continued"].split())
    assert line["resumes"] == 1 and line["outcome"] == "ok"


async def test_completions_continue_from_the_prompt_and_the_text(
    sims: StartSims, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    prompt = "Once upon a time"
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True}
    body["stream_options"] = {"include_usage": True}
    events, line, received = await _one_answer_killed_mid_way(
        sims, start_gateway, http, "/v1/completions", body
    )
    assert events[-1] == "[DONE]" and not [e for e in events[:-1] if "error" in e]
    chunks = events[:-1]
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    texts = [ch["text"] for c in chunks for ch in c["choices"]]
    assert sum(1 for t in texts if t) == MAX_TOKENS
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == [
        "length"
    ]
    (usage,) = [c["usage"] for c in chunks if c.get("usage")]
    assert usage["completion_tokens"] == MAX_TOKENS
    leg = _continued([r for r in received if r["route"] == "completions"])
    text = "".join(texts)
    assert leg["continued"] == prompt + text[: len(leg["continued"]) - len(prompt)]
    assert_across_the_seam(prompt + text, leg)
    assert leg["max_tokens"] == MAX_TOKENS - len(leg["continued"][len(prompt) :].split())
    assert line["resumes"] == 1 and line["completion_tokens"] == MAX_TOKENS


async def test_tgi_generate_stream_continues_from_inputs_and_text(
    sims: StartSims, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    inputs = "The capital of France is"
    body = {"inputs": inputs, "parameters": {"max_new_tokens": MAX_TOKENS, "details": True}}
    events, line, received = await _one_answer_killed_mid_way(
        sims, start_gateway, http, "/generate_stream", body
    )
    assert not [e for e in events if "error" in e]
    assert [e["index"] for e in events] == list(range(1, MAX_TOKENS + 1))
    texts = "".join(e["token"]["text"] for e in events)
    assert [e["generated_text"] for e in events if e["generated_text"] is not None] == [texts]
    assert events[-1]["details"]["generated_tokens"] == MAX_TOKENS
    leg = _continued([r for r in received if r["route"] == "tgi_generate_stream"])
    assert_across_the_seam(inputs + texts, leg)
    assert leg["max_tokens"] == MAX_TOKENS - len(leg["continued"][len(inputs) :].split())
    assert line["resumes"] == 1 and line["completion_tokens"] == MAX_TOKENS


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"logprobs": True}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "request_shape"),
    ],
)
async def test_what_cannot_be_continued_faithfully_ends_with_the_error_event(
    sims: StartSims,
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
    extra: dict[str, Any],
    why: str,
) -> None:
    body = chat("Go on.", max_tokens=MAX_TOKENS, stream=True, **extra)
    events, line, received = await _one_answer_killed_mid_way(
        sims, start_gateway, http, "/v1/chat/completions", body
    )
    assert events[-1]["error"]["code"] == "backend_error"
    assert line["outcome"] == "backend_error" and line["resumes"] == 0
    assert line["resume_failed"] == why
    assert not [r for r in received if r["continued"] is not None]


async def test_an_answer_past_the_buffer_is_not_resumed(
    sims: StartSims, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    two = await sims(2)

    def configure(settings: Settings) -> Settings:
        resume = msgspec.structs.replace(settings.resume, buffer_bytes=1024)
        return msgspec.structs.replace(settings, resume=resume)

    gateway = await start_gateway([s.url for s in two], configure=configure)
    await eventually(lambda: all(b.engine for b in gateway.state.pool.backends), within_s=10)
    url = gateway.url + "/v1/chat/completions"
    stream = Stream(await http.post(url, json=chat(max_tokens=MAX_TOKENS, stream=True)))
    await stream.read_tokens(12)  # ~150 bytes an event: past 1 KiB
    (await _holder(gateway, two)).kill()
    events = await stream.read_all()
    assert events[-1]["error"]["code"] == "backend_error"
    await eventually(lambda: len(gateway.request_lines()) == 1)
    assert gateway.request_lines()[0]["resume_failed"] == "buffer_full"
    async with http.get(gateway.url + "/metrics") as resp:
        assert 'gateway_stream_resumes_failed_total{why="buffer_full"} 1.0' in await resp.text()


async def test_sigstop_mid_answer_every_stream_completes_within_10_s(
    sims: StartSims, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """A frozen engine: no byte, no close. Its streams stall, and on default settings the
    stall time is seconds, not the 60 s idle timeout; the backend is down until its
    checks pass."""
    two = await sims(2)
    gateway = await _gateway(start_gateway, [s.url for s in two])
    url = gateway.url + "/v1/chat/completions"
    loop = asyncio.get_running_loop()
    sent = loop.time()
    streams = [
        Stream(await http.post(url, json=chat(f"Story {i}", max_tokens=MAX_TOKENS, stream=True)))
        for i in range(6)
    ]
    await asyncio.gather(*(s.read_tokens(5) for s in streams))
    victim = await _holder(gateway, two)
    victim_name = f"b{two.index(victim)}"
    victim.process.send_signal(signal.SIGSTOP)
    try:
        answers = await asyncio.gather(*(s.read_all() for s in streams))
        assert loop.time() - sent < 10
        for events in answers:
            check_whole_chat(events, usage=False)
        lines = gateway.request_lines()
        stalled = [line for line in lines if line["resumes"]]
        assert stalled and all(line["resume_reason"] == "stalled" for line in stalled)
        assert all(line["resumed_from"] == [victim_name] for line in stalled)
        backend = next(b for b in gateway.state.pool.backends if b.name == victim_name)
        assert not backend.healthy  # until its checks pass
    finally:
        victim.process.send_signal(signal.SIGCONT)
    await eventually(lambda: backend.healthy, within_s=15)


async def test_a_long_prefill_before_the_first_token_is_no_stall(
    sims: StartSims, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    two = await sims(2, "--prefill-ms-per-token", "2", "--prefill-tokens-per-step", "4096")
    gateway = await _gateway(start_gateway, [s.url for s in two])
    prompt = " ".join(["word"] * 2500)  # ~5 s of prefill: past the 3 s stall floor
    body = chat(prompt, max_tokens=5, stream=True)
    async with http.post(gateway.url + "/v1/chat/completions", json=body) as resp:
        events = sse_events(await asyncio.wait_for(resp.read(), 30))
    assert events[-1] == "[DONE]"
    await eventually(lambda: len(gateway.request_lines()) == 1)
    line = gateway.request_lines()[0]
    assert line["outcome"] == "ok" and line["resumes"] == 0 and line["ttft_ms"] > 3000


async def test_a_drain_under_streaming_load_breaks_no_answer(
    sims: StartSims, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """Steady streaming on two backends; b0 is drained with a deadline shorter than the
    answers: those that outlive it are carried over, none breaks, b0 is idle at the
    deadline and gets no new request."""
    two = await sims(2)
    gateway = await _gateway(start_gateway, [s.url for s in two])
    url = gateway.url + "/v1/chat/completions"
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + 7.0
    answers: list[list[Any]] = []

    async def client(i: int) -> None:
        while loop.time() < stop_at:
            body = chat(f"Client {i}", max_tokens=80, stream=True)  # ~3.3 s each
            async with http.post(url, json=body) as resp:
                answers.append(sse_events(await asyncio.wait_for(resp.read(), 30)))

    clients = [asyncio.create_task(client(i)) for i in range(8)]
    await asyncio.sleep(1.5)
    async with http.post(gateway.url + "/admin/backends/b0/drain?deadline_s=1.5") as resp:
        assert resp.status == 200
        assert (await resp.json())["draining"] is True
    drained_at = loop.time()
    b0 = gateway.state.pool.backends[0]
    sent_to_b0 = len(await _received(http, two[0]))
    async with http.get(gateway.url + "/debug/backends") as resp:
        assert [b["draining"] for b in (await resp.json())["backends"]] == [True, False]
    async with http.get(gateway.url + "/metrics") as resp:
        assert 'gateway_backend_draining{backend="b0"} 1.0' in await resp.text()
    await asyncio.sleep(max(0.0, drained_at + 1.5 - loop.time()))
    await eventually(lambda: b0.in_flight == 0, within_s=1.0)  # idle at the deadline
    await asyncio.gather(*clients)

    assert len(answers) >= 12
    for events in answers:
        check_whole_chat(events, usage=False, max_tokens=80)
    lines = gateway.request_lines()
    assert all(line["outcome"] == "ok" for line in lines)
    drained = [line for line in lines if line["resume_reason"] == "drained"]
    assert drained and all(line["resumed_from"] == ["b0"] for line in drained)
    assert len(await _received(http, two[0])) == sent_to_b0  # nothing new went there
    async with http.post(gateway.url + "/admin/backends/b0/undrain") as resp:
        assert (await resp.json())["draining"] is False
    assert b0.available(gateway.state.pool.clock())


async def test_drain_needs_an_admin_key_and_a_real_backend(
    sims: StartSims, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    (one,) = await sims(1)
    keys = [
        ApiKeySettings(name="user", key="user-key-123"),
        ApiKeySettings(name="ops", key="admin-key-123", admin=True),
    ]
    gateway = await start_gateway(
        [one.url], configure=lambda s: msgspec.structs.replace(s, api_keys=keys)
    )
    route = gateway.url + "/admin/backends/b0/drain"
    for headers in ({}, {"Authorization": "Bearer user-key-123"}):
        async with http.post(route, headers=headers) as resp:
            assert resp.status == 401
            assert (await resp.json())["error"]["code"] == "invalid_api_key"
    admin = {"Authorization": "Bearer admin-key-123"}
    async with http.post(gateway.url + "/admin/backends/nope/drain", headers=admin) as resp:
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
    async with http.post(route + "?deadline_s=-1", headers=admin) as resp:
        assert resp.status == 400
    async with http.post(route + "?wait=true", headers=admin) as resp:
        assert resp.status == 200
        assert await resp.json() == {
            "backend": "b0", "draining": True, "deadline_s": 30.0, "in_flight": 0, "idle": True
        }  # fmt: skip


async def _raw_backend_ending_before_done() -> tuple[str, asyncio.Server]:
    """A backend on a raw socket that sends a whole answer, its finish_reason included, and
    closes the connection before `[DONE]` (and before the chunked body's end)."""

    def event(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        chunk = {"id": "x1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
        data = b"data: " + json.dumps({**chunk, "choices": [choice]}).encode() + b"\n\n"
        return b"%x\r\n%s\r\n" % (len(data), data)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        else:
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
                + event({"role": "assistant", "content": ""})
                + event({"content": "Hello"})
                + event({"content": " there"})
                + event({}, "stop")
            )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}", server


async def test_an_answer_whose_end_alone_was_lost_is_ended_by_the_gateway(
    start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """The backend sent its finish_reason and broke off before `[DONE]`: nothing is left to
    continue, so the gateway ends the stream itself (the usage asked for, then [DONE])."""
    url, server = await _raw_backend_ending_before_done()
    try:
        gateway = await _gateway(start_gateway, [url, url], engine="vllm")
        body = chat(max_tokens=20, stream=True, stream_options={"include_usage": True})
        async with http.post(gateway.url + "/v1/chat/completions", json=body) as resp:
            events = sse_events(await asyncio.wait_for(resp.read(), 10))
        assert events[-1] == "[DONE]" and not [e for e in events[:-1] if "error" in e]
        (usage,) = [e["usage"] for e in events[:-1] if e.get("usage")]
        assert usage["completion_tokens"] == 2
        assert {(e["id"], e["created"]) for e in events[:-1]} == {("x1", 7)}
        await eventually(lambda: len(gateway.request_lines()) == 1)
        line = gateway.request_lines()[0]
        assert line["outcome"] == "ok" and line["resumes"] == 0 and line["resume_failed"] is None
    finally:
        server.close()
        await server.wait_closed()


async def test_an_answer_is_carried_over_to_a_full_backend_over_its_limit(
    sims: StartSims, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """Both backends at their limit (2 slots each): a drain still breaks nothing; the
    answers it hands over go to the other backend beyond its slots."""
    two = await sims(2)
    gateway = await start_gateway([s.url for s in two], max_concurrency=2)
    await eventually(lambda: all(b.engine for b in gateway.state.pool.backends), within_s=10)
    url = gateway.url + "/v1/chat/completions"
    streams = [
        Stream(await http.post(url, json=chat(f"Story {i}", max_tokens=MAX_TOKENS, stream=True)))
        for i in range(4)
    ]
    await asyncio.gather(*(s.read_tokens(3) for s in streams))
    b0, b1 = gateway.state.pool.backends
    assert (b0.in_flight, b1.in_flight) == (2, 2)
    async with http.post(gateway.url + "/admin/backends/b0/drain?deadline_s=0.2") as resp:
        assert resp.status == 200
    await eventually(lambda: (b0.in_flight, b1.in_flight) == (0, 4), within_s=3)
    for events in await asyncio.gather(*(s.read_all() for s in streams)):
        check_whole_chat(events, usage=False)
    lines = gateway.request_lines()
    assert sorted(line["resume_reason"] or "" for line in lines) == ["", "", "drained", "drained"]
    assert b1.in_flight == 0
