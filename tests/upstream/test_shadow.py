"""The shadow mirror's parts: the drop rules, the body it sends, the comparison it logs, and
the mirror itself against real servers on 127.0.0.1 (its concurrency limit, its abort at
shutdown, its loop-lag rule, its measure of a real simulator's stream).

The end-to-end claims (the primary never delayed nor changed) are in
tests/integration/test_shadow.py, against gateway processes.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from aiohttp import web

from gateway.admission.admit import RequestShape
from gateway.admission.limits import OutputBudget
from gateway.admission.tokens import TokenCounter
from gateway.config import (
    BackendSettings,
    ConfigError,
    LaneSettings,
    LimitsSettings,
    Settings,
    ShadowSettings,
    TimeoutSettings,
    consistency_warnings,
    load_settings,
)
from gateway.dialects import ChatDialect
from gateway.observability.logs import make_logger
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.record import RequestRecord, clock
from gateway.outcomes import Outcome
from gateway.scheduling.scheduler import Scheduler
from gateway.upstream import shadow
from gateway.upstream.shadow import ShadowMirror, ShadowResult, comparison, drop_reason
from tests.conftest import StartSimulator, chat, encoding, free_port

CHAT = ChatDialect("/v1/chat/completions")

# ------------------------------------------------------------------------- pure parts


def test_load_on_the_primary_drops_before_the_shadows_own_limit() -> None:
    calm = dict(lanes_waiting=False, loop_lag_s=0.001, max_loop_lag_s=0.05)
    assert drop_reason(**calm, in_flight=3, max_concurrency=4) is None
    assert drop_reason(**calm, in_flight=4, max_concurrency=4) == shadow.DROPPED_CONCURRENCY
    queued = {**calm, "lanes_waiting": True}
    assert drop_reason(**queued, in_flight=0, max_concurrency=4) == shadow.DROPPED_QUEUED
    assert drop_reason(**queued, in_flight=9, max_concurrency=4) == shadow.DROPPED_QUEUED
    late = {**calm, "loop_lag_s": 0.2}
    assert drop_reason(**late, in_flight=9, max_concurrency=4) == shadow.DROPPED_LOOP_LAG


def test_the_mirror_gets_the_primarys_bytes_or_only_its_model_changed() -> None:
    body = msgspec.json.encode({"model": "sim-model", "messages": [{"content": "你好"}]})
    assert shadow.shadow_body(body, None, openai_route=True) is body
    assert shadow.shadow_body(body, "new-model", openai_route=False) is body  # TGI: no model
    changed = json.loads(shadow.shadow_body(body, "new-model", openai_route=True))
    assert changed == {"model": "new-model", "messages": [{"content": "你好"}]}


def finished_record(*, stream: bool = True) -> RequestRecord:
    record = RequestRecord("r1", "/v1/chat/completions", arrival=100.0, stream=stream)
    record.lane, record.backend, record.status, record.outcome = (
        "interactive",
        "b0",
        200,
        Outcome.OK,
    )
    record.enqueued, record.dispatched = 100.0, 100.5  # 500 ms queued: in neither TTFT
    record.first_token, record.end, record.completion_tokens = 100.6, 101.5, 11
    return record


def test_the_comparison_times_both_sides_from_their_send() -> None:
    result = ShadowResult(sent=100.502, first_token=100.702, end=102.702, completion_tokens=21)
    result.outcome, result.status = "ok", 200
    fields = comparison(finished_record(), result, "candidate")
    assert fields["primary_ttft_ms"] == pytest.approx(100.0)
    assert fields["shadow_ttft_ms"] == pytest.approx(200.0)
    assert fields["ttft_ratio"] == pytest.approx(2.0)
    assert fields["primary_tpot_ms"] == pytest.approx(90.0)  # 900 ms / 10
    assert fields["shadow_tpot_ms"] == pytest.approx(100.0)  # 2000 ms / 20
    assert fields["tpot_ratio"] == pytest.approx(100 / 90, abs=1e-3)
    assert fields["primary_e2e_ms"] == pytest.approx(1000.0)
    assert fields["shadow_e2e_ms"] == pytest.approx(2200.0)
    assert fields["shadow_start_delay_ms"] == pytest.approx(2.0)
    assert (fields["primary_completion_tokens"], fields["shadow_completion_tokens"]) == (11, 21)
    assert (fields["primary_outcome"], fields["shadow_outcome"]) == ("ok", "ok")
    assert fields["shadow_backend"] == "candidate"


def test_absent_figures_stay_null_never_made_up() -> None:
    record = finished_record(stream=False)
    record.first_token = None  # a whole answer has no first token of its own
    failed = ShadowResult(sent=100.5, end=100.51)
    failed.fail("unreachable", "ClientConnectorError: " + "x" * 1000)
    fields = comparison(record, failed, "candidate")
    for key in ("primary_ttft_ms", "shadow_ttft_ms", "ttft_ratio", "primary_tpot_ms"):
        assert fields[key] is None, key
    assert fields["shadow_status"] is None and fields["shadow_completion_tokens"] is None
    assert fields["shadow_outcome"] == "unreachable"
    assert len(fields["shadow_error"]) == shadow.MAX_ERROR_CHARS


# ------------------------------------------------------------------------------ config


def test_shadow_is_off_by_default_and_a_url_alone_turns_it_on_for_all() -> None:
    assert load_settings(env={}).shadow.url == ""
    assert load_settings(env={"GATEWAY_SHADOW_MODELS": "chat, code"}).shadow.models == [
        "chat",
        "code",
    ]
    settings = load_settings(env={"GATEWAY_SHADOW_URL": "http://127.0.0.1:9"}).shadow
    assert (settings.url, settings.sample_rate, settings.max_concurrency) == (
        "http://127.0.0.1:9",
        1.0,
        4,
    )


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("URL", "127.0.0.1:9", "[shadow].url (from GATEWAY_SHADOW_URL): must be empty (off)"),
        ("SAMPLE_RATE", "1.5", "[shadow].sample_rate (from GATEWAY_SHADOW_SAMPLE_RATE): must be"),
        ("SAMPLE_RATE", "nan", "[shadow].sample_rate"),
        ("MAX_CONCURRENCY", "0", "[shadow].max_concurrency (from GATEWAY_SHADOW_MAX_CONCURRENCY)"),
        ("TIMEOUT_S", "-1", "[shadow].timeout_s"),
    ],
)
def test_a_bad_shadow_setting_names_its_key(name: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_settings(env={f"GATEWAY_SHADOW_{name}": value})
    assert str(error.value).startswith(message)


def test_the_shadows_api_key_is_never_repeated_in_an_error(tmp_path: Any) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text("[shadow]\napi_key = 12345678\n")
    with pytest.raises(ConfigError) as error:
        load_settings(path, env={})
    assert "12345678" not in str(error.value)


def test_a_shadow_that_is_a_primary_backend_is_warned_about() -> None:
    backends = [BackendSettings(url="http://10.0.0.1:8000", name="a")]
    same = Settings(backends=backends, shadow=ShadowSettings(url="http://10.0.0.1:8000/"))
    assert any("[shadow].url" in w for w in consistency_warnings(same))
    other = Settings(backends=backends, shadow=ShadowSettings(url="http://10.0.0.2:8000"))
    assert not any("[shadow]" in w for w in consistency_warnings(other))


# ------------------------------------------------------------------- the mirror, live


class FreeSlots:
    """A SlotSource with unlimited slots: no lane ever queues."""

    def try_take(
        self,
        lane: str,
        prompt_tokens: int,
        output_tokens: int = 0,
        exclude: object = None,
        **_: object,
    ) -> object:
        return object()

    def has_free_slot(self, lane: str) -> bool:
        return True

    def prefill_done(self, slot: object) -> None:
        pass

    def give_back(self, slot: object) -> None:
        pass

    def known_wait_s(self, lane: str, ahead: object) -> float:
        return 0.0


def route_to(pool: str, serves: tuple[str, ...] = (), target: str | None = None) -> Any:
    """A route into a pool of its own scheduler (what the mirror reads of a `Route`)."""
    scheduler = Scheduler([LaneSettings(name="only")], {"only": 8}, FreeSlots())
    return SimpleNamespace(
        pool=SimpleNamespace(name=pool, serves=frozenset(serves), scheduler=scheduler),
        target=target,
    )


#: Where the unit tests' primaries go: the default pool, which `models = []` mirrors.
DEFAULT = route_to("*")


def mirror(url: str, **knobs: Any) -> tuple[ShadowMirror, GatewayMetrics, io.StringIO]:
    metrics, events = GatewayMetrics(), io.StringIO()
    mirror = ShadowMirror(
        ShadowSettings(url=url, **knobs),
        TimeoutSettings(total_s=30.0),
        default_pool="*",
        metrics=metrics,
        events=make_logger(events),
        rng=random.Random(1),
    )
    return mirror, metrics, events


def counts(metrics: GatewayMetrics) -> dict[str, float]:
    return {
        s.labels["result"]: s.value
        for family in metrics.registry.collect()
        if family.name == "gateway_shadow_requests"
        for s in family.samples
        if s.name.endswith("_total")
    }


def compared(events: io.StringIO) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in events.getvalue().splitlines()]
    return [line for line in lines if line["event"] == "shadow_compared"]


async def shape_of(body: dict[str, Any]) -> RequestShape:
    return await CHAT.measure(body, LimitsSettings(), TokenCounter(encoding()))


def new_record(index: int, stream: bool) -> RequestRecord:
    record = RequestRecord(f"req-{index}", "/v1/chat/completions", clock(), stream=stream)
    record.lane, record.dispatched = "only", clock()
    return record


@pytest.fixture
async def hanging_backend() -> AsyncIterator[tuple[str, list[web.Request]]]:
    """A candidate that takes every request and never answers."""
    seen: list[web.Request] = []

    async def hang(request: web.Request) -> web.Response:
        seen.append(request)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", hang)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", seen
    await runner.cleanup()


async def test_off_without_a_url_or_with_no_share() -> None:
    shape = await shape_of(chat(max_tokens=2))
    for url, rate in (("", 1.0), ("http://127.0.0.1:9", 0.0)):
        off, metrics, events = mirror(url, sample_rate=rate)
        await off.start()
        off.offer(new_record(0, False), CHAT, shape, b"{}", DEFAULT)
        assert not off.enabled and off.in_flight == 0 and not off._tasks
        assert counts(metrics) == {} and events.getvalue() == ""
        await off.stop()


async def test_sampled_share_is_about_the_rate_and_unsampled_are_not_counted() -> None:
    """All sampled offers are dropped here (a lane has a waiter), so each one is counted and
    none is sent: the count is the sample."""
    sampler, metrics, _ = mirror("http://127.0.0.1:9", sample_rate=0.25)
    waiter = SimpleNamespace(tenant="default", enqueued_at=0.0, prompt_tokens=1)
    queued = route_to("*")
    queued.pool.scheduler.lane("only").queue.push(waiter)
    await sampler.start()
    shape = await shape_of(chat(max_tokens=2))
    for index in range(2000):
        sampler.offer(new_record(index, False), CHAT, shape, b"{}", queued)
    sampled = counts(metrics)[shadow.DROPPED_QUEUED]
    assert 400 <= sampled <= 600, sampled
    assert sampler.in_flight == 0
    await sampler.stop()


async def test_over_its_concurrency_a_mirror_is_dropped_and_shutdown_aborts_the_rest(
    hanging_backend: tuple[str, list[web.Request]],
) -> None:
    url, seen = hanging_backend
    hung, metrics, events = mirror(url, max_concurrency=3)
    await hung.start()
    shape = await shape_of(chat(max_tokens=2))
    body = msgspec.json.encode(shape.body)
    for index in range(5):
        hung.offer(new_record(index, False), CHAT, shape, body, DEFAULT)
    assert hung.in_flight == 3
    for _ in range(100):
        if len(seen) == 3:
            break
        await asyncio.sleep(0.02)
    assert len(seen) == 3
    assert counts(metrics)[shadow.DROPPED_CONCURRENCY] == 2
    started = time.perf_counter()
    await hung.stop()
    assert time.perf_counter() - started < 2.0  # aborted, not waited for
    assert counts(metrics)[shadow.ABORTED] == 3 and counts(metrics)[shadow.OK] == 0
    assert hung.in_flight == 0 and not hung._tasks
    in_flight = next(
        s.value
        for f in metrics.registry.collect()
        for s in f.samples
        if s.name == "gateway_shadow_in_flight"
    )
    assert in_flight == 0
    assert compared(events) == []  # an aborted mirror compares nothing


async def test_while_the_loop_runs_late_new_mirrors_are_dropped() -> None:
    late, metrics, _ = mirror(f"http://127.0.0.1:{free_port()}")
    await late.start()
    await asyncio.sleep(0.15)  # the probe's first samples: an idle loop
    shape = await shape_of(chat(max_tokens=2))
    late.offer(new_record(0, False), CHAT, shape, b"{}", DEFAULT)
    assert counts(metrics)[shadow.DROPPED_LOOP_LAG] == 0
    time.sleep(0.3)  # noqa: ASYNC251 - the point: the loop is blocked
    await asyncio.sleep(0.15)  # the probe wakes 0.3 s late and says so
    late.offer(new_record(1, False), CHAT, shape, b"{}", DEFAULT)
    assert counts(metrics)[shadow.DROPPED_LOOP_LAG] == 1
    await late.stop()


async def test_a_streamed_mirror_is_measured_like_the_primary(
    start_simulator_at: StartSimulator,
) -> None:
    """Against a real simulator: the candidate's TTFT, TPOT and tokens come from its stream,
    and the line waits for the primary to finish (its figures are final in it)."""
    candidate = await start_simulator_at(model="candidate", step_base_ms=10)
    measured, metrics, events = mirror(candidate, model="candidate")
    await measured.start()
    shape = await shape_of(chat(max_tokens=12, stream=True))
    body = msgspec.json.encode(CHAT.backend_body(shape, OutputBudget(12, 12, clamped=False)))
    record = new_record(0, True)

    async def primary() -> None:
        measured.offer(record, CHAT, shape, body, DEFAULT)
        await asyncio.sleep(0.6)  # the primary streams longer than the candidate
        record.first_token, record.end = record.dispatched + 0.05, clock()  # type: ignore[operator]
        record.completion_tokens, record.status, record.outcome = 12, 200, Outcome.OK

    await asyncio.create_task(primary())
    for _ in range(100):
        if compared(events):
            break
        await asyncio.sleep(0.02)
    [line] = compared(events)
    assert line["level"] == "info" and line["shadow_outcome"] == "ok"
    assert line["shadow_status"] == 200 and line["shadow_completion_tokens"] == 12
    assert 0 < line["shadow_ttft_ms"] < 1000 and line["shadow_tpot_ms"] >= 10 * 0.9
    assert line["primary_completion_tokens"] == 12 and line["primary_e2e_ms"] >= 500
    assert counts(metrics)[shadow.OK] == 1
    await measured.stop()


# --------------------------------------------------------------- several models, one candidate


def test_without_models_only_the_default_pools_requests_are_the_candidates() -> None:
    every, _, _ = mirror("http://127.0.0.1:9")
    assert every.covers("sim-model", DEFAULT) and every.covers(None, DEFAULT)
    assert not every.covers("code", route_to("code", ("code",)))


def test_listed_models_match_as_asked_as_sent_or_by_the_pool_of_a_nameless_request() -> None:
    chat_only, _, _ = mirror("http://127.0.0.1:9", models=["llama-3-8b", "chat"])
    llama = route_to("llama-3-8b", ("llama-3-8b",))
    assert chat_only.covers("llama-3-8b", llama)
    assert chat_only.covers("chat", route_to("qwen", ("qwen",), target="qwen"))  # the alias
    assert chat_only.covers("canary", route_to("x", ("llama-3-8b",), target="llama-3-8b"))
    assert chat_only.covers(None, llama)  # TGI's routes: its pool's model
    assert not chat_only.covers("code", route_to("code", ("code",)))
    assert not chat_only.covers(None, route_to("code", ("code",)))
    # The default pool is no exception once models are listed.
    assert not chat_only.covers("sim-model", DEFAULT)


async def test_another_models_traffic_is_never_mirrored_nor_counted() -> None:
    only_chat, metrics, _ = mirror("http://127.0.0.1:9", models=["chat"])
    await only_chat.start()
    shape = await shape_of(chat(max_tokens=2))
    only_chat.offer(new_record(0, False), CHAT, shape, b"{}", route_to("code", ("code",)))
    assert only_chat.in_flight == 0 and not only_chat._tasks
    assert sum(counts(metrics).values()) == 0
    await only_chat.stop()


async def test_a_queue_in_the_requests_own_pool_drops_it_not_one_in_another() -> None:
    mirrors, metrics, _ = mirror(f"http://127.0.0.1:{free_port()}", models=["a", "b"])
    await mirrors.start()
    loaded, calm = route_to("a", ("a",)), route_to("b", ("b",))
    waiter = SimpleNamespace(tenant="default", enqueued_at=0.0, prompt_tokens=1)
    loaded.pool.scheduler.lane("only").queue.push(waiter)
    shape = await shape_of(chat(max_tokens=2))
    record_a, record_b = new_record(0, False), new_record(1, False)
    record_a.model, record_b.model = "a", "b"
    mirrors.offer(record_a, CHAT, shape, b"{}", loaded)
    assert counts(metrics)[shadow.DROPPED_QUEUED] == 1 and mirrors.in_flight == 0
    mirrors.offer(record_b, CHAT, shape, b"{}", calm)
    assert counts(metrics)[shadow.DROPPED_QUEUED] == 1 and mirrors.in_flight == 1
    await mirrors.stop()


def test_a_shadow_model_no_backend_names_is_warned_about() -> None:
    backends = [BackendSettings(url="http://10.0.0.1:8000", name="a", models=["chat"])]
    typo = Settings(backends=backends, shadow=ShadowSettings(url="http://c:1", models=["caht"]))
    assert any("[shadow].models: caht" in w for w in consistency_warnings(typo))
    named = Settings(backends=backends, shadow=ShadowSettings(url="http://c:1", models=["chat"]))
    assert not any("[shadow]" in w for w in consistency_warnings(named))
    catch_all = [BackendSettings(url="http://10.0.0.1:8000", name="a")]
    anything = Settings(backends=catch_all, shadow=ShadowSettings(url="http://c:1", models=["x"]))
    assert not any("[shadow]" in w for w in consistency_warnings(anything))
