"""`python -m gateway api-doc`: the API page for callers, from the settings in force.

The committed `docs/api.md` is this command's output for the built-in defaults; a
test regenerates it and fails when they differ, so the page cannot go stale.
"""

from __future__ import annotations

from pathlib import Path

from gateway.apidoc.markdown import code
from gateway.apidoc.page import COMMAND, render
from gateway.config import Settings

__all__ = ["COMMAND", "render", "write_page"]


def write_page(settings: Settings, config: str | None, output: str | None) -> int:
    """Print the page, or write it to `output`; the exit status."""
    source = code(config) if config else "the built-in defaults"
    page = render(settings, source)
    if output is None:
        print(page, end="")
    else:
        Path(output).write_text(page, encoding="utf-8")
    return 0
