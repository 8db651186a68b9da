"""The gateway learns its backends: simulators of known speed and tokenizer on 127.0.0.1.

Each test runs a real gateway in front of real simulators whose engine is set to
be slow, small or to count tokens differently, sends real requests, and checks
what the gateway learned (`GET /debug/backends`, the log, the refusals).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import aiohttp
import msgspec
import pytest

from gateway.config import HealthSettings, LaneSettings, Settings, default_lanes
from tests.conftest import StartGateway, StartSimulator, chat

#: Prefill 8x slower than the simulator's default: ~250 prompt tokens/s (a CPU engine).
SLOW_ENGINE = {"prefill_ms_per_token": 4.0, "prefill_tokens_per_step": 256}


def fast_health(settings: Settings) -> Settings:
    """Sizing rounds every 0.2 s, so a test sees them within a second."""
    return msgspec.structs.replace(
        settings, health=HealthSettings(interval_s=0.2, timeout_s=0.15, probe_on_start=False)
    )


def words(n: int, seed: int = 0) -> str:
    """A prompt of about n tokens (" hello" is one token of cl100k), its opening unique."""
    return f"{seed}:" + " hello" * n


async def stream(http: aiohttp.ClientSession, url: str, prompt: str, **extra: Any) -> int:
    headers = extra.pop("headers", None)
    body = chat(prompt, **{"stream": True, "max_tokens": 4, **extra})
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        await resp.read()
        return resp.status


async def debug(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/debug/backends") as resp:
        assert resp.status == 200
        return json.loads(await resp.read())


async def test_a_slow_engine_is_learned_and_the_short_deadline_is_fitted_with_numbers(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    backend = await start_simulator_at(**SLOW_ENGINE)
    lanes = [
        msgspec.structs.replace(default_lanes()[0], queue_timeout_s=0.5),
        default_lanes()[1],
    ]
    gateway = await start_gateway([backend], lanes=lanes, configure=fast_health)
    for i in range(3):  # prompts of ~400 and ~60 tokens, one at a time
        assert await stream(http, gateway.url, words(400, i)) == 200
        assert await stream(http, gateway.url, words(60, i)) == 200
    await asyncio.sleep(0.5)  # a sizing round
    seen = await debug(http, gateway.url)
    learned = seen["backends"][0]["learned"]
    assert learned["prefill_samples"] >= 3
    # The simulator's engine: 256 tokens per step at 4 ms/token, ~250 tokens/s.
    assert 150 < learned["prefill_tokens_per_s"] < 400, learned
    interactive = next(lane for lane in seen["lanes"] if lane["lane"] == "interactive")
    assert interactive["engine_floor_s"] > 1
    assert interactive["deadline_s"] == pytest.approx(1.5 * interactive["engine_floor_s"], rel=0.05)
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line]
    said = [e for e in events if e.get("event") == "lane_in_force" and e["lane"] == "interactive"]
    assert said and said[-1]["deadline_from"] == "fitted"
    assert said[-1]["configured_s"] == 0.5 and said[-1]["engine_floor_s"] > 1
    assert said[-1]["deadline_s"] == pytest.approx(interactive["deadline_s"], rel=0.2)


async def test_an_unfitted_short_deadline_is_warned_about_with_the_floor(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    backend = await start_simulator_at(**SLOW_ENGINE)
    lanes = [
        msgspec.structs.replace(
            default_lanes()[0], queue_timeout_s=0.5, fit_timeout_to_engine=False
        ),
        default_lanes()[1],
    ]
    gateway = await start_gateway([backend], lanes=lanes, configure=fast_health)
    for i in range(3):
        assert await stream(http, gateway.url, words(400, i)) == 200
    await asyncio.sleep(0.5)
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line]
    warned = [e for e in events if e.get("event") == "lane_deadline_below_engine_floor"]
    assert warned and warned[-1]["lane"] == "interactive"
    assert warned[-1]["deadline_s"] == 0.5 and warned[-1]["engine_floor_s"] > 1
    assert gateway.state.scheduler.lane("interactive").deadline_s == 0.5


async def test_engine_slots_and_context_come_from_the_engine_when_not_configured(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    backend = await start_simulator_at(max_batch=3, max_model_len=2048)

    def unset_concurrency(settings: Settings) -> Settings:
        settings = fast_health(settings)
        backends = [msgspec.structs.replace(b, max_concurrency=None) for b in settings.backends]
        return msgspec.structs.replace(settings, backends=backends)

    gateway = await start_gateway([backend], configure=unset_concurrency)
    await asyncio.sleep(0.5)
    seen = await debug(http, gateway.url)
    assert seen["backends"][0]["slots"] == 3 and seen["backends"][0]["slots_from"] == "engine"
    assert seen["limits"]["context_window"] == 2048
    assert gateway.state.scheduler.lane("interactive").slot_limit == 3
    # A request the backend would reject for length is refused by the gateway first.
    body = chat(words(1500), max_tokens=1000)
    async with http.post(gateway.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["code"] == "context_length_exceeded"


async def test_an_engine_with_its_own_queue_holds_dispatch_and_says_so(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    # The gateway was told 6 slots; the engine runs 2 and queues the rest inside.
    backend = await start_simulator_at(max_batch=2, decode_ms_per_seq=20.0)
    gateway = await start_gateway([backend], max_concurrency=6, configure=fast_health)
    body = chat("hello", stream=True, max_tokens=120)

    async def one() -> None:
        async with http.post(gateway.url + "/v1/chat/completions", json=body) as resp:
            await resp.read()

    tasks = [asyncio.create_task(one()) for _ in range(6)]
    held = None
    for _ in range(40):
        await asyncio.sleep(0.1)
        seen = (await debug(http, gateway.url))["backends"][0]
        if seen["holding_at"] is not None:
            held = seen
            break
    assert held is not None, "the engine's queue was never seen"
    assert held["engine_load"]["waiting"] >= 1
    assert held["holding_at"] <= 4
    # New requests wait in the gateway's lanes, not in the engine.
    late = asyncio.create_task(one())
    await asyncio.sleep(0.3)
    assert gateway.state.scheduler.lane("interactive").queue
    await asyncio.gather(*tasks, late)


async def test_the_token_ratio_converges_and_applies_to_the_caps(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    backend = await start_simulator_at(token_ratio=1.5)

    def small_cap(settings: Settings) -> Settings:
        limits = msgspec.structs.replace(settings.limits, max_prompt_tokens=1000)
        return msgspec.structs.replace(fast_health(settings), limits=limits)

    gateway = await start_gateway([backend], configure=small_cap)
    prompt = words(800, 99)
    before = await stream(http, gateway.url, prompt)
    assert before == 200  # ~800 of the gateway's tokens: under the 1000 cap
    for i in range(5):
        assert await stream(http, gateway.url, words(300, i)) == 200
    learned = (await debug(http, gateway.url))["backends"][0]["learned"]
    assert learned["token_ratio"] == pytest.approx(1.5, abs=0.05)
    lines = gateway.request_lines()
    assert all(line["backend_prompt_tokens"] for line in lines)
    counted = lines[-1]
    assert counted["backend_prompt_tokens"] == pytest.approx(
        1.5 * counted["prompt_tokens"], rel=0.1
    )
    # The same prompt is now ~1200 of the backend's tokens: over the cap, refused first.
    async with http.post(
        gateway.url + "/v1/chat/completions", json=chat(prompt, max_tokens=4)
    ) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "prompt_too_long"


async def test_a_client_deadline_shorter_than_the_lane_is_honoured(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    backend = await start_simulator_at(decode_ms_per_seq=20.0)
    gateway = await start_gateway([backend], max_concurrency=1)
    hog = asyncio.create_task(
        stream(http, gateway.url, "hold the slot", max_tokens=100)  # ~2.5 s
    )
    await asyncio.sleep(0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    status = await stream(http, gateway.url, "in a hurry", headers={"x-request-deadline-ms": "300"})
    waited = loop.time() - started
    assert status in (429, 503)
    assert waited < 1.5, f"waited {waited:.2f} s for a 0.3 s deadline"
    line = gateway.request_lines()[-1]
    assert line["deadline_ms"] is not None and line["deadline_ms"] <= 300
    assert line["predicted_wait_ms"] is not None or line["error_code"] == "queue_timeout"
    await hog
    # Not a number of milliseconds: the client's mistake, a 400 naming the header.
    async with http.post(
        gateway.url + "/v1/chat/completions",
        json=chat("x"),
        headers={"x-request-deadline-ms": "soon"},
    ) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "x-request-deadline-ms"


async def test_two_backends_of_different_speed_are_told_apart(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    fast = await start_simulator_at()
    slow = await start_simulator_at(prefill_ms_per_token=2.0)  # 4x slower
    gateway = await start_gateway(
        [fast, slow], lanes=[LaneSettings(name="all", queue_timeout_s=60)], configure=fast_health
    )
    # Concurrent long prompts, so both backends serve some.
    for round_ in range(4):
        prompts = [words(600, 10 * round_ + i) for i in range(4)]
        await asyncio.gather(*(stream(http, gateway.url, prompt) for prompt in prompts))
    seen = {b["name"]: b["learned"] for b in (await debug(http, gateway.url))["backends"]}
    # An unlearned backend looks fast (the prior), so the slow one is tried until learned.
    assert seen["b0"]["prefill_samples"] >= 3 and seen["b1"]["prefill_samples"] >= 3
    assert seen["b0"]["prefill_tokens_per_s"] > 2.5 * seen["b1"]["prefill_tokens_per_s"]


async def test_the_start_up_probe_learns_a_slow_engine_before_any_traffic(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    backend = await start_simulator_at(prefill_ms_per_token=1.0)  # ~1000 tokens/s

    def probing(settings: Settings) -> Settings:
        return msgspec.structs.replace(settings, health=HealthSettings(probe_on_start=True))

    lanes = [msgspec.structs.replace(default_lanes()[0], queue_timeout_s=0.5), default_lanes()[1]]
    gateway = await start_gateway([backend], lanes=lanes, configure=probing)
    learned: dict[str, Any] = {}
    for _ in range(200):
        await asyncio.sleep(0.1)
        learned = (await debug(http, gateway.url))["backends"][0]["learned"]
        if (
            learned["prefill_samples"] >= 3
            and gateway.state.scheduler.lane("interactive").deadline_s > 0.5
        ):
            break
    assert 600 < learned["prefill_tokens_per_s"] < 1400, learned
    assert gateway.state.scheduler.lane("interactive").deadline_s > 0.5
    assert not gateway.request_lines()  # the probe is not a client's request


async def test_check_config_probe_measures_the_engine_and_warns_with_the_floor(
    start_simulator_at: StartSimulator,
) -> None:
    backend = await start_simulator_at(prefill_ms_per_token=3.0, max_batch=4)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "check-config",
        "--probe",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")},
            "GATEWAY_BACKENDS": backend,
        },
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    text = out.decode()
    probe = json.loads(text[text.index('{\n  "probe"') :])["probe"]
    described = probe["backends"][0]
    assert described["slots"] == 4 and described["slots_from"] == "engine"
    assert described["serves"]["models"] == ["sim-model"]  # what its engine lists...
    assert described["serves"]["any_name"] is True  # ...and any name: the simulator is lenient
    assert described["learned"]["prefill_samples"] >= 3
    assert 200 < described["learned"]["prefill_tokens_per_s"] < 500
    interactive = next(lane for lane in probe["lanes"] if lane["lane"] == "interactive")
    assert interactive["engine_floor_s"] > 5
    warning = next(
        line
        for line in err.decode().splitlines()
        if line.startswith("warning:") and "engine floor" in line
    )
    assert "'interactive'" in warning and "queue_timeout_s 5 s" in warning


async def test_a_non_streamed_long_prompt_does_not_hold_the_prefill_budget_to_its_end(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    backend = await start_simulator_at(decode_ms_per_seq=30.0)
    gateway = await start_gateway([backend])
    loop = asyncio.get_running_loop()
    done: dict[str, float] = {}

    async def whole(tag: str, prompt: str, max_tokens: int) -> None:
        body = chat(prompt, max_tokens=max_tokens)
        async with http.post(gateway.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            await resp.read()
        done[tag] = loop.time()

    # ~5000 tokens: over the 0.5 s prefill budget at the prior rate, so it goes alone.
    long = asyncio.create_task(whole("long", words(5000), 100))
    await asyncio.sleep(0.1)
    await whole("short", "hi", 2)
    await long
    # The short one went once the long one's predicted prefill was over, not after its
    # whole answer (100 tokens at >= 30 ms a step).
    assert done["long"] - done["short"] > 1.5, done
