"""What a backend without `models` serves: its engine's listing, and who answers any name."""

from __future__ import annotations

import pytest

from gateway.config import BackendSettings as B
from gateway.config import ConfigError, Settings, validate
from gateway.outcomes import ModelNotFound, NoBackend
from gateway.scheduling.scheduler import Deferred
from gateway.upstream.membership import _update
from gateway.upstream.models import CATCH_ALL, ModelPool, ModelRouter
from gateway.upstream.pool import Backend, BackendPool, RouteHint
from gateway.upstream.served import ServedModels, answers_any_name, serving
from gateway.upstream.telemetry import (
    ModelListing,
    engine_from_props,
    listing_from_models,
    listing_from_tgi_info,
)


def listed(*names: str, engine: str | None = "vllm", strict: bool | None = None) -> ModelListing:
    return ModelListing(frozenset(names), engine, strict)


def backend(name: str, listing: ModelListing | None = None, **settings: object) -> Backend:
    one = Backend.from_settings(B(url=f"http://127.0.0.1:1/{name}", name=name, **settings))
    if listing is not None:
        one.served.note(listing, None)
    return one


def catch_all(*backends: Backend) -> ModelPool:
    return ModelPool(
        CATCH_ALL, frozenset(), BackendPool(list(backends), clock=lambda: 0.0), *[None] * 3
    )


@pytest.mark.parametrize(
    ("mode", "engine", "strict", "expected"),
    [
        ("auto", "vllm", None, False),
        ("auto", "sglang", None, False),
        ("auto", "llama.cpp", None, True),
        ("auto", "tgi", None, True),  # TGI ignores `model`: its clients send "tgi"
        ("auto", "simulator", None, True),
        ("auto", "simulator", True, False),
        ("auto", None, None, False),  # lists names, says nothing else: as OpenAI's API
        ("listed", "llama.cpp", None, False),
        ("any", "vllm", None, True),
    ],
)
def test_which_engines_answer_any_name(
    mode: str, engine: str | None, strict: bool | None, expected: bool
) -> None:
    assert answers_any_name(mode, engine, strict) is expected  # type: ignore[arg-type]


def test_a_failed_listing_keeps_the_last_one_and_says_so_once() -> None:
    served = ServedModels()
    assert served.answers_unlisted() and not served.known  # not read yet: as before
    assert served.note(listed("alpha"), None) == "listed"
    assert served.names == {"alpha"} and not served.answers_unlisted()
    assert served.note(listed("alpha"), None) is None  # unchanged: no line
    assert served.note(None, None) == "failed"
    assert served.note(None, None) is None  # still failing: one line, not one per check
    assert served.names == {"alpha"} and served.failures == 2
    assert served.note(listed("beta"), None) == "listed"  # a model swapped later is followed
    assert served.names == {"beta"} and not served.failing


def test_an_unknown_engine_that_lists_nothing_answers_any_name() -> None:
    served = ServedModels()
    served.note(listed(engine=None), None)
    assert served.names == frozenset() and served.any_name
    assert not answers_any_name("auto", "vllm", None, lists_any=False)  # vLLM: nothing served


def test_the_configured_engine_wins_over_what_the_listing_says() -> None:
    served = ServedModels()
    served.note(listed("model.gguf", engine=None), "llama.cpp")
    assert served.any_name and served.engine == "llama.cpp"


def test_serves_any_reads_nothing_and_models_are_the_config() -> None:
    assert ServedModels.configured([], "any") == ServedModels("any", False, None, True)
    configured = ServedModels.configured(["alpha"], "auto")
    assert not configured.from_engine and configured.names == {"alpha"}
    with pytest.raises(ConfigError, match=r"serves: only without models"):
        validate(Settings(backends=[B(url="http://h:1", models=["a"], serves="listed")]))


def test_a_request_goes_to_those_that_list_its_model_else_to_those_that_answer_any() -> None:
    alpha, beta = backend("a", listed("alpha")), backend("b", listed("beta"))
    llama = backend("l", listed("model.gguf", engine="llama.cpp"))
    unread = backend("u")
    assert serving("alpha", [alpha, beta, llama]) == [alpha]
    assert serving("model.gguf", [alpha, beta, llama]) == [llama]
    assert serving("other", [alpha, beta, llama, unread]) == [llama, unread]
    assert serving("other", [alpha, beta]) == []
    # Nothing known of it (not read yet, or its engine lists nothing): every name, as before.
    assert serving("alpha", [alpha, llama, unread]) == [alpha, unread]
    assert serving("alpha", [alpha, backend("any", serves="any")])[1].name == "any"
    adapter = backend("lora", listed("base", "sql-lora"))
    adapter.lora.note_listed(["sql-lora"])
    assert serving("sql-lora", [alpha, adapter]) == [adapter]


def test_the_catch_all_pool_routes_by_what_its_engines_list() -> None:
    alpha, beta = backend("a", listed("alpha")), backend("b", listed("beta"))
    router = ModelRouter([catch_all(alpha, beta)])
    assert router.resolve("alpha").model == "alpha"
    with pytest.raises(ModelNotFound) as refused:
        router.resolve("zeta")
    assert "Served: alpha, beta." in refused.value.message
    assert router.listed_names() == ["alpha", "beta"]
    # An engine that answers any name takes the names nobody lists, as before.
    router = ModelRouter([catch_all(alpha, backend("l", listed("m.gguf", engine="llama.cpp")))])
    assert router.resolve("zeta").pool.name == CATCH_ALL


def test_the_pool_hands_a_slot_only_on_a_backend_that_serves_the_model() -> None:
    alpha, beta = backend("a", listed("alpha")), backend("b", listed("beta"))
    pool = BackendPool([alpha, beta], clock=lambda: 0.0)
    for _ in range(4):
        slot = pool.try_take("interactive", 10, 10, hint=RouteHint(model="beta"))
        assert slot is not None and not isinstance(slot, Deferred)
        assert slot.backend is beta and slot.model == "beta"
    beta.in_flight = beta.max_concurrency  # beta full, alpha free: beta's request waits aside
    assert isinstance(pool.try_take("interactive", 10, 10, hint=RouteHint(model="beta")), Deferred)
    held = pool.try_take("interactive", 10, 10, hint=RouteHint(model="alpha"))
    assert held is not None and not isinstance(held, Deferred) and held.backend is alpha
    assert pool.take_over("interactive", held) is None  # beta does not serve alpha
    beta.healthy = False
    with pytest.raises(NoBackend, match="No healthy backend serves 'beta'"):
        pool.require_available("interactive", "beta")


def test_listings_are_read_from_models_tgi_info_and_props() -> None:
    models = {
        "object": "list",
        "data": [
            {"id": "llama", "owned_by": "vllm", "parent": None},
            {"id": "sql-lora", "owned_by": "vllm", "parent": "llama"},
        ],
    }
    assert listing_from_models(models) == listed("llama", "sql-lora")
    assert listing_from_models({"data": [{"id": "x", "owned_by": "llamacpp"}]}) == listed(
        "x", engine="llama.cpp"
    )
    assert listing_from_models({"data": []}) == listed(engine=None)
    assert listing_from_models({"error": "nope"}) is None
    assert listing_from_tgi_info({"model_id": "bigscience/bloom"}) == listed(
        "bigscience/bloom", engine="tgi"
    )
    assert listing_from_tgi_info({"model_id": ""}) is None
    props = {"total_slots": 4, "simulator": {"prefill": "chunked", "strict_model": True}}
    assert engine_from_props(props) == ("simulator", True)
    assert engine_from_props({"total_slots": 4}) == ("llama.cpp", None)
    assert engine_from_props(None) == (None, None)


def test_a_lane_kept_off_a_models_backends_does_not_send_it_to_one_that_answers_any() -> None:
    vllm = backend("v", listed("alpha"))
    llama = backend("l", listed("m.gguf", engine="llama.cpp"))
    pool = BackendPool([vllm, llama], lane_backends={"bulk": ["l"]}, clock=lambda: 0.0)
    assert isinstance(pool.try_take("bulk", 10, 10, hint=RouteHint(model="alpha")), Deferred)
    with pytest.raises(NoBackend, match="'alpha' in the 'bulk' lane"):
        pool.require_available("bulk", "alpha")
    slot = pool.try_take("bulk", 10, 10, hint=RouteHint(model="other"))
    assert slot is not None and not isinstance(slot, Deferred) and slot.backend is llama


def test_a_reload_that_changes_serves_reads_the_backend_anew() -> None:
    one = backend("a", listed("alpha"))
    assert _update(one, B(url="http://127.0.0.1:1/a", name="a", serves="any"), None)
    assert one.served == ServedModels("any", False, None, True)  # any name, nothing to read
    assert _update(one, B(url="http://127.0.0.1:1/a", name="a"), None)
    assert one.served.from_engine and not one.served.known  # read at the next check
    assert not _update(one, B(url="http://127.0.0.1:1/a", name="a"), None)
