"""Shadow traffic end to end: gateway processes (`python -m gateway serve`) in front of
simulators, one more simulator (or a dead port, or a server that never answers) as the
candidate.

What is shown: mirrored requests reach the candidate (its own count) and leave a
`shadow_compared` line with both sides' figures; the primary's answer is the same bytes
with and without a shadow; a dead or hung candidate never fails nor slows a primary and
is aborted at shutdown; with a lane queued, mirrors are dropped and counted; with two
models behind the gateway, only the candidate's model's requests (as asked or through an
alias) are mirrored.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import StartSimulator, chat, free_port, wait_ready

ROOT = Path(__file__).resolve().parents[2]

#: Each answer's own id and creation second (the simulator makes them per answer):
#: everything else of a primary's body must be the same bytes.
VOLATILE = re.compile(rb'"id": ?"(chatcmpl|cmpl)-[0-9a-f]+"|"created": ?\d+')


@dataclass
class GatewayProcess:
    url: str
    process: asyncio.subprocess.Process
    events_path: Path

    def events(self, name: str = "shadow_compared") -> list[dict[str, Any]]:
        lines = []
        for line in self.events_path.read_text().splitlines():
            if line.startswith("{"):
                event = json.loads(line)
                if event.get("event") == name:
                    lines.append(event)
        return lines

    async def shadow_counts(self, http: aiohttp.ClientSession) -> dict[str, float]:
        async with http.get(self.url + "/metrics") as resp:
            text = await resp.text()
        found = re.findall(r'^gateway_shadow_requests_total\{result="(\w+)"\} (\S+)$', text, re.M)
        return {result: float(value) for result, value in found}

    async def stop(self) -> int:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 15)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        assert self.process.returncode is not None
        return self.process.returncode


ServeGateway = Callable[..., Awaitable[GatewayProcess]]


@pytest.fixture
async def serve_gateway(http: aiohttp.ClientSession, tmp_path: Path) -> AsyncIterator[ServeGateway]:
    """`python -m gateway serve` in front of `primary`, with a [shadow] table when given."""
    started: list[GatewayProcess] = []

    async def start(
        primary: str | dict[str, str],
        *,
        slots: int = 4,
        shadow: dict[str, Any] | None = None,
        lane: str = "",
        extra: str = "",
    ) -> GatewayProcess:
        """`primary`: one backend's URL, or a backend per model ({model: url})."""
        name = f"gw{len(started)}"
        config = tmp_path / f"{name}.toml"
        text = "[health]\nprobe_on_start = false\n\n"  # tests count what reaches the simulators
        if isinstance(primary, str):
            text += (
                f'[[backends]]\nurl = "{primary}"\nname = "primary"\nmax_concurrency = {slots}\n'
            )
        else:
            for model, url in primary.items():
                text += (
                    f'[[backends]]\nurl = "{url}"\nname = "{model}"\nmodels = ["{model}"]\n'
                    f"max_concurrency = {slots}\n\n"
                )
        text += extra
        if lane:
            text += f"\n[[lanes]]\n{lane}\n"
        if shadow is not None:
            text += "\n[shadow]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in shadow.items())
        config.write_text(text)
        port = free_port()
        events_path = tmp_path / f"{name}.events"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        with events_path.open("w") as events:
            process = await asyncio.create_subprocess_exec(
                *(sys.executable, "-m", "gateway", "serve"),
                *("--config", str(config), "--port", str(port)),
                cwd=ROOT,
                env=env,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=events,
            )
        gateway = GatewayProcess(f"http://127.0.0.1:{port}", process, events_path)
        started.append(gateway)
        await wait_ready(http, gateway.url, timeout_s=20)
        return gateway

    yield start
    for gateway in started:
        await gateway.stop()


async def eventually(check: Callable[[], Awaitable[bool]], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s:g} s")
        await asyncio.sleep(0.05)


async def sim_json(http: aiohttp.ClientSession, sim: str, path: str) -> Any:
    async with http.get(sim + path) as resp:
        return await resp.json()


#: One request of each kind the gateway mirrors: (path, body), streamed and not.
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", chat("Tell me a story.", max_tokens=16, stream=True)),
    ("/v1/chat/completions", chat("Tell me another.", max_tokens=12)),
    ("/v1/completions", {"model": "sim-model", "prompt": "Once", "max_tokens": 10, "stream": True}),
    ("/generate_stream", {"inputs": "Hello", "parameters": {"max_new_tokens": 9}}),
    ("/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 7}}),
]
OUTPUT_TOKENS = [16, 12, 10, 9, 7]


async def send(
    http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any], request_id: str
) -> tuple[int, dict[str, str], bytes, float]:
    """Status, headers, body and seconds to the last byte of one request."""
    started = time.perf_counter()
    async with http.post(url + path, json=body, headers={"x-request-id": request_id}) as resp:
        raw = await resp.read()
        return resp.status, dict(resp.headers), raw, time.perf_counter() - started


async def test_mirrored_requests_reach_the_candidate_and_are_compared(
    start_simulator_at: StartSimulator, serve_gateway: ServeGateway, http: aiohttp.ClientSession
) -> None:
    primary = await start_simulator_at()
    candidate = await start_simulator_at(model="candidate", seed=7, step_base_ms=8)
    gateway = await serve_gateway(
        primary, shadow={"url": candidate, "name": "candidate", "model": "candidate"}
    )
    ids = [f"mirror-{i}" for i in range(len(REQUESTS))]
    for (path, body), request_id in zip(REQUESTS, ids, strict=True):
        status, _, _, _ = await send(http, gateway.url, path, body, request_id)
        assert status == 200

    async def all_compared() -> bool:
        return len(gateway.events()) == len(REQUESTS)

    await eventually(all_compared)
    stats = await sim_json(http, candidate, "/sim/stats")
    assert stats["received"] == len(REQUESTS)  # the candidate's own count
    seen = (await sim_json(http, candidate, "/sim/requests"))["requests"]
    assert [r["request_id"] for r in seen] == ids
    assert [r["model"] for r in seen[:3]] == ["candidate"] * 3  # OpenAI routes: the override
    assert [r["completion_tokens"] for r in seen] == OUTPUT_TOKENS

    lines = {line["request_id"]: line for line in gateway.events()}
    for (path, body), request_id, tokens in zip(REQUESTS, ids, OUTPUT_TOKENS, strict=True):
        line = lines[request_id]
        assert line["level"] == "info", line
        assert line["route"] == path and line["shadow_backend"] == "candidate"
        assert (line["primary_status"], line["shadow_status"]) == (200, 200)
        assert (line["primary_outcome"], line["shadow_outcome"]) == ("ok", "ok")
        assert line["primary_completion_tokens"] == line["shadow_completion_tokens"] == tokens
        assert line["primary_e2e_ms"] > 0 and line["shadow_e2e_ms"] > 0
        streamed = body.get("stream") or path == "/generate_stream"
        assert line["stream"] is bool(streamed)
        if streamed:
            for key in ("ttft", "tpot"):
                assert line[f"primary_{key}_ms"] > 0 and line[f"shadow_{key}_ms"] > 0, line
            # The candidate's steps are 8 ms to the primary's 5: the comparison shows it.
            assert line["tpot_ratio"] > 1.2, line
    assert await gateway.shadow_counts(http) == {
        "ok": 5.0,
        "error": 0.0,
        "aborted": 0.0,
        "dropped_queued": 0.0,
        "dropped_loop_lag": 0.0,
        "dropped_concurrency": 0.0,
    }


async def test_the_primarys_answer_is_the_same_bytes_with_and_without_a_shadow(
    start_simulator_at: StartSimulator, serve_gateway: ServeGateway, http: aiohttp.ClientSession
) -> None:
    """Two fresh primaries with the same seed give the same words to the same sequence of
    requests; one gateway mirrors to a candidate that answers other words under another
    model name, the other has no shadow. The clients must not tell them apart."""
    candidate = await start_simulator_at(model="candidate", seed=99)
    plain = await serve_gateway(await start_simulator_at(seed=3))
    shadowed = await serve_gateway(
        await start_simulator_at(seed=3), shadow={"url": candidate, "model": "candidate"}
    )
    kept_headers = ("Content-Type", "x-request-id", "x-gateway-lane", "x-gateway-max-tokens")
    for round_ in range(2):
        for index, (path, body) in enumerate(REQUESTS):
            request_id = f"same-{round_}-{index}"
            answers = []
            for gateway in (plain, shadowed):
                status, headers, raw, _ = await send(http, gateway.url, path, body, request_id)
                kept = {name: headers.get(name) for name in kept_headers}
                answers.append((status, kept, VOLATILE.sub(b"<volatile>", raw)))
            assert answers[0] == answers[1], (path, body)
            assert answers[0][0] == 200 and len(answers[0][2]) > 50
    # Not a vacuous equality: every request was mirrored and answered by the candidate.
    assert (await sim_json(http, candidate, "/sim/stats"))["received"] == 2 * len(REQUESTS)
    counts = await shadowed.shadow_counts(http)
    assert counts["ok"] == 2 * len(REQUESTS) and counts["error"] == 0
    assert plain.events() == []


@pytest.fixture
async def hung_candidate() -> AsyncIterator[tuple[str, list[str]]]:
    """A candidate that accepts every request and never answers (its request ids kept)."""
    seen: list[str] = []

    async def hang(request: web.Request) -> web.Response:
        seen.append(request.headers.get("X-Request-Id", ""))
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", hang)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}", seen
    await runner.cleanup()


async def test_a_dead_or_hung_candidate_never_fails_nor_slows_a_primary(
    start_simulator_at: StartSimulator,
    serve_gateway: ServeGateway,
    http: aiohttp.ClientSession,
    hung_candidate: tuple[str, list[str]],
) -> None:
    hung_url, hung_seen = hung_candidate
    primary = await start_simulator_at()
    plain = await serve_gateway(primary)
    dead = await serve_gateway(primary, shadow={"url": f"http://127.0.0.1:{free_port()}"})
    hung = await serve_gateway(
        primary, shadow={"url": hung_url, "max_concurrency": 2, "timeout_s": 60}
    )
    body = chat("Count to twenty.", max_tokens=20, stream=True)
    times: dict[str, list[float]] = {"plain": [], "dead": [], "hung": []}
    rounds = 8
    for index in range(rounds):  # interleaved, one at a time: the same primary, alike load
        for name, gateway in (("plain", plain), ("dead", dead), ("hung", hung)):
            status, _, raw, took = await send(
                http, gateway.url, "/v1/chat/completions", body, f"{name}-{index}"
            )
            assert status == 200, (name, raw[:200])
            assert raw.rstrip().endswith(b"data: [DONE]"), (name, raw[-200:])
            times[name].append(took)
    baseline = statistics.median(times["plain"])  # ~0.1 s: 20 tokens at 5 ms steps
    for name in ("dead", "hung"):
        # Waiting for the candidate would cost seconds (hung: its 60 s timeout).
        assert statistics.median(times[name]) < baseline * 1.5 + 0.05, times
        assert max(times[name]) < max(times["plain"]) * 2 + 0.5, times

    async def dead_all_counted() -> bool:
        return (await dead.shadow_counts(http)).get("error") == rounds

    await eventually(dead_all_counted)
    warned = dead.events()
    assert len(warned) == rounds
    assert {(w["level"], w["shadow_outcome"], w["primary_outcome"]) for w in warned} == {
        ("warning", "unreachable", "ok")
    }
    hung_counts = await hung.shadow_counts(http)
    assert hung_counts["dropped_concurrency"] == rounds - 2 and hung_counts["ok"] == 0
    assert len(hung_seen) == 2
    # Shutdown aborts the two mirrors still hanging instead of waiting 60 s for them.
    started = time.monotonic()
    assert await hung.stop() == 0
    assert time.monotonic() - started < 5.0


async def test_while_a_lane_has_requests_queued_mirrors_are_dropped_and_counted(
    start_simulator_at: StartSimulator, serve_gateway: ServeGateway, http: aiohttp.ClientSession
) -> None:
    """One slot, eight requests at once: each dispatched while others still wait in the
    queue is not mirrored; only those dispatched with nobody waiting are."""
    primary = await start_simulator_at()
    candidate = await start_simulator_at(model="candidate")
    gateway = await serve_gateway(
        primary,
        slots=1,
        lane='name = "only"\nqueue_timeout_s = 30\nreject_predicted_wait = false',
        shadow={"url": candidate},
    )
    body = chat("Count to thirty.", max_tokens=30, stream=True)
    total = 8
    answers = await asyncio.gather(
        *(send(http, gateway.url, "/v1/chat/completions", body, f"q-{i}") for i in range(total))
    )
    assert [status for status, *_ in answers] == [200] * total
    assert all(raw.rstrip().endswith(b"data: [DONE]") for _, _, raw, _ in answers)

    async def settled() -> bool:
        counts = await gateway.shadow_counts(http)
        return counts["ok"] + counts["error"] + counts["dropped_queued"] == total

    await eventually(settled)
    counts = await gateway.shadow_counts(http)
    # The first (nobody queued yet) and the last (nobody left behind it) may be mirrored.
    assert counts["dropped_queued"] >= total - 3, counts
    assert counts["error"] == 0 and counts["dropped_concurrency"] == 0
    mirrored = (await sim_json(http, candidate, "/sim/stats"))["received"]
    assert mirrored == counts["ok"] >= 1


async def test_with_two_models_only_the_candidates_models_requests_are_mirrored(
    start_simulator_at: StartSimulator, serve_gateway: ServeGateway, http: aiohttp.ClientSession
) -> None:
    """A candidate for `chat` behind a gateway that also serves `code`: it gets the requests
    asking for `chat` and for the alias `assistant` (whose target is `chat`), and none of
    `code`'s, whose candidate it is not; each line names the model asked and its pool."""
    chat_sim = await start_simulator_at(model="chat", strict_model=True)
    code_sim = await start_simulator_at(model="code", strict_model=True)
    candidate = await start_simulator_at(model="candidate")
    gateway = await serve_gateway(
        {"chat": chat_sim, "code": code_sim},
        shadow={"url": candidate, "model": "candidate", "models": ["chat"]},
        extra='[[models]]\nname = "assistant"\ntarget = "chat"\n',
    )
    asked = ["chat", "code", "assistant", "code", "chat", "code"]
    for index, model in enumerate(asked):
        body = {**chat(f"Question {index}.", max_tokens=6, stream=index % 2 == 0), "model": model}
        status, _, raw, _ = await send(
            http, gateway.url, "/v1/chat/completions", body, f"{model}-{index}"
        )
        assert status == 200, raw
    mirrored_ids = [f"{m}-{i}" for i, m in enumerate(asked) if m != "code"]

    async def all_compared() -> bool:
        return len(gateway.events()) == len(mirrored_ids)

    await eventually(all_compared)
    seen = (await sim_json(http, candidate, "/sim/requests"))["requests"]
    assert sorted(r["request_id"] for r in seen) == sorted(mirrored_ids)
    assert (await sim_json(http, code_sim, "/sim/stats"))["received"] == 3
    lines = {line["request_id"]: line for line in gateway.events()}
    assert sorted(lines) == sorted(mirrored_ids)
    for request_id, line in lines.items():
        assert line["model"] == request_id.split("-")[0] and line["pool"] == "chat", line
        assert line["shadow_outcome"] == "ok", line
    await asyncio.sleep(0.3)  # nothing more arrives late
    assert len(gateway.events()) == len(mirrored_ids)
    counts = await gateway.shadow_counts(http)
    assert counts["ok"] == len(mirrored_ids) and counts["dropped_queued"] == 0
