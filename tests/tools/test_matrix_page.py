"""`gateway matrix --markdown` writes a page the docs site can hold: a title, then the table."""

from __future__ import annotations

from gateway.tools.matrix.report import HEADER, markdown, markdown_page


def test_the_markdown_page_has_a_title_and_the_table() -> None:
    page = markdown_page([])
    # The site's strict build refuses a page without a title in its navigation.
    assert page.startswith("# Engine matrix\n\n")
    assert page.endswith(markdown([]))
    assert "| " + " | ".join(HEADER) + " |" in page
