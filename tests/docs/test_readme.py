"""The README is the front door: under 200 lines, the two commands first, and every
relative link in it (to a file, or to a heading of a Markdown file) resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 200

#: `[text](target)`, not images' or code's brackets; targets without a scheme.
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub and MyST (`myst_heading_anchors`) write it."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", markdown.read_text(), flags=re.DOTALL)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.MULTILINE)}


def relative_links(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_readme_is_under_200_lines() -> None:
    assert len(README.read_text().splitlines()) < MAX_LINES


def test_the_readme_opens_with_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert lines[0].startswith("# ")
    body = [line for line in lines[1:] if line.strip()]
    assert body[0] == "```sh"
    assert body[1].startswith("make run ")
    assert body[2].startswith("make test ")
    assert body[3] == "```"


def test_every_relative_link_of_the_readme_resolves() -> None:
    links = relative_links(README.read_text())
    assert len(links) >= 10  # the docs' pages; a regex that finds none would pass anything
    for link in links:
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else README
        assert target.exists(), f"README links to {link}: {target} does not exist"
        if anchor:
            assert target.suffix == ".md", link
            assert anchor in anchors(target), f"README links to {link}: no such heading"


def test_the_link_check_sees_a_broken_link_and_a_missing_heading(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## The log line\n")
    assert anchors(page) == {"title", "the-log-line"}
    assert slug("Results (this repository's 2-core test machine)") == (
        "results-this-repositorys-2-core-test-machine"
    )
    links = "[a](docs/x.md) [b](https://example.com) ![c](d.png) `[e](f)` [g](#h)"
    assert relative_links(links) == ["docs/x.md", "#h"]
