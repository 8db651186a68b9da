"""No client can hurt the others: a flooding tenant, a light one, and a one-slot backend.

The gateway runs in front of the project's simulator on 127.0.0.1; the clients are
aiohttp sessions. The simulator's steps are slowed so that a request holds its slot
for about a second: what fair share changes (a light tenant's wait of one slot's
release against the flood's whole backlog) is seconds against a fraction of one.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
from msgspec.structs import replace

from gateway.config import ApiKeySettings, Settings, TenantSettings
from tests.conftest import StartGateway, StartSimulator, chat

FLOOD_KEY = "flood-key-0001"
LIGHT_KEY = "light-key-0002"
ROUTE = "/v1/chat/completions"


def two_keys(settings: Settings) -> Settings:
    return replace(
        settings,
        api_keys=[
            ApiKeySettings(name="flood", key=FLOOD_KEY),
            ApiKeySettings(name="light", key=LIGHT_KEY, weight=2.0),
        ],
    )


async def streamed(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str
) -> int:
    async with http.post(url + ROUTE, json={**body, "stream": True}, headers=headers) as resp:
        await resp.read()
        return resp.status


async def analyze(log: Path, *flags: str) -> str:
    """`python -m gateway analyze LOG ...` as a process: its standard output."""
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "gateway", "analyze", str(log), *flags],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


async def test_a_flooding_key_does_not_refuse_or_delay_a_light_key(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    # 4 slots, ~1 s a request (32 tokens at ~30 ms a step).
    backend = await start_simulator_at(max_batch=4, step_base_ms=30.0)
    gateway = await start_gateway([backend], max_concurrency=4, configure=two_keys)
    flood_auth = {"Authorization": f"Bearer {FLOOD_KEY}"}
    light_auth = {"Authorization": f"Bearer {LIGHT_KEY}"}
    flood = [
        asyncio.create_task(streamed(http, gateway.url, chat(max_tokens=32), **flood_auth))
        for _ in range(80)  # 20 s of work for 4 slots: most of it is refused
    ]
    await asyncio.sleep(1.5)  # the flood's line is long and its waits measured
    light = []
    for _ in range(5):
        light.append(
            asyncio.create_task(streamed(http, gateway.url, chat(max_tokens=32), **light_auth))
        )
        await asyncio.sleep(0.4)
    assert await asyncio.gather(*light) == [200] * 5
    statuses = await asyncio.gather(*flood)
    # Over capacity: the flood's own requests are refused (at arrival once the waits are
    # measured, at their deadline before that) or wait; the light key's never are.
    assert statuses.count(200) < len(flood) and set(statuses) <= {200, 429, 503}
    lines = gateway.request_lines()
    mine = [line for line in lines if line["tenant"] == "light"]
    assert len(mine) == 5 and all(line["outcome"] == "ok" for line in mine)
    assert all(line["tenant_weight"] == 2.0 and line["cost_tokens"] > 0 for line in mine)
    # First come, each would have waited behind the flood's line and timed out (5 s); in
    # its fair turn it waits for the flood's next release: at most one request's time
    # (~1.1 s here, the flood's requests running in lockstep).
    assert max(line["queue_ms"] for line in mine) < 2000, [line["queue_ms"] for line in mine]
    served_flood = [line for line in lines if line["tenant"] == "flood" and line["status"] == 200]
    assert served_flood and all(line["cost_tokens"] > 0 for line in served_flood)
    async with http.get(gateway.url + "/metrics") as resp:
        text = await resp.text()
    assert 'gateway_tenant_requests_total{lane="interactive",outcome="ok",tenant="light"} 5.0' in (
        text
    )
    # The analyzer reads the recorded log: a row per tenant, and the fair share judged.
    log = tmp_path / "gateway.log"
    log.write_text(gateway.log.getvalue())
    tenants = json.loads(await analyze(log, "--json", "-"))["tenants"]
    assert tenants["count"] == 2
    assert tenants["table"]["light"]["requests"] == 5 and tenants["table"]["light"]["served"] == 5
    assert tenants["table"]["flood"]["requests"] == len(flood)
    report = await analyze(log)
    assert "TENANTS: 2" in report and "light" in report


async def test_without_keys_a_header_names_the_tenant(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await start_gateway(
        [await start_simulator_at()],
        configure=lambda s: replace(s, tenants=TenantSettings(labeled=["team-a"])),
    )
    for headers in ({"x-tenant-id": "team-a"}, {"x-tenant-id": "x" * 300}, {}):
        assert await streamed(http, gateway.url, chat(max_tokens=2), **headers) == 200
    tenants = [line["tenant"] for line in gateway.request_lines()]
    assert tenants[0] == "team-a" and tenants[1].startswith("sha256:") and tenants[2] == "default"
    async with http.get(gateway.url + "/metrics") as resp:
        text = await resp.text()
    assert 'tenant="team-a"' in text and 'tenant="other"' in text and "x" * 300 not in text
    async with http.get(gateway.url + "/debug/backends") as resp:
        seen = await resp.json()
    assert seen["fair_share"]["enabled"] is True and seen["fair_share"]["output_token_weight"] > 0
    interactive = next(lane for lane in seen["lanes"] if lane["lane"] == "interactive")
    assert isinstance(interactive["tenants"], list) and "headroom" in interactive


async def test_on_one_slot_a_short_request_goes_before_queued_long_ones(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """One slot (llama.cpp -np 1), the default lanes: a long request holds the slot, two
    more queue, then a short one arrives. The short one is served next, not third."""
    backend = await start_simulator_at(max_batch=1, step_base_ms=20.0)
    gateway = await start_gateway([backend], max_concurrency=1)
    long_body = chat("long " * 1500, max_tokens=40)  # bulk: over 1024 prompt tokens
    first = asyncio.create_task(streamed(http, gateway.url, long_body, **{"x-request-id": "L1"}))
    await asyncio.sleep(0.3)
    queued = [
        asyncio.create_task(streamed(http, gateway.url, long_body, **{"x-request-id": f"L{i}"}))
        for i in (2, 3)
    ]
    await asyncio.sleep(0.3)
    short = asyncio.create_task(
        streamed(http, gateway.url, chat(max_tokens=4), **{"x-request-id": "S"})
    )
    assert await asyncio.gather(first, *queued, short) == [200] * 4
    lines = {line["request_id"]: line for line in gateway.request_lines()}
    assert lines["S"]["lane"] == "interactive" and lines["L2"]["lane"] == "bulk"
    # The short one got its slot when the first long one ended; the queued longs after it.
    assert lines["S"]["queue_ms"] < lines["L2"]["queue_ms"] - 300, {
        rid: line["queue_ms"] for rid, line in lines.items()
    }
