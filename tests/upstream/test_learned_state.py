"""What was learned of a backend survives a restart, marked with its age, and is
learned anew when the engine at its address changed."""

from __future__ import annotations

import io
import json
from pathlib import Path

from gateway.config import BackendSettings
from gateway.observability.logs import make_logger
from gateway.upstream.learned_state import MAX_AGE_S, LearnedState
from gateway.upstream.pool import Backend
from gateway.upstream.telemetry import BackendFacts

LLAMA = BackendFacts(engine="llama.cpp", slots=4, model="gemma-3-270m.gguf")


def backend(url: str = "http://10.0.0.7:8080") -> Backend:
    return Backend.from_settings(BackendSettings(url=url, name="cpu"))


def slow_cpu(b: Backend) -> Backend:
    for _ in range(5):
        b.model.observe_ttft(1500, 0, 0.05 + 1500 / 140)
        b.model.observe_ttft(30, 0, 0.2)
        b.model.observe_tpot(0.077, 4)
    return b


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def state(path: Path, clock: Clock, log: io.StringIO | None = None) -> LearnedState:
    return LearnedState(path, make_logger(log or io.StringIO(), "info"), clock=clock)


def test_a_restart_starts_from_what_was_learned_not_the_priors(tmp_path: Path) -> None:
    clock, path = Clock(), tmp_path / "learned.json"
    before = slow_cpu(backend())
    assert state(path, clock).save([before], {"cpu": LLAMA})
    clock.now += 120
    log = io.StringIO()
    after = backend()
    assert not after.model.prefill_learned
    assert state(path, clock, log).restore([after]) == 1
    assert after.model.prefill_learned
    assert abs(after.model.prefill_tokens_per_s - 140) < 1
    assert abs(after.model.tpot_s(4) - 0.077) < 1e-6
    restored = json.loads(log.getvalue().splitlines()[-1])
    assert restored["event"] == "backend_state_restored" and restored["age_s"] == 120
    # Its own traffic outvotes the restored figures within a few requests.
    for _ in range(6):
        after.model.observe_ttft(1500, 0, 0.05 + 1500 / 500)
    assert after.model.prefill_tokens_per_s > 400


def test_figures_too_old_or_of_another_address_are_not_restored(tmp_path: Path) -> None:
    clock, path = Clock(), tmp_path / "learned.json"
    state(path, clock).save([slow_cpu(backend())], {"cpu": LLAMA})
    assert state(path, clock).restore([backend("http://10.0.0.8:8080")]) == 0
    clock.now += MAX_AGE_S + 1
    fresh = backend()
    assert state(path, clock).restore([fresh]) == 0 and not fresh.model.prefill_learned


def test_another_engine_at_the_same_address_is_learned_anew(tmp_path: Path) -> None:
    clock, path = Clock(), tmp_path / "learned.json"
    state(path, clock).save([slow_cpu(backend())], {"cpu": LLAMA})
    same, other = backend(), backend()
    kept, log = state(path, clock), io.StringIO()
    kept.restore([same])
    kept.check_facts(same, LLAMA)
    assert same.model.prefill_learned
    changed = state(path, clock, log)
    changed.restore([other])
    changed.check_facts(other, BackendFacts(engine="vllm", slots=64, model="llama-3-8b"))
    assert not other.model.prefill_learned
    assert '"backend_changed"' in log.getvalue()


def test_an_unwritable_or_garbled_file_is_a_warning_not_a_failure(tmp_path: Path) -> None:
    clock, log = Clock(), io.StringIO()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    failed: list[int] = []
    unwritable = LearnedState(
        blocked / "learned.json",
        make_logger(log, "info"),
        clock=clock,
        on_failure=lambda: failed.append(1),
    )
    assert not unwritable.save([slow_cpu(backend())], {})
    assert '"state_unwritable"' in log.getvalue() and failed == [1]
    garbled = tmp_path / "garbled.json"
    garbled.write_text("{not json")
    assert state(garbled, clock).restore([backend()]) == 0
    assert state(garbled, clock).save([slow_cpu(backend())], {})  # written anew
    assert state(garbled, clock).restore([backend()]) == 1


async def test_with_redis_a_replica_starts_from_what_the_fleet_learned(redis_server) -> None:  # type: ignore[no-untyped-def]
    """[redis]: the figures go to the fleet's Redis, and a replica started later (a rolling
    upgrade) restores them from there, its age said."""
    from prometheus_client import CollectorRegistry

    from gateway.config import RedisSettings
    from gateway.fleet.store import SharedStore
    from gateway.upstream.learned_state import SharedLearnedState

    clock = Clock()
    stores = [
        SharedStore(
            RedisSettings(url=redis_server.url),
            events=make_logger(io.StringIO(), "info"),
            registry=CollectorRegistry(),
        )
        for _ in range(2)
    ]
    try:
        first = SharedLearnedState(stores[0], make_logger(io.StringIO(), "info"), clock=clock)
        assert await first.save_shared([slow_cpu(backend())], {"cpu": LLAMA})
        clock.now += 30
        log = io.StringIO()
        second = SharedLearnedState(stores[1], make_logger(log, "info"), clock=clock)
        fresh = backend()
        assert await second.restore_shared([fresh]) == 1
        assert abs(fresh.model.prefill_tokens_per_s - 140) < 1
        line = json.loads(log.getvalue().splitlines()[-1])
        assert line["age_s"] == 30 and line["source"].startswith("redis:")
    finally:
        for store in stores:
            await store.close()


def test_an_engines_learned_batch_survives_a_restart_and_goes_with_the_engine(
    tmp_path: Path,
) -> None:
    """TGI reports its router's limit (128) and batches 32: a restarted gateway sends it
    32 at once from the start, not 128 until the engine is seen full again."""
    tgi = BackendFacts(engine="tgi", slots=128, model="org/model")
    clock, path = Clock(), tmp_path / "learned.json"
    before = slow_cpu(backend())
    before.engine_batch = 32
    assert state(path, clock).save([before], {"cpu": tgi})
    after = backend()
    restored = state(path, clock)
    assert restored.restore([after]) == 1
    assert after.engine_batch == 32
    restored.check_facts(after, tgi)  # the same engine: kept
    assert after.engine_batch == 32
    other = backend()
    again = state(path, clock)
    again.restore([other])
    again.check_facts(other, BackendFacts(engine="tgi", slots=128, model="org/other"))
    assert other.engine_batch is None  # another model there: learned anew
