"""The simulator tells its load and size as engines do, and can count tokens its own way.

Each simulator here is a real process on 127.0.0.1 (`python -m gateway.tools.simulator`),
started with the flags a benchmark would give it, and read with the gateway's own
telemetry parsers: what the gateway would learn from a real vLLM or llama.cpp server.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.tools.simulator import SimulatorConfig
from gateway.upstream.engine_timings import RequestTimeTotals, Totals
from gateway.upstream.telemetry import (
    BackendFacts,
    EngineLoad,
    parse_engine_metrics,
    probe_facts,
)
from tests.conftest import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]

StartProcess = Callable[..., Awaitable[str]]


@pytest.fixture
async def simulator_process() -> AsyncIterator[StartProcess]:
    """Start `python -m gateway.tools.simulator --port <free> <flags>`; its base URL."""
    procs: list[asyncio.subprocess.Process] = []

    async def start(*flags: str) -> str:
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.tools.simulator", "--port", str(port), *flags,
            stdout=asyncio.subprocess.DEVNULL, cwd=REPO_ROOT, env=env,
        )  # fmt: skip
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        await _wait_healthy(url, proc)
        return url

    yield start
    for proc in procs:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _wait_healthy(url: str, proc: asyncio.subprocess.Process, timeout_s: float = 20) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while loop.time() < deadline:
            if proc.returncode is not None:
                raise AssertionError(f"the simulator exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise AssertionError(f"{url}/health did not answer within {timeout_s:g} s")


async def _metrics_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return await resp.text()


def _only(text: str, prefix: str) -> str:
    """The lines of one engine's names (and their HELP/TYPE comments)."""
    return "".join(line + "\n" for line in text.splitlines() if prefix in line)


async def _hold_stream(session: aiohttp.ClientSession, url: str, started: asyncio.Event) -> None:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 2000,
        "stream": True,
    }
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        started.set()
        async for _ in resp.content.iter_any():
            pass


async def test_metrics_show_the_engines_own_queue(
    simulator_process: StartProcess, http: aiohttp.ClientSession
) -> None:
    # Two batch places, five long streams: three wait inside the engine. Steps of 20 ms make
    # each stream last ~40 s, far longer than the test reads.
    url = await simulator_process("--max-batch", "2", "--step-base-ms", "20", "--model", "m/x")
    idle = parse_engine_metrics(await _metrics_text(http, url))
    # 16,384 blocks of 16 tokens: the simulator's cache, in vLLM's cache_config_info; and
    # its request time histograms, empty.
    nothing = Totals(0.0, 0.0)
    assert idle == EngineLoad(
        "vllm",
        waiting=0.0,
        running=0.0,
        kv_usage=0.0,
        kv_capacity_tokens=262_144,
        times=RequestTimeTotals(queue=nothing, prefill=nothing, decode=nothing),
    )

    started = [asyncio.Event() for _ in range(5)]
    streams = [asyncio.create_task(_hold_stream(http, url, event)) for event in started]
    try:
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 10)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        load = None
        while loop.time() < deadline:
            text = await _metrics_text(http, url)
            load = parse_engine_metrics(text)
            if load is not None and load.running == 2 and load.waiting == 3:
                if load.kv_usage:  # the first prefill step has run
                    break
            await asyncio.sleep(0.05)
        assert load is not None
        assert (load.engine, load.running, load.waiting) == ("vllm", 2.0, 3.0)
        assert load.kv_usage is not None and 0 < load.kv_usage <= 1
        assert 'model_name="m/x"' in text  # vLLM labels its series by model

        # The llama.cpp names carry the same numbers, for a gateway that reads only those.
        llama = parse_engine_metrics(_only(text, "llamacpp:"))
        assert llama == EngineLoad("llama.cpp", waiting=3.0, running=2.0, kv_usage=None)

        # The queue drains as streams end: two cancelled, one of the three waiting gets a place.
        for task in streams[:2]:
            task.cancel()
        deadline = loop.time() + 10
        while loop.time() < deadline:
            load = parse_engine_metrics(await _metrics_text(http, url))
            if load is not None and load.waiting == 1:
                break
            await asyncio.sleep(0.05)
        assert load is not None and (load.running, load.waiting) == (2.0, 1.0)
    finally:
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)


async def test_props_tell_slots_and_context(
    simulator_process: StartProcess, http: aiohttp.ClientSession
) -> None:
    url = await simulator_process(
        "--max-batch", "3", "--max-model-len", "4096", "--model", "m/y", "--prefill", "whole"
    )
    async with http.get(url + "/props") as resp:
        assert resp.status == 200
        props = await resp.json()
    assert props["total_slots"] == 3
    assert props["default_generation_settings"] == {"n_ctx": 4096}
    assert props["model_path"] == "m/y"
    # It says what it is, and which engine it models: never mistaken for a llama.cpp.
    assert props["build_info"].startswith("llm-tail-gateway simulator: 3 sequences a batch")
    assert props["simulator"]["prefill"] == "whole"
    # /props answers first; /info adds TGI's input cap.
    assert await probe_facts(http, url, None) == BackendFacts(
        engine="simulator",
        slots=3,
        context_tokens=4096,
        max_input_tokens=4095,
        model="m/y",
        prefill="whole",
    )


async def _usage_prompt_tokens(session: aiohttp.ClientSession, url: str, route: str) -> int:
    text = "The quick brown fox jumps over the lazy dog. " * 20
    if route == "chat":
        body: dict[str, Any] = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return int((await resp.json())["usage"]["prompt_tokens"])
    if route == "completions":
        body = {"prompt": text, "max_tokens": 2}
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return int((await resp.json())["usage"]["prompt_tokens"])
    body = {"inputs": text, "parameters": {"max_new_tokens": 2, "details": True}}
    async with session.post(url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return int(resp.headers["x-prompt-tokens"])


async def test_token_ratio_scales_the_simulators_own_count(
    simulator_process: StartProcess, http: aiohttp.ClientSession
) -> None:
    plain, scaled = await asyncio.gather(
        simulator_process(), simulator_process("--token-ratio", "1.5")
    )
    for route in ("chat", "completions", "tgi"):
        tiktoken_count = await _usage_prompt_tokens(http, plain, route)
        backend_count = await _usage_prompt_tokens(http, scaled, route)
        assert tiktoken_count > 100
        assert backend_count == math.floor(tiktoken_count * 1.5 + 0.5), route
        assert abs(backend_count / tiktoken_count - 1.5) < 0.01


async def test_token_ratio_counts_against_the_context(
    simulator_process: StartProcess, http: aiohttp.ClientSession
) -> None:
    # ~200 tiktoken tokens fit a 512-token window; three times as many backend tokens do not.
    url = await simulator_process("--token-ratio", "3", "--max-model-len", "512")
    body = {"messages": [{"role": "user", "content": "word " * 200}], "max_tokens": 8}
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "context_length_exceeded"


def test_token_ratio_rounding() -> None:
    assert SimulatorConfig().backend_tokens(7) == 7
    assert SimulatorConfig(token_ratio=1.5).backend_tokens(3) == 5  # 4.5 rounds up
    assert SimulatorConfig(token_ratio=0.01).backend_tokens(3) == 1  # never below one
    assert SimulatorConfig(token_ratio=0.5).backend_tokens(0) == 0  # nothing stays nothing


@pytest.mark.parametrize("ratio", [0.0, -1.0, math.nan, math.inf])
def test_token_ratio_must_be_positive(ratio: float) -> None:
    with pytest.raises(ValueError, match="token_ratio"):
        SimulatorConfig(token_ratio=ratio)


async def test_a_bad_token_ratio_flag_stops_the_process() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.tools.simulator", "--port", "0", "--token-ratio", "0",
        stderr=asyncio.subprocess.PIPE, cwd=REPO_ROOT, env=env,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2
    assert b"token_ratio" in err
