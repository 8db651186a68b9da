"""The other servers' log readers on broken and hostile lines: skipped and counted, never fatal.

Logs at 2 a.m. are cut by rotation, corrupted by a full disk, or hand-edited; a
reader that raises on one such line loses the whole report, and one that lets
`nan` or `1e999` through poisons the percentiles and writes JSON that no JSON
parser accepts. Every line here is derived from the sample files or written to
break a number.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.tools.analyze.sources.detect import classify

SAMPLES = Path(__file__).parent / "samples"
SAMPLE_FILES = sorted(SAMPLES.glob("*.log"))
ROOT = Path(__file__).resolve().parents[3]

HOSTILE_NUMBERS = [
    '{"time":"t","status":200,"request_time":"nan","upstream_header_time":"inf"}',
    '{"time":"t","status":200,"request_time":1e999,"upstream_header_time":"0.1"}',
    '{"time":"t","status":200,"request_time":"-1e999","upstream_response_time":"NaN"}',
    "INFO 12-03 07:01:40 [loggers.py:118] Engine 000: Avg prompt throughput: 71..0 tokens/s, "
    "Avg generation throughput: 323.0 tokens/s, Running: 3 reqs, Waiting: 0 reqs, "
    "GPU KV cache usage: 2.0%, Prefix cache hit rate: 0.0%",
    "INFO 12-03 07:01:40 [loggers.py:118] Engine 000: Avg prompt throughput: "
    + "9" * 400
    + ".0 tokens/s, Avg generation throughput: 1.0 tokens/s, Running: 1 reqs, "
    "Waiting: 1 reqs, GPU KV cache usage: 1.0%, Prefix cache hit rate: 0.0%",
    '2026-12-03T07:00:01Z  INFO generate{total_time="1e400s" validation_time="1ms" '
    'queue_time="1.2.3s" inference_time="1s"}: text_generation_router::server: Success',
    '{"timestamp":"t","level":"INFO","message":"Success","span":{"total_time":"inf s",'
    '"queue_time":"NaNs","inference_time":"1s","name":"generate"}}',
]


def _lines() -> list[str]:
    lines: list[str] = []
    for path in SAMPLE_FILES:
        lines += path.read_text(encoding="utf-8", errors="replace").splitlines()
    return [line for line in lines if line.strip()]


def _finite(entry: dict[str, Any] | None) -> bool:
    return entry is None or all(
        not (isinstance(value, float) and not math.isfinite(value)) for value in entry.values()
    )


def test_the_samples_are_there() -> None:
    assert len(SAMPLE_FILES) >= 5 and len(_lines()) > 50


def test_every_cut_of_every_sample_line_is_read_or_skipped() -> None:
    failures = []
    for line in _lines():
        step = max(1, len(line) // 50)
        for cut in range(0, len(line) + 1, step):
            for part in (line[:cut], line[cut:]):
                try:
                    _, entry = classify(part)
                except Exception as exc:  # noqa: BLE001 - the point is that nothing raises
                    failures.append((part[:100], repr(exc)))
                    continue
                if not _finite(entry):
                    failures.append((part[:100], f"non-finite: {entry}"))
    assert failures == []


def test_corrupted_sample_lines_are_read_or_skipped() -> None:
    rng = random.Random(29)
    noise = '"{}[]:,\\\x1b0123456789.µ- \x00\ufffd'
    failures = []
    for line in _lines():
        for _ in range(30):
            chars = list(line)
            for _ in range(3):
                chars[rng.randrange(len(chars))] = rng.choice(noise)
            text = "".join(chars)
            try:
                _, entry = classify(text)
            except Exception as exc:  # noqa: BLE001
                failures.append((text[:100], repr(exc)))
                continue
            if not _finite(entry):
                failures.append((text[:100], f"non-finite: {entry}"))
    assert failures == []


@pytest.mark.parametrize("line", HOSTILE_NUMBERS)
def test_a_number_that_is_not_one_is_never_read_as_one(line: str) -> None:
    _, entry = classify(line)
    assert _finite(entry)


def test_analyze_on_hostile_lines_writes_a_report_and_strict_json(tmp_path: Path) -> None:
    log = tmp_path / "hostile.log"
    good = (SAMPLES / "mixed.log").read_text(encoding="utf-8")
    log.write_text(good + "\n".join(HOSTILE_NUMBERS) + "\n", encoding="utf-8")
    out = tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "analyze", str(log), "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode in (0, 1), done.stderr

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    report = json.loads(out.read_text(encoding="utf-8"), parse_constant=refuse)
    assert "sources" in report
