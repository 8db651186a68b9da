"""Measure a backend's prefill with a few tiny requests: `check-config --probe` and start-up.

Before any traffic the gateway's backend models hold a prior (a fast GPU
engine). Streamed completions with one output token each, short prompts and
long ones (three of each, for the medians), give the fixed cost of a first token and the prefill rate at
once, so the lanes' deadlines can be fitted (and a deadline below the engine
floor warned about, with the numbers) before the first user waits. The
prompts are random words, so an engine's prompt cache cannot flatter them.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from gateway.upstream.pool import Backend

if TYPE_CHECKING:
    from gateway.upstream.questions import BackendQuestions

#: Prompt sizes of the two probes (gateway tokens; common words are one token each).
SHORT_PROBE_TOKENS = 32
LONG_PROBE_TOKENS = 1024
#: Each size is sent this many times: enough for the medians to replace the prior.
PROBE_ROUNDS = 3
_WORDS = (
    "time people way year day thing man world life hand part child eye woman place work "
    "week case point number group problem fact water room mother area money story month "
    "night study book word issue side kind head house service friend father power hour game"
).split()


def probe_prompt(tokens: int, rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(tokens))


async def measure_prefill(
    questions: BackendQuestions,
    backend: Backend,
    model: str | None = None,
    seed: int | None = None,
) -> bool:
    """Teach `backend.model` its first-token cost and prefill rate; False if it would not say.

    Only on an idle backend: a probe sent beside the gateway's own requests would wait
    behind them inside the engine and teach a rate far too slow. Once traffic flows,
    its own records teach better, and the probing stops.
    """
    # Fresh words each time (seeded from the system unless a test says): a second gateway,
    # or this one restarted, must not find its probes in the engine's prompt cache.
    rng = random.Random(seed)
    measured = False
    for tokens in (SHORT_PROBE_TOKENS, LONG_PROBE_TOKENS) * PROBE_ROUNDS:
        before = backend.dispatches
        if backend.in_flight:
            return measured
        ttft = await questions.first_token_s(backend, model, probe_prompt(tokens, rng), tokens)
        if ttft is None or backend.in_flight or backend.dispatches != before:
            return measured
        backend.model.observe_ttft(tokens, 0, ttft)
        measured = True
    return measured
