"""What a backend probably has cached: an LRU of the blocks sent to it, bounded in tokens."""

from __future__ import annotations

from gateway.admission.prefix import PromptPrefix, prefix_of
from gateway.upstream.prefix_index import PrefixIndex


def blocks(*names: str, tokens: int = 100) -> PromptPrefix:
    """A prompt of one block per name (each text long enough to be a block)."""
    texts = [f"{name}: " + "some text of this block " * 4 for name in names]
    prefix = prefix_of(texts, [tokens] * len(texts))
    assert prefix is not None
    return prefix


def test_the_longest_run_of_leading_blocks_sent_is_matched() -> None:
    index = PrefixIndex()
    index.add(blocks("sys", "q1"))
    assert index.matched_tokens(blocks("sys", "q1", "a1", "q2")) == 200
    assert index.matched_tokens(blocks("sys", "other")) == 100
    assert index.matched_tokens(blocks("another system")) == 0
    # A block found later in a prompt whose start differs is no prefix.
    assert index.matched_tokens(blocks("x", "sys")) == 0


def test_the_bound_evicts_the_least_recent_chain_from_its_end() -> None:
    index = PrefixIndex(capacity_tokens=400)
    old, new = blocks("a1", "a2", "a3"), blocks("b1", "b2")
    index.add(old)
    index.add(new)
    assert index.tokens == 400
    # a3 (the end of the oldest chain) went first: what is left of it is still a prefix.
    assert index.matched_tokens(old) == 200
    assert index.matched_tokens(new) == 200
    index.add(blocks("c1", "c2"))
    assert index.matched_tokens(old) == 0
    assert index.matched_tokens(new) == 200
    assert index.tokens <= 400


def test_sending_a_prefix_again_refreshes_it() -> None:
    index = PrefixIndex(capacity_tokens=300)
    hot = blocks("hot")
    index.add(hot)
    for n in range(10):
        index.add(blocks(f"cold{n}"))
        index.add(hot)
    assert index.matched_tokens(hot) == 100
    assert index.tokens <= 300


def test_a_prefix_larger_than_the_bound_keeps_its_start() -> None:
    index = PrefixIndex(capacity_tokens=250)
    long = blocks("p1", "p2", "p3", "p4")
    index.add(long)
    assert index.matched_tokens(long) == 200


def test_clear_forgets_everything() -> None:
    index = PrefixIndex()
    index.add(blocks("a"))
    index.clear()
    assert index.tokens == 0 and len(index) == 0 and index.matched_tokens(blocks("a")) == 0
