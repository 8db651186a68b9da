"""A prompt's prefix as chained block hashes, for routing it to where it is cached.

Engines keep the KV cache of prompts they served (vLLM's automatic prefix
caching, SGLang's radix tree, llama.cpp's slot cache): a prompt that starts
with a prefix they hold skips that part of its prefill. Chat turns, agents and
RAG resend the same system prompt and history every call, so knowing which
backend holds which prefix is worth seconds of TTFT on long conversations.

The prompt is cut into blocks along the texts the tokenizer already counted
(a message's role, its content, ...), long texts further into chunks of
`CHUNK_CHARS`; block k's hash covers everything up to and including it
(chained), so equal hashes mean an equal prefix, and a change in one block
changes every later hash. Each block carries the tokens it covers, known from
the count already made (a chunk's share pro rata of its text's characters), so
a match says how many prompt tokens a backend probably has cached: better than
the character estimates of routers that do not tokenize.

Hashes are Python's (fast, randomised per process): they only ever meet the
same process's index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Long texts are hashed in chunks of this many characters (~250-500 tokens), so a
#: shared beginning of one long message (a document, a code file) is found too.
CHUNK_CHARS = 1024
#: Texts shorter than this join the next block (see `prefix_of`).
MIN_BLOCK_CHARS = 32


@dataclass(slots=True, frozen=True)
class PromptPrefix:
    """Block hashes of a prompt, and the prompt tokens covered up to each block."""

    hashes: tuple[int, ...]
    #: Cumulative: tokens[k] is the prompt tokens of blocks 0..k.
    tokens: tuple[int, ...]

    def covered(self, blocks: int) -> int:
        """Tokens covered by the first `blocks` blocks."""
        return self.tokens[blocks - 1] if blocks > 0 else 0


def prefix_of(texts: Sequence[str], counts: Sequence[int]) -> PromptPrefix | None:
    """The chained blocks of a prompt made of `texts` (in order), `counts` tokens each.

    Texts shorter than `MIN_BLOCK_CHARS` (a role, a name) join the next block: a block
    of a few tokens that every prompt starts with would match everywhere and mean
    nothing.
    """
    if not texts:
        return None
    chained = 0
    covered = 0
    pending = 0  # characters hashed into the chain since the last block was emitted
    hashes: list[int] = []
    tokens: list[int] = []
    for text, count in zip(texts, counts, strict=True):
        size = len(text)
        if size <= CHUNK_CHARS:
            chained = hash((chained, text))
            covered += count
            pending += size
            if pending >= MIN_BLOCK_CHARS:
                hashes.append(chained)
                tokens.append(covered)
                pending = 0
            continue
        start_tokens = covered
        for start in range(0, size, CHUNK_CHARS):
            end = min(size, start + CHUNK_CHARS)
            chained = hash((chained, text[start:end]))
            hashes.append(chained)
            tokens.append(start_tokens + count * end // size)
        covered = start_tokens + count
        pending = 0
    if pending:  # the short texts at the end: a block of their own
        hashes.append(chained)
        tokens.append(covered)
    return PromptPrefix(tuple(hashes), tuple(tokens))
