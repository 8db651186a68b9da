"""nginx in front of the gateway: the shipped `config/nginx.conf` and `check-config --nginx`.

The first part checks the checker (`gateway/checks/nginx.py`) on small snippets: its
tokenizer, nginx's location choice and inheritance, and each warning, fired and
quiet. The second runs a real nginx (Debian's package, as `nobody` when the tests
run as root) with the shipped file in front of a real gateway in front of the
simulator: a stream through nginx is the stream direct, byte for byte and as it is
produced; the gateway's own 503 reaches the client as that 503, not nginx's 504; a
client that leaves mid-stream still stops the backend; the request id travels all
the way; the body limit matches; and a stream queued 12 s behind a slow request
survives nginx's 5 s read timeout by the gateway's SSE keepalive comments.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from gateway.checks.nginx import (
    NginxConfigError,
    api_scopes,
    load,
    location_for,
    nginx_warnings,
    parse,
    parse_size_bytes,
    parse_time_s,
    servers,
    tokenize,
)
from gateway.cli import main
from gateway.config import LaneSettings, Settings, load_settings
from tests.conftest import RunningGateway, StartGateway, StartSimulator, chat, free_port
from tests.ops.conftest import ROOT
from tests.ops.nginx import (
    SHIPPED_CONFIG,
    RunningNginx,
    check_syntax,
    make_prefix,
    nginx_binary,
    render,
    start_nginx,
)

# ============================================================================ the checker


def keepalive(seconds: float) -> Settings:
    settings = Settings()
    return msgspec.structs.replace(
        settings, server=msgspec.structs.replace(settings.server, sse_keepalive_s=seconds)
    )


#: A location that fits the default settings; each case below changes one directive.
GOOD_LOCATION = {
    "proxy_buffering": "off",
    "proxy_http_version": "1.1",
    "client_max_body_size": "4m",
    "proxy_read_timeout": "630s",
}


def snippet(location: Mapping[str, str | None], *, around: str = "") -> str:
    body = " ".join(f"{name} {value};" for name, value in location.items() if value is not None)
    return (
        "events { worker_connections 64; }\n"
        f"http {{\n  {around}\n  server {{\n    listen 8000;\n"
        f"    location / {{ proxy_pass http://gateway; {body} }}\n  }}\n}}\n"
    )


def warnings_for(text: str, settings: Settings | None = None) -> list[str]:
    return nginx_warnings(parse(text), settings or Settings())


def test_the_tokenizer_reads_quotes_escapes_variables_and_comments() -> None:
    text = 'a "b;c {d}" \'e\\\'f\' g\\;h ${x}y # a comment; {\nk "l\\nm";'
    tokens = [(t.text, t.line, t.quoted) for t in tokenize(text)]
    assert tokens == [
        ("a", 1, False),
        ("b;c {d}", 1, True),
        ("e'f", 1, True),
        ("g;h", 1, False),
        ("${x}y", 1, False),
        ("k", 2, False),
        ("l\nm", 2, True),
        (";", 2, False),
    ]
    (directive,) = parse('add_header X "a;b" always;')
    assert directive.name == "add_header" and directive.args == ("X", "a;b", "always")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("http {", "unexpected end of file"),
        ("}", "unexpected '}'"),
        ("listen 80", "'listen' lacks ';'"),
        ("http { listen 80 }", "'listen' lacks ';'"),
        ('return 200 "abc;', 'unterminated " string'),
        (";", "unexpected ';'"),
        ("{ }", "unexpected '{'"),
    ],
)
def test_the_parser_refuses_broken_syntax_naming_the_line(text: str, message: str) -> None:
    with pytest.raises(NginxConfigError, match=re.escape(message)) as caught:
        parse(text, "x.conf")
    assert "x.conf" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("630s", 630), ("1m30s", 90), ("500ms", 0.5), ("90", 90), ("1h", 3600), ("2d", 172800)],
)
def test_nginx_times(text: str, seconds: float) -> None:
    assert parse_time_s(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "5x", "s", "1.5s", "-1s"])
def test_what_is_not_an_nginx_time(text: str) -> None:
    assert parse_time_s(text) is None


@pytest.mark.parametrize(
    ("text", "size"),
    [("4m", 4 * 1024**2), ("4M", 4 * 1024**2), ("512k", 512 * 1024), ("1g", 1024**3), ("10", 10)],
)
def test_nginx_sizes(text: str, size: int) -> None:
    assert parse_size_bytes(text) == size
    assert parse_size_bytes(text + "b") is None


def test_the_location_nginx_picks_exact_then_prefix_or_regex() -> None:
    (http,) = parse(
        "http { server {"
        " location / { a; }"
        " location /v1/ { b; location /v1/chat/ { c; } }"
        " location = /generate { d; }"
        " location ~ ^/generate { e; }"
        " location ^~ /stop/ { f; }"
        " location ~ ^/stop/ { g; }"
        " location ~* ^/V1/COMPLETIONS { h; }"
        " location @named { i; }"
        "} }"
    )
    ((_, server),) = list(servers([http]))

    def picked(path: str) -> list[str]:
        return [" ".join(d.args) for d in location_for(path, server)]

    assert picked("/generate") == ["= /generate"]  # exact first
    assert picked("/generate_stream") == ["~ ^/generate"]  # a regex beats the prefix /
    assert picked("/v1/chat/completions") == ["/v1/", "/v1/chat/"]  # nested
    assert picked("/v1/completions") == ["~* ^/V1/COMPLETIONS"]  # case-insensitive regex
    assert picked("/stop/x") == ["^~ /stop/"]  # ^~: no regexes
    assert picked("/") == ["/"]


def test_values_are_inherited_from_server_and_http_and_overridden_inside() -> None:
    around = "proxy_read_timeout 700s; proxy_buffering off;"
    inherited = snippet({**GOOD_LOCATION, "proxy_read_timeout": None, "proxy_buffering": None})
    assert warnings_for(inherited.replace("listen 8000;", "listen 8000; " + around)) == []
    overridden = snippet({**GOOD_LOCATION, "proxy_buffering": "on"}, around=around)
    (warning,) = warnings_for(overridden)
    assert "proxy_buffering is on" in warning


def test_the_shipped_file_passes_clean_against_the_default_and_the_example_config() -> None:
    directives = load(SHIPPED_CONFIG)
    assert nginx_warnings(directives, Settings()) == []
    assert nginx_warnings(directives, load_settings(ROOT / "config" / "gateway.toml")) == []
    (scope,) = api_scopes(directives)  # `location /` serves every generation route
    assert scope.location.args == ("/",)


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("proxy_buffering", "on", "proxy_buffering is on"),
        ("proxy_buffering", None, "proxy_buffering is on"),  # nginx's default
        ("proxy_http_version", "1.0", "proxy_http_version is 1.0"),
        ("proxy_http_version", None, "proxy_http_version is 1.0"),
        ("client_max_body_size", "1m", "below [server].max_body_bytes (4194304)"),
        ("client_max_body_size", None, "1m (nginx's default)"),
        ("client_max_body_size", "4194303", "below [server].max_body_bytes"),
        ("client_max_body_size", "4194304", None),
        ("client_max_body_size", "0", None),  # 0: nginx has no limit
        ("proxy_read_timeout", "600s", "not above 600 s, how long the gateway may wait"),
        ("proxy_read_timeout", "601s", None),
        ("proxy_read_timeout", "15s", "[server].sse_keepalive_s (15 s)"),
        ("proxy_read_timeout", "60s", "[timeouts].idle_s (60 s)"),
        ("proxy_send_timeout", "10s", "proxy_send_timeout 10s is shorter than"),
        ("proxy_send_timeout", "15s", None),
        ("send_timeout", "14s", "send_timeout 14s is shorter than"),
        ("proxy_next_upstream", "error non_idempotent", "a generation can run twice"),
        ("proxy_next_upstream", "off", None),
        ("proxy_read_timeout", "ten", "'ten' is not an nginx time"),
    ],
)
def test_each_warning_fires_and_names_file_line_and_location(
    name: str, value: str | None, expected: str | None
) -> None:
    found = warnings_for(snippet({**GOOD_LOCATION, name: value}))
    if expected is None:
        assert found == []
        return
    assert any(expected in w for w in found), found
    assert all(w.startswith("nginx nginx.conf:6: location / (server 8000): ") for w in found)


def test_without_keepalive_a_stream_s_silent_wait_for_its_first_byte_counts() -> None:
    """bulk queues up to 30 s, then 60 s for the first byte: 90 s of silence."""
    lower_total = load_settings(
        None, env={"GATEWAY_TIMEOUTS_TOTAL_S": "80", "GATEWAY_SERVER_SSE_KEEPALIVE_S": "0"}
    )
    text = snippet({**GOOD_LOCATION, "proxy_read_timeout": "85s"})
    assert warnings_for(text, lower_total) == []  # total_s (80 s) bounds it first
    found = warnings_for(snippet({**GOOD_LOCATION, "proxy_read_timeout": "90s"}), keepalive(0))
    assert any("how long a stream may wait silent for its first byte" in w for w in found)
    assert any("30 s + [timeouts].first_token_s 60 s" in w for w in found)
    found = warnings_for(snippet({**GOOD_LOCATION, "proxy_send_timeout": "1s"}), keepalive(0))
    assert found == []  # no keepalive: nothing for the send timeouts to be shorter than


def test_a_lane_queue_longer_than_total_s_is_the_bound() -> None:
    settings = Settings(lanes=[LaneSettings(name="slow", queue_timeout_s=900.0)])
    found = warnings_for(snippet(GOOD_LOCATION), settings)
    assert any("not above 900 s" in w and "lane 'slow' queues up to 900 s" in w for w in found)


def test_only_the_locations_that_serve_generation_routes_are_checked() -> None:
    text = snippet(GOOD_LOCATION).replace(
        "location / {",
        "location ~ ^/(metrics|debug/) { proxy_pass http://gateway; proxy_buffering on; }\n"
        "    location = /v1/chat/completions { proxy_pass http://gateway; }\n"
        "    location / {",
    )
    found = warnings_for(text)
    assert found and all("location = /v1/chat/completions" in w for w in found), found
    not_proxied = snippet(GOOD_LOCATION).replace("proxy_pass http://gateway;", "return 404;")
    (warning,) = warnings_for(not_proxied)
    assert "no location proxies the gateway's generation routes" in warning


def test_includes_are_read_in_place(tmp_path: Path) -> None:
    (tmp_path / "sites").mkdir()
    (tmp_path / "sites" / "gateway.conf").write_text(
        "server { listen 8000; location / { proxy_pass http://gateway; } }"
    )
    main_file = tmp_path / "nginx.conf"
    main_file.write_text("events {}\nhttp {\n  include sites/*.conf;\n}\n")
    found = nginx_warnings(load(main_file), Settings())
    assert any("gateway.conf:1" in w and "proxy_buffering is on" in w for w in found), found
    (tmp_path / "loop.conf").write_text("include loop.conf;")
    with pytest.raises(NginxConfigError, match="includes itself"):
        load(tmp_path / "loop.conf")


def test_check_config_with_nginx_prints_the_warnings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check-config", "--nginx", str(SHIPPED_CONFIG)]) == 0
    assert "warning: nginx" not in capsys.readouterr().err
    bad = tmp_path / "nginx.conf"
    bad.write_text(snippet({**GOOD_LOCATION, "proxy_read_timeout": "30s"}))
    assert main(["check-config", "--nginx", str(bad)]) == 0  # warnings do not fail it
    err = capsys.readouterr().err
    assert f"warning: nginx {bad}:6: location / (server 8000): proxy_read_timeout 30s" in err
    bad.write_text("http {")
    assert main(["check-config", "--nginx", str(bad)]) == 2
    assert "nginx config error:" in capsys.readouterr().err
    assert main(["check-config", "--nginx", str(tmp_path / "missing.conf")]) == 2


# ============================================================================ a real nginx

StartNginx = Callable[..., Awaitable[RunningNginx]]
#: The simulator's seed: two simulators with the same one generate the same words.
SEED = 11
#: Simulator step time: ~20 ms per token, so a stream visibly takes its time.
SLOW_STEP_MS = 20.0


@pytest.fixture
async def start_front() -> AsyncIterator[StartNginx]:
    """Start nginx with the shipped config in front of a gateway; stopped by PID after."""
    binary = nginx_binary()
    started: list[RunningNginx] = []

    async def start(gateway: RunningGateway, *, read_timeout: str | None = None) -> RunningNginx:
        nginx = await start_nginx(
            binary,
            listen_port=free_port(),
            upstream=gateway.url.removeprefix("http://"),
            read_timeout=read_timeout,
        )
        started.append(nginx)
        return nginx

    yield start
    for nginx in started:
        nginx.stop()
        assert nginx.process.returncode is not None


def only_lane(**knobs: Any) -> list[LaneSettings]:
    """One lane with one slot whose deadline stays as configured (no engine fitting)."""
    return [
        LaneSettings(
            name="only",
            max_slots=1,
            fit_timeout_to_engine=False,
            reject_predicted_wait=False,
            **knobs,
        )
    ]


def with_keepalive(seconds: float) -> Callable[[Settings], Settings]:
    def configure(settings: Settings) -> Settings:
        server = msgspec.structs.replace(settings.server, sse_keepalive_s=seconds)
        return msgspec.structs.replace(settings, server=server)

    return configure


async def eventually(check: Callable[[], Awaitable[bool]], within_s: float = 3.0) -> float:
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not await check():
        if loop.time() - start > within_s:
            pytest.fail(f"condition not met within {within_s} s")
        await asyncio.sleep(0.01)
    return loop.time() - start


async def slot_taken(gateway: RunningGateway, lane: str = "only") -> None:
    async def taken() -> bool:
        return gateway.state.scheduler.lane(lane).in_flight == 1

    await eventually(taken)


async def timed_body(resp: aiohttp.ClientResponse) -> tuple[bytes, list[float]]:
    """The whole body, and when each piece of it arrived (loop time)."""
    loop = asyncio.get_running_loop()
    parts: list[bytes] = []
    times: list[float] = []
    async for chunk in resp.content.iter_any():
        parts.append(chunk)
        times.append(loop.time())
    return b"".join(parts), times


def data_events(raw: bytes) -> list[Any]:
    """The `data:` payloads of an SSE body, comment blocks (`: queued`) skipped."""
    events: list[Any] = []
    for block in raw.decode().split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        (line,) = lines
        assert line.startswith("data:"), block
        data = line[len("data:") :].removeprefix(" ")  # TGI writes no space
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def without_ids(raw: bytes) -> tuple[bytes, int]:
    """The OpenAI stream with its random ids and clock times replaced (the only bytes
    the simulator makes differently per request); and how many were replaced."""
    raw, ids = re.subn(rb'"id":"chatcmpl-[0-9a-f]{32}"', b'"id":"chatcmpl-X"', raw)
    raw, times = re.subn(rb'"created":\d+', b'"created":0', raw)
    assert ids == times
    return raw, ids


async def post_and_read(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], **kwargs: Any
) -> tuple[int, bytes]:
    async with http.post(url, json=body, **kwargs) as resp:
        return resp.status, await resp.read()


def test_the_shipped_config_is_valid_for_nginx_run_without_root() -> None:
    binary = nginx_binary()
    prefix = make_prefix(render(listen_port=free_port(), upstream="127.0.0.1:9"))
    try:
        result = check_syntax(binary, prefix)
        assert result.returncode == 0, result.stderr
        assert "test is successful" in result.stderr
    finally:
        shutil.rmtree(prefix, ignore_errors=True)


async def test_a_stream_through_nginx_is_the_stream_direct_byte_for_byte_and_incremental(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    start_front: StartNginx,
    http: aiohttp.ClientSession,
) -> None:
    """Two identical stacks (same simulator seed, same request order): one direct, one
    behind nginx. TGI's stream has no ids or times: equal as is; OpenAI's has a random
    id and a clock time per chunk, replaced in both before comparing."""
    direct = await start_gateway([await start_simulator_at(seed=SEED, step_base_ms=SLOW_STEP_MS)])
    behind = await start_gateway([await start_simulator_at(seed=SEED, step_base_ms=SLOW_STEP_MS)])
    nginx = await start_front(behind)
    openai_body = chat("Tell me a story about queues.", max_tokens=40, stream=True)
    tgi_body = {"inputs": "Tell me a story about queues.", "parameters": {"max_new_tokens": 40}}
    streams: dict[str, dict[str, bytes]] = {}
    arrivals: list[float] = []
    for name, base in (("direct", direct.url), ("nginx", nginx.url)):
        streams[name] = {}
        for route, body in (("/v1/chat/completions", openai_body), ("/generate_stream", tgi_body)):
            async with http.post(base + route, json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                raw, times = await timed_body(resp)
            streams[name][route] = raw
            if name == "nginx" and route == "/v1/chat/completions":
                arrivals = times
    tgi_direct, tgi_nginx = (
        streams["direct"]["/generate_stream"],
        streams["nginx"]["/generate_stream"],
    )
    assert tgi_nginx == tgi_direct
    assert len(data_events(tgi_direct)) == 40
    openai_direct, replaced = without_ids(streams["direct"]["/v1/chat/completions"])
    assert without_ids(streams["nginx"]["/v1/chat/completions"]) == (openai_direct, replaced)
    assert replaced == len(data_events(openai_direct)) - 1  # every chunk but [DONE]
    # As produced: 40 tokens ~20 ms apart came in many reads spread over the generation,
    # not in one read at the end (what a buffering proxy would give).
    assert len(arrivals) >= 10, arrivals
    assert arrivals[-1] - arrivals[0] >= 0.4, arrivals


async def test_the_gateway_s_503_reaches_the_client_as_that_503_not_nginx_s_504(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    start_front: StartNginx,
    http: aiohttp.ClientSession,
) -> None:
    sim = await start_simulator_at(step_base_ms=SLOW_STEP_MS)
    gateway = await start_gateway([sim], lanes=only_lane(queue_timeout_s=1.0))
    nginx = await start_front(gateway)
    url = nginx.url + "/v1/chat/completions"
    slow = asyncio.create_task(post_and_read(http, url, chat("Hold the slot.", max_tokens=200)))
    await slot_taken(gateway)

    async def refused(stream: bool) -> None:
        headers = {"X-Request-Id": f"queued-{stream}"}
        body = chat("Wait behind it.", max_tokens=8, stream=stream)
        async with http.post(url, json=body, headers=headers) as resp:
            assert resp.status == 503, await resp.text()
            assert resp.headers["Content-Type"].startswith("application/json")
            error = (await resp.json())["error"]
            assert error["code"] == "queue_timeout" and error["type"] == "service_unavailable"
            assert int(resp.headers["Retry-After"]) >= 1
            assert resp.headers["x-gateway-refusal"] == "queue_timeout"
            assert resp.headers["x-request-id"] == f"queued-{stream}"

    await asyncio.gather(refused(False), refused(True))
    status, _ = await slow
    assert status == 200
    logged = {line["request_id"]: line for line in nginx.access_log()}
    for stream in (False, True):
        line = logged[f"queued-{stream}"]
        # nginx passed the gateway's answer on: its status is the upstream's.
        assert (line["status"], line["upstream_status"]) == (503, "503"), line
        assert line["gateway_refusal"] == "queue_timeout"


async def test_a_client_leaving_mid_stream_through_nginx_stops_the_backend(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    start_front: StartNginx,
    http: aiohttp.ClientSession,
) -> None:
    sim = await start_simulator_at()
    gateway = await start_gateway([sim])
    nginx = await start_front(gateway)
    resp = await http.post(
        nginx.url + "/v1/chat/completions",
        json=chat("A long answer, please.", max_tokens=1000, stream=True),
        headers={"X-Request-Id": "leaver"},
    )
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    loop = asyncio.get_running_loop()
    left = loop.time()
    resp.close()  # the client goes away; nginx must close its side to the gateway

    async def aborted() -> bool:
        async with http.get(sim + "/sim/stats") as stats_resp:
            stats = await stats_resp.json()
        return bool(stats["aborted"] == 1 and stats["running"] == 0)

    await eventually(aborted, within_s=2.0)
    print(f"backend sequence aborted {(loop.time() - left) * 1000:.0f} ms after the client left")

    async def logged() -> bool:
        return any(line["request_id"] == "leaver" for line in gateway.request_lines())

    await eventually(logged)
    (line,) = [line for line in gateway.request_lines() if line["request_id"] == "leaver"]
    assert line["outcome"] == "client_disconnected"
    assert gateway.state.scheduler.lane("interactive").in_flight == 0

    async def nginx_logged() -> bool:  # nginx ended it too (logged as 200: headers went out)
        return any(entry["request_id"] == "leaver" for entry in nginx.access_log())

    await eventually(nginx_logged)


async def test_the_request_id_goes_through_nginx_the_gateway_and_to_the_backend(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    start_front: StartNginx,
    http: aiohttp.ClientSession,
) -> None:
    sim = await start_simulator_at()
    gateway = await start_gateway([sim])
    nginx = await start_front(gateway)
    url = nginx.url + "/v1/chat/completions"
    async with http.post(url, json=chat(max_tokens=4), headers={"X-Request-Id": "abc-123"}) as r:
        assert r.status == 200 and r.headers["x-request-id"] == "abc-123"
        await r.read()
    async with http.post(url, json=chat(max_tokens=4)) as r:  # none sent: nginx makes one
        assert r.status == 200
        made = r.headers["x-request-id"]
        await r.read()
    assert re.fullmatch("[0-9a-f]{32}", made), made  # nginx's $request_id
    ids = ["abc-123", made]

    async def backend_ids() -> list[str]:
        async with http.get(sim + "/sim/requests") as r:
            return [info["request_id"] for info in (await r.json())["requests"]]

    async def everywhere() -> bool:  # each log line is written once its request is over
        return (
            [line["request_id"] for line in gateway.request_lines()] == ids
            and [entry["request_id"] for entry in nginx.access_log()] == ids
            and await backend_ids() == ids
        )

    await eventually(everywhere)


async def test_nginx_s_body_limit_is_the_gateway_s_and_answers_in_its_envelope(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    start_front: StartNginx,
    http: aiohttp.ClientSession,
) -> None:
    gateway = await start_gateway([await start_simulator_at()])
    nginx = await start_front(gateway)
    limit = gateway.state.settings.server.max_body_bytes
    url = nginx.url + "/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    at_limit = b"{" + b" " * (limit - 2) + b"}"  # `{}`: valid JSON, no messages
    async with http.post(url, data=at_limit, headers=headers) as resp:
        # It reached the gateway, which answered it (400: no messages).
        assert resp.status == 400 and resp.headers["x-gateway-refusal"] == "invalid_request"
    async with http.post(url, data=at_limit + b" ", headers=headers) as resp:
        assert resp.status == 413
        assert resp.headers["Content-Type"] == "application/json"
        assert (await resp.json())["error"]["code"] == "body_too_large"
        assert "x-gateway-refusal" not in resp.headers  # nginx's own answer
        assert re.fullmatch("[0-9a-f]{32}", resp.headers["x-request-id"])
    async with http.get(nginx.url + "/metrics") as resp:  # per replica, not through nginx
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
    async with http.get(nginx.url + "/readyz") as resp:
        assert resp.status == 200


@pytest.mark.slow
async def test_a_stream_queued_12_s_survives_a_5_s_nginx_read_timeout_by_keepalive(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    start_front: StartNginx,
    http: aiohttp.ClientSession,
) -> None:
    """The issue's proof: nginx gives up after 5 s of silence, the gateway sends a
    `: queued` comment every 2 s, the stream waits ~12 s and then completes."""
    sim = await start_simulator_at(step_base_ms=SLOW_STEP_MS)
    gateway = await start_gateway(
        [sim], lanes=only_lane(queue_timeout_s=40.0), configure=with_keepalive(2.0)
    )
    nginx = await start_front(gateway, read_timeout="5s")
    # ~600 tokens x ~20 ms: the slot is held ~12 s (sent to the gateway directly).
    slow = asyncio.create_task(
        post_and_read(http, gateway.url + "/v1/chat/completions", chat("Hold.", max_tokens=600))
    )
    await slot_taken(gateway)
    loop = asyncio.get_running_loop()
    started = loop.time()
    body = chat("Wait behind it.", max_tokens=20, stream=True)
    timeout = aiohttp.ClientTimeout(total=60)
    async with http.post(
        nginx.url + "/v1/chat/completions",
        json=body,
        headers={"X-Request-Id": "patient"},
        timeout=timeout,
    ) as resp:
        assert resp.status == 200, await resp.text()
        raw, _ = await timed_body(resp)
    waited = loop.time() - started
    status, _ = await slow
    assert status == 200
    print(f"queued stream completed through a 5 s proxy_read_timeout after {waited:.1f} s")
    assert waited >= 10.0, waited
    assert raw.count(b": queued\n\n") >= 4, raw[:200]
    events = data_events(raw)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] is not None
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text
    (line,) = [line for line in gateway.request_lines() if line["request_id"] == "patient"]
    assert line["outcome"] == "ok" and line["queue_ms"] >= 10_000, line


@pytest.mark.slow
async def test_without_keepalive_the_same_wait_is_cut_by_nginx_s_read_timeout(
    start_simulator_at: StartSimulator,
    start_gateway: StartGateway,
    start_front: StartNginx,
    http: aiohttp.ClientSession,
) -> None:
    """The control: the proof above fails without the keepalive (so it can fail), and
    nginx's own 504 is an OpenAI envelope too."""
    sim = await start_simulator_at(step_base_ms=SLOW_STEP_MS)
    gateway = await start_gateway(
        [sim], lanes=only_lane(queue_timeout_s=40.0), configure=with_keepalive(0.0)
    )
    nginx = await start_front(gateway, read_timeout="5s")
    slow = asyncio.create_task(
        post_and_read(http, gateway.url + "/v1/chat/completions", chat("Hold.", max_tokens=400))
    )
    try:
        await slot_taken(gateway)
        loop = asyncio.get_running_loop()
        started = loop.time()
        body = chat("Wait behind it.", max_tokens=20, stream=True)
        async with http.post(nginx.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 504
            assert (await resp.json())["error"]["code"] == "backend_timeout"
            assert "x-gateway-refusal" not in resp.headers
        waited = loop.time() - started
        assert 4.5 <= waited < 8.0, waited
    finally:
        slow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await slow
