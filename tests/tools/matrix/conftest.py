"""The matrix tests read the conversation trace the repository carries, wherever it runs.

`gateway matrix` takes the hour of the Azure trace when it lies beside the repository
(`../shared/data`), else the 30-s slice under `tests/data`. A baseline written beside the
hour and checked in a clone without it compared two different schedules: CI read
sglang-a100's conversation cell 1.08x the floor against a baseline of 0.97x. So these
tests pin the slice, and nothing they read depends on what lies outside the clone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.tools.matrix import traffic

SLICE = Path(__file__).resolve().parents[2] / "data" / "azure_conv_600s_30s.csv"


@pytest.fixture(autouse=True, scope="package")
def repository_trace_only() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(traffic, "TRACE_PATHS", (SLICE,))
        patch.setattr(traffic, "_TRACE", None)
        yield
