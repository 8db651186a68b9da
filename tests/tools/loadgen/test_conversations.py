"""Multi-turn planning: seeded, sizes and times as the mix says, histories that grow by replies."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import pytest

from gateway.admission.tokens import (
    REPLY_PRIMING_TOKENS,
    TOKENS_PER_MESSAGE,
    TokenCounter,
    chat_prompt_parts,
)
from gateway.config import LimitsSettings
from gateway.tools.loadgen import (
    MULTI_TURN,
    MULTI_TURN_HOT,
    NAMED_CONVERSATION_MIXES,
    ConversationMix,
    Dialogue,
    RequestResult,
    RunResult,
    add_arguments,
    format_conversation_tables,
    main,
    plan_conversations,
    summarize_run,
    summarize_turns,
)
from gateway.tools.loadgen.conversations import FIRST_TURN, LATER_TURN, ONE_OFF, conversation_id
from tests.conftest import encoding

SMALL = dataclasses.replace(MULTI_TURN, conversations=12)


def gateway_count(messages: list[dict[str, str]]) -> int:
    """Prompt tokens as the gateway counts a chat of these messages."""
    counter = TokenCounter(encoding())
    try:
        return counter.count(chat_prompt_parts(messages))
    finally:
        counter.close()


def test_named_mixes() -> None:
    assert set(NAMED_CONVERSATION_MIXES) == {"multi-turn", "multi-turn-hot", "agent"}
    assert MULTI_TURN.tenants == 8 and MULTI_TURN_HOT.tenants == 1
    assert 32 <= MULTI_TURN.conversations <= 64
    assert MULTI_TURN.system_tokens == (500, 2000) and MULTI_TURN.turns == (3, 8)
    assert 500 <= MULTI_TURN_HOT.system_tokens[0] <= MULTI_TURN_HOT.system_tokens[1] <= 2000
    with pytest.raises(ValueError, match="turns"):
        dataclasses.replace(MULTI_TURN, turns=(0, 3))
    with pytest.raises(ValueError, match="one_off_share"):
        dataclasses.replace(MULTI_TURN, one_off_share=1.0)
    with pytest.raises(ValueError, match="think_s"):
        dataclasses.replace(MULTI_TURN, think_s=float("nan"))


def test_an_agents_history_stays_under_the_default_prompt_cap() -> None:
    """The agent mix's longest history (every turn at its largest) is still admitted."""
    agent = NAMED_CONVERSATION_MIXES["agent"]
    per_turn = agent.user_tokens[1] + agent.max_tokens[1] + 2 * TOKENS_PER_MESSAGE
    longest = agent.system_tokens[1] + agent.turns[1] * per_turn + REPLY_PRIMING_TOKENS
    assert agent.user_tokens[0] >= 300 and agent.turns[0] >= 6  # long histories, its point
    assert longest < LimitsSettings().max_prompt_tokens
    plan = plan_conversations(dataclasses.replace(agent, conversations=4), seed=1)
    assert all(6 <= len(c.turns) <= 12 for c in plan.conversations)


def test_the_plan_is_seeded() -> None:
    one, again, other = (plan_conversations(SMALL, seed) for seed in (3, 3, 4))
    assert one == again  # texts included: the dataclasses compare every field
    assert one.to_json() == again.to_json()
    assert one.to_json() != other.to_json()
    assert [c.system for c in one.conversations] != [c.system for c in other.conversations]


def test_sizes_turns_and_tenants_follow_the_mix() -> None:
    plan = plan_conversations(MULTI_TURN, seed=1)
    assert len(plan.conversations) == MULTI_TURN.conversations
    systems: dict[int, str] = {}
    for conversation in plan.conversations:
        assert 0 <= conversation.tenant < MULTI_TURN.tenants
        # Conversations of one tenant share its system prompt, word for word.
        assert systems.setdefault(conversation.tenant, conversation.system) == conversation.system
        assert 500 <= conversation.system_tokens <= 2000
        assert 3 <= len(conversation.turns) <= 8
        assert [t.turn for t in conversation.turns] == list(range(1, len(conversation.turns) + 1))
        for turn in conversation.turns:
            assert 100 <= turn.user_tokens <= 400
            assert 50 <= turn.max_tokens <= 200
            # The planned size is the gateway's own count of the text.
            assert gateway_count([{"role": "user", "content": turn.user}]) == turn.user_tokens + 7
    assert len(set(systems.values())) == len(systems) >= 6  # distinct prompts per tenant
    hot = plan_conversations(MULTI_TURN_HOT, seed=1)
    assert len({c.system for c in hot.conversations}) == 1


def test_session_ids_are_per_conversation_and_stable() -> None:
    plan = plan_conversations(SMALL, seed=7)
    ids = [c.id for c in plan.conversations]
    assert len(set(ids)) == len(ids)
    assert ids == [conversation_id(7, n) for n in range(len(ids))]
    assert ids != [c.id for c in plan_conversations(SMALL, seed=8).conversations]
    indices = [t.index for c in plan.conversations for t in c.turns] + [
        p.index for p in plan.one_offs
    ]
    assert sorted(indices) == list(range(plan.requests))  # request ids never collide


def test_think_times_and_starts() -> None:
    mix = dataclasses.replace(MULTI_TURN, conversations=400, think_s=2.0, start_window_s=40.0)
    plan = plan_conversations(mix, seed=2)
    thinks = [t.think_s for c in plan.conversations for t in c.turns]
    assert all(c.turns[0].think_s == 0 for c in plan.conversations)
    later = [t.think_s for c in plan.conversations for t in c.turns[1:]]
    assert all(t > 0 for t in later) and len(thinks) > 1000
    assert statistics.mean(later) == pytest.approx(2.0, rel=0.1)  # exponential of mean 2
    assert statistics.median(later) == pytest.approx(2.0 * 0.693, rel=0.15)
    starts = [c.start_s for c in plan.conversations]
    assert starts == sorted(starts) and starts[0] > 0
    assert starts[-1] == pytest.approx(40.0, rel=0.15)  # they arrive over the window
    scaled = plan_conversations(mix.scaled(0.1), seed=2)
    assert [c.start_s for c in scaled.conversations] == pytest.approx([s * 0.1 for s in starts])
    assert [t.think_s for c in scaled.conversations for t in c.turns] == pytest.approx(
        [t * 0.1 for t in thinks]
    )
    with pytest.raises(ValueError, match="time scale"):
        mix.scaled(0)


def test_one_offs_are_a_fifth_of_the_requests() -> None:
    plan = plan_conversations(MULTI_TURN, seed=5)
    turns = sum(len(c.turns) for c in plan.conversations)
    assert plan.requests == turns + len(plan.one_offs)
    assert len(plan.one_offs) / plan.requests == pytest.approx(0.2, abs=0.01)
    offsets = [p.at_s for p in plan.one_offs]
    assert offsets == sorted(offsets) and offsets[-1] < 60 + 7 * 5.0  # window + 7 thinks
    for planned in plan.one_offs:
        assert planned.cls == ONE_OFF and planned.conversation is None and planned.turn is None
        assert 200 <= planned.prompt_tokens <= 2000
        assert gateway_count([{"role": "user", "content": planned.prompt}]) == planned.prompt_tokens
    assert len({p.prompt for p in plan.one_offs}) == len(plan.one_offs)
    none = plan_conversations(dataclasses.replace(SMALL, one_off_share=0.0), seed=5)
    assert none.one_offs == ()


def test_the_history_grows_by_the_reply() -> None:
    conversation = plan_conversations(SMALL, seed=9).conversations[0]
    dialogue = Dialogue(conversation, run_tag="123456")
    assert dialogue.messages[0]["role"] == "system"
    assert dialogue.messages[0]["content"].startswith("Session 123456 ")  # the run's tag
    first, second = conversation.turns[0], conversation.turns[1]

    sent = dialogue.ask(first)
    assert [m["role"] for m in sent] == ["system", "user"]
    assert dialogue.prompt_tokens == gateway_count(sent)
    request = dialogue.request(first, at_s=1.5)
    assert (request.cls, request.turn, request.conversation) == (FIRST_TURN, 1, conversation.id)
    assert request.prompt_tokens == gateway_count(sent) and request.at_s == 1.5

    reply = "Sure: the quarterly numbers grew, mostly in the north. Anything else?"
    dialogue.answer(reply)
    sent = dialogue.ask(second)
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[2] == {"role": "assistant", "content": reply}
    assert dialogue.prompt_tokens == gateway_count(sent)
    assert dialogue.request(second, at_s=3.0).cls == LATER_TURN

    # A failed turn leaves no trace: the history stays user/assistant alternating.
    dialogue.withdraw(second)
    assert [m["role"] for m in dialogue.messages] == ["system", "user", "assistant"]
    assert dialogue.prompt_tokens == gateway_count(dialogue.messages)
    with pytest.raises(RuntimeError):
        dialogue.answer("a reply to nothing")
    sent.append({"role": "user", "content": "more"})  # the caller's list, not the history
    assert len(dialogue.messages) == 3


def _result(index: int, cls: str, turn: int | None, ttft: float, **extra: Any) -> RequestResult:
    return RequestResult(
        index=index,
        cls=cls,
        prompt_tokens=1000,
        max_tokens=10,
        request_id=str(index),
        scheduled_ms=0,
        status=200,
        ttft_ms=ttft,
        e2e_ms=ttft + 100,
        completion_tokens=10,
        turn=turn,
        conversation=None if turn is None else "c",
        **extra,
    )


def test_report_by_turn_with_hit_ratio() -> None:
    results = [
        _result(0, FIRST_TURN, 1, 900.0, cached_tokens=0),
        _result(1, LATER_TURN, 2, 100.0, cached_tokens=800),
        _result(2, LATER_TURN, 3, 200.0, cached_tokens=900),
        _result(3, ONE_OFF, None, 1000.0),
        RequestResult(4, LATER_TURN, 1000, 10, "4", 0, status=429, error_code="queue_full", turn=2),
    ]
    run = RunResult("http://x", results, wall_s=2.0)
    summary = summarize_run(run)
    later = summary[LATER_TURN]
    assert later["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert later["cache_hit_ratio"] == pytest.approx(1700 / 2000)
    assert summary[ONE_OFF]["cache_hit_ratio"] is None  # no usage said anything
    assert summary["all"]["ok_per_s"] == pytest.approx(4 / 2.0)
    assert summary["all"]["goodput_tok_s"] == pytest.approx(40 / 2.0)
    turns = summarize_turns(run)
    assert list(turns) == ["1", "2", "3"]
    assert turns["2"]["count"] == 2 and turns["2"]["ok"] == 1
    table = format_conversation_tables([run, run])
    assert "turn-2+" in table and "85%" in table and "429/queue_full=1" in table
    assert "side by side" in table
    assert summarize_turns(RunResult("http://x", results[3:4], 1.0)) == {}


@pytest.mark.parametrize(
    "argv",
    [
        ["--mix", "multi-turn", "--concurrency", "4"],
        ["--mix", "multi-turn", "--class", "a:1:10:4"],
        ["--conversations", "4"],
        ["--mix", "multi-turn", "--time-scale", "0"],
        ["--mix", "multi-turn", "--conversations", "0"],
    ],
)
def test_cli_refuses_what_a_multi_turn_mix_cannot_do(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert main(parser.parse_args(["--target", "http://127.0.0.1:9", *argv])) == 2
    assert capsys.readouterr().err.startswith("loadgen: ")


def test_mix_with_no_conversations_is_refused() -> None:
    with pytest.raises(ValueError):
        ConversationMix("x", conversations=0)
