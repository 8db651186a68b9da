"""A prompt's chained block hashes: equal prefixes hash equal, a change moves every later hash."""

from __future__ import annotations

from gateway.admission.prefix import CHUNK_CHARS, prefix_of
from gateway.admission.tokens import TokenCounter, chat_prompt_parts
from tests.conftest import encoding

SYSTEM = "Be brief, precise and kind in every answer."
QUESTION = "What is the tallest mountain in the world?"
REPLY = "Mount Everest, at 8849 metres above sea level."


def test_a_shared_prefix_has_the_same_leading_hashes() -> None:
    turn1 = prefix_of(["system", SYSTEM, "user", QUESTION], [1, 10, 1, 10])
    turn2 = prefix_of(
        ["system", SYSTEM, "user", QUESTION, "assistant", REPLY], [1, 10, 1, 10, 1, 12]
    )
    assert turn1 is not None and turn2 is not None
    # A role joins the text after it: blocks are [system + SYSTEM], [user + QUESTION], ...
    assert turn1.tokens == (11, 22)
    assert turn2.hashes[:2] == turn1.hashes
    assert turn2.tokens == (11, 22, 35)
    assert turn2.covered(2) == 22 and turn2.covered(0) == 0


def test_short_texts_make_no_block_of_their_own() -> None:
    # Every chat prompt starts with a role: alone it would match everywhere.
    one = prefix_of(["user", "Hi"], [1, 1])
    two = prefix_of(["user", "Hello"], [1, 1])
    assert one is not None and two is not None
    assert len(one.hashes) == 1 and one.hashes[0] != two.hashes[0]


def test_a_change_in_one_block_changes_every_later_hash() -> None:
    one = prefix_of([SYSTEM, QUESTION, REPLY, QUESTION], [10, 10, 12, 10])
    two = prefix_of([SYSTEM, QUESTION.upper(), REPLY, QUESTION], [10, 10, 12, 10])
    assert one is not None and two is not None
    assert one.hashes[0] == two.hashes[0]
    assert all(x != y for x, y in zip(one.hashes[1:], two.hashes[1:], strict=True))


def test_a_long_text_is_cut_into_chunks_with_its_tokens_pro_rata() -> None:
    document = "x" * (CHUNK_CHARS * 2 + CHUNK_CHARS // 2)
    prefix = prefix_of([document], [500])
    assert prefix is not None
    assert len(prefix.hashes) == 3
    assert prefix.tokens == (200, 400, 500)
    # Another document with the same first chunk and a different rest.
    other = prefix_of([document[:CHUNK_CHARS] + "y" * CHUNK_CHARS], [400])
    assert other is not None
    assert other.hashes[0] == prefix.hashes[0] and other.hashes[1] != prefix.hashes[1]


def test_no_text_no_prefix() -> None:
    assert prefix_of([], []) is None


def test_the_counter_gives_a_chat_prompt_its_prefix() -> None:
    counter = TokenCounter(encoding())
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    first = counter.measure(chat_prompt_parts([system, {"role": "user", "content": "Hi"}]))
    later = counter.measure(
        chat_prompt_parts(
            [
                system,
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello, how can I help?"},
                {"role": "user", "content": "Tell me more."},
            ]
        )
    )
    assert first.prefix is not None and later.prefix is not None
    # The short last message ("user", "Hi") is a tail block of its own in the first
    # prompt (an exact repeat matches it); in the next turn it joins the reply's block.
    shared = len(first.prefix.hashes) - 1
    assert shared == 1
    assert later.prefix.hashes[:shared] == first.prefix.hashes[:shared]
    assert later.prefix.hashes[shared] != first.prefix.hashes[shared]
    # The counted tokens of the texts (the per-message template tokens are not in blocks).
    assert first.prefix.tokens[-1] <= first.total
    assert later.prefix.covered(shared) == first.prefix.tokens[0] > 100
    counter.close()
