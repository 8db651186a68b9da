"""The prefix cache as a data structure, and the token ids it is keyed by.

Chained hashes name a whole prefix; the LRU keeps its bound, evicts least recently
used first (a prefix's tail before its head) and never evicts a pinned block. The
prompt's token ids must make a conversation's next turn start with the previous
turn's ids exactly, or no real multi-turn prompt would ever hit.
"""

from __future__ import annotations

import pytest

from gateway.tools.simulator import SimulatorConfig
from gateway.tools.simulator import tokens as sim_tokens
from gateway.tools.simulator.prefix_cache import PrefixCache, block_hashes, prompt_blocks
from tests.tools.simulator.test_tokens import CHATS, PROMPTS

B = 4  # tokens per block in these tests


def test_same_prefix_same_hashes_and_a_change_moves_every_later_hash() -> None:
    base = list(range(100, 120))  # 5 full blocks of 4
    assert block_hashes(base, B) == block_hashes(list(base), B)
    assert len(block_hashes(base, B)) == 5
    assert len(set(block_hashes(base, B))) == 5

    changed = list(base)
    changed[B + 1] = 999  # one token inside block 2 (index 1)
    before, after = block_hashes(base, B), block_hashes(changed, B)
    assert after[0] == before[0]
    assert all(a != b for a, b in zip(after[1:], before[1:], strict=True))

    # The same block content at another position, after another prefix: another name.
    shifted = [7, 7, 7, 7, *base[:B]]
    assert block_hashes(shifted, B)[1] != before[0]


def test_only_full_blocks_are_hashed_and_a_chain_continues_from_its_parent() -> None:
    ids = list(range(10))  # 2 full blocks of 4, and 2 tokens over
    hashes = block_hashes(ids, B)
    assert len(hashes) == 2
    assert block_hashes(ids[:3], B) == []
    assert block_hashes(ids[:8] + [42, 43], B) == hashes  # the partial block is not named

    whole = block_hashes(list(range(16)), B)
    assert block_hashes(list(range(8, 16)), B, parent=whole[1]) == whole[2:]

    blocks = prompt_blocks(ids, B)
    assert (blocks.tokens, blocks.hashes, blocks.tail) == (10, tuple(hashes), (8, 9))


def test_block_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        PrefixCache(0)
    with pytest.raises(ValueError):
        SimulatorConfig(block_tokens=0)
    with pytest.raises(ValueError):
        SimulatorConfig(prefix_cache_blocks=0)


def _served(cache: PrefixCache, blocks: list[bytes]) -> None:
    """What a sequence does to the cache: look up, fill the rest, finish."""
    hits = cache.acquire(blocks)
    for block in blocks[hits:]:
        assert cache.insert(block)
    cache.release(blocks)


def test_the_lru_keeps_its_bound_and_evicts_the_least_recently_used() -> None:
    cache = PrefixCache(capacity_blocks=3, block_tokens=B)
    a, b, c, d = (bytes([n]) for n in b"abcd")
    for block in (a, b, c):
        _served(cache, [block])
    assert len(cache) == 3
    _served(cache, [a])  # a is used again: b is now the least recently used
    _served(cache, [d])
    assert len(cache) == 3
    assert (a in cache, b in cache, c in cache, d in cache) == (True, False, True, True)
    assert cache.evictions == 1
    _served(cache, [b])  # b again: c goes
    assert c not in cache and len(cache) == 3


def test_a_prefix_is_evicted_tail_first() -> None:
    cache = PrefixCache(capacity_blocks=3, block_tokens=B)
    head, middle, tail = block_hashes(list(range(12)), B)
    _served(cache, [head, middle, tail])
    assert cache.insert(b"other")  # evicts the tail, so the rest of the prefix still hits
    assert tail not in cache
    assert cache.cached_prefix([head, middle, tail]) == 2


def test_pinned_blocks_are_never_evicted() -> None:
    cache = PrefixCache(capacity_blocks=2, block_tokens=B)
    running = [b"r1", b"r2"]
    for block in running:
        assert cache.insert(block)  # pinned by the running sequence
    assert cache.pinned_blocks == 2
    assert not cache.insert(b"new")  # full of pinned blocks: not cached, nothing evicted
    assert all(block in cache for block in running) and b"new" not in cache

    cache.release(running[1:])  # half the prefix unpinned (another sequence's share, say)
    assert cache.insert(b"new")
    assert running[0] in cache and running[1] not in cache
    assert cache.pinned_blocks == 2  # r1, and "new" pinned by its inserter


def test_a_block_pinned_twice_stays_pinned_until_both_release() -> None:
    cache = PrefixCache(capacity_blocks=1, block_tokens=B)
    assert cache.insert(b"x")
    assert cache.acquire([b"x", b"y"]) == 1  # a second sequence hits it
    cache.release([b"x"])
    assert not cache.insert(b"z")  # still pinned by the other
    cache.release([b"x"])
    cache.release([b"x"])  # an extra release changes nothing
    assert cache.insert(b"z") and b"x" not in cache


def test_lookup_stops_at_the_first_missing_block() -> None:
    cache = PrefixCache(capacity_blocks=8, block_tokens=B)
    first, second, third = block_hashes(list(range(12)), B)
    _served(cache, [first, third])
    assert cache.acquire([first, second, third]) == 1
    assert cache.pinned_blocks == 1


@pytest.fixture(scope="module")
def counter() -> sim_tokens.PromptCounter:
    counter = sim_tokens.PromptCounter(sim_tokens.load_encoding())
    yield counter
    counter.close()


@pytest.mark.parametrize(("messages", "tools"), CHATS)
def test_chat_token_ids_are_as_many_as_the_count(counter, messages, tools) -> None:
    parts = sim_tokens.chat_prompt_parts(messages, tools)
    assert len(counter.token_ids(parts)) == counter.count(parts)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_token_ids_are_as_many_as_the_count(counter, prompt) -> None:
    parts = sim_tokens.completion_prompt_parts(prompt)
    assert len(counter.token_ids(parts)) == counter.count(parts)


def test_token_id_prompts_keep_their_ids(counter) -> None:
    assert counter.token_ids(sim_tokens.completion_prompt_parts([5, 6, 7])) == [5, 6, 7]
    assert counter.token_ids(sim_tokens.completion_prompt_parts([[1, 2], [3]])) == [1, 2, 3]


def test_the_priming_is_the_head_of_the_assistant_message(counter) -> None:
    assert counter.encoding.encode_ordinary("assistant") == [sim_tokens.ASSISTANT_ROLE_ID]


def test_the_next_turn_starts_with_the_previous_turns_ids_and_reply(counter) -> None:
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    reply = "Because the sky is blue "
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "Ok"}]
    ids1 = counter.token_ids(sim_tokens.chat_prompt_parts(turn1))
    ids2 = counter.token_ids(sim_tokens.chat_prompt_parts(turn2))
    reply_ids = counter.encoding.encode_ordinary(reply)
    assert ids2[: len(ids1) + len(reply_ids)] == ids1 + reply_ids
    assert ids2[len(ids1) + len(reply_ids)] == sim_tokens.MESSAGE_END

    other_system = [{"role": "system", "content": "Be long."}, *turn2[1:]]
    ids3 = counter.token_ids(sim_tokens.chat_prompt_parts(other_system))
    assert ids3[:2] == ids2[:2] and ids3[:10] != ids2[:10]


def test_images_get_ids_of_their_own(counter) -> None:
    def ids(url: str) -> list[int]:
        image = {"type": "image_url", "image_url": {"url": url}}
        return counter.token_ids(
            sim_tokens.chat_prompt_parts([{"role": "user", "content": [image]}])
        )

    assert ids("http://a/1.png") == ids("http://a/1.png")
    assert ids("http://a/1.png") != ids("http://a/2.png")


@pytest.mark.parametrize("ratio", [0.5, 0.77, 1.0, 1.5, 2.3])
def test_backend_ids_keep_a_shared_prefix_shared(ratio: float) -> None:
    config = SimulatorConfig(token_ratio=ratio)
    short, long = list(range(1000, 1050)), list(range(1000, 1080))
    assert len(config.backend_token_ids(long)) == config.backend_tokens(len(long))
    short_ids = config.backend_token_ids(short)
    assert config.backend_token_ids(long)[: len(short_ids)] == short_ids


def test_backend_prompt_truncates_and_skips_hashing_with_the_cache_off() -> None:
    config = SimulatorConfig(block_tokens=4)
    ids = list(range(10))
    assert config.backend_prompt(ids, keep_last=6).hashes == tuple(block_hashes(ids[-6:], 4))
    assert config.backend_prompt(ids, keep_last=6).tokens == 6
    assert config.backend_prompt(ids, keep_last=50).tokens == 10
    off = SimulatorConfig(prefix_cache=False).backend_prompt(ids)
    assert (off.tokens, off.hashes) == (10, ())
