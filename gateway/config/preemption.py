"""[preemption]: a lower lane's request still in prefill gives its engine back to a
waiting request of the highest lane (`scheduling/preemption.py`)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from gateway.config.constraints import rule

#: The engines on which preemption is on while `enabled` is unset: those measured to
#: gain from it (docs/matrix.md's preemption columns; docs/benchmarks.md).
PREEMPT_BY_DEFAULT: frozenset[str] = frozenset()


class PreemptionSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A request of the highest lane that would wait, for a slot or behind a lower lane's
    prompt in prefill on its engine, may take the place of that prompt: the engine
    connection of the lower lane's request is closed (the engine aborts it) and it goes
    back to the head of its lane's line; its client sees a longer wait, then its whole
    answer. Never after its first token, never a request of the same or a higher lane."""

    #: Preempt at all. Unset: on for the engines measured to gain (`PREEMPT_BY_DEFAULT`),
    #: off for the others; written: exactly that, on every backend.
    enabled: bool | None = None
    #: Most times one request is preempted. Never once preemptions held it back for its
    #: lane's `promote_after_s`, nor with a fifth of its queue deadline left, nor while
    #: its lane's arrivals are refused (`scheduling/preemption.py`). 4: on the matrix's
    #: vLLM-like engine at 80% load (chat, an engine keeping a preempted prompt's
    #: prefill), 2 left the short P99 at 0.75-0.9x the engine floor (a long prompt
    #: preempted twice then held the shorts arriving behind it), 4 at 0.5-0.6x.
    max_per_request: Annotated[int, rule("be from 1 to 8", ge=1, le=8)] = 4

    def applies_to(self, engine: str | None) -> bool:
        """Requests on a backend running `engine` (None: not known yet) may be preempted."""
        if self.enabled is not None:
            return self.enabled
        return engine in PREEMPT_BY_DEFAULT
