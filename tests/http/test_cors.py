"""CORS on a real gateway in front of the simulator, seen through aiohttp: preflights,
the labels on answers (streams and errors included), and nothing at all when off."""

from __future__ import annotations

import re
from collections.abc import Callable

import aiohttp
import pytest
from msgspec.structs import replace
from multidict import CIMultiDictProxy

from gateway.config import ConfigError, LimitsSettings, Settings, load_settings
from gateway.http.cors import EXPOSED_HEADERS, MAX_AGE_S, allowed_request_headers
from tests.conftest import RunningGateway, StartGateway, StartSimulator, chat, sse_events

APP = "http://app.example.com:3000"
OTHER = "http://evil.example"
ASKED_HEADERS = (
    "authorization, content-type, x-request-id, x-gateway-lane, "
    "x-request-deadline-ms, traceparent, x-stainless-os"
)


def cors(*origins: str) -> Callable[[Settings], Settings]:
    def configure(settings: Settings) -> Settings:
        return replace(
            settings,
            server=replace(settings.server, cors_origins=list(origins)),
            limits=LimitsSettings(max_prompt_tokens=64, default_max_tokens=4),
        )

    return configure


async def started(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, *origins: str
) -> RunningGateway:
    sim = await start_simulator_at(step_base_ms=1.0)
    return await start_gateway([sim], configure=cors(*origins))


async def preflight(
    http: aiohttp.ClientSession,
    url: str,
    origin: str = APP,
    method: str = "POST",
    asked: str = ASKED_HEADERS,
) -> tuple[int, CIMultiDictProxy[str], bytes]:
    headers = {"Origin": origin, "Access-Control-Request-Method": method}
    if asked:
        headers["Access-Control-Request-Headers"] = asked
    async with http.options(url, headers=headers) as resp:
        return resp.status, resp.headers, await resp.read()


def access_control(headers: CIMultiDictProxy[str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items() if k.lower().startswith("access-control-")}


def assert_labelled(headers: CIMultiDictProxy[str], origin: str = APP) -> None:
    assert headers["Access-Control-Allow-Origin"] == origin
    exposed = {h.strip().lower() for h in headers["Access-Control-Expose-Headers"].split(",")}
    assert {h.lower() for h in EXPOSED_HEADERS} <= exposed
    assert {"x-gateway-lane", "x-gateway-queue-ms", "x-gateway-refusal", "server-timing"} <= exposed
    assert "Origin" in headers["Vary"]


# --- off by default ------------------------------------------------------------------------


async def test_with_cors_off_a_preflight_gets_405_and_no_cors_headers(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await started(start_simulator_at, start_gateway)
    status, headers, body = await preflight(http, gateway.url + "/v1/chat/completions")
    assert status == 405
    assert b'"code":"method_not_allowed"' in body
    assert access_control(headers) == {}
    async with http.post(
        gateway.url + "/v1/chat/completions", json=chat(stream=True), headers={"Origin": APP}
    ) as resp:
        assert resp.status == 200
        await resp.read()
        assert access_control(resp.headers) == {}
        assert "Vary" not in resp.headers


# --- preflights ---------------------------------------------------------------------------


async def test_a_preflight_from_a_listed_origin_gets_204_with_what_it_asked(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await started(start_simulator_at, start_gateway, APP, "https://other.example")
    status, headers, body = await preflight(
        http, gateway.url + "/v1/chat/completions", asked=ASKED_HEADERS + ", x-evil, bad header"
    )
    assert status == 204 and body == b""
    assert headers["Access-Control-Allow-Origin"] == APP
    assert "POST" in headers["Access-Control-Allow-Methods"].split(", ")
    allowed = headers["Access-Control-Allow-Headers"].split(", ")
    assert allowed == [h.strip() for h in ASKED_HEADERS.split(",")]  # not x-evil
    assert headers["Access-Control-Max-Age"] == str(MAX_AGE_S)
    assert "Origin" in headers["Vary"]
    assert "Access-Control-Allow-Credentials" not in headers


async def test_every_route_answers_a_preflight(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await started(start_simulator_at, start_gateway, APP)
    routes = {
        (route.resource.canonical, route.method)
        for route in gateway.app.router.routes()
        if route.resource is not None and route.method != "HEAD"
    }
    assert ("/v1/chat/completions", "POST") in routes and ("/generate_stream", "POST") in routes
    for path, method in sorted(routes):
        path = re.sub(r"\{[^}]+\}", "b0", path)  # a dynamic route's segment, filled in
        status, headers, _ = await preflight(http, gateway.url + path, method=method)
        assert status == 204, path
        assert headers["Access-Control-Allow-Origin"] == APP, path
        assert method in headers["Access-Control-Allow-Methods"], path


async def test_a_preflight_from_another_origin_gets_no_allow_headers(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await started(start_simulator_at, start_gateway, APP)
    for origin in (OTHER, APP + "/", "http://app.example.com", "null"):
        status, headers, body = await preflight(
            http, gateway.url + "/v1/chat/completions", origin=origin
        )
        assert status == 405 and b"method_not_allowed" in body, origin
        assert access_control(headers) == {}, origin
        assert "Origin" in headers["Vary"]


async def test_an_options_request_that_is_no_preflight_or_has_no_route_is_refused_as_before(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await started(start_simulator_at, start_gateway, APP)
    async with http.options(
        gateway.url + "/v1/chat/completions", headers={"Origin": APP}
    ) as resp:  # no Access-Control-Request-Method
        assert resp.status == 405
        assert "Access-Control-Allow-Methods" not in resp.headers
    status, headers, body = await preflight(http, gateway.url + "/v2/nothing")
    assert status == 404 and b'"code":"not_found"' in body
    assert "Access-Control-Allow-Methods" not in headers


async def test_any_origin_with_a_star_and_private_network_preflights(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await started(start_simulator_at, start_gateway, "*")
    origin = "https://whatever.example:8443"
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Private-Network": "true",
    }
    async with http.options(gateway.url + "/v1/completions", headers=headers) as resp:
        assert resp.status == 204
        assert resp.headers["Access-Control-Allow-Origin"] == origin
        assert resp.headers["Access-Control-Allow-Private-Network"] == "true"
        assert "Access-Control-Allow-Headers" not in resp.headers  # none asked for


# --- labels on answers ---------------------------------------------------------------------


async def test_a_stream_and_a_whole_answer_carry_the_origin_and_expose_the_gateway_headers(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await started(start_simulator_at, start_gateway, APP)
    url = gateway.url + "/v1/chat/completions"
    async with http.post(url, json=chat(stream=True), headers={"Origin": APP}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert_labelled(resp.headers)
        events = sse_events(await resp.read())
        assert events[-1] == "[DONE]"
    async with http.post(url, json=chat(), headers={"Origin": APP}) as resp:
        assert resp.status == 200
        assert_labelled(resp.headers)
        assert resp.headers["x-gateway-lane"] == "interactive"
    async with http.post(url, json=chat(), headers={"Origin": OTHER}) as resp:
        assert resp.status == 200  # CORS is the browser's check: the answer is just unlabelled
        assert access_control(resp.headers) == {}
        assert "Origin" in resp.headers["Vary"]


async def test_errors_carry_the_origin_too(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await started(start_simulator_at, start_gateway, APP)
    url = gateway.url + "/v1/chat/completions"
    origin = {"Origin": APP}
    async with http.post(url, json=chat("word " * 200, stream=True), headers=origin) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "prompt_too_long"
        assert_labelled(resp.headers)
    async with http.post(
        url, data=b"{nope", headers={**origin, "Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 400
        assert_labelled(resp.headers)
    async with http.get(gateway.url + "/v2/nothing", headers=origin) as resp:
        assert resp.status == 404
        assert_labelled(resp.headers)
    gateway.state.draining = True  # as on SIGTERM: 503 shutting_down with Retry-After
    async with http.post(url, json=chat(), headers=origin) as resp:
        assert resp.status == 503
        assert int(resp.headers["Retry-After"]) >= 1
        assert_labelled(resp.headers)


# --- the pieces ----------------------------------------------------------------------------


def test_only_known_and_well_formed_request_headers_are_echoed() -> None:
    asked = "Authorization , X-Stainless-Arch, openai-organization, cookie, x-evil, a b, , é"
    assert allowed_request_headers(asked) == [
        "Authorization",
        "X-Stainless-Arch",
        "openai-organization",
    ]
    assert allowed_request_headers(", ".join(["content-type"] * 1000)) == ["content-type"] * 32


@pytest.mark.parametrize(
    "origins",
    ["https://app.example.com/", "app.example.com", "https://a.example/chat", "https://a:1x"],
)
def test_an_origin_that_a_browser_never_sends_is_a_config_error(origins: str) -> None:
    with pytest.raises(ConfigError, match=r"^\[server\]\.cors_origins .*no trailing slash"):
        load_settings(env={"GATEWAY_SERVER_CORS_ORIGINS": origins})


def test_origins_are_read_as_a_list() -> None:
    settings = load_settings(
        env={"GATEWAY_SERVER_CORS_ORIGINS": "https://a.example, http://[::1]:3000,*"}
    )
    assert settings.server.cors_origins == ["https://a.example", "http://[::1]:3000", "*"]
    assert load_settings(env={}).server.cors_origins == []
