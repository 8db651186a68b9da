"""The other servers' log readers: TGI, vLLM, nginx, detection, and their verdicts on the samples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.tools.analyze.sources import detect, nginx, tgi, vllm
from gateway.tools.analyze.sources.detect import read_sources
from gateway.tools.analyze.sources.durations import duration_ms
from gateway.tools.analyze.sources.verdicts import source_analysis

SAMPLES = Path(__file__).parent / "samples"
ROOT = Path(__file__).resolve().parents[3]

TGI_TEXT = (
    "\x1b[2m2026-12-03T07:00:01.5Z\x1b[0m \x1b[32m INFO\x1b[0m \x1b[1mgenerate\x1b[0m{parameters="
    'GenerateParameters { max_new_tokens: Some(20) } total_time="1.5s" validation_time="812µs" '
    'queue_time="35.1ms" inference_time="1.46s" time_per_token="73ms" seed="None"}'
    "\x1b[2m:\x1b[0m text_generation_router::server: router/src/server.rs:422: Success"
)


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("1.2s", 1200.0),
        ("35.1ms", 35.1),
        ("812µs", 0.812),
        ("812μs", 0.812),
        ("120ns", 0.00012),
        ("2m", 120_000.0),
        ("1h", 3_600_000.0),
        ("0ns", 0.0),
    ],
)
def test_rust_durations(text: str, ms: float) -> None:
    assert duration_ms(text) == pytest.approx(ms)


@pytest.mark.parametrize("text", ["", "12", "1.2 sec", "-1s", "ms", "1.2.3s", None, 5])
def test_not_durations(text: object) -> None:
    assert duration_ms(text) is None


def test_tgi_text_line_with_ansi_colours() -> None:
    entry = tgi.parse_line(TGI_TEXT)
    assert entry is not None
    assert entry["span"] == "generate"
    assert entry["time"] == "2026-12-03T07:00:01.5Z"
    assert entry["total_ms"] == pytest.approx(1500)
    assert entry["queue_ms"] == pytest.approx(35.1)
    assert entry["inference_ms"] == pytest.approx(1460)
    assert entry["validation_ms"] == pytest.approx(0.812)


def test_tgi_json_line() -> None:
    span = {
        "name": "generate_stream",
        "total_time": "2.5s",
        "validation_time": "1ms",
        "queue_time": "2s",
        "inference_time": "499ms",
        "time_per_token": "20ms",
    }
    line = json.dumps(
        {
            "timestamp": "2026-12-03T07:00:00Z",
            "level": "INFO",
            "fields": {"message": "Success"},
            "span": span,
            "spans": [span],
        }
    )
    entry = tgi.parse_line(line)
    assert entry is not None
    assert (entry["queue_ms"], entry["inference_ms"], entry["span"]) == (
        2000,
        499,
        "generate_stream",
    )


@pytest.mark.parametrize("cut", [20, 120, 200, len(TGI_TEXT) - 8])
def test_tgi_line_cut_in_the_middle_is_not_read(cut: int) -> None:
    assert tgi.parse_line(TGI_TEXT[:cut]) is None


@pytest.mark.parametrize(
    "line",
    [
        "",
        "garbage",
        "{",
        '{"message":"Success"}',
        "[1,2]",
        "2026-12-03T07:00:00Z  INFO text_generation_launcher: Starting Webserver",
        '{"timestamp":"x","fields":{"message":"Success"},"span":{"total_time":"1s"}}',
    ],
)
def test_tgi_garbage(line: str) -> None:
    assert tgi.parse_line(line) is None


def test_vllm_v1_and_v0_stats_and_access() -> None:
    v1 = (
        "INFO 12-03 07:00:10 [loggers.py:118] Engine 000: Avg prompt throughput: 512.3 tokens/s, "
        "Avg generation throughput: 88.1 tokens/s, Running: 12 reqs, Waiting: 3 reqs, "
        "GPU KV cache usage: 71.5%, Prefix cache hit rate: 12.0%"
    )
    v0 = (
        "INFO 12-03 07:00:10 metrics.py:351] Avg prompt throughput: 1.0 tokens/s, Avg generation "
        "throughput: 2.0 tokens/s, Running: 4 reqs, Swapped: 1 reqs, Pending: 2 reqs, "
        "GPU KV cache usage: 9.5%, CPU KV cache usage: 0.0%."
    )
    one, zero = vllm.parse_line(v1), vllm.parse_line(v0)
    assert one is not None and zero is not None
    assert (one["running"], one["waiting"], one["kv_usage_pct"], one["prefix_hit_pct"]) == (
        12,
        3,
        71.5,
        12,
    )
    assert (zero["running"], zero["waiting"], zero["swapped"]) == (4, 2, 1)
    access = vllm.parse_line(
        'INFO:     127.0.0.1:5 - "POST /v1/chat/completions HTTP/1.1" 503 Service Unavailable'
    )
    assert access == {
        "source": "vllm",
        "kind": "access",
        "method": "POST",
        "path": "/v1/chat/completions",
        "status": 503,
    }
    assert vllm.parse_line(v1[:60]) is None
    assert vllm.parse_line("INFO:     Started server process [1]") is None


@pytest.mark.parametrize(
    ("value", "ms"),
    [
        (0.25, 250.0),
        ("0.012", 12.0),
        ("0.012, 0.340", 352.0),
        ("0.1 : 0.2", 300.0),
        ("-", None),
        ("", None),
        ("- , 0.5", 500.0),
        ("abc", None),
        (True, None),
        (None, None),
    ],
)
def test_nginx_seconds(value: object, ms: float | None) -> None:
    got = nginx.seconds_ms(value)
    assert got == (None if ms is None else pytest.approx(ms))


def test_nginx_line_and_garbage() -> None:
    line = (
        '{"status":200,"request_time":1.5,"upstream_header_time":"0.100",'
        '"upstream_response_time":"1.499","uri":"/v1/chat/completions"}'
    )
    entry = nginx.parse_line(line)
    assert entry is not None
    assert (entry["status"], entry["request_ms"], entry["ttfb_ms"]) == (200, 1500, 100)
    assert nginx.parse_line(line[:40]) is None
    assert nginx.parse_line('{"status":"x","request_time":1}') is None
    assert nginx.parse_line('{"event":"request"}') is None


def test_detect_keeps_our_own_lines_ours() -> None:
    ours = json.dumps({"event": "request", "status": 200, "request_time": 1})
    assert detect.classify(ours) == ("ours", None)
    assert detect.classify(TGI_TEXT)[0] == "tgi"
    assert detect.classify('{"status":200,"request_time":0.1}')[0] == "nginx"
    assert detect.classify('INFO:     1.2.3.4:5 - "GET /health HTTP/1.1" 200 OK')[0] == "vllm"
    assert detect.classify("\x00\xff garbage")[0] == "unknown"


def test_verdicts_on_the_samples() -> None:
    def of(name: str) -> dict:
        found, unknown = read_sources((SAMPLES / name).read_text(encoding="utf-8").splitlines())
        return source_analysis(found, unknown)

    text, js = of("tgi.log"), of("tgi.json.log")
    assert text["tgi"]["verdict"] == js["tgi"]["verdict"] == "queueing"
    assert text["tgi"]["total_ms"] == js["tgi"]["total_ms"]
    assert text["tgi"]["longest_waits"][0]["queue_ms"] == pytest.approx(4200)
    assert text["unreadable_lines"] == 2  # the launcher's line and a line cut in the middle
    vl = of("vllm.log")["vllm"]
    assert vl["verdict"] == "engine queued"
    assert [(w["start"], w["end"], w["max_waiting"]) for w in vl["queued_windows"]] == [
        ("12-03 07:00:30", "12-03 07:01:00", 7),
        ("12-03 07:01:40", "12-03 07:01:40", 1),
    ]
    assert (vl["max_running"], vl["kv_usage_peak_pct"], vl["statuses"]) == (
        32,
        95,
        {"200": 34, "503": 2},
    )
    assert of("vllm-v0.log")["vllm"]["max_waiting"] == 4
    ng = of("nginx.json.log")["nginx"]
    assert ng["verdict"] == "first byte"
    assert ng["statuses"] == {"200": 19, "502": 1}
    mixed = of("mixed.log")
    assert set(mixed) == {"tgi", "nginx", "unreadable_lines"}
    assert mixed["tgi"]["requests"] == 11 and mixed["nginx"]["requests"] == 6


def _analyze(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "analyze", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_cli_on_mixed_files_text_and_json(tmp_path: Path) -> None:
    out = _analyze(
        str(SAMPLES / "tgi.log"),
        str(SAMPLES / "tgi.json.log"),
        str(SAMPLES / "nginx.json.log"),
        "--json",
        str(tmp_path / "a.json"),
    )
    assert out.returncode == 0, out.stderr
    assert "TGI log: 40 requests" in out.stdout
    assert "are queueing-bound" in out.stdout
    assert "nginx cannot split queue from prefill" in out.stdout
    data = json.loads((tmp_path / "a.json").read_text())
    assert data["sources"]["tgi"]["requests"] == 40
    assert data["sources"]["nginx"]["verdict"] == "first byte"


def test_cli_vllm_says_what_it_cannot_tell() -> None:
    out = _analyze(str(SAMPLES / "vllm.log"))
    assert out.returncode == 0, out.stderr
    assert "verdict: engine queued" in out.stdout
    assert "no per-request TTFT" in out.stdout
