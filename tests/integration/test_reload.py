"""The config reloaded live (`gateway/reload.py`): a real gateway process, its config file
rewritten, then SIGHUP or POST /admin/reload, with streams in flight.

A reload applies to the requests that arrive after it; a stream in flight finishes where
it is; a file that does not load keeps the config in force, with one warning line and a
metric; a backend dropped by the file is drained (no new request, its stream finishes)
and forgotten once idle, and one added gets the new requests.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp

from gateway.config import BackendSettings, HealthSettings, Settings, validate
from tests.conftest import StartSimulator, chat
from tests.helpers import eventually
from tests.integration.conftest import metric

ROOT = Path(__file__).resolve().parents[2]
#: 40 ms a decode step: a 60-token answer streams for about 2.5 s.
SLOW = {"step_base_ms": 40.0, "decode_ms_per_seq": 0.5, "prefill_ms_per_token": 0.05}
STREAM_TOKENS = 60


async def reloads(http: aiohttp.ClientSession, url: str, result: str) -> float:
    return await metric(http, url, f'gateway_config_reloads_total{{result="{result}"}}') or 0.0


async def whole_stream(resp: aiohttp.ClientResponse) -> str:
    """The streamed answer's text, checked whole (one finish_reason, [DONE] last)."""
    body = (await resp.read()).decode()
    events = [block[6:] for block in body.split("\n\n") if block.startswith("data: ")]
    assert events[-1] == "[DONE]", body[-300:]
    chunks = [json.loads(event) for event in events[:-1]]
    assert not any("error" in chunk for chunk in chunks), body[-300:]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert [f for f in finishes if f] == ["length"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def one_lane(sim: str, max_slots: int, extra: str = "") -> str:
    return (
        f'[[backends]]\nname = "sim"\nurl = "{sim}"\nmax_concurrency = 4\n\n'
        f'[[lanes]]\nname = "only"\nmax_slots = {max_slots}\nmax_queue_depth = 1\n'
        "reject_predicted_wait = false\n" + extra
    )


async def test_a_reload_changes_a_lanes_limit_for_the_next_request_while_a_stream_finishes(
    start_simulator_at: StartSimulator, http: aiohttp.ClientSession, gateway_process: Any
) -> None:
    sim = await start_simulator_at(**SLOW)
    gateway = await gateway_process(one_lane(sim, max_slots=1))
    chat_url = gateway.url + "/v1/chat/completions"
    stream = await http.post(chat_url, json=chat(max_tokens=STREAM_TOKENS, stream=True))
    assert stream.status == 200
    # The lane's one slot is the stream's: the next request queues, the one after is refused.
    queued = asyncio.create_task(http.post(chat_url, json=chat(max_tokens=2)))
    await asyncio.sleep(0.3)
    async with http.post(chat_url, json=chat(max_tokens=2)) as resp:
        assert resp.status == 429
        assert (await resp.json())["error"]["code"] == "queue_full"
    assert not queued.done()

    gateway.config.write_text(
        one_lane(sim, max_slots=3, extra="\n[tokenizer]\noffload_min_chars = 1000\n")
    )
    gateway.hup()
    await eventually(lambda: gateway.events("config_reloaded"), within_s=10)

    async with http.post(chat_url, json=chat(max_tokens=2)) as resp:
        assert resp.status == 200  # the new limit, while the stream still runs
    async with await asyncio.wait_for(queued, 5) as resp:  # the queued one was served too
        assert resp.status == 200
    assert not stream.content.at_eof()
    assert len((await whole_stream(stream)).split()) > 0
    line = gateway.events("config_reloaded")[0]
    assert line["reason"] == "sighup"
    assert line["changed"] == ["lanes"]  # what cannot change live is said, not applied:
    assert line["not_applied"] == ["tokenizer"]
    assert "restart" in line["hint"]
    assert await reloads(http, gateway.url, "ok") == 1


async def test_a_file_that_does_not_load_keeps_the_config_in_force(
    start_simulator_at: StartSimulator, http: aiohttp.ClientSession, gateway_process: Any
) -> None:
    sim = await start_simulator_at(**SLOW)
    gateway = await gateway_process(one_lane(sim, max_slots=1))
    chat_url = gateway.url + "/v1/chat/completions"
    gateway.config.write_text(one_lane(sim, max_slots=0) + "max_promt_tokens = 5\n")
    gateway.hup()
    await eventually(lambda: gateway.events("config_reload_failed"), within_s=10)
    failed = gateway.events("config_reload_failed")[0]
    assert "max_slots" in failed["error"] and "max_promt_tokens" in failed["error"]
    assert "unchanged" in failed["hint"]
    assert await reloads(http, gateway.url, "failed") == 1
    assert await metric(http, gateway.url, "gateway_config_last_reload_successful") == 0

    gateway.config.write_text("this is [not TOML")
    async with http.post(gateway.url + "/admin/reload") as resp:  # loopback: allowed
        assert resp.status == 422
        answer = await resp.json()
    assert answer["result"] == "failed" and "not valid TOML" in answer["error"]
    # The old config serves: one slot, one queued, the next refused.
    stream = await http.post(chat_url, json=chat(max_tokens=STREAM_TOKENS, stream=True))
    queued = asyncio.create_task(http.post(chat_url, json=chat(max_tokens=2)))
    await asyncio.sleep(0.3)
    async with http.post(chat_url, json=chat(max_tokens=2)) as resp:
        assert resp.status == 429
    await whole_stream(stream)
    async with await queued as resp:
        assert resp.status == 200


async def test_a_reload_drains_a_dropped_backend_and_sends_new_requests_to_the_added_one(
    start_simulator_at: StartSimulator, http: aiohttp.ClientSession, gateway_process: Any
) -> None:
    first, second = await start_simulator_at(**SLOW), await start_simulator_at(**SLOW)
    backend = '[[backends]]\nname = "{name}"\nurl = "{url}"\nmax_concurrency = 4\n'
    gateway = await gateway_process(backend.format(name="first", url=first))
    chat_url = gateway.url + "/v1/chat/completions"
    streams = [
        await http.post(chat_url, json=chat(max_tokens=STREAM_TOKENS, stream=True))
        for _ in range(3)
    ]
    gateway.config.write_text(backend.format(name="second", url=second))
    async with http.post(gateway.url + "/admin/reload") as resp:
        assert resp.status == 200
        answer = await resp.json()
    assert answer["joined"] == ["second"] and answer["left"] == ["first"]

    async def backends() -> dict[str, Any]:
        async with http.get(gateway.url + "/debug/backends") as resp:
            return {b["name"]: b for b in (await resp.json())["backends"]}

    described = await backends()
    assert described["first"]["leaving"] and described["first"]["in_flight"] == 3
    fresh = [await http.post(chat_url, json=chat(max_tokens=4)) for _ in range(4)]
    assert [r.status for r in fresh] == [200] * 4
    for resp in fresh:
        resp.release()
    for stream in streams:  # the dropped backend's streams finish there, whole
        await whole_stream(stream)
    async with http.get(second + "/sim/stats") as resp:
        assert (await resp.json())["received"] == 4

    # Idle, the dropped backend is forgotten.
    async def forgotten() -> bool:
        return "first" not in await backends()

    await eventually(forgotten, within_s=10)
    # Its line is read from the process's stderr, which may come a moment after.
    await eventually(lambda: gateway.events("backend_left"), within_s=5)
    assert gateway.events("backend_left")[0]["backend"] == "first"


async def test_a_reload_makes_a_pool_for_new_models_and_drops_one_left_empty(
    start_simulator_at: StartSimulator, start_gateway: Any, http: aiohttp.ClientSession
) -> None:
    alpha, beta = await start_simulator_at(), await start_simulator_at()

    def serving(*backends: tuple[str, str]) -> Settings:
        return validate(
            Settings(
                backends=[
                    BackendSettings(url=url, name=model, models=[model], max_concurrency=4)
                    for model, url in backends
                ],
                health=HealthSettings(probe_on_start=False),
            )
        )

    gateway = await start_gateway([], configure=lambda _: serving(("alpha", alpha)))
    reloader = gateway.state.reloader
    chat_url = gateway.url + "/v1/chat/completions"
    async with http.post(chat_url, json=chat(model="beta", max_tokens=2)) as resp:
        assert resp.status == 404

    reloader.load = lambda: serving(("alpha", alpha), ("beta", beta))
    result = await reloader.reload("test")
    assert result.ok and result.changes.joined == ["beta"]
    async with http.post(chat_url, json=chat(model="beta", max_tokens=2)) as resp:
        assert resp.status == 200
        assert (await resp.json())["model"] == "beta"
    async with http.get(beta + "/sim/stats") as resp:
        assert (await resp.json())["received"] == 1

    reloader.load = lambda: serving(("beta", beta))
    result = await reloader.reload("test")
    assert result.changes.left == ["alpha"]
    await eventually(lambda: [p.name for p in gateway.state.pools.pools] == ["beta"])
    async with http.post(chat_url, json=chat(model="alpha", max_tokens=2)) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "model_not_found"
    assert gateway.state.pools.default.name == "beta" and gateway.state.pool.backends[0].url == beta


async def test_a_watched_file_is_reloaded_when_it_changes(
    start_simulator_at: StartSimulator, http: aiohttp.ClientSession, gateway_process: Any
) -> None:
    sim = await start_simulator_at()
    watched = "\n[discovery]\nwatch_config_s = 0.2\n"
    gateway = await gateway_process(one_lane(sim, max_slots=1, extra=watched))
    await asyncio.sleep(0.5)
    assert not gateway.events("config_reloaded")  # nothing changed: nothing reloaded
    gateway.config.write_text(one_lane(sim, max_slots=2, extra=watched))
    await eventually(lambda: gateway.events("config_reloaded"), within_s=10)
    line = gateway.events("config_reloaded")[0]
    assert line["reason"] == "file_changed" and line["changed"] == ["lanes"]
    async with http.get(gateway.url + "/debug/backends") as resp:
        lanes = (await resp.json())["lanes"]
    assert [lane["slot_limit"] for lane in lanes] == [2]
