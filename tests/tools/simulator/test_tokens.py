"""The simulator's own token count agrees with the gateway's, counted independently.

The simulator does not import the gateway's counter (it is the witness the
gateway is tested against), so this is where the two are held side by side:
the same prompts give the same numbers.
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.admission import tokens as gateway_tokens
from gateway.tools.simulator import tokens as sim_tokens
from gateway.tools.simulator.errors import SimulatorError
from tests.conftest import encoding

CHATS: list[tuple[list[dict[str, Any]], Any]] = [
    ([{"role": "user", "content": "Hello there!"}], None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}], None),
    ([{"role": "user", "name": "ada", "content": "hi"}], None),
    ([{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url"}]}], None),
    (
        [
            {"role": "assistant", "content": None,
             "tool_calls": [{"function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        ],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    ),
]  # fmt: skip
PROMPTS: list[Any] = ["Once upon a time", ["a b", "c d e"], [1, 2, 3], [[1, 2], [3]]]


@pytest.fixture(scope="module")
def counters() -> Any:
    sim = sim_tokens.PromptCounter(sim_tokens.load_encoding())
    gateway = gateway_tokens.TokenCounter(encoding())
    yield sim, gateway
    sim.close()
    gateway.close()


@pytest.mark.parametrize(("messages", "tools"), CHATS)
def test_chat_counts_match_the_gateway(counters: Any, messages: Any, tools: Any) -> None:
    sim, gateway = counters
    expected = gateway.count(gateway_tokens.chat_prompt_parts(messages, tools))
    assert sim.count(sim_tokens.chat_prompt_parts(messages, tools)) == expected


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_counts_match_the_gateway(counters: Any, prompt: Any) -> None:
    sim, gateway = counters
    expected = gateway.count(gateway_tokens.completion_prompt_parts(prompt))
    assert sim.count(sim_tokens.completion_prompt_parts(prompt)) == expected


async def test_big_prompts_are_counted_off_the_loop_to_the_same_number(counters: Any) -> None:
    sim, gateway = counters
    text = "word " * (sim_tokens.OFFLOAD_MIN_CHARS // 4)
    parts = sim_tokens.completion_prompt_parts(text)
    assert await sim.count_async(parts) == sim.count(parts)
    assert sim.count(parts) == gateway.count(gateway_tokens.completion_prompt_parts(text))


def test_the_chat_rule_is_openais() -> None:
    """3 per message, 1 per name, 3 to prime the reply, on top of the texts' tokens."""
    sim = sim_tokens.PromptCounter(sim_tokens.load_encoding())
    try:
        texts = ["user", "ada", "hi"]
        expected = sum(len(sim.encoding.encode_ordinary(t)) for t in texts) + 3 + 1 + 3
        parts = sim_tokens.chat_prompt_parts([{"role": "user", "name": "ada", "content": "hi"}])
        assert sim.count(parts) == expected
    finally:
        sim.close()


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "video"}]}], "messages[0].content[0].type"),
        ([{"role": "user", "content": "x", "name": 1}], "messages[0].name"),
    ],
)
def test_malformed_chats_get_a_400_naming_the_field(messages: Any, param: str) -> None:
    with pytest.raises(SimulatorError) as refusal:
        sim_tokens.chat_prompt_parts(messages)
    assert (refusal.value.status, refusal.value.code) == (400, "invalid_request")
    assert refusal.value.param == param
    error = refusal.value.body()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]
