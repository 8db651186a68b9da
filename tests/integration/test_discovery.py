"""Backends found by DNS (`upstream/discovery.py`): a real gateway process whose
`[[backends]] dns` name is answered by a DNS server the test runs and changes.

As a Kubernetes headless Service does, the name's A records are the servers and the
port is the entry's: simulator A listens on 127.0.0.2, simulator B on 127.0.0.3, both on
the same port (Linux serves all of 127/8). Streams flow while the records move from A
to B: every answer is whole, new requests reach B, A is drained and forgotten once
idle. A resolution that fails keeps the addresses last known.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp

from gateway.tools.simulator.config import SimulatorConfig
from gateway.tools.simulator.server import start_simulator
from tests.conftest import chat
from tests.dns_server import records_server
from tests.helpers import eventually
from tests.integration.conftest import metric
from tests.integration.test_reload import SLOW, whole_stream

NAME = "sim.models.test"


def port_free_on(*hosts: str) -> int:
    """A port free on every one of `hosts` (the Service's port, the same on each pod)."""
    for _ in range(20):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = int(probe.getsockname()[1])
        try:
            for host in hosts[1:]:
                with socket.socket() as other:
                    other.bind((host, port))
        except OSError:
            continue
        return port
    raise AssertionError("no port free on every address")


async def test_a_dns_name_whose_records_change_moves_traffic_and_drains_the_old_server(
    http: aiohttp.ClientSession, gateway_process: Any
) -> None:
    port = port_free_on("127.0.0.2", "127.0.0.3")
    runners = [
        (await start_simulator(SimulatorConfig(**SLOW), host=host, port=port))[0]
        for host in ("127.0.0.2", "127.0.0.3")
    ]
    old, new = f"http://127.0.0.2:{port}", f"http://127.0.0.3:{port}"
    try:
        async with records_server() as dns:
            dns.records[NAME] = ["127.0.0.2"]
            gateway = await gateway_process(
                f'[discovery]\ninterval_s = 1\nnameservers = ["127.0.0.1:{dns.port}"]\n\n'
                f'[[backends]]\nname = "sim"\ndns = "{NAME}:{port}"\nmax_concurrency = 8\n'
            )
            await _moves(http, gateway, dns, old, new)
    finally:
        for runner in runners:
            await runner.cleanup()


async def _moves(http: aiohttp.ClientSession, gateway: Any, dns: Any, old: str, new: str) -> None:
    chat_url = gateway.url + "/v1/chat/completions"

    async def backends() -> dict[str, Any]:
        async with http.get(gateway.url + "/debug/backends") as resp:
            return {b["name"]: b for b in (await resp.json())["backends"]}

    async def received(sim: str) -> int:
        async with http.get(sim + "/sim/stats") as resp:
            return int((await resp.json())["received"])

    assert list(await backends()) == ["sim@127.0.0.2"]
    answers: list[asyncio.Task[str]] = []
    flowing = True

    async def one_stream() -> str:
        async with http.post(chat_url, json=chat(max_tokens=30, stream=True)) as resp:
            assert resp.status == 200, await resp.text()
            return await whole_stream(resp)

    async def traffic() -> None:
        while flowing:  # a stream every 100 ms, through the whole change
            answers.append(asyncio.create_task(one_stream()))
            await asyncio.sleep(0.1)

    sender = asyncio.create_task(traffic())
    await asyncio.sleep(0.5)
    dns.records[NAME] = ["127.0.0.3"]

    async def moved() -> bool:
        found = await backends()
        return "sim@127.0.0.3" in found and found["sim@127.0.0.2"]["leaving"]

    await eventually(moved, within_s=10)
    before = await received(old)
    await asyncio.sleep(1.0)  # traffic goes on, to the new server only
    flowing = False
    await sender
    texts = await asyncio.gather(*answers)  # every stream whole, none failed
    assert len(texts) >= 10 and all(texts)
    assert await received(old) == before
    assert await received(new) >= 5

    async def forgotten() -> bool:  # the old server idle: out of the pool
        return list(await backends()) == ["sim@127.0.0.3"]

    await eventually(forgotten, within_s=10)
    # Its lines are read from the process's stderr, which may come a moment after.
    await eventually(lambda: gateway.events("backend_left"), within_s=5)
    assert gateway.events("dns_addresses_changed")[-1]["addresses"] == ["127.0.0.3"]
    assert gateway.events("backend_left")[0]["backend"] == "sim@127.0.0.2"

    # The name no longer resolves: the last known server stays, with a warning and a metric.
    del dns.records[NAME]
    await eventually(lambda: gateway.events("dns_resolution_failed"), within_s=5)
    failed = (
        f'gateway_dns_resolutions_total{{name="{NAME}:{new.rsplit(":", 1)[1]}",result="failed"}}'
    )
    assert (await metric(http, gateway.url, failed) or 0) >= 1
    assert gateway.events("dns_resolution_failed")[0]["kept"] == ["127.0.0.3"]
    async with http.post(chat_url, json=chat(max_tokens=2)) as resp:
        assert resp.status == 200
    assert list(await backends()) == ["sim@127.0.0.3"]
