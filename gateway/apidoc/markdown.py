"""The few Markdown shapes the API page needs: tables, code spans, numbers.

Config values (lane and key names) are free text: a `|` or a newline in one must not
break a table, and a backtick must not end a code span early.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def cell(text: object) -> str:
    """A table cell: pipes escaped, line breaks flattened."""
    return " ".join(str(text).split()).replace("|", "\\|")


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        assert len(row) == len(header), row
        lines.append("| " + " | ".join(cell(value) for value in row) + " |")
    return lines


def code(text: object) -> str:
    """An inline code span that holds any text, backticks included."""
    body = str(text)
    fence = "`"
    while fence in body:
        fence += "`"
    padded = f" {body} " if body.startswith("`") or body.endswith("`") else body
    return f"{fence}{padded}{fence}"


def seconds(value: float) -> str:
    return f"{value:g} s"


def count(value: int) -> str:
    """An integer with thousands separators: 32,768 tokens reads faster than 32768."""
    return f"{value:,}"


def fenced(language: str, text: str) -> list[str]:
    return [f"```{language}", *text.rstrip("\n").split("\n"), "```"]
