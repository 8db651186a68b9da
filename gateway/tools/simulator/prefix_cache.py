"""The simulator's prefix cache: an LRU of KV blocks keyed by chained hashes, as vLLM's.

vLLM's automatic prefix caching (on by default in its V1 engine), SGLang's radix
tree, TGI 3's radix allocator and llama.cpp's `cache_prompt` all keep the KV of
prompts they have served, so a prompt that starts with a prefix they hold skips
that part of its prefill. That is what makes cache-aware routing worth seconds
of TTFT, so the witness the gateway is tested against has to have it.

The model is vLLM V1's: a prompt's token ids are cut into blocks of a fixed
number of tokens; block k is named by a hash over block k-1's hash and its own
tokens (chained), so equal names mean an equal prefix up to that block and only
a true shared prefix hits. Only full blocks are named and cached. A block a
running sequence uses is pinned; once no sequence uses it, it stays cached and
becomes evictable, least recently used first. Capacity is in blocks, pinned or
not, like the GPU's KV pool it stands for.

Pure data structure: no clock, no engine, no HTTP.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: The parent of a prompt's first block (vLLM seeds its chain with a fixed value too).
ROOT_HASH = b""
#: vLLM's default `--block-size` on GPUs.
DEFAULT_BLOCK_TOKENS = 16
_HASH_BYTES = 16


def block_hashes(
    token_ids: Sequence[int], block_tokens: int, parent: bytes = ROOT_HASH
) -> list[bytes]:
    """The chained hashes of the full blocks of `token_ids` (a partial last block has none).

    Block k's hash covers block k-1's hash and block k's tokens, so it names the whole
    prefix up to and including block k. `parent` continues a chain: the reply of a
    sequence is hashed on from its prompt's last full block.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    hashes: list[bytes] = []
    chained = parent
    full = len(token_ids) - len(token_ids) % block_tokens
    for start in range(0, full, block_tokens):
        block = array("q", token_ids[start : start + block_tokens]).tobytes()
        chained = hashlib.blake2b(chained + block, digest_size=_HASH_BYTES).digest()
        hashes.append(chained)
    return hashes


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A prompt as the engine sees it: its length, its full blocks' hashes, what follows them.

    No hashes: the prompt is not looked up or cached (the prefix cache is off).
    """

    tokens: int
    hashes: tuple[bytes, ...] = ()
    #: The token ids after the last full block: a reply's blocks continue from them.
    tail: tuple[int, ...] = ()


def prompt_blocks(token_ids: Sequence[int], block_tokens: int) -> PromptBlocks:
    """Cut a prompt into hashed full blocks and its leftover tail."""
    full = len(token_ids) - len(token_ids) % block_tokens
    return PromptBlocks(
        len(token_ids), tuple(block_hashes(token_ids, block_tokens)), tuple(token_ids[full:])
    )


class PrefixCache:
    """Cached KV blocks by hash, each with the number of running sequences that pin it.

    A pinned block (count > 0) is never evicted; an unpinned one waits in LRU order.
    Inserting into a full cache evicts the least recently used unpinned block, and
    when every block is pinned the new block is simply not cached (vLLM would have
    preempted a sequence instead; the simulator has no KV limit on running work).
    """

    def __init__(self, capacity_blocks: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.capacity_blocks = capacity_blocks
        self.block_tokens = block_tokens
        self._pins: dict[bytes, int] = {}
        #: Unpinned blocks, least recently used first.
        self._evictable: OrderedDict[bytes, None] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, block: object) -> bool:
        return block in self._pins

    @property
    def pinned_blocks(self) -> int:
        return len(self._pins) - len(self._evictable)

    def cached_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` are cached (stops at the first miss)."""
        count = 0
        for block in hashes:
            if block not in self._pins:
                break
            count += 1
        return count

    def acquire(self, hashes: Sequence[bytes]) -> int:
        """Pin the cached leading blocks of `hashes`; returns how many there were."""
        count = self.cached_prefix(hashes)
        for block in hashes[:count]:
            self._pin(block)
        return count

    def insert(self, block: bytes) -> bool:
        """Cache a block a running sequence has just filled, pinned by it.

        Already cached (another sequence filled the same prefix): pinned once more.
        Returns False when the cache is full of pinned blocks and the block was not kept.
        """
        if block in self._pins:
            self._pin(block)
            return True
        if len(self._pins) >= self.capacity_blocks:
            if not self._evictable:
                return False
            evicted, _ = self._evictable.popitem(last=False)
            del self._pins[evicted]
            self.evictions += 1
        self._pins[block] = 1
        return True

    def release(self, blocks: Iterable[bytes]) -> None:
        """Unpin a finished sequence's blocks; given in prompt order.

        They join the LRU end last block first, as vLLM frees them: the tail of a prefix
        is evicted before its head, whose loss would make every later block unreachable.
        """
        for block in reversed(list(blocks)):
            count = self._pins.get(block)
            if not count:  # not cached, or not pinned: nothing of this sequence's to undo
                continue
            if count > 1:
                self._pins[block] = count - 1
            else:
                self._pins[block] = 0
                self._evictable[block] = None

    def drop(self, blocks: Iterable[bytes]) -> None:
        """Unpin blocks an aborted sequence filled and uncache those no other sequence
        pins (an engine that keeps nothing of a prefill cut short)."""
        for block in blocks:
            count = self._pins.get(block)
            if not count:
                continue
            if count > 1:
                self._pins[block] = count - 1
            else:
                del self._pins[block]

    def _pin(self, block: bytes) -> None:
        count = self._pins[block]
        if count == 0:
            del self._evictable[block]
        self._pins[block] = count + 1
