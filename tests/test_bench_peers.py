"""scripts/bench_peers.py's own logic: what counts as broken, its routes, and its tables.

No router is started: the benchmark's open loop runs against two tiny scripted
servers on 127.0.0.1 (one empty 200, as smg answers a request it preempted).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.tools.loadgen import RequestResult, TrafficClass, closed_schedule

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def peers() -> ModuleType:
    sys.path.insert(0, str(SCRIPTS))  # it imports benchlib as the scripts do
    try:
        spec = importlib.util.spec_from_file_location("bench_peers", SCRIPTS / "bench_peers.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_peers"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


def result(status: int | None, error_code: str | None = None, chunks: int = 3) -> RequestResult:
    return RequestResult(
        index=0,
        cls="short",
        prompt_tokens=50,
        max_tokens=64,
        request_id="r",
        scheduled_ms=0.0,
        status=status,
        error_code=error_code,
        content_chunks=chunks,
        ttft_ms=10.0 if chunks else None,
    )


def test_outcomes(peers: ModuleType) -> None:
    assert peers.outcome(result(200)) == "completed"
    assert peers.outcome(result(200, chunks=0)) == "broken"  # smg's preempted empty 200
    assert peers.outcome(result(200, "stream_truncated")) == "broken"  # no [DONE]
    assert peers.outcome(result(200, "internal_error")) == "broken"  # a mid-stream error event
    assert peers.outcome(result(429, "queue_full", chunks=0)) == "refused"
    assert peers.outcome(result(None, "client_timeout", chunks=0)) == "timeout"
    assert peers.outcome(result(200, "client_timeout")) == "timeout"
    assert peers.outcome(result(None, "connection_error", chunks=0)) == "no_answer"


def test_class_figures_count_refusals_by_status_and_time_only_completed(
    peers: ModuleType,
) -> None:
    rows = [result(200), result(200, chunks=0), result(429, chunks=0), result(503, chunks=0)]
    rows[0].ttft_ms = 40.0
    figures = peers.class_figures(rows)
    assert figures["completed"] == 1 and figures["broken"] == 1
    assert figures["refused"] == {"429": 1, "503": 1}
    assert figures["ttft_p50_ms"] == figures["ttft_p99_ms"] == 40.0


def test_backend_list_and_gateway_config(peers: ModuleType) -> None:
    assert peers.backend_list(None) is None
    assert peers.backend_list(["http://a:1/", "http://b:2,http://c:3"]) == [
        "http://a:1",
        "http://b:2",
        "http://c:3",
    ]
    toml = peers.gateway_config(["http://a:1", "http://b:2"])
    assert toml.count("[[backends]]") == 2 and 'name = "engine-b"' in toml
    assert "max_concurrency" not in toml  # the default config: slots as the gateway finds them


def test_router_command_lines(peers: ModuleType) -> None:
    vllm = peers.vllm_router_argv(Path("/v/vllm-router"), 1, 2, ["http://a", "http://b"])
    assert "--disable-retries" in vllm and vllm[vllm.index("--host") + 1] == "127.0.0.1"
    assert "--max-concurrent-requests" not in vllm
    smg = peers.smg_argv(Path("/v/smg"), 1, 2, ["http://a"], priority=True)
    assert smg[1] == "launch" and "--priority-scheduler-enabled" in smg
    assert smg[smg.index("--priority-scheduler-default-max-class") + 1] == "interactive"
    assert "--worker-urls" not in smg  # registered with their slots instead
    assert smg[smg.index("--prometheus-host") + 1] == "127.0.0.1"


def test_parse_counters(peers: ModuleType) -> None:
    text = (
        "# HELP smg_scheduler_admit_total x\n"
        'smg_scheduler_admit_total{class="interactive",outcome="admitted"} 27\n'
        'smg_scheduler_admit_total{class="bulk",outcome="admitted"} 0\n'
        'smg_scheduler_inflight{class="bulk"} 3\n'
        "other_total 5\n"
    )
    assert peers.parse_counters(text, "smg_scheduler_") == {
        'smg_scheduler_admit_total{class="interactive",outcome="admitted"}': 27.0
    }


@pytest.fixture
async def two_servers() -> AsyncIterator[tuple[list[str], list[tuple[int, str | None]]]]:
    """Two servers: the first streams an answer, the second an empty 200. Each request
    is recorded as (server, its x-smg-priority header)."""
    seen: list[tuple[int, str | None]] = []

    def handler(number: int) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            await request.read()
            seen.append((number, request.headers.get("x-smg-priority")))
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            if number == 0:
                chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response

        return handle

    servers = []
    for number in range(2):
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler(number))
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
    yield [str(s.make_url("")).rstrip("/") for s in servers], seen
    for server in servers:
        await server.close()


async def test_run_schedule_round_robin_labels_and_broken(
    peers: ModuleType, two_servers: tuple[list[str], list[tuple[int, str | None]]]
) -> None:
    urls, seen = two_servers
    mix = [TrafficClass("short", 1, (20, 20), 4), TrafficClass("long", 1, (30, 30), 4)]
    schedule = closed_schedule(mix, 8, seed=3)
    run = await peers.run_schedule(
        "t",
        urls,
        schedule,
        class_headers={"short": {"x-smg-priority": "interactive"}},
        timeout_s=10,
        model="m",
        extra_body={"ignore_eos": True},
    )
    assert [r.index for r in run.results] == list(range(8))
    assert sorted(server for server, _ in seen) == [0] * 4 + [1] * 4  # round robin
    labels = {p.index: p.cls for p in schedule}
    for r in run.results:
        assert peers.outcome(r) == ("completed" if r.index % 2 == 0 else "broken")
    expected = sorted("interactive" if labels[i] == "short" else "" for i in range(8))
    assert sorted(label or "" for _, label in seen) == expected
    summary = peers.summarize(run)
    assert summary["all"]["completed"] == 4 and summary["all"]["broken"] == 4
    assert summary["all"]["broken_by_kind"] == {"stream_truncated": 4}  # no [DONE]
    assert "| 0% | t |" in peers.table([(0.0, "t", summary)])
