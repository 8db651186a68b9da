"""One table maps refusals to statuses; the docs' error table and the OpenAPI document agree with it."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.config import Settings
from gateway.http.errors import ERRORS, RETRY_AFTER_CODES, error_response
from gateway.http.openapi import openapi_document
from gateway.outcomes import REFUSALS, Outcome, QueueFull, Refusal

#: The errors table moved here from the README (the docs site's "Diagnosing from logs").
DIAGNOSING = Path(__file__).resolve().parents[2] / "docs" / "diagnosing.md"


def documented_error_rows() -> set[tuple[int, str]]:
    """(status, code) pairs of docs/diagnosing.md's error table ("404 / 405" pairs with codes)."""
    text = DIAGNOSING.read_text()
    section = text[text.index("## Errors") :]
    section = section[: section.index("\n## ", 1)]
    rows = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not re.match(r"\d{3}", cells[1]):
            continue
        statuses = [int(s) for s in re.findall(r"\d{3}", cells[1])]
        codes = re.findall(r"`([a-z_]+)`", cells[2])
        if len(statuses) == 1:
            statuses *= len(codes)
        assert len(statuses) == len(codes), line
        rows.update(zip(statuses, codes, strict=True))
    return rows


def test_every_refusal_has_a_row_in_the_table() -> None:
    assert {kind.code for kind in REFUSALS} <= set(ERRORS)


def test_the_documented_error_table_is_the_code_table() -> None:
    assert documented_error_rows() == {(kind.status, code) for code, kind in ERRORS.items()}


def test_every_status_of_the_table_is_documented_in_openapi() -> None:
    document = openapi_document(Settings())
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    responses = document["components"]["responses"]
    for code, kind in ERRORS.items():
        assert str(kind.status) in chat
        description = responses[f"Error{kind.status}"]["description"]
        assert f"`{code}`" in description
        if code in RETRY_AFTER_CODES:
            assert "Retry-After" in responses[f"Error{kind.status}"]["headers"]


def test_refusals_carry_no_status_and_render_through_the_table() -> None:
    refusal = QueueFull("full", retry_after_s=2.2)
    assert not hasattr(refusal, "status")
    response = error_response(refusal, {"x-request-id": "r"})
    assert response.status == 429
    assert response.headers["Retry-After"] == "3"
    assert refusal.outcome is Outcome.REJECTED_QUEUE_FULL


def test_rejected_outcomes_are_named_after_their_code() -> None:
    for kind in REFUSALS:
        if kind.outcome.value.startswith("rejected_") and kind.code != "invalid_api_key":
            assert kind.outcome.value == f"rejected_{kind.code}", kind
        assert issubclass(kind, Refusal)
