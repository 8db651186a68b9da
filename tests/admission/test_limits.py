"""Caps on prompt and output size: defaults, clamping, refusals, the context window."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.admission.limits import (
    OutputBudget,
    check_n,
    check_prompt,
    decide_output_budget,
    smallest_cap,
)
from gateway.admission.schema import ChatCompletionRequest, CompletionRequest, parse
from gateway.config import LimitsSettings
from gateway.http.errors import status_of
from gateway.outcomes import Refusal


def read_n(body: dict[str, Any], limits: LimitsSettings) -> int:
    """`n` of a chat body, as the chat dialect reads it: schema, then the max_n cap."""
    return check_n(parse({"messages": [{"role": "user"}], **body}, ChatCompletionRequest).n, limits)


def requested_max_tokens(
    body: dict[str, Any], fields: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
) -> int | None:
    """The smallest max-tokens field of a chat body (`fields` = ("max_tokens",): completions)."""
    if fields == ("max_tokens",):
        return parse({"prompt": "x", **body}, CompletionRequest).max_tokens
    request = parse({"messages": [{"role": "user"}], **body}, ChatCompletionRequest)
    return smallest_cap(request.max_tokens, request.max_completion_tokens)


def limits(**changes: Any) -> LimitsSettings:
    values: dict[str, Any] = {
        "max_prompt_tokens": 4000,
        "default_max_tokens": 200,
        "max_output_tokens": 1000,
        "on_max_tokens_over": "clamp",
        "context_window": 0,
        "max_n": 4,
    }
    values.update(changes)
    return LimitsSettings(**values)


# --- default, clamp, reject ---------------------------------------------------------


def test_default_is_injected_when_the_client_did_not_say() -> None:
    budget = decide_output_budget(None, 50, limits())
    assert budget == OutputBudget(requested=None, max_tokens=200, clamped=False)


def test_a_request_within_the_cap_is_kept() -> None:
    budget = decide_output_budget(700, 50, limits())
    assert (budget.requested, budget.max_tokens, budget.clamped) == (700, 700, False)


def test_a_request_at_the_cap_is_kept() -> None:
    budget = decide_output_budget(1000, 50, limits())
    assert (budget.max_tokens, budget.clamped) == (1000, False)


def test_over_the_cap_is_clamped_and_the_request_remembered() -> None:
    budget = decide_output_budget(1001, 50, limits())
    assert (budget.requested, budget.max_tokens, budget.clamped) == (1001, 1000, True)


def test_over_the_cap_in_reject_mode_is_400_max_tokens_too_large() -> None:
    with pytest.raises(Refusal) as info:
        decide_output_budget(1001, 50, limits(on_max_tokens_over="reject"))
    error = info.value
    assert (status_of(error), error.code, error.param) == (
        400,
        "max_tokens_too_large",
        "max_tokens",
    )
    assert "1001" in error.message and "1000" in error.message


def test_reject_mode_names_the_field_the_client_used() -> None:
    with pytest.raises(Refusal) as info:
        decide_output_budget(
            5000, 50, limits(on_max_tokens_over="reject"), param="max_completion_tokens"
        )
    assert info.value.param == "max_completion_tokens"


def test_reject_mode_keeps_a_request_within_the_cap() -> None:
    budget = decide_output_budget(1000, 50, limits(on_max_tokens_over="reject"))
    assert (budget.max_tokens, budget.clamped) == (1000, False)


# --- prompt cap -------------------------------------------------------------------------


def test_prompt_at_the_cap_passes() -> None:
    settings = limits()
    assert settings.max_prompt_tokens == 4000
    check_prompt(4000, settings)  # at the cap: accepted (the cap is inclusive)
    with pytest.raises(Refusal):  # one more is refused, so 4000 was the boundary checked
        check_prompt(4001, settings)


def test_prompt_over_the_cap_is_413_prompt_too_long() -> None:
    with pytest.raises(Refusal) as info:
        check_prompt(4001, limits())
    error = info.value
    assert (status_of(error), error.code) == (413, "prompt_too_long")
    assert "4001" in error.message and "4000" in error.message


# --- context window -----------------------------------------------------------------------


def test_explicit_request_over_the_window_is_400_context_length_exceeded() -> None:
    with pytest.raises(Refusal) as info:
        decide_output_budget(601, 1400, limits(context_window=2000))
    error = info.value
    assert (status_of(error), error.code, error.param) == (
        400,
        "context_length_exceeded",
        "max_tokens",
    )
    assert "2000" in error.message


def test_explicit_request_that_exactly_fills_the_window_passes() -> None:
    budget = decide_output_budget(600, 1400, limits(context_window=2000))
    assert (budget.max_tokens, budget.clamped) == (600, False)


def test_default_is_fitted_to_the_window() -> None:
    budget = decide_output_budget(None, 1900, limits(context_window=2000))
    # Fitted, not clamped: the client asked for nothing.
    assert budget == OutputBudget(requested=None, max_tokens=100, clamped=False)


def test_default_that_fits_the_window_is_unchanged() -> None:
    budget = decide_output_budget(None, 100, limits(context_window=2000))
    assert budget.max_tokens == 200


def test_clamped_request_is_then_fitted_to_the_window() -> None:
    budget = decide_output_budget(5000, 1500, limits(context_window=2000))
    assert (budget.requested, budget.max_tokens, budget.clamped) == (5000, 500, True)


@pytest.mark.parametrize("requested", [None, 1, 100])
def test_prompt_filling_the_window_is_400(requested: int | None) -> None:
    with pytest.raises(Refusal) as info:
        decide_output_budget(requested, 2000, limits(context_window=2000))
    assert (status_of(info.value), info.value.code) == (400, "context_length_exceeded")


def test_prompt_one_short_of_the_window_leaves_one_token() -> None:
    budget = decide_output_budget(None, 1999, limits(context_window=2000))
    assert budget.max_tokens == 1


def test_no_window_means_no_check() -> None:
    budget = decide_output_budget(900, 10**6, limits(context_window=0))
    assert budget.max_tokens == 900


# --- n -------------------------------------------------------------------------------------


def test_n_defaults_to_one() -> None:
    assert read_n({}, limits()) == 1
    assert read_n({"n": None}, limits()) == 1


def test_n_up_to_max_n_is_accepted() -> None:
    assert read_n({"n": 4}, limits()) == 4


@pytest.mark.parametrize(
    "n",
    [
        pytest.param(True, id="bool-true"),
        pytest.param(False, id="bool-false"),
        pytest.param(0, id="zero"),
        pytest.param(-2, id="negative"),
        pytest.param("2", id="string"),
        pytest.param(2.0, id="float"),
        pytest.param(5, id="over-max-n"),
    ],
)
def test_invalid_n_is_400(n: Any) -> None:
    with pytest.raises(Refusal) as info:
        read_n({"n": n}, limits())
    assert (status_of(info.value), info.value.code, info.value.param) == (
        400,
        "invalid_request",
        "n",
    )


# --- max_tokens fields ---------------------------------------------------------------------


def test_no_field_means_no_request() -> None:
    assert requested_max_tokens({}) is None
    assert requested_max_tokens({"max_tokens": None, "max_completion_tokens": None}) is None


def test_either_field_alone() -> None:
    assert requested_max_tokens({"max_tokens": 300}) == 300
    assert requested_max_tokens({"max_completion_tokens": 120}) == 120


@pytest.mark.parametrize(
    ("max_tokens", "max_completion_tokens"), [(300, 200), (200, 300), (250, 250)]
)
def test_the_smaller_of_the_two_fields_wins(max_tokens: int, max_completion_tokens: int) -> None:
    body = {"max_tokens": max_tokens, "max_completion_tokens": max_completion_tokens}
    assert requested_max_tokens(body) == min(max_tokens, max_completion_tokens)


def test_only_the_given_fields_are_read() -> None:
    body = {"max_tokens": 300, "max_completion_tokens": 50}
    assert requested_max_tokens(body, ("max_tokens",)) == 300


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [True, False, "100", 100.0, 0, -5, [100]])
def test_non_positive_integer_max_tokens_are_refused(field: str, value: Any) -> None:
    with pytest.raises(Refusal) as info:
        requested_max_tokens({field: value})
    assert (status_of(info.value), info.value.code, info.value.param) == (
        400,
        "invalid_request",
        field,
    )


def test_a_cap_of_one_is_accepted() -> None:
    assert requested_max_tokens({"max_tokens": 1}) == 1


# --- the budget --------------------------------------------------------------------------


def test_total_is_max_tokens_times_n_times_prompt_count() -> None:
    budget = decide_output_budget(100, 10, limits(), n=3, prompt_count=2)
    assert (budget.max_tokens, budget.n, budget.prompt_count) == (100, 3, 2)
    assert budget.total == 600


def test_total_of_a_single_choice_is_max_tokens() -> None:
    assert OutputBudget(requested=None, max_tokens=256, clamped=False).total == 256


def test_total_uses_the_clamped_value() -> None:
    budget = decide_output_budget(5000, 10, limits(), n=2)
    assert budget.total == 2000
