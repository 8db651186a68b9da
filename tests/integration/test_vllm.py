"""The gateway in front of a real vLLM (its CPU build, Gemma 3 270M), what mocks hide.

Two vLLM servers for the module (`tests/vllm_server.py`): one as vLLM starts by
default, one with `--scheduling-policy priority`. Every answer is greedy
(temperature 0), so an answer through the gateway can be set byte for byte beside
the same request sent to vLLM itself, its `id` and `created` masked. The last test
SIGKILLs the server holding an answer and reads that answer, whole, from the other.

Marked `serial`: each server holds ~5 GB and both cores while it starts (~35 s).
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import msgspec
import pytest

from gateway.config import HealthSettings, PreemptionSettings, Settings
from tests.conftest import RunningGateway, StartGateway, sse_events
from tests.helpers import eventually
from tests.vllm_server import MODEL, VllmServer, start_servers, vllm_installed

pytestmark = pytest.mark.serial

#: What differs between two identical requests to vLLM: the answer's id and its clock.
VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmServer]]:
    """`plain` (vLLM's defaults: first come, first served) and `priority`."""
    vllm_installed()
    plain, priority = start_servers(
        ["", "--scheduling-policy priority"], tmp_path_factory.mktemp("vllm")
    )
    yield {"plain": plain, "priority": priority}
    for server in (plain, priority):
        server.stop()


def masked(raw: bytes) -> list[bytes]:
    """Event by event (a failure names the one that differs), id and clock masked."""
    return VOLATILE.sub(rb'"\1":"*"', raw).split(b"\n\n")


def unique(text: str) -> str:
    """A prompt whose opening no earlier request shares (no prefix-cache hit)."""
    return f"[{uuid.uuid4().hex[:8]}] {text}"


def chat(prompt: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        **extra,
    }


def chat_text(events: list[Any]) -> str:
    """The answer's text in a chat stream's events."""
    return "".join(
        choice["delta"].get("content") or ""
        for event in events
        if isinstance(event, dict)
        for choice in event.get("choices", [])
    )


def fast_health(settings: Settings) -> Settings:
    """Health (and /metrics) every 0.2 s: the engine's histogram windows follow quickly."""
    return msgspec.structs.replace(
        settings, health=HealthSettings(interval_s=0.2, timeout_s=1.0, probe_on_start=False)
    )


async def gateway_for(
    start_gateway: StartGateway, *servers: VllmServer, **backend: Any
) -> RunningGateway:
    def configure(settings: Settings) -> Settings:
        settings = fast_health(settings)
        backends = [msgspec.structs.replace(b, **backend) for b in settings.backends]
        return msgspec.structs.replace(settings, backends=backends)

    gateway = await start_gateway([s.url for s in servers], configure=configure)
    # Its engine and model list from vLLM's /v1/models, at the first health rounds.
    await eventually(
        lambda: all(b.engine == "vllm" for b in gateway.state.pool.backends), within_s=10
    )
    return gateway


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.read()


async def metric(
    http: aiohttp.ClientSession, server: VllmServer, name: str, **labels: str
) -> float:
    """The sum of one counter of vLLM's /metrics over the series with these labels."""
    async with http.get(server.url + "/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        series, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


async def test_streamed_answers_are_vllms_bytes_with_the_usage_chunk(
    vllm: dict[str, VllmServer], start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    server = vllm["plain"]
    gateway = await gateway_for(start_gateway, server)
    prompt = unique("Name three colours of the rainbow.")
    for extra in ({}, {"stream_options": {"include_usage": True}}):
        body = chat(prompt, max_tokens=12, stream=True, **extra)
        direct_status, direct = await post(http, server.url + "/v1/chat/completions", body)
        status, through = await post(http, gateway.url + "/v1/chat/completions", body)
        assert direct_status == status == 200
        assert masked(through) == masked(direct)
        events = sse_events(through)
        assert events[-1] == "[DONE]"
        usage = [e["usage"] for e in events[:-1] if e.get("usage")]
        if extra:
            assert len(usage) == 1 and usage[0]["completion_tokens"] == 12, usage
        else:
            assert not usage
    line = gateway.request_lines()[-1]
    assert line["outcome"] == "ok" and line["completion_tokens"] == 12, line


async def test_whole_answers_and_completions_are_vllms(
    vllm: dict[str, VllmServer], start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    server = vllm["plain"]
    gateway = await gateway_for(start_gateway, server)
    bodies = {
        "/v1/chat/completions": chat(unique("What is a gateway?"), max_tokens=10),
        "/v1/completions": {
            "model": MODEL,
            "prompt": unique("The capital of France is"),
            "max_tokens": 10,
            "temperature": 0,
        },
    }
    bodies["/v1/completions (stream)"] = {**bodies["/v1/completions"], "stream": True}
    for name, body in bodies.items():
        path = name.split()[0]
        direct_status, direct = await post(http, server.url + path, body)
        status, through = await post(http, gateway.url + path, body)
        assert direct_status == status == 200, (name, through[:300])
        assert masked(through) == masked(direct), name
    assert [line["route"] for line in gateway.request_lines()] == [
        "/v1/chat/completions", "/v1/completions", "/v1/completions",
    ]  # fmt: skip


async def test_a_model_vllm_does_not_list_is_404_at_the_door(
    vllm: dict[str, VllmServer], start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    server = vllm["plain"]
    gateway = await gateway_for(start_gateway, server)
    await eventually(lambda: gateway.state.pool.backends[0].served.names, within_s=10)
    before = await metric(http, server, "vllm:request_success_total")
    async with http.post(
        gateway.url + "/v1/chat/completions", json={**chat("hi", max_tokens=2), "model": "gpt-4o"}
    ) as resp:
        assert resp.status == 404
        error = (await resp.json())["error"]
    assert error["code"] == "model_not_found" and "gemma" in error["message"], error
    status, _ = await post(http, gateway.url + "/v1/chat/completions", chat("hi", max_tokens=2))
    assert status == 200
    async with http.get(gateway.url + "/v1/models") as resp:
        assert [card["id"] for card in (await resp.json())["data"]] == [MODEL]
    # Only the listed one reached vLLM.
    assert await metric(http, server, "vllm:request_success_total") == before + 1


async def test_the_engine_split_comes_from_vllms_metrics(
    vllm: dict[str, VllmServer], start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    server = vllm["plain"]
    gateway = await gateway_for(start_gateway, server, max_concurrency=3)

    async def burst(tag: str) -> None:
        async def one(i: int) -> None:
            body = chat(unique("hello " * 200), max_tokens=16, stream=True)
            status, _ = await post(http, gateway.url + "/v1/chat/completions", body)
            assert status == 200

        await asyncio.gather(*(one(i) for i in range(3)))

    await burst("a")
    await asyncio.sleep(1.0)  # scrapes on both sides of the burst: vLLM's histograms move
    await burst("b")
    lines = gateway.request_lines()[-3:]
    for line in lines:
        assert line["timing_source"] == "engine_window", line
        parts = line["engine_queue_ms"] + line["prefill_ms"]
        assert parts == pytest.approx(line["backend_ttft_ms"], abs=0.01), line
        assert line["prefill_ms"] > 0, line
    async with http.get(gateway.url + "/debug/backends") as resp:
        window = (await resp.json())["backends"][0]["engine_window"]
    assert window["requests"] >= 1 and window["prefill_ms"] > 0, window


async def test_a_client_gone_mid_answer_is_an_abort_in_vllms_counters(
    vllm: dict[str, VllmServer], start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """vLLM 0.32 counts no `finished_reason="abort"` for a dropped stream: the abort
    shows as the request leaving `num_requests_running` and `generation_tokens_total`
    stopping, far short of the answer's 400 tokens."""
    server = vllm["plain"]
    gateway = await gateway_for(start_gateway, server)
    generated = await metric(http, server, "vllm:generation_tokens_total")
    body = chat(unique("Tell a long story."), max_tokens=400, stream=True, ignore_eos=True)
    async with aiohttp.ClientSession() as client:
        async with client.post(gateway.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            seen = b""
            while seen.count(b'"content"') < 6:  # the role chunk and five tokens
                seen += await asyncio.wait_for(resp.content.readany(), 20)
            assert await metric(http, server, "vllm:num_requests_running") == 1
        # leaving both blocks closes the connection mid-answer

    async def stopped() -> bool:
        return await metric(http, server, "vllm:num_requests_running") == 0

    await eventually(stopped, within_s=1.0, step_s=0.05)
    await asyncio.sleep(1.0)  # an engine still decoding would add ~25 tokens a second
    made = await metric(http, server, "vllm:generation_tokens_total") - generated
    assert made < 60, made  # (the counter lags a step or two: no lower bound)
    await eventually(lambda: gateway.request_lines(), within_s=2)
    line = gateway.request_lines()[-1]
    assert line["outcome"] == "client_disconnected", line
    assert 5 <= line["completion_tokens"] < 60, line
    assert gateway.state.pool.backends[0].in_flight == 0


@pytest.mark.parametrize("which", ["plain", "priority"])
async def test_the_priority_field_is_served_with_and_without_vllms_priority_policy(
    which: str,
    vllm: dict[str, VllmServer],
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    """The lane's index goes in `priority`: vLLM started with `--scheduling-policy
    priority` orders by it; one started without ignores it. Neither may break."""
    server = vllm[which]
    gateway = await gateway_for(start_gateway, server, priority_field=True)
    short = chat(unique("Say hi."), max_tokens=4)
    long = chat(unique("word " * 2500), max_tokens=4)  # the default lanes put it lower
    for body in (short, long, {**short, "stream": True}, {**long, "stream": True}):
        status, answer = await post(http, gateway.url + "/v1/chat/completions", body)
        assert status == 200, answer[:300]
    lanes = [line["lane"] for line in gateway.request_lines()]
    assert len(set(lanes)) == 2, lanes  # both priorities were sent
    assert all(line["outcome"] == "ok" for line in gateway.request_lines())


async def test_a_long_prompt_preempted_in_prefill_is_answered_whole_and_the_same(
    vllm: dict[str, VllmServer], start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """`[preemption]` on vLLM (#53): its prefill cut when its connection closes, the long
    prompt's answer comes once and byte for byte vLLM's own (greedy), and the short
    request that preempted it does not wait for the rest of that prefill. (vLLM 0.32
    keeps nothing of a prefill cut short: the prompt sent again is prefilled whole,
    `scripts/abort_cache.py`.)"""
    server = vllm["plain"]

    def preempting(settings: Settings) -> Settings:
        return msgspec.structs.replace(
            fast_health(settings), preemption=PreemptionSettings(enabled=True)
        )

    gateway = await start_gateway([server.url], configure=preempting)
    await eventually(lambda: gateway.state.pool.backends[0].engine == "vllm", within_s=10)

    def long_body(tag: str) -> dict[str, Any]:  # ~2500 tokens: ~1 s of prefill here
        return chat(unique(tag + " hello" * 2500), max_tokens=8, stream=True)

    start = asyncio.get_running_loop().time()
    async with http.post(server.url + "/v1/chat/completions", json=long_body("alone")) as resp:
        await resp.content.readany()
        alone_ttft = asyncio.get_running_loop().time() - start
        await resp.read()
    body = long_body("preempted")
    long = asyncio.create_task(post(http, gateway.url + "/v1/chat/completions", body))
    await asyncio.sleep(0.3 * alone_ttft)  # its prefill under way
    start = asyncio.get_running_loop().time()
    short_status, _ = await post(
        http, gateway.url + "/v1/chat/completions", chat(unique("Hi."), max_tokens=2)
    )
    short_s = asyncio.get_running_loop().time() - start
    status, through = await long
    assert short_status == status == 200
    direct_status, direct = await post(http, server.url + "/v1/chat/completions", body)
    assert direct_status == 200 and masked(through) == masked(direct)
    await eventually(lambda: len(gateway.request_lines()) >= 2, within_s=2)
    (line,) = [line for line in gateway.request_lines() if line["lane"] == "bulk"]
    assert line["preempted"] == 1 and line["outcome"] == "ok", line
    # Behind the rest of the long prefill it would have waited ~0.7 of it, and its own.
    assert short_s < 0.6 * alone_ttft, (short_s, alone_ttft)


async def test_an_engine_killed_mid_answer_the_answer_goes_on_whole_on_the_other(
    vllm: dict[str, VllmServer], start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """Last in the module: it SIGKILLs the server holding the answer."""
    servers = [vllm["plain"], vllm["priority"]]
    gateway = await gateway_for(start_gateway, *servers)
    prompt = unique("Count to one hundred: 1, 2, 3, 4, 5, 6,")
    body = chat(prompt, max_tokens=60, stream=True, ignore_eos=True,
                stream_options={"include_usage": True})  # fmt: skip
    _, unbroken = await post(http, servers[1].url + "/v1/chat/completions", body)
    async with http.post(gateway.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        raw = b""
        # Killed at a seam after a space when one comes ("5, 6, 7, "): the other engine,
        # sent the text (its chat template trims it), writes that space again.
        while raw.count(b'"content"') < 15 or (
            not chat_text(sse_events(raw[: raw.rfind(b"\n\n") + 2])).endswith(" ")
            and raw.count(b'"content"') < 40
        ):
            raw += await asyncio.wait_for(resp.content.readany(), 20)
        backends = gateway.state.pool.backends
        holder = servers[max(range(2), key=lambda i: backends[i].in_flight)]
        holder.kill()
        before = chat_text(sse_events(raw[: raw.rfind(b"\n\n") + 2]))
        raw += await asyncio.wait_for(resp.read(), 60)
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    assert not [c for c in chunks if "error" in c], chunks[-3:]
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usage) == 1 and usage[0]["completion_tokens"] == 60, usage
    # Greedy: what came before the kill is vLLM's own answer, and it goes on from there,
    # nothing lost, nothing twice. (Not the unbroken answer byte for byte: the other
    # engine re-tokenizes the text so far, and its tokens at the seam may differ.)
    text = chat_text(events)
    assert len(before) >= 15 and chat_text(sse_events(unbroken)).startswith(before)
    assert text.startswith(before) and len(text) > len(before)
    # The seam's whitespace once: any double space is one vLLM wrote itself, unbroken.
    own = chat_text(sse_events(unbroken))
    doubled = [i for i in range(len(text) - 1) if text[i : i + 2] == "  "]
    assert all(own[i : i + 2] == "  " for i in doubled), (text, own)
    line = gateway.request_lines()[-1]
    assert line["resumes"] == 1 and line["outcome"] == "ok", line
