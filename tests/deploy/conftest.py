"""The image test is opt-in (`make test-image`, `pytest -m image`): it builds an OCI
image as root (a debootstrap base the first time), which CI's 15 minutes cannot hold
next to the suite. Any `-m` expression naming `image` selects it; otherwise it is
deselected, so `make test` and `-m "not slow"` never build an image."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "image" in (config.getoption("markexpr") or ""):
        return
    chosen = [item for item in items if item.get_closest_marker("image") is None]
    if len(chosen) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in chosen])
        items[:] = chosen
