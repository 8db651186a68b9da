"""What the load generator's tests share: the gateway's count, the yardstick for prompt sizes."""

from __future__ import annotations

from gateway.admission.tokens import TokenCounter, chat_prompt_parts
from tests.conftest import encoding


def gateway_count(prompt: str) -> int:
    """Prompt tokens as the gateway (and the simulator) count a one-message chat."""
    counter = TokenCounter(encoding())
    try:
        return counter.count(chat_prompt_parts([{"role": "user", "content": prompt}]))
    finally:
        counter.close()
