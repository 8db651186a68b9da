"""Admission of OpenAI bodies: the backend body, stream options, the lane, refusals.

Admission runs in two steps (the dialect's `measure` validates and counts, `admit`
applies the policy) and the dialect shapes the backend body; the helpers below run
all three, as the handler does.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import tiktoken

from gateway.admission.admit import Admission, RequestShape, admit
from gateway.admission.limits import OutputBudget
from gateway.admission.tokens import TokenCounter, load_encoding
from gateway.config import LaneSettings, LimitsSettings, Settings
from gateway.dialects import ChatDialect, CompletionDialect, Dialect
from gateway.http.errors import status_of
from gateway.outcomes import Refusal

HELLO = [{"role": "user", "content": "hello world"}]  # 9 prompt tokens
CHAT = ChatDialect("/v1/chat/completions")
COMPLETION = CompletionDialect("/v1/completions")


@dataclass
class Admitted:
    """An admission and the backend body the dialect made of it."""

    budget: OutputBudget
    lane: LaneSettings
    backend_body: dict[str, Any]


@pytest.fixture(scope="module")
def encoding() -> tiktoken.Encoding:
    return load_encoding("cl100k_base")


@pytest.fixture
def counter(encoding: tiktoken.Encoding) -> Iterator[TokenCounter]:
    counter = TokenCounter(encoding)
    yield counter
    counter.close()


@pytest.fixture
def settings() -> Settings:
    # The documented defaults: default 256, cap 1024, clamp; lanes interactive/bulk.
    return Settings()


async def admit_body(
    body: dict[str, Any], settings: Settings, counter: TokenCounter, kind: Dialect = CHAT
) -> tuple[RequestShape, Admitted]:
    shape = await kind.measure(body, settings.limits, counter)
    admission: Admission = admit(shape, settings)
    backend_body = kind.backend_body(shape, admission.budget)
    return shape, Admitted(admission.budget, admission.lane, backend_body)


async def refusal(
    body: dict[str, Any], settings: Settings, counter: TokenCounter, kind: Dialect = CHAT
) -> Refusal:
    with pytest.raises(Refusal) as info:
        await admit_body(body, settings, counter, kind)
    return info.value


# --- max_tokens in the backend body ----------------------------------------------------


async def test_default_max_tokens_is_injected(settings: Settings, counter: TokenCounter) -> None:
    shape, admission = await admit_body({"model": "m", "messages": HELLO}, settings, counter)
    assert shape.prompt_tokens == 9
    assert shape.model == "m"
    assert shape.requested_max_tokens is None
    assert admission.backend_body["max_tokens"] == 256
    assert "max_completion_tokens" not in admission.backend_body
    assert admission.backend_body["messages"] == HELLO
    assert admission.backend_body["model"] == "m"


async def test_explicit_null_max_tokens_gets_the_default(
    settings: Settings, counter: TokenCounter
) -> None:
    shape, admission = await admit_body({"messages": HELLO, "max_tokens": None}, settings, counter)
    assert admission.backend_body["max_tokens"] == 256


async def test_max_tokens_within_the_cap_is_passed_on(
    settings: Settings, counter: TokenCounter
) -> None:
    shape, admission = await admit_body({"messages": HELLO, "max_tokens": 40}, settings, counter)
    assert admission.backend_body["max_tokens"] == 40
    assert not admission.budget.clamped


async def test_max_tokens_over_the_cap_is_clamped(
    settings: Settings, counter: TokenCounter
) -> None:
    shape, admission = await admit_body({"messages": HELLO, "max_tokens": 5000}, settings, counter)
    assert admission.backend_body["max_tokens"] == 1024
    assert admission.budget.clamped
    assert shape.requested_max_tokens == 5000


async def test_max_completion_tokens_is_the_field_clamped_when_the_client_used_it(
    settings: Settings, counter: TokenCounter
) -> None:
    shape, admission = await admit_body(
        {"messages": HELLO, "max_completion_tokens": 5000}, settings, counter
    )
    assert admission.backend_body["max_completion_tokens"] == 1024
    assert "max_tokens" not in admission.backend_body
    assert shape.requested_max_tokens == 5000


async def test_both_fields_get_the_smaller_value(settings: Settings, counter: TokenCounter) -> None:
    body = {"messages": HELLO, "max_tokens": 300, "max_completion_tokens": 100}
    shape, admission = await admit_body(body, settings, counter)
    assert admission.backend_body["max_tokens"] == 100
    assert admission.backend_body["max_completion_tokens"] == 100
    assert admission.budget.max_tokens == 100


async def test_the_client_body_is_not_modified(settings: Settings, counter: TokenCounter) -> None:
    body = {
        "messages": HELLO,
        "max_tokens": 5000,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    before = copy.deepcopy(body)
    shape, admission = await admit_body(body, settings, counter)
    assert body == before
    assert admission.backend_body is not body


async def test_other_fields_pass_through(settings: Settings, counter: TokenCounter) -> None:
    body = {"messages": HELLO, "temperature": 0.2, "top_p": 0.9, "seed": 7, "user": "u1"}
    shape, admission = await admit_body(body, settings, counter)
    for key in ("temperature", "top_p", "seed", "user"):
        assert admission.backend_body[key] == body[key]


async def test_reject_mode_refuses_over_cap(counter: TokenCounter) -> None:
    settings = Settings(limits=LimitsSettings(on_max_tokens_over="reject"))
    error = await refusal({"messages": HELLO, "max_tokens": 1025}, settings, counter)
    assert (status_of(error), error.code) == (400, "max_tokens_too_large")


async def test_reject_mode_names_max_completion_tokens_when_the_client_used_it(
    counter: TokenCounter,
) -> None:
    settings = Settings(limits=LimitsSettings(on_max_tokens_over="reject"))
    error = await refusal({"messages": HELLO, "max_completion_tokens": 1025}, settings, counter)
    assert error.param == "max_completion_tokens"


async def test_context_window_refusal(counter: TokenCounter) -> None:
    settings = Settings(limits=LimitsSettings(context_window=100))
    error = await refusal({"messages": HELLO, "max_tokens": 92}, settings, counter)
    assert (status_of(error), error.code) == (400, "context_length_exceeded")
    # 9 + 91 fills the window exactly: admitted.
    shape, admission = await admit_body({"messages": HELLO, "max_tokens": 91}, settings, counter)
    assert admission.backend_body["max_tokens"] == 91


async def test_default_is_fitted_to_the_context_window(counter: TokenCounter) -> None:
    settings = Settings(limits=LimitsSettings(context_window=100))
    shape, admission = await admit_body({"messages": HELLO}, settings, counter)
    assert admission.backend_body["max_tokens"] == 91


# --- stream options -----------------------------------------------------------------------


async def test_stream_asks_the_backend_for_usage(settings: Settings, counter: TokenCounter) -> None:
    shape, admission = await admit_body({"messages": HELLO, "stream": True}, settings, counter)
    assert shape.stream is True
    assert admission.backend_body["stream_options"] == {"include_usage": True}
    assert shape.client_wants_usage is False


async def test_stream_keeps_other_stream_options(settings: Settings, counter: TokenCounter) -> None:
    body = {"messages": HELLO, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    shape, admission = await admit_body(body, settings, counter)
    assert admission.backend_body["stream_options"] == {
        "continuous_usage_stats": True,
        "include_usage": True,
    }
    assert shape.client_wants_usage is False


async def test_client_that_asked_for_usage_wants_it(
    settings: Settings, counter: TokenCounter
) -> None:
    body = {"messages": HELLO, "stream": True, "stream_options": {"include_usage": True}}
    shape, admission = await admit_body(body, settings, counter)
    assert shape.client_wants_usage is True
    assert admission.backend_body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("include_usage", [False, None, "true", 1])
async def test_only_include_usage_true_counts_as_asking(
    settings: Settings, counter: TokenCounter, include_usage: Any
) -> None:
    body = {"messages": HELLO, "stream": True, "stream_options": {"include_usage": include_usage}}
    shape, admission = await admit_body(body, settings, counter)
    assert shape.client_wants_usage is False
    assert admission.backend_body["stream_options"]["include_usage"] is True


@pytest.mark.parametrize("stream", [False, None])
async def test_no_stream_adds_no_stream_options(
    settings: Settings, counter: TokenCounter, stream: Any
) -> None:
    shape, admission = await admit_body({"messages": HELLO, "stream": stream}, settings, counter)
    assert shape.stream is False
    assert "stream_options" not in admission.backend_body


async def test_stream_absent_is_not_a_stream(settings: Settings, counter: TokenCounter) -> None:
    shape, admission = await admit_body({"messages": HELLO}, settings, counter)
    assert shape.stream is False
    assert "stream_options" not in admission.backend_body


# --- completions ----------------------------------------------------------------------------


async def test_completions_require_a_prompt(settings: Settings, counter: TokenCounter) -> None:
    error = await refusal({"model": "m", "messages": HELLO}, settings, counter, COMPLETION)
    assert (status_of(error), error.code, error.param) == (400, "invalid_request", "prompt")


async def test_completions_with_a_string_prompt(settings: Settings, counter: TokenCounter) -> None:
    body = {"prompt": "hello world", "max_tokens": 20, "stream": True}
    shape, admission = await admit_body(body, settings, counter, COMPLETION)
    assert shape.prompt_tokens == 2  # no chat overhead
    assert admission.backend_body["max_tokens"] == 20
    assert admission.backend_body["stream_options"] == {"include_usage": True}


async def test_completions_get_the_default_max_tokens(
    settings: Settings, counter: TokenCounter
) -> None:
    shape, admission = await admit_body({"prompt": [1, 2, 3]}, settings, counter, COMPLETION)
    assert shape.prompt_tokens == 3
    assert admission.backend_body["max_tokens"] == 256


async def test_chat_requires_messages(settings: Settings, counter: TokenCounter) -> None:
    error = await refusal({"prompt": "hello"}, settings, counter)
    assert (status_of(error), error.param) == (400, "messages")


# --- the lane follows the budget --------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "max_tokens", "lane"),
    [
        (1, 256, "interactive"),
        (2, 128, "interactive"),
        (3, 128, "bulk"),
        (1, 257, "bulk"),
        (16, 16, "interactive"),
        (16, 17, "bulk"),
    ],
)
async def test_lane_follows_n_times_max_tokens(
    settings: Settings, counter: TokenCounter, n: int, max_tokens: int, lane: str
) -> None:
    body = {"messages": HELLO, "n": n, "max_tokens": max_tokens}
    shape, admission = await admit_body(body, settings, counter)
    assert admission.budget.total == n * max_tokens
    assert admission.lane.name == lane


async def test_lane_follows_the_prompt_count_of_a_batch(
    settings: Settings, counter: TokenCounter
) -> None:
    _, one = await admit_body({"prompt": ["a"], "max_tokens": 200}, settings, counter, COMPLETION)
    _, two = await admit_body(
        {"prompt": ["a", "b"], "max_tokens": 200}, settings, counter, COMPLETION
    )
    assert (one.lane.name, one.budget.total) == ("interactive", 200)
    assert (two.lane.name, two.budget.total) == ("bulk", 400)


async def test_lane_follows_the_clamped_budget(counter: TokenCounter) -> None:
    settings = Settings(limits=LimitsSettings(max_output_tokens=256, default_max_tokens=256))
    shape, admission = await admit_body(
        {"messages": HELLO, "max_tokens": 100_000}, settings, counter
    )
    assert admission.budget.max_tokens == 256
    assert admission.lane.name == "interactive"


async def test_long_prompt_goes_to_bulk(settings: Settings, counter: TokenCounter) -> None:
    body = {"messages": [{"role": "user", "content": "hello " * 1100}], "max_tokens": 10}
    shape, admission = await admit_body(body, settings, counter)
    assert shape.prompt_tokens > 1024
    assert admission.lane.name == "bulk"


async def test_no_lane_admits_is_413(counter: TokenCounter) -> None:
    settings = Settings(lanes=[LaneSettings(name="only", max_prompt_tokens=5)])
    error = await refusal({"messages": HELLO}, settings, counter)
    assert (status_of(error), error.code, error.param) == (413, "prompt_too_long", "messages")
    error = await refusal({"prompt": "a b c d e f g h"}, settings, counter, COMPLETION)
    assert (status_of(error), error.code, error.param) == (413, "prompt_too_long", "prompt")


async def test_prompt_over_the_cap_is_413(counter: TokenCounter) -> None:
    settings = Settings(limits=LimitsSettings(max_prompt_tokens=8))
    error = await refusal({"messages": HELLO}, settings, counter)
    assert (status_of(error), error.code) == (413, "prompt_too_long")


async def test_completions_prompt_over_the_cap_names_prompt(counter: TokenCounter) -> None:
    settings = Settings(limits=LimitsSettings(max_prompt_tokens=8))
    error = await refusal({"prompt": list(range(9))}, settings, counter, COMPLETION)
    assert (status_of(error), error.code, error.param) == (413, "prompt_too_long", "prompt")


async def test_context_window_applies_to_each_prompt_of_a_batch(counter: TokenCounter) -> None:
    settings = Settings(limits=LimitsSettings(context_window=1000))
    prompt = [list(range(600)), list(range(600))]  # two prompts of 600 tokens
    shape, admission = await admit_body(
        {"prompt": prompt, "max_tokens": 100}, settings, counter, COMPLETION
    )
    assert admission.budget.max_tokens == 100


# --- wrong types ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        pytest.param({"stream": "yes"}, "stream", id="stream-a-string"),
        pytest.param({"stream": 1}, "stream", id="stream-a-number"),
        pytest.param({"model": 5}, "model", id="model-a-number"),
        pytest.param({"model": ["m"]}, "model", id="model-a-list"),
        pytest.param(
            {"stream_options": "include_usage"}, "stream_options", id="stream-options-a-string"
        ),
        pytest.param({"stream_options": [True]}, "stream_options", id="stream-options-a-list"),
        pytest.param(
            {"stream": True, "stream_options": True}, "stream_options", id="stream-options-true"
        ),
        pytest.param({"n": True}, "n", id="n-a-bool"),
        pytest.param({"n": 17}, "n", id="n-over-max"),
        pytest.param({"max_tokens": "5"}, "max_tokens", id="max-tokens-a-string"),
        pytest.param(
            {"max_completion_tokens": False},
            "max_completion_tokens",
            id="max-completion-tokens-a-bool",
        ),
        pytest.param({"messages": "hello"}, "messages", id="messages-a-string"),
    ],
)
async def test_wrong_types_are_400(
    settings: Settings, counter: TokenCounter, changes: dict[str, Any], param: str
) -> None:
    error = await refusal({"messages": HELLO, **changes}, settings, counter)
    assert (status_of(error), error.code, error.param) == (400, "invalid_request", param)


# --- the measured shape --------------------------------------------------------------------


async def test_shape_records_what_the_client_asked(
    settings: Settings, counter: TokenCounter
) -> None:
    body = {"messages": HELLO, "n": 3, "max_completion_tokens": 50, "max_tokens": None}
    shape = await CHAT.measure(body, settings.limits, counter)
    assert shape.prompt_param == "messages"
    assert (shape.n, shape.prompt_count) == (3, 1)
    assert shape.requested_max_tokens == 50
    assert shape.max_tokens_fields == ("max_completion_tokens",)
    assert shape.body is body


async def test_completions_read_only_max_tokens(settings: Settings, counter: TokenCounter) -> None:
    body = {"prompt": ["a", "b", "c"], "max_completion_tokens": 50}
    shape = await COMPLETION.measure(body, settings.limits, counter)
    assert shape.requested_max_tokens is None
    assert shape.max_tokens_fields == ()
    assert shape.prompt_count == 3
