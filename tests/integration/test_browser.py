"""The playground and CORS in a real headless Chromium (Debian's chromium + chromedriver,
driven by selenium) against real gateway and simulator processes.

The simulator takes 80 ms per token, so a reply streams for about two seconds and the
page can be watched while it grows. One browser for the module, quit in a finalizer;
the processes are stopped by their PIDs. Without chromium the browser tests skip on a
developer's machine and fail under CI (CI=true), where `.ci/run` installs it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from aiohttp import web
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from gateway.http.playground import content_security_policy, load_page
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "playground-key-123"
STEP_MS = 80  # per token: a reply of REPLY_TOKENS streams for ~2 s
#: The gateway's output cap: the page asks for 128 tokens and gets this many.
REPLY_TOKENS = 24
START_TIMEOUT_S = 20.0


def require_binary(name: str) -> str:
    """The path of `name`; skip without it, or fail when running under CI."""
    path = shutil.which(name)
    if path is not None:
        return path
    why = (
        f"`{name}` is not installed (Debian: apt-get install chromium chromium-driver; "
        ".ci/run does it)"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}, and CI=true: CI must have it", pytrace=False)
    pytest.skip(why)


# --- processes -----------------------------------------------------------------------------


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def request_lines(self) -> list[dict[str, object]]:
        lines = [json.loads(line) for line in self.log_path.read_text().splitlines() if line]
        return [line for line in lines if line.get("event") == "request"]

    def request_line(self, request_id: str, within_s: float = 5.0) -> dict[str, object]:
        """The request's log line, once written (a served gateway writes it in a batch
        within about 0.1 s of the request's end)."""
        deadline = time.monotonic() + within_s
        while True:
            for line in self.request_lines():
                if line["request_id"] == request_id:
                    return line
            assert time.monotonic() < deadline, f"no log line for {request_id}"
            time.sleep(0.02)


def start_process(args: list[str], port: int, ready_path: str, log_path: Path) -> Server:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway", *args, "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.DEVNULL,
        )
    server = Server(f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{args[0]} exited with {process.returncode}")
        try:
            if requests.get(server.url + ready_path, timeout=1).status_code == 200:
                return server
        except requests.RequestException:
            pass
        time.sleep(0.05)
    server.stop()
    raise AssertionError(f"{args[0]} on {server.url} was not ready in {START_TIMEOUT_S:g} s")


def gateway_config(sim_url: str, *, cors_origins: list[str]) -> str:
    return (
        "[server]\nplayground = true\n"
        f"cors_origins = {json.dumps(cors_origins)}\n"
        # a prompt over 64 tokens is refused: the page must show why
        "[limits]\nmax_prompt_tokens = 64\ndefault_max_tokens = 16\n"
        f"max_output_tokens = {REPLY_TOKENS}\n"
        "[health]\nprobe_on_start = false\n"
        f'[[backends]]\nurl = "{sim_url}"\nname = "sim"\nmax_concurrency = 4\n'
        f'[[api_keys]]\nname = "browser"\nkey = "{API_KEY}"\n'
    )


class StaticSite:
    """Another origin: a tiny aiohttp server for one page, on its own loop and thread."""

    def __init__(self, pages: dict[str, str]) -> None:
        self.pages = pages
        self.loop = asyncio.new_event_loop()
        self.url = ""
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="static-site", daemon=True)

    def start(self) -> StaticSite:
        self._thread.start()
        assert self._ready.wait(10), "the static site did not start"
        return self

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        runner = self.loop.run_until_complete(self._start())
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())
        self.loop.close()

    async def _start(self) -> web.AppRunner:
        app = web.Application()
        for name, html in self.pages.items():
            app.router.add_get(f"/{name}", _page(html))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        return runner

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def _page(html: str) -> Callable[[web.Request], object]:
    async def serve(request: web.Request) -> web.Response:
        return web.Response(text=html, content_type="text/html")

    return serve


#: A page on another origin that streams a chat completion from the gateway named in
#: its call, with headers that need a preflight, and reports what it got or why not.
CROSS_ORIGIN_PAGE = """<!doctype html>
<meta charset="utf-8"><title>another origin</title>
<pre id="out"></pre><p id="lane"></p><p id="request-id"></p><p id="status">idle</p>
<script>
async function run(gateway, key, requestId) {
  const show = (id, text) => { document.getElementById(id).textContent = text; };
  show("status", "running");
  try {
    const response = await fetch(gateway + "/v1/chat/completions", {
      method: "POST",
      headers: {"Content-Type": "application/json", "Authorization": "Bearer " + key,
                "X-Request-Id": requestId},
      body: JSON.stringify({messages: [{role: "user", content: "Hello from elsewhere"}],
                            stream: true, max_tokens: 6}),
    });
    show("lane", response.headers.get("x-gateway-lane"));
    show("request-id", response.headers.get("x-request-id"));
    const reader = response.body.getReader(), decoder = new TextDecoder();
    let raw = "", chunks = 0;
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      chunks += 1;
      raw += decoder.decode(value, {stream: true});
      show("out", raw);
    }
    show("status", "done " + response.status + " in " + chunks + " chunks");
  } catch (error) {
    show("status", "failed: " + error.name + ": " + error.message);
  }
}
</script>
"""


@dataclass
class Setup:
    cors_gateway: Server
    closed_gateway: Server
    site: StaticSite


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("browser")
    site = StaticSite({"cross.html": CROSS_ORIGIN_PAGE}).start()
    servers: list[Server] = []
    try:
        sim = start_process(
            [
                "simulate",
                f"--step-base-ms={STEP_MS}",
                "--decode-ms-per-seq=0",
                "--prefill-ms-per-token=0",
            ],
            free_port(),
            "/health",
            tmp / "sim.log",
        )
        servers.append(sim)
        for name, origins in (("cors", [site.url]), ("closed", [])):
            config = tmp / f"{name}.toml"
            config.write_text(gateway_config(sim.url, cors_origins=origins))
            servers.append(
                start_process(
                    ["serve", "--config", str(config)], free_port(), "/readyz", tmp / f"{name}.log"
                )
            )
        yield Setup(cors_gateway=servers[1], closed_gateway=servers[2], site=site)
    finally:
        for server in reversed(servers):
            server.stop()
        site.stop()


@pytest.fixture(scope="module")
def browser(request: pytest.FixtureRequest) -> WebDriver:
    chromium = require_binary("chromium")
    chromedriver = require_binary("chromedriver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=chromedriver))
    request.addfinalizer(driver.quit)
    driver.set_page_load_timeout(20)
    driver.set_script_timeout(20)
    return driver


# --- the playground in the browser ---------------------------------------------------------


def open_playground(browser: WebDriver, gateway: Server, *, key: str = API_KEY) -> None:
    browser.get(gateway.url + "/playground")
    field = browser.find_element(By.ID, "api-key")
    field.clear()
    if key:
        field.send_keys(key)


def send(browser: WebDriver, prompt: str) -> None:
    browser.find_element(By.ID, "prompt").send_keys(prompt)
    browser.find_element(By.ID, "send").click()


def last_turn(browser: WebDriver) -> dict[str, str]:
    state: dict[str, str] = browser.execute_script(
        """const turns = document.querySelectorAll(".turn");
        const turn = turns[turns.length - 1];
        if (!turn) return {state: "none", reply: "", meta: "", code: ""};
        return {state: turn.dataset.state, code: turn.dataset.code || "",
                reply: turn.querySelector(".reply").textContent,
                meta: turn.querySelector(".meta").textContent};"""
    )
    return state


def wait_until_finished(browser: WebDriver, timeout_s: float = 20.0) -> dict[str, str]:
    WebDriverWait(browser, timeout_s, poll_frequency=0.05).until(
        lambda _: last_turn(browser)["state"] in ("done", "refused", "failed")
    )
    return last_turn(browser)


TIMING = re.compile(
    r"^lane (?P<lane>\w+) · queue (?P<queue>\d+) ms · TTFT (?P<ttft>\d+) ms · "
    r"(?P<tokens>\d+) tokens · (?P<rate>\d+\.\d) tok/s$"
)


def test_the_playground_streams_tokens_as_they_arrive_and_fills_the_timing_line(
    setup: Setup, browser: WebDriver
) -> None:
    open_playground(browser, setup.cors_gateway)
    send(browser, "Tell me a story.")
    lengths = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        turn = last_turn(browser)
        if turn["state"] in ("done", "refused", "failed"):
            break
        lengths.append(len(turn["reply"]))
        time.sleep(0.05)
    turn = wait_until_finished(browser)
    assert turn["state"] == "done", turn
    final = len(turn["reply"])
    growing = sorted(set(n for n in lengths if 0 < n < final))
    # ~24 tokens over ~2 s, sampled every ~50 ms: many partial lengths, not one jump
    assert len(growing) >= 5, (lengths, final)
    assert lengths == sorted(lengths), "the reply only ever grows"
    timing = TIMING.match(turn["meta"])
    assert timing, turn["meta"]
    assert timing["lane"] == "interactive"
    assert int(timing["tokens"]) == REPLY_TOKENS  # the page's 128 clamped; from usage
    assert int(timing["ttft"]) > 0
    rate = float(timing["rate"])
    assert 1.0 < rate < 1000 / STEP_MS * 2, rate  # about 12.5 tokens/s at 80 ms a token


def test_the_playground_shows_why_a_request_was_refused(setup: Setup, browser: WebDriver) -> None:
    open_playground(browser, setup.cors_gateway, key="")
    send(browser, "Hello?")
    turn = wait_until_finished(browser)
    assert turn["state"] == "refused" and turn["code"] == "invalid_api_key", turn
    assert "401" in turn["meta"] and "invalid_api_key" in turn["meta"]

    open_playground(browser, setup.cors_gateway)
    send(browser, "word " * 200)  # over max_prompt_tokens = 64
    turn = wait_until_finished(browser)
    assert turn["state"] == "refused" and turn["code"] == "prompt_too_long", turn
    assert "413" in turn["meta"] and "prompt_too_long" in turn["meta"]
    assert turn["reply"] == ""


# --- another origin ------------------------------------------------------------------------


def run_cross_origin(
    browser: WebDriver, site: StaticSite, gateway: Server, request_id: str
) -> dict[str, str]:
    browser.get(site.url + "/cross.html")
    browser.get_log("browser")  # drop what an earlier page logged
    browser.execute_script(
        "run(arguments[0], arguments[1], arguments[2])", gateway.url, API_KEY, request_id
    )
    WebDriverWait(browser, 20, poll_frequency=0.05).until(
        lambda _: browser.find_element(By.ID, "status").text.startswith(("done", "failed"))
    )
    return {
        name: browser.find_element(By.ID, name).text
        for name in ("status", "out", "lane", "request-id")
    }


def test_a_page_on_a_listed_origin_streams_from_the_gateway_and_reads_its_headers(
    setup: Setup, browser: WebDriver
) -> None:
    seen = run_cross_origin(browser, setup.site, setup.cors_gateway, "cross-origin-allowed")
    assert seen["status"].startswith("done 200"), seen
    assert seen["out"].rstrip().endswith("data: [DONE]")
    assert seen["lane"] == "interactive"  # an exposed header the page could read
    assert seen["request-id"] == "cross-origin-allowed"
    assert setup.cors_gateway.request_line("cross-origin-allowed")["outcome"] == "ok"


def test_with_cors_off_the_browser_blocks_the_page_at_the_preflight(
    setup: Setup, browser: WebDriver
) -> None:
    seen = run_cross_origin(browser, setup.site, setup.closed_gateway, "cross-origin-blocked")
    assert seen["status"].startswith("failed: TypeError"), seen
    assert seen["out"] == "" and seen["lane"] == ""
    console = " ".join(entry["message"] for entry in browser.get_log("browser"))
    assert "CORS policy" in console, console
    # The preflight got 405: the browser never sent the request itself.
    assert all(
        line["request_id"] != "cross-origin-blocked"
        for line in setup.closed_gateway.request_lines()
    )


# --- the page itself (no browser needed) ---------------------------------------------------


def test_the_page_has_no_external_assets_and_a_policy_that_allows_only_itself() -> None:
    page = load_page().decode()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "@import" not in page and "url(" not in page
    policy = content_security_policy(load_page())
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]{44}'", policy)
    assert "unsafe-inline" not in policy


def test_the_playground_is_served_only_when_enabled(setup: Setup) -> None:
    answer = requests.get(setup.cors_gateway.url + "/playground", timeout=5)
    assert answer.status_code == 200
    assert answer.headers["Content-Type"] == "text/html; charset=utf-8"
    assert answer.headers["Content-Security-Policy"] == content_security_policy(load_page())
    assert "<title>Gateway playground</title>" in answer.text


@pytest.fixture
def default_gateway(tmp_path: Path) -> Iterator[Server]:
    config = tmp_path / "default.toml"
    config.write_text(
        '[health]\nprobe_on_start = false\n[[backends]]\nurl = "http://127.0.0.1:9"\n'
    )
    server = start_process(
        ["serve", "--config", str(config)], free_port(), "/healthz", tmp_path / "g.log"
    )
    yield server
    server.stop()


def test_the_playground_is_a_404_by_default(default_gateway: Server) -> None:
    answer = requests.get(default_gateway.url + "/playground", timeout=5)
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "not_found"
