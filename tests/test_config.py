"""Settings: defaults, TOML file, GATEWAY_* environment, CLI overrides, and one-line errors.

The environment is always passed with `env=` so the tests never read or change
the real one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gateway.config import (
    DEFAULT_MAX_CONCURRENCY,
    ApiKeySettings,
    BackendSettings,
    ConfigError,
    LaneSettings,
    ServerSettings,
    Settings,
    consistency_warnings,
    load_settings,
    unrecognized_env_names,
    validate,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def write_toml(tmp_path: Path, text: str, name: str = "gateway.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def lane(settings: Settings, name: str) -> LaneSettings:
    return next(ln for ln in settings.lanes if ln.name == name)


# --- defaults ----------------------------------------------------------------------------


def test_defaults() -> None:
    settings = load_settings(env={})
    assert (settings.server.host, settings.server.port) == ("127.0.0.1", 8080)
    assert settings.server.max_body_bytes == 4 * 1024 * 1024
    assert settings.tokenizer.encoding == "cl100k_base"
    limits = settings.limits
    assert (limits.max_prompt_tokens, limits.default_max_tokens, limits.max_output_tokens) == (
        32_768,
        256,
        1024,
    )
    assert (limits.on_max_tokens_over, limits.context_window, limits.max_n) == ("clamp", 0, 16)
    assert settings.backends == []
    assert settings.timeouts.total_s == 600.0
    assert settings.logging.level == "info"


def test_default_lanes_are_interactive_then_bulk() -> None:
    settings = load_settings(env={})
    assert [ln.name for ln in settings.lanes] == ["interactive", "bulk"]
    interactive, bulk = settings.lanes
    assert (interactive.max_prompt_tokens, interactive.max_output_tokens) == (1024, 256)
    assert (interactive.queue_timeout_s, interactive.max_queue_depth) == (5.0, 256)
    assert interactive.max_slot_share == 1.0
    assert interactive.promote_after_s is None
    assert (bulk.max_prompt_tokens, bulk.max_output_tokens) == (None, None)
    assert (bulk.queue_timeout_s, bulk.max_queue_depth) == (30.0, 64)
    assert (bulk.max_slot_share, bulk.min_slots, bulk.promote_after_s) == (1.0, 0, 10.0)


def test_bulk_may_use_every_slot_by_default() -> None:
    settings = Settings(
        backends=[
            BackendSettings(url="http://a:1", name="a", max_concurrency=8),
            BackendSettings(url="http://b:1", name="b", max_concurrency=8),
        ]
    )
    assert settings.total_slots == 16
    assert settings.lane_slot_limit(lane(settings, "interactive")) == 16
    # Work-conserving: bulk gives slots back under pressure (scheduler), it is not capped.
    assert settings.lane_slot_limit(lane(settings, "bulk")) == 16


def test_slot_limit_rounds_down_and_is_at_least_one() -> None:
    half = LaneSettings(name="half", max_slot_share=0.5)
    three = Settings(backends=[BackendSettings(url="http://a:1", name="a", max_concurrency=3)])
    assert three.lane_slot_limit(half) == 1
    one = Settings(backends=[BackendSettings(url="http://a:1", name="a", max_concurrency=1)])
    assert one.lane_slot_limit(half) == 1
    assert Settings().lane_slot_limit(half) == 1  # no backends at all


def test_unset_concurrency_counts_as_the_default_until_the_engine_says() -> None:
    settings = Settings(backends=[BackendSettings(url="http://a:1", name="a")])
    assert settings.backends[0].max_concurrency is None
    assert settings.total_slots == DEFAULT_MAX_CONCURRENCY


def test_absolute_slot_limit_applies_when_smaller() -> None:
    settings = Settings(backends=[BackendSettings(url="http://a:1", name="a", max_concurrency=10)])
    assert settings.lane_slot_limit(LaneSettings(name="x", max_slots=2, max_slot_share=0.5)) == 2
    assert settings.lane_slot_limit(LaneSettings(name="x", max_slots=9, max_slot_share=0.5)) == 5


@pytest.mark.parametrize(("slots", "share", "expected"), [(90, 0.7, 63), (100, 0.29, 29)])
def test_slot_share_is_not_lost_to_float_rounding(slots: int, share: float, expected: int) -> None:
    settings = Settings(
        backends=[BackendSettings(url="http://a:1", name="a", max_concurrency=slots)]
    )
    assert settings.lane_slot_limit(LaneSettings(name="x", max_slot_share=share)) == expected


def test_default_settings_have_no_consistency_warnings() -> None:
    assert consistency_warnings(load_settings(env={})) == []


def test_the_documented_example_config_loads() -> None:
    settings = load_settings(REPO_ROOT / "config" / "gateway.toml", env={})
    assert [ln.name for ln in settings.lanes][:1] == ["interactive"]


# --- the TOML file -------------------------------------------------------------------------


FULL_TOML = """
[server]
port = 9090

[limits]
max_output_tokens = 2048
on_max_tokens_over = "reject"
context_window = 8192

[timeouts]
total_s = 120

[[backends]]
url = "http://10.0.0.1:8000"
max_concurrency = 4

[[backends]]
url = "https://gpu-2.internal:8443"
name = "gpu2"

[[lanes]]
name = "chat"
max_prompt_tokens = 512
max_output_tokens = 128
queue_timeout_s = 2

[[lanes]]
name = "agent"
max_prompt_tokens = 8192
max_slots = 3

[[lanes]]
name = "batch"
max_slot_share = 0.25
promote_after_s = 20.0
reject_predicted_wait = false
"""


def test_toml_overrides_sections_and_keeps_other_defaults(tmp_path: Path) -> None:
    settings = load_settings(write_toml(tmp_path, FULL_TOML), env={})
    assert settings.server.port == 9090
    assert settings.server.host == "127.0.0.1"  # not in the file: default
    assert settings.limits.max_output_tokens == 2048
    assert settings.limits.on_max_tokens_over == "reject"
    assert settings.limits.context_window == 8192
    assert settings.limits.default_max_tokens == 256
    assert settings.timeouts.total_s == 120.0
    assert isinstance(settings.timeouts.total_s, float)
    assert settings.timeouts.connect_s == 5.0


def test_toml_backends(tmp_path: Path) -> None:
    settings = load_settings(write_toml(tmp_path, FULL_TOML), env={})
    assert [(b.url, b.name, b.max_concurrency) for b in settings.backends] == [
        ("http://10.0.0.1:8000", "10.0.0.1:8000", 4),  # name defaults to host:port
        ("https://gpu-2.internal:8443", "gpu2", None),  # None: the engine's, or 8
    ]
    assert settings.total_slots == 12


def test_toml_lanes_replace_the_defaults(tmp_path: Path) -> None:
    settings = load_settings(write_toml(tmp_path, FULL_TOML), env={})
    assert [ln.name for ln in settings.lanes] == ["chat", "agent", "batch"]
    chat, agent, batch = settings.lanes
    assert (chat.max_prompt_tokens, chat.max_output_tokens, chat.queue_timeout_s) == (512, 128, 2.0)
    assert (agent.max_prompt_tokens, agent.max_output_tokens, agent.max_slots) == (8192, None, 3)
    assert agent.queue_timeout_s == 30.0  # LaneSettings default
    assert (batch.max_slot_share, batch.promote_after_s) == (0.25, 20.0)
    assert batch.reject_predicted_wait is False
    assert settings.lane_slot_limit(agent) == 3
    assert settings.lane_slot_limit(batch) == 3  # floor(12 * 0.25)


# --- the environment -----------------------------------------------------------------------


def test_env_overrides_a_table_key() -> None:
    settings = load_settings(env={"GATEWAY_SERVER_PORT": "9001"})
    assert settings.server.port == 9001


def test_env_overrides_on_max_tokens_over() -> None:
    settings = load_settings(env={"GATEWAY_LIMITS_ON_MAX_TOKENS_OVER": "reject"})
    assert settings.limits.on_max_tokens_over == "reject"


def test_env_overrides_a_lane_by_name() -> None:
    settings = load_settings(env={"GATEWAY_LANES_BULK_QUEUE_TIMEOUT_S": "45.5"})
    assert lane(settings, "bulk").queue_timeout_s == 45.5
    assert lane(settings, "interactive").queue_timeout_s == 5.0


def test_env_none_clears_an_optional_lane_key() -> None:
    settings = load_settings(env={"GATEWAY_LANES_BULK_PROMOTE_AFTER_S": "none"})
    assert lane(settings, "bulk").promote_after_s is None


def test_env_bool() -> None:
    settings = load_settings(env={"GATEWAY_LANES_INTERACTIVE_REJECT_PREDICTED_WAIT": "off"})
    assert lane(settings, "interactive").reject_predicted_wait is False


def test_env_backends_list_replaces_the_configured_ones(tmp_path: Path) -> None:
    env = {"GATEWAY_BACKENDS": "http://a.local:8000, http://b.local:9000,"}
    settings = load_settings(write_toml(tmp_path, FULL_TOML), env=env)
    assert [(b.url, b.name) for b in settings.backends] == [
        ("http://a.local:8000", "a.local:8000"),
        ("http://b.local:9000", "b.local:9000"),
    ]


def test_env_backend_by_index() -> None:
    env = {
        "GATEWAY_BACKENDS": "http://a.local:8000,http://b.local:9000",
        "GATEWAY_BACKENDS_0_MAX_CONCURRENCY": "3",
    }
    settings = load_settings(env=env)
    assert [b.max_concurrency for b in settings.backends] == [3, None]


MODELS_TOML = """
[[backends]]
url = "http://a.local:8000"
models = ["big", "small"]

[[models]]
name = "chat"
target = "big"
"""


def test_env_models_entry_by_index_and_its_limits(tmp_path: Path) -> None:
    env = {
        "GATEWAY_MODELS_0_TARGET": "small",
        "GATEWAY_MODELS_0_DEFAULT": "yes",
        "GATEWAY_MODELS_0_LIMITS_MAX_PROMPT_TOKENS": "2048",
    }
    settings = load_settings(write_toml(tmp_path, MODELS_TOML), env=env)
    (chat,) = settings.models
    assert (chat.name, chat.target, chat.default) == ("chat", "small", True)
    assert chat.limits is not None and chat.limits.max_prompt_tokens == 2048
    assert unrecognized_env_names(env) == []


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"GATEWAY_MODELS_1_TARGET": "small"}, ["GATEWAY_MODELS_1_TARGET", "existing entry"]),
        ({"GATEWAY_MODELS_0_LIMITS_MAX_PROMPT_TOKENS": "lots"}, ["chat.limits", "integer"]),
        ({"GATEWAY_MODELS_0_LIMITS_MAX_PROMPT_TOKENS": "0"}, ["chat.limits", "> 0"]),
        ({"GATEWAY_MODELS_0_LIMITS_NOPE": "1"}, ["GATEWAY_MODELS_0_LIMITS_NOPE", "'nope'"]),
        ({"GATEWAY_MODELS_0_TARGET": "tiny"}, ["no backend serves tiny"]),
    ],
    ids=["index-past-the-end", "not-an-int", "zero", "unknown-key", "unserved-target"],
)
def test_env_models_errors_name_the_variable_or_key(
    tmp_path: Path, env: dict[str, str], words: list[str]
) -> None:
    with pytest.raises(ConfigError) as error:
        load_settings(write_toml(tmp_path, MODELS_TOML), env=env)
    assert all(word in str(error.value) for word in words), str(error.value)


def test_env_wins_over_the_file(tmp_path: Path) -> None:
    env = {"GATEWAY_SERVER_PORT": "7000", "GATEWAY_LANES_CHAT_QUEUE_TIMEOUT_S": "1.5"}
    settings = load_settings(write_toml(tmp_path, FULL_TOML), env=env)
    assert settings.server.port == 7000
    assert lane(settings, "chat").queue_timeout_s == 1.5


def test_other_variables_are_ignored() -> None:
    env = {"GATEWAY_CONFIG": "/nowhere.toml", "PATH": "/bin", "SERVER_PORT": "1"}
    assert load_settings(env=env).server.port == 8080


@pytest.mark.parametrize(
    ("env", "names"),
    [
        pytest.param(
            {"GATEWAY_SERVER_PORT": "eighty"}, ["GATEWAY_SERVER_PORT", "integer"], id="port-not-int"
        ),
        pytest.param({"GATEWAY_SERVER_PORT": "70000"}, ["[server].port"], id="port-out-of-range"),
        pytest.param(
            {"GATEWAY_SERVER_PROT": "80"}, ["GATEWAY_SERVER_PROT", "'prot'"], id="unknown-key"
        ),
        pytest.param(
            {"GATEWAY_LANES_BULK_QUEUE_TIMEOUT_S": "soon"},
            ["GATEWAY_LANES_BULK_QUEUE_TIMEOUT_S", "number"],
            id="lane-timeout-not-a-number",
        ),
        pytest.param(
            {"GATEWAY_LANES_BULK_QUEUE_TIMEOUT_S": "nan"},
            ["GATEWAY_LANES_BULK_QUEUE_TIMEOUT_S"],
            id="lane-timeout-nan",
        ),
        pytest.param(
            {"GATEWAY_LANES_FAST_QUEUE_TIMEOUT_S": "1"},
            ["GATEWAY_LANES_FAST_QUEUE_TIMEOUT_S", "interactive"],
            id="unknown-lane",
        ),
        pytest.param(
            {"GATEWAY_LANES_BULK_NAME": "x"},
            ["GATEWAY_LANES_BULK_NAME"],
            id="lane-name-not-settable",
        ),
        pytest.param(
            {"GATEWAY_BACKENDS_0_MAX_CONCURRENCY": "3"},
            ["GATEWAY_BACKENDS_0_MAX_CONCURRENCY"],
            id="backend-index-without-backends",
        ),
        pytest.param(
            {"GATEWAY_BACKENDS": "http://a:1", "GATEWAY_BACKENDS_X_MAX_CONCURRENCY": "3"},
            ["GATEWAY_BACKENDS_X_MAX_CONCURRENCY"],
            id="backend-index-not-a-number",
        ),
        pytest.param(
            {"GATEWAY_BACKENDS": "a.local:8000"},
            ["[[backends]] #1.url"],
            id="backend-url-without-scheme",
        ),
        pytest.param(
            {"GATEWAY_LANES_INTERACTIVE_REJECT_PREDICTED_WAIT": "maybe"},
            ["GATEWAY_LANES_INTERACTIVE_REJECT_PREDICTED_WAIT", "true or false"],
            id="bool-not-a-bool",
        ),
        pytest.param(
            {"GATEWAY_LIMITS_ON_MAX_TOKENS_OVER": "truncate"},
            ["[limits].on_max_tokens_over", "truncate"],
            id="on-max-tokens-over-invalid",
        ),
    ],
)
def test_bad_env_values_name_the_key(env: dict[str, str], names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env=env)
    message = str(info.value)
    for name in names:
        assert name in message
    assert "\n" not in message


# --- CLI overrides ---------------------------------------------------------------------------


def test_overrides_win_over_env_and_file(tmp_path: Path) -> None:
    settings = load_settings(
        write_toml(tmp_path, FULL_TOML),
        env={"GATEWAY_SERVER_PORT": "7000", "GATEWAY_BACKENDS": "http://env.local:1"},
        overrides={
            "server.port": 7100,
            "server.host": "0.0.0.0",
            "backends": ["http://cli.local:2"],
        },
    )
    assert (settings.server.host, settings.server.port) == ("0.0.0.0", 7100)
    assert [(b.url, b.name) for b in settings.backends] == [("http://cli.local:2", "cli.local:2")]


def test_none_and_empty_overrides_change_nothing() -> None:
    settings = load_settings(
        env={"GATEWAY_BACKENDS": "http://env.local:1"},
        overrides={"server.port": None, "server.host": None, "backends": []},
    )
    assert settings.server.port == 8080
    assert [b.url for b in settings.backends] == ["http://env.local:1"]


def test_overrides_of_other_sections() -> None:
    settings = load_settings(env={}, overrides={"limits.max_n": 4, "timeouts.total_s": 30})
    assert settings.limits.max_n == 4
    assert settings.timeouts.total_s == 30.0


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        pytest.param({"nope.port": 1}, "nope.port", id="unknown-section"),
        pytest.param({"server.prot": 1}, "server.prot", id="unknown-key"),
        pytest.param({"server.port": "80"}, "server.port", id="wrong-type"),
        pytest.param({"server.port": 0}, "[server].port", id="out-of-range"),
        pytest.param({"backends": ["ftp://x:1"]}, "[[backends]] #1.url", id="bad-url"),
    ],
)
def test_bad_overrides_name_the_key(overrides: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env={}, overrides=overrides)
    assert name in str(info.value)


# --- errors in the file --------------------------------------------------------------------------


BAD_FILES = [
    pytest.param("[bogus]\nx = 1\n", ["[bogus]"], id="unknown-section"),
    pytest.param("[server]\nprot = 8080\n", ["[server]", "'prot'"], id="unknown-key"),
    pytest.param(
        '[[lanes]]\nname = "a"\nspeed = 1\n', ["[[lanes]] #1", "'speed'"], id="unknown-lane-key"
    ),
    pytest.param('[server]\nport = "8080"\n', ["[server].port", "integer"], id="port-a-string"),
    pytest.param("[server]\nport = 8080.0\n", ["[server].port", "integer"], id="port-a-float"),
    pytest.param("[server]\nport = true\n", ["[server].port", "integer"], id="port-a-bool"),
    pytest.param("[server]\nport = 70000\n", ["[server].port", "70000"], id="port-out-of-range"),
    pytest.param(
        '[timeouts]\ntotal_s = "long"\n', ["[timeouts].total_s", "number"], id="timeout-a-string"
    ),
    pytest.param(
        "[timeouts]\nconnect_s = -1\n", ["[timeouts].connect_s", "> 0"], id="negative-timeout"
    ),
    pytest.param("[timeouts]\nidle_s = 0\n", ["[timeouts].idle_s"], id="zero-timeout"),
    pytest.param("[timeouts]\ntotal_s = nan\n", ["[timeouts].total_s"], id="nan-timeout"),
    pytest.param("[timeouts]\ntotal_s = inf\n", ["[timeouts].total_s"], id="inf-timeout"),
    pytest.param(
        '[[backends]]\nurl = "ftp://host:21"\n',
        ["[[backends]] #1.url", "ftp://host:21"],
        id="bad-url-scheme",
    ),
    pytest.param('[[backends]]\nurl = "http://"\n', ["[[backends]] #1.url"], id="url-without-host"),
    pytest.param('[[backends]]\nname = "x"\n', ["[[backends]] #1.url"], id="backend-without-url"),
    pytest.param(
        '[[backends]]\nurl = "http://a:1"\n[[backends]]\nurl = "http://b:1"\nmax_concurrency = 0\n',
        ["[[backends]] #2.max_concurrency"],
        id="backend-zero-slots",
    ),
    pytest.param(
        '[[backends]]\nurl = "http://a:1"\n[[backends]]\nurl = "http://a:1"\n',
        ["[[backends]] #2.name", "a:1"],
        id="duplicate-backend",
    ),
    pytest.param(
        '[[lanes]]\nname = "a"\n[[lanes]]\nname = "a"\n',
        ["[[lanes]] #2.name", "duplicate", "'a'"],
        id="duplicate-lane",
    ),
    pytest.param(
        "[[lanes]]\nmax_prompt_tokens = 10\n", ["[[lanes]] #1.name"], id="lane-without-name"
    ),
    pytest.param(
        '[[lanes]]\nname = "a"\nqueue_timeout_s = -5\n',
        ["[[lanes]] a.queue_timeout_s"],
        id="negative-lane-timeout",
    ),
    pytest.param(
        '[[lanes]]\nname = "a"\nmax_slot_share = 1.5\n',
        ["[[lanes]] a.max_slot_share"],
        id="share-over-one",
    ),
    pytest.param(
        '[[lanes]]\nname = "a"\nmax_prompt_tokens = 0\n',
        ["[[lanes]] a.max_prompt_tokens"],
        id="lane-zero-prompt",
    ),
    pytest.param(
        '[[lanes]]\nname = "a"\npromote_after_s = 0\n',
        ["[[lanes]] a.promote_after_s"],
        id="lane-zero-promote",
    ),
    pytest.param('[lanes]\nname = "a"\n', ["[[lanes]]"], id="lanes-a-table"),
    pytest.param("lanes = []\n", ["[[lanes]]", "at least one"], id="no-lanes"),
    pytest.param("server = 1\n", ["[server]", "table"], id="section-not-a-table"),
    pytest.param(
        '[limits]\non_max_tokens_over = "truncate"\n',
        ["[limits].on_max_tokens_over", "truncate"],
        id="on-max-tokens-over",
    ),
    pytest.param(
        "[limits]\ndefault_max_tokens = 2000\n",
        ["[limits].default_max_tokens"],
        id="default-over-cap",
    ),
    pytest.param(
        "[limits]\ncontext_window = -1\n", ["[limits].context_window"], id="negative-window"
    ),
    pytest.param("[limits]\nmax_n = 0\n", ["[limits].max_n"], id="zero-max-n"),
    pytest.param('[tokenizer]\nencoding = ""\n', ["[tokenizer].encoding"], id="empty-encoding"),
    pytest.param('[logging]\nlevel = "loud"\n', ["[logging].level"], id="bad-log-level"),
]


@pytest.mark.parametrize(("text", "names"), BAD_FILES)
def test_bad_file_values_name_the_key(tmp_path: Path, text: str, names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write_toml(tmp_path, text), env={})
    message = str(info.value)
    for name in names:
        assert name in message
    assert "\n" not in message


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[server\nport = = 1\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    assert "not valid TOML" in str(info.value)
    assert str(path) in str(info.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "absent.toml", env={})


# --- consistency warnings -------------------------------------------------------------------------


def test_warns_when_a_queue_timeout_reaches_the_total_timeout(tmp_path: Path) -> None:
    text = '[timeouts]\ntotal_s = 30\n[[lanes]]\nname = "a"\nqueue_timeout_s = 30\n'
    warnings = consistency_warnings(load_settings(write_toml(tmp_path, text), env={}))
    assert any("[[lanes]] a.queue_timeout_s" in w and "total_s" in w for w in warnings)


def test_no_warning_when_the_queue_timeout_is_shorter(tmp_path: Path) -> None:
    text = '[timeouts]\ntotal_s = 30\n[[lanes]]\nname = "a"\nqueue_timeout_s = 29.9\n'
    warnings = consistency_warnings(load_settings(write_toml(tmp_path, text), env={}))
    assert not any("queue_timeout_s" in w for w in warnings)


def test_warns_when_promotion_comes_after_the_queue_timeout() -> None:
    settings = load_settings(env={"GATEWAY_LANES_BULK_PROMOTE_AFTER_S": "30"})  # queue timeout 30
    warnings = consistency_warnings(settings)
    assert any("[[lanes]] bulk.promote_after_s" in w for w in warnings)
    settings = load_settings(env={"GATEWAY_LANES_BULK_PROMOTE_AFTER_S": "29"})
    assert not any("promote_after_s" in w for w in consistency_warnings(settings))


# --- the check-config command -------------------------------------------------------------------------


def run_check_config(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    return subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_check_config_with_a_bad_file_prints_one_line_naming_the_key(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path, '[[backends]]\nurl = "http://a:1"\n[limits]\nmax_output_tokens = "lots"\n'
    )
    result = run_check_config("--config", str(path))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "[limits].max_output_tokens" in lines[0]
    assert result.stdout == ""


def test_check_config_with_a_good_file_prints_json(tmp_path: Path) -> None:
    text = FULL_TOML.replace("total_s = 120", "total_s = 600")
    result = run_check_config("--config", str(write_toml(tmp_path, text)))
    assert result.returncode == 0, result.stderr
    effective = json.loads(result.stdout)
    assert effective["server"]["port"] == 9090
    assert [ln["name"] for ln in effective["lanes"]] == ["chat", "agent", "batch"]
    assert effective["lane_slot_limits"] == {"chat": 12, "agent": 3, "batch": 3}
    # Unset, the headroom is adapted, and check-config says so; written, it is exact.
    assert all(rule.startswith("adapted") for rule in effective["lane_headroom"].values())
    from gateway.checks.settings import headroom_rule
    from gateway.config import LaneSettings

    written = headroom_rule(LaneSettings(name="x", headroom_wait_probability=0.25))
    assert "25%" in written and "exact" in written and "engine floor" not in written


def test_unrecognized_gateway_env_names_are_reported() -> None:
    from gateway.config import unrecognized_env_names

    env = {
        "GATEWAY_LIMTS_MAX_N": "3",
        "GATEWAY_LIMITS_MAX_N": "3",
        "GATEWAY_CONFIG": "x.toml",
        "GATEWAY_BACKENDS": "http://a:1",
        "GATEWAY_LANES_BULK_QUEUE_TIMEOUT_S": "3",
        "PATH": "/bin",
    }
    assert unrecognized_env_names(env) == ["GATEWAY_LIMTS_MAX_N"]


# --- frozen settings, and the decisions of the msgspec conversion ------------------------------


def test_settings_are_frozen_and_changed_by_replacing() -> None:
    settings = load_settings(env={})
    with pytest.raises(AttributeError):
        settings.server.port = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        settings.backends = []  # type: ignore[misc]
    changed = msgspec.structs.replace(settings, server=ServerSettings(port=9000))
    assert (changed.server.port, settings.server.port) == (9000, 8080)


def test_validate_returns_checked_settings_with_names_filled() -> None:
    built = Settings(
        backends=[BackendSettings(url="http://a.local:1"), BackendSettings(url="http://b:2")],
        api_keys=[ApiKeySettings(key="k" * 8), ApiKeySettings(key="j" * 8, name="mine")],
        lanes=[LaneSettings(name="only", queue_timeout_s=2)],
    )
    checked = validate(built)
    assert [b.name for b in checked.backends] == ["a.local:1", "b:2"]
    assert [k.name for k in checked.api_keys] == ["key1", "mine"]
    assert checked.lanes[0].queue_timeout_s == 2.0
    assert isinstance(checked.lanes[0].queue_timeout_s, float)
    assert [b.name for b in built.backends] == ["", ""]  # the input is left as it was


@pytest.mark.parametrize(
    ("settings", "names"),
    [
        pytest.param(Settings(server=ServerSettings(port=0)), ["[server].port"], id="port"),
        pytest.param(
            Settings(lanes=[LaneSettings(name="a", max_slot_share=float("nan"))]),
            ["[[lanes]] a.max_slot_share", "nan"],
            id="nan-share",
        ),
        pytest.param(
            Settings(backends=[BackendSettings(url="nowhere")]), ["[[backends]] #1.url"], id="url"
        ),
        pytest.param(Settings(lanes=[]), ["[[lanes]]", "at least one"], id="no-lanes"),
    ],
)
def test_validate_checks_settings_built_in_code(settings: Settings, names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        validate(settings)
    for name in names:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        pytest.param("[timeouts]\ntotal_s = -inf\n", ["[timeouts].total_s", "finite"], id="-inf"),
        pytest.param(
            '[[backends]]\nurl = "http://a:1"\nweight = inf\n',
            ["[[backends]] #1.weight", "finite"],
            id="inf-weight",
        ),
        pytest.param(
            '[[lanes]]\nname = "a"\nmax_slot_share = nan\n',
            ["[[lanes]] a.max_slot_share", "nan"],
            id="nan-share",
        ),
    ],
)
def test_non_finite_floats_are_refused(tmp_path: Path, text: str, names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write_toml(tmp_path, text), env={})
    for name in names:
        assert name in str(info.value)


@pytest.mark.parametrize("text", ["inf", "-inf", "infinity", "NaN"])
def test_non_finite_floats_from_env_are_refused_naming_the_variable(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env={"GATEWAY_TIMEOUTS_TOTAL_S": text})
    assert "[timeouts].total_s (from GATEWAY_TIMEOUTS_TOTAL_S)" in str(info.value)


def test_non_finite_override_is_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"\[timeouts\].total_s \(from override timeouts.total_s\)"
    ):
        load_settings(env={}, overrides={"timeouts.total_s": float("nan")})


BOOL_IS_NOT_A_NUMBER = [
    pytest.param("[server]\nuvloop = 1\n", ["[server].uvloop", "true or false"], id="int-bool"),
    pytest.param(
        '[[backends]]\nurl = "http://a:1"\nweight = true\n',
        ["[[backends]] #1.weight", "number"],
        id="bool-float",
    ),
    pytest.param(
        '[[lanes]]\nname = "a"\nmax_slots = false\n',
        ["[[lanes]] a.max_slots", "integer"],
        id="bool-optional-int",
    ),
]


@pytest.mark.parametrize(("text", "names"), BOOL_IS_NOT_A_NUMBER)
def test_a_toml_bool_is_not_a_number_nor_a_number_a_bool(
    tmp_path: Path, text: str, names: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write_toml(tmp_path, text), env={})
    for name in names:
        assert name in str(info.value)


def test_a_toml_integer_is_a_number_and_becomes_a_float(tmp_path: Path) -> None:
    text = '[[backends]]\nurl = "http://a:1"\nweight = 2\n'
    weight = load_settings(write_toml(tmp_path, text), env={}).backends[0].weight
    assert weight == 2.0 and isinstance(weight, float)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", True), ("YES", True), (" on ", True), ("0", False), ("False", False), ("no", False)],
)
def test_env_bool_words(text: str, expected: bool) -> None:
    settings = load_settings(env={"GATEWAY_SERVER_UVLOOP": text})
    assert settings.server.uvloop is expected


@pytest.mark.parametrize("text", ["true", "1.0", "8e3", ""])
def test_env_integer_is_an_integer(text: str) -> None:
    with pytest.raises(ConfigError, match="GATEWAY_LIMITS_MAX_N.*expected an integer"):
        load_settings(env={"GATEWAY_LIMITS_MAX_N": text})


def test_env_lists_are_comma_separated() -> None:
    env = {
        "GATEWAY_BACKENDS": "http://a:1,http://b:2",
        "GATEWAY_LANES_BULK_BACKENDS": " b:2 , a:1,,",
    }
    assert lane(load_settings(env=env), "bulk").backends == ["b:2", "a:1"]
    env["GATEWAY_LANES_BULK_BACKENDS"] = "none"
    assert lane(load_settings(env=env), "bulk").backends is None


def test_env_sets_a_client_key_by_index_and_never_repeats_it(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[[api_keys]]\nkey = "from-the-file"\n')
    settings = load_settings(path, env={"GATEWAY_API_KEYS_0_KEY": "from-the-env"})
    assert [(k.name, k.key) for k in settings.api_keys] == [("key1", "from-the-env")]
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={"GATEWAY_API_KEYS_0_KEY": "s3cr3t"})
    assert "[[api_keys]] #1.key" in str(info.value)
    assert "s3cr3t" not in str(info.value)


def test_env_sets_a_keys_lanes_as_a_comma_list(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[[api_keys]]\nkey = "long-enough"\n')
    settings = load_settings(path, env={"GATEWAY_API_KEYS_0_LANES": "bulk, interactive"})
    assert settings.api_keys[0].lanes == ["bulk", "interactive"]
    with pytest.raises(ConfigError, match=r"^\[\[api_keys\]\] #1.lanes: no lane named nope$"):
        load_settings(path, env={"GATEWAY_API_KEYS_0_LANES": "nope"})


def test_a_bad_file_value_is_not_rescued_by_the_environment(tmp_path: Path) -> None:
    """Each source must be valid on its own: a broken file is reported, not masked."""
    path = write_toml(tmp_path, "[server]\nport = 0\n")
    with pytest.raises(ConfigError, match=r"^\[server\].port: must be from 1 to 65535, got 0$"):
        load_settings(path, env={"GATEWAY_SERVER_PORT": "8080"})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[backends]]\nurl = "http://a:1"\nport = 1\n', "[[backends]] #1: unknown key 'port'"),
        ('[[api_keys]]\nkey = "long-enough"\nlane = "a"\n', "[[api_keys]] #1: unknown key 'lane'"),
        (
            '[[lanes]]\nname = "a"\nbackends = ["x", 1]\n',
            "[[lanes]] a.backends: expected an array of strings",
        ),
        (
            '[[lanes]]\nname = "a"\nbackends = []\n',
            "[[lanes]] a.backends: must name at least one backend",
        ),
        ('[health]\npath = "health"\n', "[health].path: must start with '/', got 'health'"),
        (
            "[limits]\non_max_tokens_over = 1\n",
            '[limits].on_max_tokens_over: expected "clamp" or "reject", got 1',
        ),
    ],
)
def test_more_one_line_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write_toml(tmp_path, text), env={})
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_a_backends_api_key_is_never_repeated_in_an_error(tmp_path: Path) -> None:
    text = '[[backends]]\nurl = "http://a:1"\napi_key = 12345678\n'
    with pytest.raises(ConfigError) as info:
        load_settings(write_toml(tmp_path, text), env={})
    assert str(info.value) == "[[backends]] #1.api_key: expected a string"


def test_log_level_is_case_insensitive() -> None:
    assert load_settings(env={"GATEWAY_LOGGING_LEVEL": "WARNING"}).logging.level == "WARNING"


def test_to_dict_is_plain_data_that_converts_back() -> None:
    settings = load_settings(REPO_ROOT / "config" / "gateway.toml", env={})
    data = settings.to_dict()
    assert json.loads(json.dumps(data)) == data
    data["server"]["port"] = 1  # a copy: the settings are untouched
    assert settings.server.port == 8080
    assert msgspec.convert(settings.to_dict(), Settings) == settings


def test_check_config_masks_secrets(tmp_path: Path) -> None:
    text = (
        '[[backends]]\nurl = "http://a:1"\napi_key = "backend-secret"\n'
        '[[api_keys]]\nkey = "client-secret"\n'
        '[redis]\nurl = "redis://gw:redis-secret@127.0.0.1:6379/0"\n'
    )
    result = run_check_config("--config", str(write_toml(tmp_path, text)))
    assert result.returncode == 0, result.stderr
    assert "secret" not in result.stdout
    effective = json.loads(result.stdout)
    assert effective["backends"][0]["api_key"] == "***"
    assert effective["redis"]["url"] == "redis://gw:***@127.0.0.1:6379/0"
    assert effective["api_keys"][0] == {
        "name": "key1",
        "key": "***",
        "lanes": None,
        "allow_lane_override": False,
        "requests_per_minute": None,
        "tokens_per_minute": None,
        "weight": 1.0,
        "admin": False,
    }


def test_the_documented_example_config_checks_clean() -> None:
    result = run_check_config("--config", str(REPO_ROOT / "config" / "gateway.toml"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["backends"][0]["name"] == "local"


# --- several mistakes at once, and "did you mean" -------------------------------------------------

SEVERAL_MISTAKES = """\
[limits]
max_promt_tokens = 100
max_output_tokens = "lots"
[server]
prot = 3
[[backends]]
url = "http://a:1"
max_concurency = 3
[[lanes]]
name = "short"
max_slots = -1
[lmits]
a = 1
"""


def test_a_config_with_several_mistakes_reports_each_on_its_own_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write_toml(tmp_path, SEVERAL_MISTAKES), env={})
    assert info.value.problems == (
        "[limits]: unknown key 'max_promt_tokens'; did you mean 'max_prompt_tokens'?",
        "[limits].max_output_tokens: expected an integer, got 'lots'",
        "[server]: unknown key 'prot'; did you mean 'port'?",
        "[[backends]] #1: unknown key 'max_concurency'; did you mean 'max_concurrency'?",
        "[[lanes]] short.max_slots: must be > 0, got -1",
        "unknown section [lmits]; did you mean 'limits'?",
    )
    assert str(info.value) == "\n".join(info.value.problems)


def test_an_unknown_key_far_from_any_known_one_gets_no_guess(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write_toml(tmp_path, "[server]\nzzz = 1\n"), env={})
    assert str(info.value) == "[server]: unknown key 'zzz'"


def test_a_bad_required_value_ends_the_list_without_inventing_a_missing_key(
    tmp_path: Path,
) -> None:
    # A target's `model` is required: taking it out would invent "missing model".
    text = (
        '[server]\nprot = 3\n[[models]]\nname = "m"\ntargets = [{ model = 5 }]\n'
        '[limits]\nmax_output_tokens = "x"\n'
    )
    with pytest.raises(ConfigError) as info:
        load_settings(write_toml(tmp_path, text), env={})
    assert len(info.value.problems) == 2, info.value.problems
    assert info.value.problems[0].startswith("[server]: unknown key 'prot'")
    assert info.value.problems[1].startswith("[[models]] m.targets[0].model: expected a string")
    assert not any("missing" in p for p in info.value.problems)


def test_check_config_prints_every_mistake_and_start_up_refuses_them(tmp_path: Path) -> None:
    path = str(write_toml(tmp_path, SEVERAL_MISTAKES))
    result = run_check_config("--config", path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 6, result.stderr
    assert all(line.startswith("config error: ") for line in lines)
    assert "did you mean 'max_prompt_tokens'?" in lines[0]
    assert result.stdout == ""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    served = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", path, "--port", "1"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert served.returncode == 2
    assert served.stderr.strip().splitlines() == lines


# --- --version ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["serve"],
        ["simulate"],
        ["check-config"],
        ["api-doc"],
        ["loadgen"],
        ["analyze"],
        ["replay"],
        ["matrix"],
    ],
)
def test_version_on_the_command_and_every_subcommand(command: list[str]) -> None:
    from importlib.metadata import version

    result = subprocess.run(
        [sys.executable, "-m", "gateway", *command, "--version"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"llm-tail-gateway {version('llm-tail-gateway')}\n"


def test_the_rules_across_keys_are_all_reported_too(tmp_path: Path) -> None:
    text = (
        '[[backends]]\nurl = "http://a:1"\nname = "a"\n'
        '[[backends]]\nurl = "http://b:1"\nname = "a"\n'
        '[[lanes]]\nname = "x"\n[[lanes]]\nname = "x"\n'
        '[[api_keys]]\nkey = "long-enough-key"\nlanes = ["nope"]\n'
    )
    with pytest.raises(ConfigError) as info:
        load_settings(write_toml(tmp_path, text), env={})
    assert info.value.problems == (
        "[[backends]] #2.name: duplicate backend name 'a'",
        "[[lanes]] #2.name: duplicate lane name 'x'",
        "[[api_keys]] #1.lanes: no lane named nope",
    )
