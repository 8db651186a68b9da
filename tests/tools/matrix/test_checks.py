"""The matrix's promises as checked per cell (`cells.checks`), on figures made by hand."""

from __future__ import annotations

from gateway.tools.matrix.cells import Cell, Figures, checks


def figures(short_refused: int) -> dict[str, Figures]:
    served = Figures(short_p99_s=1.0, shorts=100)
    return {
        "direct": served,
        "ideal": served,
        "gateway": Figures(short_p99_s=1.0, shorts=100, short_refused=short_refused),
    }


def refusal_check(found: list[dict]) -> dict:
    (check,) = [c for c in found if c["check"].startswith("shorts refused")]
    return check


def test_refusals_over_5_percent_miss_where_the_ideal_serves_the_shorts_in_time() -> None:
    cell = Cell("llamacpp-one-slot", "conversation", 0.5)
    check = refusal_check(checks(cell, 1.0, figures(8), shorts_fit=True, ideal_late=0.02))
    assert check["check"] == "shorts refused <= 5%"
    assert not check["passed"]


def test_where_the_ideal_itself_serves_shorts_late_refusals_are_held_to_that_share() -> None:
    """A one-slot engine queues a conversation's short turns behind each other: the ideal
    scheduler gave 8-21% of them their first token past the deadline at 50% load."""
    cell = Cell("llamacpp-one-slot", "conversation", 0.5)
    held = refusal_check(checks(cell, 1.0, figures(8), shorts_fit=True, ideal_late=0.14))
    assert held["check"] == "shorts refused <= the ideal's late share"
    assert held["passed"] and held["bound"] == 0.14
    # More refused than the ideal leaves late: still a miss.
    over = refusal_check(checks(cell, 1.0, figures(20), shorts_fit=True, ideal_late=0.14))
    assert not over["passed"]
