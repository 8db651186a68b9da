"""Sphinx configuration of the docs site (`make docs`; tests/test_docs_site.py builds it strict).

Why Sphinx + MyST + Furo: the pages are Markdown (the README was), and MyST parses
CommonMark for Sphinx; Sphinx (9.x) and MyST (5.x) are actively released, while
MkDocs 1.x has had no release since 2024-08 and Material for MkDocs' authors moved to
Zensical, still at 0.1. `sphinx-build -W --keep-going -n` fails on every broken link
between pages, missing anchor or page left out of the navigation. Nothing is fetched
at build time (no intersphinx, no remote theme assets).
"""

project = "LLM tail-latency gateway"
author = "llm-tail-gateway contributors"
copyright = "llm-tail-gateway contributors, Apache-2.0"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Anchors for `page.md#heading` links, checked like the links themselves.
myst_heading_anchors = 3

html_theme = "furo"
html_title = project
# The site is a set of plain pages; no copy of the Markdown sources in the output.
html_copy_source = False
html_show_sourcelink = False
