"""Deadlines fitted to the engine floor."""

from __future__ import annotations

from gateway.scheduling.fitting import (
    DEADLINE_OVER_FLOOR,
    PRIOR_LONG_PROMPT_TOKENS,
    PromptSizes,
    engine_floor_s,
    fitted_deadline_s,
)


def prefill_at(rate: float, overhead: float = 0.02):
    return lambda tokens: overhead + tokens / rate


def test_floor_is_one_long_prefill_plus_its_own() -> None:
    floor = engine_floor_s(prefill_at(500.0), long_tokens=1500, own_tokens=50)
    assert abs(floor - (0.02 + 3.0 + 0.02 + 0.1)) < 1e-9


def test_a_short_deadline_is_raised_only_on_a_slow_engine() -> None:
    cpu = engine_floor_s(prefill_at(300.0), 1500, 50)
    gpu = engine_floor_s(prefill_at(20_000.0), 1500, 50)
    assert fitted_deadline_s(5.0, cpu, fit=True) == DEADLINE_OVER_FLOOR * cpu > 5.0
    assert fitted_deadline_s(5.0, gpu, fit=True) == 5.0
    assert fitted_deadline_s(5.0, cpu, fit=False) == 5.0


def test_prompt_sizes_say_what_long_and_own_are() -> None:
    sizes = PromptSizes()
    assert sizes.long() == PRIOR_LONG_PROMPT_TOKENS
    assert sizes.own("interactive", 1024) == 256  # the prior, within the lane's limit
    assert sizes.own("tiny", 100) == 100
    for _ in range(80):
        sizes.add("interactive", 50)
    for _ in range(20):
        sizes.add("bulk", 1500)
    assert sizes.own("interactive", 1024) == 50
    assert sizes.long() == 1500


def test_a_few_short_prompts_do_not_make_the_long_one_short() -> None:
    sizes = PromptSizes()
    for _ in range(5):
        sizes.add("interactive", 50)
    assert sizes.long() == PRIOR_LONG_PROMPT_TOKENS
    for _ in range(40):
        sizes.add("interactive", 50)
    assert sizes.long() == 50  # enough seen: this traffic has no long prompts
