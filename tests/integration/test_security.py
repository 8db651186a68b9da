"""Client API keys, the lane override header, and what never leaves the gateway."""

from __future__ import annotations

import aiohttp
from msgspec.structs import replace

from gateway.config import ApiKeySettings, Settings
from tests.conftest import StartGateway, StartSimulator, chat

WEB_KEY = "web-ui-key-123"
BATCH_KEY = "batch-key-456"


def with_keys(settings: Settings) -> Settings:
    return replace(
        settings,
        api_keys=[
            ApiKeySettings(name="web-ui", key=WEB_KEY, lanes=["interactive"]),
            ApiKeySettings(name="batch", key=BATCH_KEY, allow_lane_override=True),
        ],
    )


async def post(
    http: aiohttp.ClientSession, url: str, body: dict, **headers: str
) -> tuple[int, dict, dict]:
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


async def test_missing_or_wrong_key_gets_401_in_the_envelope(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await start_gateway([await start_simulator_at()], configure=with_keys)
    for headers in ({}, {"Authorization": "Bearer nope-nope-nope"}, {"Authorization": WEB_KEY}):
        status, body, _ = await post(http, gateway.url, chat(max_tokens=2), **headers)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert WEB_KEY not in body["error"]["message"]
    status, _, _ = await post(
        http, gateway.url, chat(max_tokens=2), Authorization=f"Bearer {WEB_KEY}"
    )
    assert status == 200
    lines = gateway.request_lines()
    assert [line["outcome"] for line in lines] == ["rejected_unauthorized"] * 3 + ["ok"]
    assert lines[-1]["client"] == "web-ui"
    assert WEB_KEY not in gateway.log.getvalue()
    async with http.get(gateway.url + "/healthz") as resp:
        assert resp.status == 200  # operational routes stay open


async def test_a_key_limited_to_a_lane_cannot_send_long_requests(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await start_gateway([await start_simulator_at()], configure=with_keys)
    status, body, _ = await post(
        http, gateway.url, chat("long " * 2000, max_tokens=2), Authorization=f"Bearer {WEB_KEY}"
    )
    assert status == 403 and body["error"]["code"] == "lane_not_allowed"


async def test_lane_override_only_with_a_key_allowed_to(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await start_gateway([await start_simulator_at()], configure=with_keys)
    long_body = chat("long " * 2000, max_tokens=2)
    status, _, headers = await post(
        http,
        gateway.url,
        long_body,
        Authorization=f"Bearer {BATCH_KEY}",
        **{"X-Gateway-Lane": "interactive"},
    )
    assert status == 200 and headers["x-gateway-lane"] == "interactive"
    status, _, headers = await post(
        http,
        gateway.url,
        chat(max_tokens=2),
        Authorization=f"Bearer {WEB_KEY}",
        **{"X-Gateway-Lane": "bulk"},
    )
    assert status == 200 and headers["x-gateway-lane"] == "interactive"  # ignored
    status, body, _ = await post(
        http,
        gateway.url,
        chat(max_tokens=2),
        Authorization=f"Bearer {BATCH_KEY}",
        **{"X-Gateway-Lane": "vip"},
    )
    assert status == 400 and body["error"]["code"] == "invalid_lane"


async def test_override_header_is_ignored_without_keys(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await start_gateway([await start_simulator_at()])
    status, _, headers = await post(
        http, gateway.url, chat("long " * 2000, max_tokens=2), **{"X-Gateway-Lane": "interactive"}
    )
    assert status == 200 and headers["x-gateway-lane"] == "bulk"
