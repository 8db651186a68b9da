"""Hand-made request lines whose answer is obvious, and a way to run the `analyze` CLI."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.tools import analyze as analyzer

END = "2026-01-01T00:00:10.000000Z"  # 1767225610.0 as epoch seconds
END_S = 1767225610.0
_IDS = itertools.count(1)


def rec(
    lane: str | None = "interactive",
    outcome: str = "ok",
    queue: float | None = 1.0,
    backend: float | None = 10.0,
    *,
    stream: bool = True,
    e2e: float | None = None,
    end: str = END,
    **fields: Any,
) -> dict[str, Any]:
    """A request line as the gateway writes it; ttft = queue + backend + 0.5 ms of admission."""
    ttft = None if backend is None or not stream else (queue or 0.0) + backend + 0.5
    if e2e is None:
        e2e = (ttft or (queue or 0.0) + (backend or 0.0)) + 100.0
    line = {
        "request_id": f"req-{next(_IDS)}",
        "route": "/v1/chat/completions",
        "model": "m",
        "stream": stream,
        "lane": lane,
        "backend": None if backend is None else "b0",
        "status": 200 if outcome == "ok" else 429,
        "outcome": outcome,
        "error_code": None,
        "prompt_tokens": 10,
        "max_tokens_requested": 20,
        "max_tokens": 20,
        "completion_tokens": 20 if outcome == "ok" else None,
        "queue_ms": queue,
        "backend_ttft_ms": backend if stream else None,
        "ttft_ms": ttft,
        "tpot_ms": 5.0 if stream and outcome == "ok" else None,
        "e2e_ms": e2e,
        "event": "request",
        "level": "info",
        "timestamp": end,
    }
    line.update(fields)
    return line


def lane_with_slow_tail(lane: str, queue: float, backend: float, fast: int = 99) -> list[dict]:
    """`fast` quick requests and one slow one split queue/backend as given."""
    return [rec(lane, queue=1.0, backend=10.0) for _ in range(fast)] + [
        rec(lane, queue=queue, backend=backend, request_id=f"{lane}-slowest")
    ]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    analyzer.add_arguments(parser)
    code = analyzer.main(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write_log(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("banner\n" + "".join(json.dumps(r) + "\n" for r in records))
    return path
