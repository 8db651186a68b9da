"""Multi-turn traffic: seeded conversations whose history grows by the model's own replies.

Chat turns, agents and RAG resend the same system prompt and history on every
call, which is what an engine's prefix cache (and a gateway that routes by it)
exists for; one-off requests with prompts of their own are the traffic no
cache can help. Everything but the replies is decided up front from the seed:
which tenant's system prompt a conversation opens with, its user messages and
their sizes, its turn count, when it starts and how long its user thinks
before each turn. So two targets get the same conversations, and their
histories differ only where their replies do (in length, when the backends
differ).

A conversation's history lives in a `Dialogue`: the system prompt, then per
turn the user message and the assistant's streamed reply, with the prompt's
size kept the way the gateway counts it (tiktoken, OpenAI's per-message
overhead), so a turn's `prompt_tokens` is the gateway's own figure without
encoding the whole history again every turn.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from dataclasses import dataclass, field
from typing import Any

from gateway.admission.tokens import REPLY_PRIMING_TOKENS, TOKENS_PER_MESSAGE
from gateway.tools.loadgen.mix import PlannedRequest
from gateway.tools.loadgen.prompts import (
    PromptBuilder,
    _encoding,
    chat_overhead_tokens,
    with_run_tag,
)

#: The `cls` of a conversation's first turn, its later turns and the one-off requests:
#: the report's rows, since a later turn is the one a prefix cache can serve.
FIRST_TURN = "turn-1"
LATER_TURN = "turn-2+"
ONE_OFF = "one-off"
#: PromptBuilder indices of the tenants' system prompts, apart from the requests' own.
_SYSTEM_PROMPT_INDEX = 900_000


def _check_range(name: str, bounds: tuple[int, int], low: int = 1) -> None:
    if not low <= bounds[0] <= bounds[1]:
        raise ValueError(f"{name} must be {low} <= min <= max, got {bounds[0]}-{bounds[1]}")


@dataclass(slots=True, frozen=True)
class ConversationMix:
    """The shape of a multi-turn workload; sizes in tokens as the gateway counts a message.

    `tenants` system prompts are drawn once and each conversation opens with one of
    them (1: one hot prompt shared by every conversation, the pile-up case). Times
    are seconds; `scaled` shrinks them all for a benchmark that cannot wait minutes.
    """

    name: str
    #: Conversations in the run; they start over about `start_window_s` (Poisson arrivals).
    conversations: int = 48
    tenants: int = 8
    system_tokens: tuple[int, int] = (500, 2000)
    #: Each turn's new user message.
    user_tokens: tuple[int, int] = (100, 400)
    turns: tuple[int, int] = (3, 8)
    #: The reply's `max_tokens`, drawn per turn.
    max_tokens: tuple[int, int] = (50, 200)
    #: Mean of the exponential pause between a reply's end and the next turn.
    think_s: float = 5.0
    start_window_s: float = 60.0
    #: Share of all requests that are one-offs (random prompts, no history, no session).
    one_off_share: float = 0.2
    one_off_tokens: tuple[int, int] = (200, 2000)
    one_off_max_tokens: tuple[int, int] = (50, 200)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a conversation mix needs a name")
        if self.conversations < 1 or self.tenants < 1:
            raise ValueError("conversations and tenants must be >= 1")
        _check_range("system_tokens", self.system_tokens)
        _check_range("user_tokens", self.user_tokens)
        _check_range("turns", self.turns)
        _check_range("max_tokens", self.max_tokens)
        _check_range("one_off_tokens", self.one_off_tokens)
        _check_range("one_off_max_tokens", self.one_off_max_tokens)
        for name in ("think_s", "start_window_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if not 0 <= self.one_off_share < 1:
            raise ValueError(f"one_off_share must be in [0, 1), got {self.one_off_share}")

    def scaled(self, time_scale: float) -> ConversationMix:
        """The same mix with think times and the start window multiplied by `time_scale`."""
        if not (math.isfinite(time_scale) and time_scale > 0):
            raise ValueError(f"time scale must be > 0, got {time_scale}")
        return dataclasses.replace(
            self,
            think_s=self.think_s * time_scale,
            start_window_s=self.start_window_s * time_scale,
        )


#: Eight tenants (a support bot, a coding assistant, ...) with their own system prompts.
MULTI_TURN = ConversationMix("multi-turn")
#: One long system prompt in every conversation: the hot prefix that a naive cache-aware
#: router piles onto one backend until it collapses.
MULTI_TURN_HOT = dataclasses.replace(
    MULTI_TURN, name="multi-turn-hot", tenants=1, system_tokens=(1500, 2000)
)

#: An agent's loop (a coding assistant, a tool-using bot): each turn sends back a tool's
#: output of up to 1500 tokens and gets a short reply (the next tool call), a second or
#: two later, for 6-12 turns; the history reaches ~10k tokens, the kind of workload
#: published prefix-routing figures are measured on. Fewer one-offs: agents run in
#: sessions.
AGENT = ConversationMix(
    "agent",
    conversations=24,
    system_tokens=(1000, 3000),
    user_tokens=(300, 1500),
    turns=(6, 12),
    max_tokens=(30, 120),
    think_s=2.0,
    one_off_share=0.1,
)

#: The conversation mixes `--mix NAME` accepts (next to the one-request mixes).
NAMED_CONVERSATION_MIXES: dict[str, ConversationMix] = {
    mix.name: mix for mix in (MULTI_TURN, MULTI_TURN_HOT, AGENT)
}


# ------------------------------------------------------------------------------ the plan


@dataclass(slots=True, frozen=True)
class PlannedTurn:
    """One turn: its user message, and the pause before it (0 for the first turn)."""

    #: The request's index in the whole run (unique over conversations and one-offs).
    index: int
    #: 1 for the first turn.
    turn: int
    user: str
    #: The user message's content tokens (without the per-message overhead).
    user_tokens: int
    max_tokens: int
    think_s: float


@dataclass(slots=True, frozen=True)
class PlannedConversation:
    """A conversation: its session id, tenant, start offset and turns."""

    id: str
    tenant: int
    start_s: float
    system: str
    #: The system prompt's content tokens.
    system_tokens: int
    turns: tuple[PlannedTurn, ...]


@dataclass(slots=True, frozen=True)
class ConversationPlan:
    """What a multi-turn run sends, bar the replies."""

    mix: ConversationMix
    seed: int
    conversations: tuple[PlannedConversation, ...]
    #: Requests of their own, at fixed offsets like an open-loop schedule.
    one_offs: tuple[PlannedRequest, ...]

    @property
    def requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations) + len(self.one_offs)

    def describe(self) -> str:
        turns = sum(len(c.turns) for c in self.conversations)
        return (
            f"{self.mix.name}: {len(self.conversations)} conversations ({turns} turns, "
            f"{self.mix.tenants} system prompt{'s' if self.mix.tenants > 1 else ''}) "
            f"+ {len(self.one_offs)} one-offs, think {self.mix.think_s:g} s"
        )

    def to_json(self) -> dict[str, Any]:
        """Sizes and times, no text (prompt text is never logged)."""
        return {
            "mix": dataclasses.asdict(self.mix),
            "seed": self.seed,
            "conversations": [
                {
                    "id": c.id,
                    "tenant": c.tenant,
                    "start_s": round(c.start_s, 3),
                    "system_tokens": c.system_tokens,
                    "turns": [
                        {
                            "index": t.index,
                            "user_tokens": t.user_tokens,
                            "max_tokens": t.max_tokens,
                            "think_s": round(t.think_s, 3),
                        }
                        for t in c.turns
                    ],
                }
                for c in self.conversations
            ],
            "one_offs": [
                {"index": p.index, "at_s": round(p.at_s, 3), "prompt_tokens": p.prompt_tokens}
                for p in self.one_offs
            ],
        }


def conversation_id(seed: int, number: int) -> str:
    """The session id a conversation sends (`x-session-id` and `user`): stable per seed."""
    return f"conv-{seed}-{number:04d}"


def _content(builder: PromptBuilder, index: int, tokens: int) -> tuple[str, int]:
    """Text whose content counts `tokens` tokens (PromptBuilder counts a one-message chat)."""
    overhead = chat_overhead_tokens()
    text, real = builder.build(index, tokens + overhead)
    return text, real - overhead


def plan_conversations(mix: ConversationMix, seed: int) -> ConversationPlan:
    """The whole run's conversations and one-offs, from `seed` alone."""
    rng = random.Random(f"loadgen-conversations-{seed}")
    longest = max(mix.system_tokens[1], mix.user_tokens[1], mix.one_off_tokens[1])
    builder = PromptBuilder(longest, seed)
    systems = [
        _content(builder, _SYSTEM_PROMPT_INDEX + tenant, rng.randint(*mix.system_tokens))
        for tenant in range(mix.tenants)
    ]
    gap = mix.start_window_s / mix.conversations
    start, index = 0.0, 0
    conversations: list[PlannedConversation] = []
    for number in range(mix.conversations):
        start += rng.expovariate(1 / gap) if gap > 0 else 0.0
        tenant = rng.randrange(mix.tenants)
        turns = []
        for turn in range(1, rng.randint(*mix.turns) + 1):
            text, tokens = _content(builder, index, rng.randint(*mix.user_tokens))
            think = rng.expovariate(1 / mix.think_s) if turn > 1 and mix.think_s > 0 else 0.0
            turns.append(
                PlannedTurn(index, turn, text, tokens, rng.randint(*mix.max_tokens), think)
            )
            index += 1
        system, system_tokens = systems[tenant]
        conversations.append(
            PlannedConversation(
                conversation_id(seed, number), tenant, start, system, system_tokens, tuple(turns)
            )
        )
    return ConversationPlan(mix, seed, tuple(conversations), _one_offs(mix, rng, builder, index))


def _one_offs(
    mix: ConversationMix, rng: random.Random, builder: PromptBuilder, first_index: int
) -> tuple[PlannedRequest, ...]:
    """`one_off_share` of all requests, spread uniformly over the conversations' planned span.

    The span leaves out the replies' own time (unknown up front), so one-offs come a
    little denser than the turns at first; uniform offsets over a fixed span are what a
    Poisson process with that many arrivals would give.
    """
    turns = first_index
    count = round(turns * mix.one_off_share / (1 - mix.one_off_share))
    if count == 0:
        return ()
    span = max(mix.start_window_s + mix.think_s * (mix.turns[1] - 1), 1.0)
    offsets = sorted(rng.uniform(0, span) for _ in range(count))
    out = []
    for number, at_s in enumerate(offsets):
        index = first_index + number
        prompt, real = builder.build(index, rng.randint(*mix.one_off_tokens))
        out.append(
            PlannedRequest(index, at_s, ONE_OFF, real, rng.randint(*mix.one_off_max_tokens), prompt)
        )
    return tuple(out)


# -------------------------------------------------------------------------- the history


@functools.cache
def _role_tokens(role: str) -> int:
    return len(_encoding().encode_ordinary(role))


def _message_tokens(role: str, content_tokens: int) -> int:
    return TOKENS_PER_MESSAGE + _role_tokens(role) + content_tokens


@dataclass(slots=True)
class Dialogue:
    """A conversation's history as sent, and its prompt size as the gateway counts it.

    The system prompt and user messages carry the run's tag (see `prompts`), so one
    run's conversations never hit the cache another run left behind, while the
    conversations of one tenant share their system prompt within the run.
    """

    conversation: PlannedConversation
    run_tag: str
    messages: list[dict[str, str]] = field(default_factory=list)
    #: REPLY_PRIMING_TOKENS + every message's tokens: the next request's prompt_tokens.
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        system = with_run_tag(self.conversation.system, self.run_tag)
        self.messages = [{"role": "system", "content": system}]
        self.prompt_tokens = REPLY_PRIMING_TOKENS + _message_tokens(
            "system", self.conversation.system_tokens
        )

    def ask(self, turn: PlannedTurn) -> list[dict[str, str]]:
        """Append the turn's user message; the messages to send (a copy)."""
        self.messages.append({"role": "user", "content": with_run_tag(turn.user, self.run_tag)})
        self.prompt_tokens += _message_tokens("user", turn.user_tokens)
        return list(self.messages)

    def answer(self, reply: str) -> None:
        """Append the assistant's reply to the question just asked."""
        if self.messages[-1]["role"] != "user":
            raise RuntimeError("a reply needs a question before it")
        self.messages.append({"role": "assistant", "content": reply})
        self.prompt_tokens += _message_tokens("assistant", len(_encoding().encode_ordinary(reply)))

    def withdraw(self, turn: PlannedTurn) -> None:
        """Drop the question that got no answer, as a user would retype it next turn.

        The history stays user/assistant alternating, so the next turn is a request
        an engine's chat template accepts.
        """
        if self.messages[-1]["role"] != "user":
            raise RuntimeError("no unanswered question to withdraw")
        self.messages.pop()
        self.prompt_tokens -= _message_tokens("user", turn.user_tokens)

    def request(self, turn: PlannedTurn, at_s: float) -> PlannedRequest:
        """The turn as a planned request (asked already): what the client records it under."""
        return PlannedRequest(
            index=turn.index,
            at_s=at_s,
            cls=FIRST_TURN if turn.turn == 1 else LATER_TURN,
            prompt_tokens=self.prompt_tokens,
            max_tokens=turn.max_tokens,
            prompt="",
            conversation=self.conversation.id,
            turn=turn.turn,
        )


def resolve_conversation_mix(name: str) -> ConversationMix | None:
    """The named conversation mix, or None when `name` names none."""
    return NAMED_CONVERSATION_MIXES.get(name)
