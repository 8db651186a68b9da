"""The README's five-minute tour, run as written against a real gateway process (in front
of its built-in simulator, as `make run` starts it): the curl request's body, the openai
SDK snippet with only its base URL pointed at the test's port, the log line's fields,
and the analyzer on the log the gateway wrote."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
START_TIMEOUT_S = 30.0
TOUR_URL = "http://127.0.0.1:8080"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.DOTALL)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    log_path = tmp_path_factory.mktemp("tour") / "gateway.log"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.DEVNULL,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert process.poll() is None, f"the gateway exited with {process.returncode}"
            with contextlib.suppress(requests.RequestException):
                if requests.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"the gateway was not ready in {START_TIMEOUT_S} s"
            time.sleep(0.05)
        yield url, log_path
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def request_lines(log_path: Path) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == "request"]


def test_the_curl_request_streams_a_completion(gateway: tuple[str, Path]) -> None:
    url, _ = gateway
    curl = next(block for block in blocks("sh") if block.startswith("curl"))
    assert f"{TOUR_URL}/v1/chat/completions" in curl
    body = json.loads(re.search(r"-d '(.*?)'", curl, flags=re.DOTALL).group(1))  # type: ignore[union-attr]
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "data: [DONE]"
    assert len(events) > 2


def test_the_openai_sdk_snippet_prints_the_reply(gateway: tuple[str, Path]) -> None:
    url, _ = gateway
    (snippet,) = blocks("python")
    assert f'base_url="{TOUR_URL}/v1"' in snippet
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(snippet.replace(TOUR_URL, url), {})  # noqa: S102
    assert printed.getvalue().strip()


def test_the_log_lines_fields_are_the_gateways(gateway: tuple[str, Path]) -> None:
    url, log_path = gateway
    before = len(request_lines(log_path))
    body = {"model": "sim-model", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    assert requests.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    (example,) = [b for b in blocks("json") if '"event": "request"' in b]
    documented = set(json.loads(example))
    deadline = time.monotonic() + 10
    while len(lines := request_lines(log_path)) == before:  # written as the request ends
        assert time.monotonic() < deadline, "no log line for the request"
        time.sleep(0.05)
    assert documented <= set(lines[-1]), documented - set(lines[-1])


def test_the_analyzer_reads_the_log(gateway: tuple[str, Path]) -> None:
    url, log_path = gateway
    body = {"model": "sim-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(3):
        assert requests.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    assert any("gateway analyze gateway.log" in block for block in blocks("sh"))
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "analyze", str(log_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "VERDICT" in result.stdout
