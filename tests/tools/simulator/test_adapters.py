"""The simulator's LoRA adapters: listing, max_lora in the batch, swaps and vLLM's gauge.

The bookkeeping is checked on plain data; the engine and the routes over real HTTP,
with a swap cost large against a step (200 ms against 5 ms), so its time shows.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import pytest

from gateway.tools.simulator.adapters import AdapterSet, parse_adapter_list
from gateway.tools.simulator.config import SimulatorConfig
from tests.tools.simulator.support import StartSim, stats

LORA = {"lora_adapters": "a1,a2,a3", "max_lora": 2, "lora_swap_ms": 200.0}


def test_the_adapter_list_is_split_stripped_and_deduplicated():
    assert parse_adapter_list(" a1, a2,,a1 ") == ("a1", "a2")
    assert parse_adapter_list("") == ()


def test_a_new_adapter_may_join_only_below_max_lora_and_a_resident_one_costs_nothing():
    clock = iter(range(100))
    adapters = AdapterSet(
        ["a1", "a2", "a3"], max_lora=2, swap_ms=30.0, wall_clock=lambda: next(clock)
    )
    assert adapters.may_join("a3", ["a1", None, "a1"])  # one distinct running
    assert not adapters.may_join("a3", ["a1", "a2"])
    assert adapters.may_join("a1", ["a1", "a2"]) and adapters.may_join(None, ["a1", "a2"])
    assert adapters.admit("a1", []) == 30.0
    assert adapters.admit("a2", ["a1"]) == 30.0
    assert adapters.admit("a1", ["a1", "a2"]) == 0.0  # resident
    # a3 loads into the slot of the least recently used adapter no running request needs.
    assert adapters.admit("a3", ["a1"]) == 30.0
    assert list(adapters.resident) == ["a1", "a3"] and adapters.swaps == 3
    adapters.note_batch(["a1", "a3", "a1"], [None, "a2"])
    adapters.note_batch([], [])
    adapters.note_batch(["a1", "a3"], ["a2"])  # the same set again: newest, moved last
    assert list(adapters.info_history.items()) == [(("", ""), 1), (("a1,a3", "a2"), 2)]


def test_lora_adapters_must_not_name_the_base_model():
    with pytest.raises(ValueError, match="base model"):
        SimulatorConfig(model="m", lora_adapters="a1,m")
    assert SimulatorConfig(enable_lora=True).lora and not SimulatorConfig().lora


async def _post(session: aiohttp.ClientSession, url: str, path: str, body: Any) -> tuple[int, Any]:
    async with session.post(f"{url}{path}", json=body) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, await resp.text()


async def _models(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with session.get(f"{url}/v1/models") as resp:
        return (await resp.json())["data"]


async def test_models_list_the_adapters_with_the_base_as_parent_and_loading_adds_one(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim(model="base", **LORA)
    cards = await _models(session, url)
    assert [(c["id"], c["parent"]) for c in cards] == [
        ("base", None), ("a1", "base"), ("a2", "base"), ("a3", "base"),
    ]  # fmt: skip
    status, text = await _post(
        session, url, "/v1/load_lora_adapter", {"lora_name": "a4", "lora_path": "/lora/a4"}
    )
    assert (status, text) == (200, "Success: LoRA adapter 'a4' added successfully.")
    assert (await _models(session, url))[-1] == {
        **cards[-1], "id": "a4", "root": "/lora/a4", "created": cards[-1]["created"],
    }  # fmt: skip
    again, body = await _post(
        session, url, "/v1/load_lora_adapter", {"lora_name": "a4", "lora_path": "/x"}
    )
    assert again == 400 and "already been loaded" in body["error"]["message"]
    missing, body = await _post(session, url, "/v1/load_lora_adapter", {"lora_name": "a5"})
    assert missing == 400 and body["error"]["type"] == "invalid_request_error"
    status, _ = await _post(session, url, "/v1/unload_lora_adapter", {"lora_name": "a4"})
    assert status == 200 and [c["id"] for c in await _models(session, url)][-1] == "a3"
    gone, body = await _post(session, url, "/v1/unload_lora_adapter", {"lora_name": "a4"})
    assert gone == 404
    # A model that is neither the base nor a served adapter: vLLM's 404.
    status, body = await _post(
        session, url, "/v1/completions", {"model": "a4", "prompt": "hi", "max_tokens": 1}
    )
    assert status == 404 and body["error"]["code"] == "model_not_found"


async def test_without_lora_the_routes_refuse_and_no_gauge_is_exported(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim()
    status, _ = await _post(
        session, url, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"}
    )
    assert status == 400
    async with session.get(f"{url}/metrics") as resp:
        assert "lora_requests_info" not in await resp.text()
    assert (await stats(session, url))["lora_swaps"] == 0


async def _complete(session: aiohttp.ClientSession, url: str, model: str, tokens: int) -> float:
    loop = asyncio.get_running_loop()
    start = loop.time()
    status, body = await _post(
        session, url, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": tokens}
    )
    assert status == 200 and body["model"] == model
    return loop.time() - start


def _lora_series(text: str) -> list[tuple[dict[str, str], float]]:
    series = []
    for labels, value in re.findall(r"^vllm:lora_requests_info\{(.*)\} (\S+)$", text, re.M):
        series.append((dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
    return series


async def test_a_third_adapter_waits_for_a_batch_place_and_each_load_is_a_swap(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim(**LORA)
    # a1 and a2 run long (200 tokens of 5.5 ms: ~1.1 s); a3 may not join until one ends.
    long_runs = [asyncio.create_task(_complete(session, url, a, 200)) for a in ("a1", "a2")]
    await asyncio.sleep(0.5)
    third = asyncio.create_task(_complete(session, url, "a3", 1))
    base = await _complete(session, url, "sim-model", 1)  # the base model is never held
    await asyncio.sleep(0.1)
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    newest = max(_lora_series(text), key=lambda s: s[1])
    assert newest[0] == {
        "max_lora": "2", "running_lora_adapters": "a1,a2", "waiting_lora_adapters": "a3",
    }  # fmt: skip
    assert newest[1] > 1.7e9  # a wall-clock timestamp, as vLLM's set_to_current_time
    assert (await stats(session, url))["lora_swaps"] == 2
    assert base < 0.5
    third_s = await third
    assert third_s > 0.4  # it waited for a1 or a2 to end
    await asyncio.gather(*long_runs)
    assert (await stats(session, url))["lora_swaps"] == 3
    # a3 took the GPU slot of a1, the least recently used one (admitted first): a3 is
    # resident and costs nothing, a1 must be loaded again.
    again = [await _complete(session, url, "a3", 1) for _ in range(2)]
    assert (await stats(session, url))["lora_swaps"] == 3
    assert max(again) < 0.15
    assert await _complete(session, url, "a1", 1) >= 0.2  # the load's 200 ms
    assert (await stats(session, url))["lora_swaps"] == 4
