"""What the sizer makes of an engine: the floor behind a lane's deadline, the automatic
prefill budget, and when a queue inside the engine is real.

On a backend of one slot no slot can be kept for short requests: one that arrives just
after a long request took the slot waits for that request's whole answer. A deadline
fitted to the prefill alone refused a third of the short requests on a one-slot
llama.cpp server in the engine matrix, requests the engine served a moment later.
"""

from __future__ import annotations

import io
import time

import msgspec
import pytest

from gateway.app import build_pools
from gateway.config import BackendSettings, load_settings
from gateway.observability.logs import make_logger
from gateway.upstream.pool import (
    MAX_AUTO_PREFILL_BUDGET_S,
    MIN_AUTO_PREFILL_BUDGET_TOKENS,
    Backend,
    BackendPool,
)
from gateway.upstream.sizing import _Known, _queued_scrapes
from gateway.upstream.telemetry import EngineLoad


def sizer_with_slots(slots: int | None):  # type: ignore[no-untyped-def]
    settings = load_settings(None)
    backend = BackendSettings(url="http://floor.invalid", name="b0", max_concurrency=slots)
    settings = msgspec.structs.replace(settings, backends=[backend])
    router = build_pools(settings, make_logger(io.StringIO(), "error"), clock_of=lambda: 0.0)
    return router.default.sizer, router.default.scheduler


def test_one_slot_floor_is_a_whole_long_answer_not_only_its_prefill() -> None:
    one, _ = sizer_with_slots(1)
    two, _ = sizer_with_slots(2)
    short = one.settings.lanes[0]
    one_floor = one.floor_s(short.name, short.max_prompt_tokens)
    two_floor = two.floor_s(short.name, short.max_prompt_tokens)
    # The prior's long answer: 256 tokens at the prior TPOT, beside the same prefills.
    assert one_floor > two_floor + 256 * 0.9 * 0.02


def test_one_slot_floor_follows_the_lower_lanes_measured_hold() -> None:
    sizer, scheduler = sizer_with_slots(1)
    short, bulk = sizer.settings.lanes[0], sizer.settings.lanes[-1]
    scheduler.lane(bulk.name).hold_ewma_s = 30.0
    assert sizer.floor_s(short.name, short.max_prompt_tokens) > 30.0
    sizer.refit()
    assert scheduler.lane(short.name).deadline_s >= 1.5 * 30.0


def test_the_automatic_prefill_budget_is_one_long_prefill_at_the_learned_rate() -> None:
    fast = Backend.from_settings(BackendSettings(url="http://h100.invalid", name="h100"))
    slow = Backend.from_settings(BackendSettings(url="http://cpu.invalid", name="cpu"))
    for _ in range(5):
        fast.model.observe_ttft(3000, 0, 0.02 + 3000 / 50_000)  # an H100: 50k tokens/s
        slow.model.observe_ttft(1500, 0, 0.05 + 1500 / 150)  # a slow CPU
    fast.fit_prefill_budget(3000)
    slow.fit_prefill_budget(3000)
    assert fast.prefill_budget_s < 0.1  # one long prompt, not eight
    assert slow.prefill_budget_s == MAX_AUTO_PREFILL_BUDGET_S  # a long prompt goes alone
    fixed = Backend.from_settings(
        BackendSettings(url="http://x.invalid", name="x", prefill_budget_s=0.5)
    )
    fixed.fit_prefill_budget(3000)
    assert fixed.prefill_budget_s == 0.5


def load(waiting: float, running: float, kv: float | None = None) -> EngineLoad:
    return EngineLoad(engine="vllm", waiting=waiting, running=running, kv_usage=kv)


def scrapes(*loads: EngineLoad) -> int:
    known = _Known()
    for each in loads:
        known.queued_scrapes = _queued_scrapes(known, each)
        known.queued_running = each.running
        known.peak_running = max(known.peak_running, int(each.running or 0))
    return known.queued_scrapes


def test_a_request_between_engine_steps_is_not_a_queue() -> None:
    # A fast engine at a third of its batch: a request or two waiting at every scrape.
    assert scrapes(load(1, 29, 0.3), load(2, 33, 0.3), load(1, 30, 0.3)) < 2


def test_an_engine_at_its_limit_with_requests_waiting_is_a_queue() -> None:
    assert scrapes(load(3, 16), load(4, 16)) >= 2  # at its batch limit
    assert scrapes(load(3, 20, 0.95), load(2, 18, 0.97)) >= 2  # out of KV cache
    assert scrapes(load(3, 16), load(0, 12), load(3, 16)) == 1


def test_a_queue_behind_one_long_prefill_is_not_a_full_batch() -> None:
    # A whole-prompt engine (TGI) queues new requests while it prefills a long prompt,
    # its running unchanged meanwhile: 3 running of the 16 it ran before is not full.
    assert scrapes(load(0, 16), load(1, 3), load(4, 3)) < 2
    assert scrapes(load(0, 16), load(1, 16), load(4, 16)) >= 2


def test_an_engine_that_reports_a_routers_limit_has_its_batch_learned() -> None:
    """TGI's /info says 128 (its router's limit) while it batches 32: the slots the lanes
    share become the 32 it runs when full, and grow again while it runs all of them
    with none waiting (a batch bounded by KV tokens is larger for smaller requests)."""
    from gateway.upstream.sizing import BATCH_PROBE_SCRAPES
    from gateway.upstream.telemetry import BackendFacts

    sizer, scheduler = sizer_with_slots(None)
    backend = sizer.pool.backends[0]
    told = BackendFacts(engine="tgi", slots=128)
    sizer.apply_facts(backend, told)
    assert backend.max_concurrency == 128
    sizer.apply_load(backend, load(0, 20))
    sizer.apply_load(backend, load(3, 32))
    backend.in_flight = 35
    sizer.apply_load(backend, load(3, 32))
    assert backend.max_concurrency == 32
    sizer.refit()
    assert scheduler.lane(sizer.settings.lanes[-1].name).capacity == 32
    # Its facts asked again do not undo what was learned.
    sizer.apply_facts(backend, BackendFacts(engine="tgi", slots=128, context_tokens=4096))
    assert backend.max_concurrency == 32
    # Running all 32 with none waiting, scrape after scrape: one more eighth is tried.
    for _ in range(BATCH_PROBE_SCRAPES):
        sizer.apply_load(backend, load(0, 32))
    assert backend.max_concurrency == 36


def test_a_batch_restored_from_the_state_file_is_in_force_from_the_first_facts() -> None:
    from gateway.upstream.telemetry import BackendFacts

    sizer, _ = sizer_with_slots(None)
    backend = sizer.pool.backends[0]
    backend.engine_batch = 32  # as `LearnedState.restore` leaves it
    sizer.apply_facts(backend, BackendFacts(engine="tgi", slots=128))
    assert backend.max_concurrency == 32


def test_configured_slots_are_never_learned_over() -> None:
    sizer, _ = sizer_with_slots(64)
    backend = sizer.pool.backends[0]
    for _ in range(3):
        sizer.apply_load(backend, load(3, 30))
    assert backend.max_concurrency == 64


def test_no_deadline_refusal_rests_on_figures_not_learned() -> None:
    """Until the backend's prefill is learned the lane's deadline is a provisional long
    one: the prior is a GPU's, and a slow CPU's first long prefill alone is 10 s."""
    from gateway.upstream.sizing import UNLEARNED_DEADLINE_S

    sizer, scheduler = sizer_with_slots(4)
    short = sizer.settings.lanes[0]
    # Short prompts alone wait for nothing the configured deadline did not allow for.
    sizer.note_prompt(short.name, 50)
    assert scheduler.lane(short.name).deadline_s == short.queue_timeout_s
    # The first prompt the prior cannot time makes the deadlines provisional at once.
    sizer.note_prompt(short.name, 1500)
    assert scheduler.lane(short.name).deadline_s == UNLEARNED_DEADLINE_S
    backend = sizer.pool.backends[0]
    for _ in range(5):
        backend.model.observe_ttft(1500, 0, 0.02 + 1500 / 20_000)
    sizer.refit()
    assert scheduler.lane(short.name).deadline_s == short.queue_timeout_s


def test_short_prompts_alone_prefill_together_not_one_at_a_time() -> None:
    """Traffic of short prompts only: "a long prompt" is one of them, and the automatic
    budget was one of their prefills, so each waited for the one before's first byte
    (64 arriving together: the last one 63 first bytes late). The budget is at least
    MIN_AUTO_PREFILL_BUDGET_TOKENS' prefill, and riding prompts count as one prompt."""
    backend = Backend.from_settings(BackendSettings(url="http://b.invalid", name="b"))
    backend.max_concurrency = 256
    backend.fit_prefill_budget(11)  # every prompt seen was 11 tokens
    assert backend.prefill_budget_s >= backend.model.prefill_s(MIN_AUTO_PREFILL_BUDGET_TOKENS)
    pool = BackendPool([backend], clock=time.monotonic)
    slots = []
    while (slot := pool.try_take("interactive", 11)) is not None and len(slots) < 64:
        slots.append(slot)
    # As one prompt of their tokens within the budget: 46 (it was 1; then, each with the
    # 20-ms fixed cost of a first token, 4).
    assert len(slots) >= 40
    assert backend.riding_tokens == len(slots) * 11
    for slot in slots:
        pool.give_back(slot)
    assert backend.riding_tokens == 0 and backend.prefilling_tokens == 0


def test_a_reload_keeps_the_batch_learned_behind_a_routers_limit() -> None:
    """A reload that leaves the backend's slots unset must not put back TGI's 128."""
    from gateway.upstream.membership import _update
    from gateway.upstream.telemetry import BackendFacts

    sizer, _ = sizer_with_slots(None)
    backend = sizer.pool.backends[0]
    backend.engine_batch = backend.max_concurrency = 32
    settings = BackendSettings(url="http://floor.invalid", name="b0", weight=2.0)
    assert _update(backend, settings, BackendFacts(engine="tgi", slots=128))  # the weight
    assert backend.max_concurrency == 32


def test_an_unset_lower_lane_deadline_fits_the_promotion_it_waits_for() -> None:
    """Under the higher lanes' pressure the head of the bulk line gets a slot only by
    promotion: once its lane's running request ends (the measured hold) and
    promote_after_s more. Unset, its deadline leaves room for that (a CPU's long answer
    holds a slot 15 s: 10 + 15 s, x1.5); written, it stays as written."""
    sizer, scheduler = sizer_with_slots(4)
    backend = sizer.pool.backends[0]
    for _ in range(5):  # a fast engine: the engine floor is nothing
        backend.model.observe_ttft(1500, 0, 0.02 + 1500 / 20_000)
    bulk = scheduler.lane("bulk")
    assert bulk.settings.promote_after_s == 10.0
    bulk.hold_ewma_s = 15.0
    sizer.refit()
    assert bulk.deadline_s == pytest.approx(1.5 * (10.0 + 15.0))
    bulk.hold_ewma_s = 2.0  # a GPU's: the configured 30 s holds room enough
    sizer.refit()
    assert bulk.deadline_s == bulk.settings.queue_timeout_s == 30.0
