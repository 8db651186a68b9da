"""What prompt prefixes a backend probably holds in its KV cache: the blocks sent to it.

The gateway cannot see an engine's cache, but it knows every prompt it sent
there. An LRU of the block hashes sent recently (`admission/prefix.py`),
bounded by the tokens they cover (the engine's cache is bounded too, and
evicts the least recently used), is a good guess of what is cached: the
longest run of a prompt's leading blocks found in it is the prefix the engine
can probably skip. A chain's blocks are touched from the last to the first, so
the first blocks are the freshest and eviction takes a chain from its end, as
an engine's does: what is left is still a prefix.
"""

from __future__ import annotations

from collections import OrderedDict

from gateway.admission.prefix import PromptPrefix

#: Tokens of prefixes remembered per backend when its engine does not say how much it
#: caches: about what a 24-80 GB GPU's KV cache holds for a small-to-mid model.
DEFAULT_MEMORY_TOKENS = 262_144


class PrefixIndex:
    """Block hash -> tokens of that block, least recently sent first."""

    __slots__ = ("capacity_tokens", "tokens", "_blocks")

    def __init__(self, capacity_tokens: int = DEFAULT_MEMORY_TOKENS) -> None:
        self.capacity_tokens = capacity_tokens
        #: Tokens covered by the blocks held now.
        self.tokens = 0
        self._blocks: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def matched_blocks(self, prefix: PromptPrefix) -> int:
        """How many leading blocks of `prefix` were sent here (and not evicted)."""
        blocks = self._blocks
        matched = 0
        for block in prefix.hashes:
            if block not in blocks:
                break
            matched += 1
        return matched

    def matched_tokens(self, prefix: PromptPrefix) -> int:
        return prefix.covered(self.matched_blocks(prefix))

    def add(self, prefix: PromptPrefix) -> None:
        """The prompt was sent here: its blocks are the freshest, the first ones most."""
        blocks = self._blocks
        hashes, tokens = prefix.hashes, prefix.tokens
        for index in range(len(hashes) - 1, -1, -1):
            block = hashes[index]
            size = tokens[index] - (tokens[index - 1] if index else 0)
            old = blocks.pop(block, None)
            if old is not None:
                self.tokens -= old
            blocks[block] = size
            self.tokens += size
        while self.tokens > self.capacity_tokens and len(blocks) > 1:
            _, size = blocks.popitem(last=False)
            self.tokens -= size

    def clear(self) -> None:
        """The engine lost its cache (it restarted): nothing is cached any more."""
        self._blocks.clear()
        self.tokens = 0
