"""Prompts of an exact size, built fast: English text cut from a token stream at word starts.

Sizes are what the gateway counts for a one-message chat request (its tiktoken
encoding plus OpenAI's per-message overhead), so a class's bounds line up with
the gateway's lane thresholds exactly. Cutting the stream only before a token
that starts a word (" " + letter) keeps every cut on a tokenizer boundary, so
the count is exact without encoding each prompt again: thousands of prompts
cost a fraction of a second. Each prompt opens with its own index and seed and
a six-digit run tag the client rewrites per run, so a prefix cache never serves
one request from another's work, nor a second target from the first one's.
"""

from __future__ import annotations

import bisect
import functools
import random
from dataclasses import dataclass

import tiktoken

from gateway.admission.tokens import REPLY_PRIMING_TOKENS, TOKENS_PER_MESSAGE, load_encoding

ENCODING_NAME = "cl100k_base"
#: Six digits are always two cl100k tokens, so any run tag keeps a prompt's size.
RUN_TAG_PLACEHOLDER = "000000"
OPENING_PREFIX = "Session "
#: Tokens of body text kept beyond the longest prompt, so bodies start at varied offsets.
STREAM_MARGIN_TOKENS = 4096


# Plain sentences (no digits, apostrophes or newlines) so every word boundary is a clean
# tokenizer boundary; the mix of topics reads like real chat and document traffic.
_SENTENCES = (
    "The quarterly report shows that revenue grew faster than expected in the northern region.",
    "Please summarize the main arguments of the article and list any claims that need a source.",
    "Our team moved the build pipeline to a new cluster and the average job now finishes sooner.",
    "When the river floods in early spring, farmers move their animals to the higher pastures.",
    "Write a short poem about a lighthouse keeper who waits for a ship that never arrives.",
    "The customer says the package arrived damaged and asks whether a replacement can be sent.",
    "In the old town, narrow streets wind between stone houses with red roofs and small gardens.",
    "Explain how a hash table handles collisions, and compare open addressing with chaining.",
    "The committee will meet again next week to review the budget and approve the final plan.",
    "She opened the window, listened to the rain, and decided to finish the letter tomorrow.",
    "A good onboarding guide explains where the code lives, how to run it, and who to ask.",
    "Translate the following paragraph into plain language that a new student can follow.",
    "The museum keeps a collection of maps drawn by sailors who crossed the ocean long ago.",
    "Engineers measured the latency of every request and found that the slowest ones waited.",
    "Most of the forest burned during the dry summer, but young trees are growing back fast.",
    "List the steps needed to migrate the database without losing any customer records.",
    "The recipe calls for flour, butter, sugar, and a pinch of salt, mixed slowly by hand.",
    "During the interview, the candidate described a project that failed and what it taught.",
    "The city plans to add more bicycle lanes and to plant trees along the main avenues.",
    "Describe the differences between weather and climate for a curious child at school.",
    "After the update, several users reported that the application closed without warning.",
    "The orchestra rehearsed the second movement until the strings and the horns agreed.",
    "Check whether the contract allows either party to end the agreement with short notice.",
    "Scientists collected samples of ice to learn how the air changed over many centuries.",
    "The hotel offers a quiet room with a view of the harbor and breakfast on the terrace.",
    "Give three reasons why a small business might choose to rent software instead of buying.",
    "He fixed the bicycle chain, cleaned his hands, and rode along the coast until sunset.",
    "The support ticket describes an error that appears only when the disk is almost full.",
    "Compare the two proposals and recommend the one that is cheaper to maintain over time.",
    "Children in the village walk to school together and cross the bridge near the mill.",
    "The library extended its opening hours so that students can study late before exams.",
    "Outline a training plan for a beginner who wants to run a long race next autumn.",
)


@dataclass(slots=True)
class _TokenStream:
    """Body text as tokens, with the positions where a prompt may start or end."""

    encoding: tiktoken.Encoding
    tokens: list[int]
    #: Indices of tokens that begin a word (" " + letter): cutting there keeps counts exact.
    starts: list[int]
    is_start: list[bool]


@functools.cache
def _encoding() -> tiktoken.Encoding:
    return load_encoding(ENCODING_NAME)


@functools.cache
def _sentence_tokens() -> tuple[list[int], ...]:
    encode = _encoding().encode_ordinary
    return tuple(encode(" " + sentence) for sentence in _SENTENCES)


@functools.cache
def _word_start_ids() -> frozenset[int]:
    encoding = _encoding()
    ids = {t for sentence in _sentence_tokens() for t in sentence}
    return frozenset(
        t
        for t in ids
        if (raw := encoding.decode_single_token_bytes(t))[:1] == b" " and raw[1:2].isalpha()
    )


def _stream_size(min_tokens: int) -> int:
    """Power-of-two sizes: a schedule's text depends only on its own sizes, not on history."""
    return max(8192, 1 << (min_tokens - 1).bit_length())


@functools.cache
def _token_stream(size: int) -> _TokenStream:
    """At least `size` tokens of shuffled sentences; the same text for every seed and run."""
    rng = random.Random(20231116)
    sentences = _sentence_tokens()
    tokens: list[int] = []
    order = list(range(len(sentences)))
    while len(tokens) < size:
        rng.shuffle(order)
        for i in order:
            tokens.extend(sentences[i])
    word_starts = _word_start_ids()
    is_start = [t in word_starts for t in tokens]
    return _TokenStream(_encoding(), tokens, [i for i, s in enumerate(is_start) if s], is_start)


@functools.cache
def chat_overhead_tokens() -> int:
    """Tokens the gateway adds to a one-message user chat on top of its text."""
    return REPLY_PRIMING_TOKENS + TOKENS_PER_MESSAGE + len(_encoding().encode_ordinary("user"))


def opening(index: int, seed: int) -> str:
    """The unique first sentence of a prompt; the run tag placeholder is rewritten per run."""
    return f"{OPENING_PREFIX}{RUN_TAG_PLACEHOLDER} note {index} of set {seed}."


def with_run_tag(prompt: str, tag: str) -> str:
    """The prompt with its run tag replaced (six digits, so the token count is unchanged)."""
    if len(tag) != len(RUN_TAG_PLACEHOLDER) or not tag.isdigit():
        raise ValueError(f"run tag must be {len(RUN_TAG_PLACEHOLDER)} digits, got {tag!r}")
    head = OPENING_PREFIX + RUN_TAG_PLACEHOLDER
    if not prompt.startswith(head):
        return prompt
    return OPENING_PREFIX + tag + prompt[len(head) :]


class PromptBuilder:
    """Builds prompts of an exact chat token count; one per schedule, cheap per prompt."""

    def __init__(self, max_prompt_tokens: int, seed: int) -> None:
        self._stream = _token_stream(_stream_size(max_prompt_tokens + STREAM_MARGIN_TOKENS))
        self._rng = random.Random(f"loadgen-prompts-{seed}")
        self._seed = seed
        self._overhead = chat_overhead_tokens()

    def build(self, index: int, prompt_tokens: int) -> tuple[str, int]:
        """The prompt and its real size (larger than asked only below the opening's size)."""
        head = opening(index, self._seed)
        stream = self._stream
        fixed = self._overhead + len(stream.encoding.encode_ordinary(head))
        body = max(0, prompt_tokens - fixed)
        if body == 0:
            return head, fixed
        start = self._body_start(body)
        return head + stream.encoding.decode(stream.tokens[start : start + body]), fixed + body

    def _body_start(self, length: int) -> int:
        """A word start `s` such that `s + length` is a word start too (exact cut)."""
        stream = self._stream
        last = len(stream.tokens) - length - 1
        candidates = bisect.bisect_right(stream.starts, last)
        first = self._rng.randrange(candidates)
        for k in range(first, first + candidates):
            start = stream.starts[k % candidates]
            if stream.is_start[start + length]:
                return start
        raise RuntimeError(f"no exact cut of {length} tokens in the prompt text")
