"""Which pool serves a `model`: pools per served list, aliases, adapters, the catch-all."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest

from gateway.config import BackendSettings as B
from gateway.config import (
    ConfigError,
    LimitsSettings,
    ModelLimits,
    ModelSettings,
    ModelTarget,
    Settings,
    validate,
)
from gateway.outcomes import ModelNotFound
from gateway.upstream.models import CATCH_ALL, ModelPool, ModelRouter, pool_key
from gateway.upstream.pool import Backend, BackendPool


def model_pool(name: str, serves: Sequence[str], *, adapters: Sequence[str] = ()) -> ModelPool:
    backend = Backend.from_settings(B(url="http://127.0.0.1:1", name=f"{name}-0"))
    backend.lora.note_listed(adapters)
    pool = BackendPool([backend], clock=lambda: 0.0)
    return ModelPool(name, frozenset(serves), pool, None, None, None)


def first_choice(names: Sequence[str], weights: Sequence[float]) -> str:
    return names[0]


def test_a_model_goes_to_the_pool_that_serves_it() -> None:
    chat, code = model_pool("llama", ["llama"]), model_pool("coder", ["coder", "coder-fast"])
    router = ModelRouter([chat, code])
    assert router.resolve("llama").pool is chat
    assert router.resolve("coder-fast").pool is code
    assert router.resolve("coder").target is None  # not an alias: the body is left be


def test_an_unknown_model_is_model_not_found_naming_what_is_served() -> None:
    router = ModelRouter(
        [model_pool("llama", ["llama"])], [ModelSettings(name="chat", target="llama")]
    )
    with pytest.raises(ModelNotFound) as refused:
        router.resolve("nonexistent-model")
    assert refused.value.param == "model" and refused.value.code == "model_not_found"
    assert "'nonexistent-model'" in refused.value.message
    assert "llama, chat" in refused.value.message


def test_the_catch_all_pool_takes_any_name_the_others_do_not_serve() -> None:
    named, anything = model_pool("llama", ["llama"]), model_pool(CATCH_ALL, [])
    router = ModelRouter([named, anything])
    assert router.resolve("llama").pool is named
    assert router.resolve("whatever").pool is anything
    assert router.resolve(None).pool is named  # no model (TGI): the first pool


def test_an_alias_sends_its_target_to_the_target_s_pool() -> None:
    chat, code = model_pool("llama", ["llama"]), model_pool("coder", ["coder"])
    router = ModelRouter([chat, code], [ModelSettings(name="assistant", target="coder")])
    route = router.resolve("assistant")
    assert route.pool is code and route.target == "coder"


def test_weighted_targets_split_by_weight() -> None:
    alias = ModelSettings(
        name="chat",
        targets=[ModelTarget(model="old", weight=9.0), ModelTarget(model="new", weight=1.0)],
    )
    router = ModelRouter([model_pool("old", ["old"]), model_pool("new", ["new"])], [alias])
    random.seed(7)
    counts = Counter(router.resolve("chat").target for _ in range(4000))
    assert 0.87 < counts["old"] / 4000 < 0.93
    picked = ModelRouter(
        [model_pool("old", ["old"]), model_pool("new", ["new"])], [alias], pick=first_choice
    )
    assert picked.resolve("chat").target == "old"


def test_an_adapter_goes_to_the_pool_whose_backends_list_it() -> None:
    base, other = (
        model_pool("llama", ["llama"], adapters=["sql-lora"]),
        model_pool("qwen", ["qwen"]),
    )
    router = ModelRouter([other, base])
    assert router.resolve("sql-lora").pool is base
    assert "sql-lora" in router.listed_names()


def test_the_default_model_is_the_tgi_routes_pool() -> None:
    chat, code = model_pool("llama", ["llama"]), model_pool("coder", ["coder"])
    router = ModelRouter([chat, code], [ModelSettings(name="coder", default=True)])
    assert router.default is code and router.resolve(None).pool is code


def test_listed_names_are_served_models_adapters_then_aliases_each_once() -> None:
    router = ModelRouter(
        [model_pool("a", ["b", "a"], adapters=["x"]), model_pool("c", ["c"])],
        [ModelSettings(name="a"), ModelSettings(name="z", target="c")],
    )
    assert router.listed_names() == ["a", "b", "x", "c", "z"]


def test_pool_key_names_a_pool_by_its_models_in_order() -> None:
    assert pool_key(["llama", "llama-8b", "llama"]) == "llama,llama-8b"
    assert pool_key([]) == CATCH_ALL


def settings_with(backends: list[B], models: list[ModelSettings]) -> Settings:
    return validate(Settings(backends=backends, models=models))


def test_config_refuses_an_alias_no_backend_serves() -> None:
    backends = [B(url="http://127.0.0.1:1", models=["llama"])]
    with pytest.raises(ConfigError, match="no backend serves coder"):
        settings_with(backends, [ModelSettings(name="chat", target="coder")])
    with pytest.raises(ConfigError, match="target or targets, not both"):
        settings_with(
            backends,
            [ModelSettings(name="c", target="llama", targets=[ModelTarget(model="llama")])],
        )
    with pytest.raises(ConfigError, match="more than one default"):
        settings_with(
            backends,
            [
                ModelSettings(name="a", target="llama", default=True),
                ModelSettings(name="llama", default=True),
            ],
        )
    with pytest.raises(ConfigError, match="duplicate model name"):
        settings_with(backends, [ModelSettings(name="llama"), ModelSettings(name="llama")])
    # A catch-all backend serves any name, so any target is fine.
    settings_with([*backends, B(url="http://127.0.0.1:2")], [ModelSettings(name="c", target="x")])


def test_a_route_carries_the_caps_of_the_model_asked() -> None:
    base = LimitsSettings(max_prompt_tokens=8000)
    small = ModelSettings(name="small", limits=ModelLimits(max_prompt_tokens=4096))
    fast = ModelSettings(name="fast", target="small", default=True)
    router = ModelRouter(
        [model_pool("big", ["big"]), model_pool("small", ["small"])],
        [small, fast],
        limits=base,
    )
    assert router.resolve("big").limits is base  # no entry: [limits] itself
    assert router.resolve("small").limits.max_prompt_tokens == 4096
    assert router.resolve("fast").limits.max_prompt_tokens == 4096  # its target's entry
    # TGI's routes carry no model: the default entry's caps.
    assert router.resolve(None).limits.max_prompt_tokens == 4096
    assert router.resolve(None).pool.name == "small"
