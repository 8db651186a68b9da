"""Per-model caps: `[[models]] limits` over `[limits]`, read from TOML, checked, inherited."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import (
    BackendSettings,
    ConfigError,
    LimitsSettings,
    ModelLimits,
    ModelSettings,
    ModelTarget,
    Settings,
    consistency_warnings,
    default_lanes,
    load_settings,
    model_limits,
    validate,
)

TWO_MODELS = """
[limits]
max_prompt_tokens = 8000
default_max_tokens = 200
max_output_tokens = 1000

[[backends]]
url = "http://127.0.0.1:9001"
models = ["big"]
[[backends]]
url = "http://127.0.0.1:9002"
models = ["small"]
"""


def load(tmp_path: Path, text: str) -> Settings:
    path = tmp_path / "gateway.toml"
    path.write_text(TWO_MODELS + text, encoding="utf-8")
    return load_settings(path, env={})


def test_an_inline_table_and_a_sub_table_read_the_same(tmp_path: Path) -> None:
    inline = load(
        tmp_path,
        '[[models]]\nname = "small"\nlimits = { max_prompt_tokens = 4096, context_window = 8192 }\n',
    )
    sub_table = load(
        tmp_path,
        '[[models]]\nname = "small"\n[models.limits]\nmax_prompt_tokens = 4096\n'
        "context_window = 8192\n",
    )
    assert inline.models == sub_table.models
    assert inline.models[0].limits == ModelLimits(max_prompt_tokens=4096, context_window=8192)


def test_unset_keys_inherit_the_limits_table(tmp_path: Path) -> None:
    settings = load(tmp_path, '[[models]]\nname = "small"\nlimits = { max_prompt_tokens = 4096 }\n')
    table = model_limits(settings.models, settings.limits)
    assert table == {
        ("small", "small"): LimitsSettings(
            max_prompt_tokens=4096, default_max_tokens=200, max_output_tokens=1000
        )
    }
    # A name without an entry (big) is not in the map: it has [limits].
    assert ("big", "big") not in table


def test_an_alias_takes_its_target_s_caps_under_its_own() -> None:
    models = [
        ModelSettings(name="small", limits=ModelLimits(context_window=8192, max_output_tokens=500)),
        ModelSettings(name="fast", target="small", limits=ModelLimits(max_output_tokens=100)),
        ModelSettings(name="plain", target="small"),
        ModelSettings(
            name="canary",
            targets=[ModelTarget(model="big"), ModelTarget(model="small")],
        ),
    ]
    table = model_limits(models, LimitsSettings(default_max_tokens=64))
    assert table[("fast", "small")].max_output_tokens == 100  # its own wins
    assert table[("fast", "small")].context_window == 8192  # the target's
    assert table[("plain", "small")] == table[("small", "small")]
    # Each target of a weighted alias keeps its own caps.
    assert table[("canary", "small")].context_window == 8192
    assert ("canary", "big") not in table
    assert all(limits.default_max_tokens == 64 for limits in table.values())


def test_a_default_over_the_model_s_output_cap_is_refused_naming_the_entry(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError) as refused:
        load(tmp_path, '[[models]]\nname = "small"\nlimits = { max_output_tokens = 100 }\n')
    assert str(refused.value) == (
        "[[models]] small.limits.default_max_tokens: must not exceed max_output_tokens (200 > 100)"
    )
    # The same rule, reached through an alias over its target's entry.
    models = [
        ModelSettings(name="small", limits=ModelLimits(default_max_tokens=300)),
        ModelSettings(name="fast", target="small", limits=ModelLimits(max_output_tokens=250)),
    ]
    backends = [BackendSettings(url="http://127.0.0.1:1", models=["small"])]
    with pytest.raises(
        ConfigError,
        match=r"^\[\[models\]\] fast\.limits\.default_max_tokens: "
        r"must not exceed max_output_tokens \(300 > 250, with small's limits\)$",
    ):
        validate(Settings(backends=backends, models=models))


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ("max_prompt_tokens = 0", "[[models]] small.limits.max_prompt_tokens: must be > 0, got 0"),
        (
            "context_window = -1",
            "[[models]] small.limits.context_window: must be >= 0 (0: unknown), got -1",
        ),
        (
            'max_output_tokens = "lots"',
            "[[models]] small.limits.max_output_tokens: expected an integer, got 'lots'",
        ),
        ("max_n = 2", "[[models]] small.limits: unknown key 'max_n'"),
    ],
)
def test_a_bad_cap_names_the_model_entry_and_the_key(
    tmp_path: Path, limits: str, message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        load(tmp_path, f'[[models]]\nname = "small"\nlimits = {{ {limits} }}\n')
    assert str(refused.value) == message


def test_caps_for_a_name_no_backend_serves_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no backend serves tiny"):
        load(tmp_path, '[[models]]\nname = "tiny"\nlimits = { max_prompt_tokens = 10 }\n')


def test_a_bad_value_inside_an_array_of_tables_names_its_item(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        load(
            tmp_path,
            '[[models]]\nname = "canary"\n'
            'targets = [{ model = "big" }, { model = "small", weight = "x" }]\n',
        )
    assert str(refused.value) == "[[models]] canary.targets[1].weight: expected a number, got 'x'"


def test_a_model_cap_above_the_last_lane_s_is_warned() -> None:
    settings = validate(
        Settings(
            backends=[BackendSettings(url="http://127.0.0.1:1", models=["small"])],
            lanes=[default_lanes()[0]],  # interactive only: prompts up to 1024
            limits=LimitsSettings(max_prompt_tokens=1000, default_max_tokens=200),
            models=[ModelSettings(name="small", limits=ModelLimits(max_prompt_tokens=4096))],
        )
    )
    assert (
        "[[models]] small.limits.max_prompt_tokens (4096) > the last lane's (interactive, "
        "1024): larger requests for it fit no lane"
    ) in consistency_warnings(settings)
