"""The load generator: seeded schedules, exact prompt sizes, trace replay, and real runs.

Runs go to real servers on 127.0.0.1: the project's simulator, or a tiny scripted
aiohttp server for answers the simulator never gives (429 then success, error
envelopes, a mid-stream error event). Timing bounds are loose on purpose.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.admission.tokens import TokenCounter, chat_prompt_parts
from gateway.tools.loadgen import (
    DEFAULT_MIX,
    PlannedRequest,
    RetryPolicy,
    TrafficClass,
    add_arguments,
    closed_schedule,
    format_tables,
    load_mix,
    main,
    parse_class,
    poisson_schedule,
    run_closed_loop,
    run_open_loop,
    summarize_run,
    trace_schedule,
)
from gateway.tools.loadgen_client import error_from_body
from gateway.tools.loadgen_prompts import with_run_tag
from tests.conftest import StartSimulator, encoding

REPO_ROOT = Path(__file__).resolve().parents[2]
AZURE_TRACE = REPO_ROOT.parent / "shared" / "data" / "AzureLLMInferenceTrace_conv.csv"
SMALL_MIX = [
    TrafficClass("short", 0.7, (40, 60), 8),
    TrafficClass("long", 0.3, (800, 1200), 16),
]


def gateway_count(prompt: str) -> int:
    """Prompt tokens as the gateway (and the simulator) count a one-message chat."""
    counter = TokenCounter(encoding())
    try:
        return counter.count(chat_prompt_parts([{"role": "user", "content": prompt}]))
    finally:
        counter.close()


def planned(index: int = 0, max_tokens: int = 3) -> PlannedRequest:
    return closed_schedule([TrafficClass("short", 1, (20, 20), max_tokens)], index + 1, 0)[index]


# --------------------------------------------------------------------------- schedules


def test_same_seed_same_schedule() -> None:
    first = poisson_schedule(DEFAULT_MIX, rate=20, duration_s=5, seed=7)
    closed_schedule([TrafficClass("huge", 1, (20_000, 20_000), 1)], 1, 0)  # another text size
    again = poisson_schedule(DEFAULT_MIX, rate=20, duration_s=5, seed=7)
    other = poisson_schedule(DEFAULT_MIX, rate=20, duration_s=5, seed=8)
    assert first == again
    assert [p.at_s for p in first] != [p.at_s for p in other]
    assert closed_schedule(DEFAULT_MIX, 50, 3) == closed_schedule(DEFAULT_MIX, 50, 3)
    assert all(p.at_s == 0 for p in closed_schedule(DEFAULT_MIX, 5, 3))


def test_shares_follow_the_mix() -> None:
    schedule = closed_schedule(DEFAULT_MIX, 1000, seed=11)
    short = sum(p.cls == "short" for p in schedule) / len(schedule)
    assert 0.75 <= short <= 0.85  # binomial sd ~0.013
    for p in schedule:
        cls = next(c for c in DEFAULT_MIX if c.name == p.cls)
        assert cls.prompt_tokens[0] <= p.prompt_tokens <= cls.prompt_tokens[1]
        assert p.max_tokens == cls.max_tokens
    assert [p.index for p in schedule] == list(range(1000))


def test_poisson_inter_arrival_mean() -> None:
    rate = 50.0
    schedule = poisson_schedule([TrafficClass("a", 1, (10, 20), 4)], rate, 40.0, seed=5)
    assert 1600 <= len(schedule) <= 2400
    times = [p.at_s for p in schedule]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 40.0
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(1 / rate, rel=0.15)
    # Exponential gaps: the standard deviation is about the mean, unlike a fixed pace.
    assert statistics.stdev(gaps) == pytest.approx(1 / rate, rel=0.25)


def test_prompt_sizes_are_exact_with_the_gateways_count() -> None:
    mix = [
        TrafficClass("tiny", 1, (1, 30), 4),
        TrafficClass("short", 1, (40, 60), 4),
        TrafficClass("long", 1, (2800, 3200), 4),
    ]
    schedule = closed_schedule(mix, 150, seed=2)
    minimum = gateway_count(schedule[0].prompt.split(".")[0] + ".")
    for p in schedule:
        assert gateway_count(p.prompt) == p.prompt_tokens
        # The run tag the client writes in never changes the size.
        assert gateway_count(with_run_tag(p.prompt, "987654")) == p.prompt_tokens
        low, high = next(c.prompt_tokens for c in mix if c.name == p.cls)
        assert max(low, minimum - 2) <= p.prompt_tokens <= max(high, minimum + 2)
    long_one = next(p for p in schedule if p.cls == "long")
    assert long_one.prompt.count(" ") > 1500  # words, not one token repeated


def test_openings_are_unique() -> None:
    schedule = closed_schedule(DEFAULT_MIX, 300, seed=4)
    openings = [p.prompt.split(".")[0] for p in schedule]
    assert len(set(openings)) == len(openings)
    other_seed = closed_schedule(DEFAULT_MIX, 300, seed=5)
    assert not {p.prompt.split(".")[0] for p in other_seed} & set(openings)
    tagged = with_run_tag(schedule[0].prompt, "123456")
    assert tagged != schedule[0].prompt and tagged.startswith("Session 123456 ")


def test_mix_from_flags_and_toml(tmp_path: Path) -> None:
    assert parse_class("short:0.8:40-60:64") == TrafficClass("short", 0.8, (40, 60), 64)
    assert parse_class("x:1:100:8") == TrafficClass("x", 1.0, (100, 100), 8)
    for bad in ("short:0.8:40-60", "s:0:40-60:64", "s:1:60-40:64", "s:1:a-b:64", "s:1:5:0"):
        with pytest.raises(ValueError):
            parse_class(bad)
    path = tmp_path / "mix.toml"
    path.write_text(
        '[[class]]\nname = "chat"\nshare = 3\nprompt_tokens = [10, 20]\nmax_tokens = 32\n'
        '[[class]]\nname = "rag"\nshare = 1\nprompt_tokens = 2000\nmax_tokens = 128\n'
    )
    assert load_mix(path) == [
        TrafficClass("chat", 3.0, (10, 20), 32),
        TrafficClass("rag", 1.0, (2000, 2000), 128),
    ]
    path.write_text('[[class]]\nname = "chat"\nshare = 1\nprompt_tokens = "big"\nmax_tokens = 3\n')
    with pytest.raises(ValueError, match="prompt_tokens"):
        load_mix(path)


# --------------------------------------------------------------------------- traces


def write_trace(path: Path, rows: list[tuple[str, int, int]]) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"{stamp},{ctx},{gen}" for stamp, ctx, gen in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_trace_schedule(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "trace.csv",
        [
            ("2023-11-16 18:15:46.6805900", 1024, 256),  # the first lane's limits: short
            ("2023-11-16 18:15:48.6805900", 1025, 10),  # prompt over: long
            ("2023-11-16 18:15:50.1805900", 100, 257),  # output over: long
            ("2023-11-16 18:15:56.6805900", 3000, 0),
        ],
    )
    schedule = trace_schedule(path, speedup=2.0, prompt_scale=1.0, output_scale=1.0)
    assert [p.at_s for p in schedule] == pytest.approx([0.0, 1.0, 1.75, 5.0])
    assert [p.cls for p in schedule] == ["short", "long", "long", "long"]
    assert [p.prompt_tokens for p in schedule] == [1024, 1025, 100, 3000]
    assert [p.max_tokens for p in schedule] == [256, 10, 257, 1]  # at least one token
    assert gateway_count(schedule[1].prompt) == 1025

    scaled = trace_schedule(
        path, speedup=1.0, prompt_scale=0.5, output_scale=0.1, start=1, limit=2, seed=3
    )
    assert [p.at_s for p in scaled] == pytest.approx([0.0, 1.5])  # from the window's first row
    assert [(p.prompt_tokens, p.max_tokens) for p in scaled] == [(512, 1), (50, 26)]
    assert [p.cls for p in scaled] == ["short", "short"]

    (tmp_path / "bad.csv").write_text("time,ctx\n1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        trace_schedule(tmp_path / "bad.csv", speedup=1, prompt_scale=1, output_scale=1)


@pytest.mark.skipif(not AZURE_TRACE.exists(), reason="the Azure trace is not next to the repo")
def test_azure_trace_smoke() -> None:
    schedule = trace_schedule(
        AZURE_TRACE, speedup=10.0, prompt_scale=1.0, output_scale=1.0, start=100, limit=200
    )
    assert len(schedule) == 200
    times = [p.at_s for p in schedule]
    assert times[0] == 0.0 and times == sorted(times) and times[-1] < 100.0
    assert {p.cls for p in schedule} == {"short", "long"}
    for p in schedule[:20]:
        assert gateway_count(p.prompt) == p.prompt_tokens


# --------------------------------------------------------------------------- runs


async def test_open_loop_against_the_simulator(start_simulator_at: StartSimulator) -> None:
    url = await start_simulator_at()
    schedule = poisson_schedule(SMALL_MIX, rate=3.0, duration_s=2.5, seed=1)
    assert len(schedule) >= 3
    run = await run_open_loop(url, schedule, timeout_s=30)

    assert run.target == url
    assert [r.index for r in run.results] == [p.index for p in schedule]
    for result, plan in zip(run.results, schedule, strict=True):
        assert result.ok, result
        assert result.status == 200 and result.attempts == 1
        assert result.cls == plan.cls
        assert result.completion_tokens == plan.max_tokens == result.content_chunks
        assert result.ttft_ms is not None and result.e2e_ms is not None
        assert 0 < result.ttft_ms <= result.e2e_ms < 20_000
        assert result.tpot_ms is not None and 0 < result.tpot_ms < 2_000
        assert result.sent_ms is not None
        assert 0 <= result.sent_ms - result.scheduled_ms < 1_000
        assert result.reject_ms is None and result.error_code is None
    assert run.wall_s >= schedule[-1].at_s

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/sim/requests") as resp:
            seen = {r["request_id"]: r for r in (await resp.json())["requests"]}
    for result in run.results:
        record = seen[result.request_id]
        assert record["stream"] is True and record["include_usage"] is True
        assert record["prompt_tokens"] == result.prompt_tokens  # same count as the gateway's

    summary = summarize_run(run)
    assert list(summary)[-1] == "all"
    assert summary["all"]["count"] == summary["all"]["ok"] == len(schedule)
    tokens = sum(p.max_tokens for p in schedule)
    assert summary["all"]["completion_tokens"] == tokens
    assert summary["all"]["goodput_tok_s"] == pytest.approx(tokens / run.wall_s)
    assert summary["all"]["errors"] == {}
    assert summary["all"]["ttft_ms"]["p99"] is not None


async def test_closed_loop_keeps_concurrency(start_simulator_at: StartSimulator) -> None:
    url = await start_simulator_at()
    schedule = closed_schedule(SMALL_MIX, 8, seed=2)
    run = await run_closed_loop(url, schedule, 3, timeout_s=30)
    assert len(run.results) == 8 and all(r.ok for r in run.results)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/sim/requests") as resp:
            seen = (await resp.json())["requests"]
    assert len(seen) == 8
    in_flight = [sum(o["arrival"] <= r["arrival"] < o["end"] for o in seen) for r in seen]
    assert max(in_flight) == 3  # three workers, never more


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


# --------------------------------------------------------------------------- command line


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


async def test_main_two_targets_tables_and_json(
    start_simulator_at: StartSimulator, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = await start_simulator_at(), await start_simulator_at()
    out = tmp_path / "run.json"
    args = parse(
        ["--target", first, "--target", second, "--rate", "4", "--duration", "1.5"]
        + ["--class", "short:0.7:40-60:8", "--class", "long:0.3:500-700:16"]
        + ["--seed", "3", "--json", str(out), "--no-progress"]
    )
    # main() runs its own event loop: give it a thread while the simulators serve here.
    assert await asyncio.to_thread(main, args) == 0

    printed = capsys.readouterr().out
    assert f"== [1] {first}" in printed and f"== [2] {second}" in printed
    assert "side by side [1] vs [2]" in printed
    assert max(len(line) for line in printed.splitlines()) <= 100

    data = json.loads(out.read_text())
    assert data["params"]["seed"] == 3 and data["params"]["target"] == [first, second]
    assert [c["name"] for c in data["params"]["mix"]] == ["short", "long"]
    first_run, second_run = data["runs"]
    assert (first_run["target"], second_run["target"]) == (first, second)
    assert first_run["run_tag"] != second_run["run_tag"]
    planned_count = data["params"]["requests_planned"]
    for run in data["runs"]:
        assert len(run["results"]) == planned_count
        assert set(run["summary"]) <= {"short", "long", "all"}
        assert run["summary"]["all"]["ok"] == planned_count
        row = run["results"][0]
        for key in ("index", "cls", "scheduled_ms", "sent_ms", "status", "error_code", "ttft_ms"):
            assert key in row
        assert row["ok"] is True and row["attempts"] == 1
    # The same schedule on both targets.
    assert [(r["cls"], r["prompt_tokens"], r["scheduled_ms"]) for r in first_run["results"]] == [
        (r["cls"], r["prompt_tokens"], r["scheduled_ms"]) for r in second_run["results"]
    ]


async def test_main_closed_loop_with_a_mix_file(
    start_simulator_at: StartSimulator, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = await start_simulator_at()
    mix = tmp_path / "mix.toml"
    mix.write_text(
        '[[class]]\nname = "chat"\nshare = 1\nprompt_tokens = [20, 30]\nmax_tokens = 4\n'
    )
    args = parse(["--target", url, "--mix", str(mix), "--concurrency", "2", "--requests", "5"])
    assert await asyncio.to_thread(main, args) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"== {url}")
    assert any(
        line.startswith("chat") and line.split()[1:3] == ["5", "5"] for line in printed.splitlines()
    )


def test_main_refuses_bad_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(parse(["--mix", "x.toml", "--class", "a:1:5:5"])) == 2
    assert main(parse(["--rate", "0.001", "--duration", "0.01"])) == 2
    assert main(parse(["--trace", str(tmp_path / "missing.csv")])) == 2
    assert main(parse(["--json", str(tmp_path / "no" / "dir.json")])) == 2
    err = capsys.readouterr().err
    assert "not both" in err and "empty" in err and "no such directory" in err
