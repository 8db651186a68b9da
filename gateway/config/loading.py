"""Settings from their sources in order: defaults, a TOML file, GATEWAY_* variables, CLI
flags; each source checked as it is read, then all of them together (`checks`). What the
operator wrote is exact (`written`): it turns off the adaptation of that value.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from gateway.config.checks import checked
from gateway.config.constraints import ConfigError
from gateway.config.environment import apply_env, backends_from_urls
from gateway.config.messages import convert, type_at
from gateway.config.settings import TABLES, Origins, Settings
from gateway.config.written import settle_written


def load_settings(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build validated settings from a TOML file, the environment and CLI overrides.

    `overrides` takes dotted keys (`server.port`) plus `backends` as a list of URLs.
    """
    raw: dict[str, Any] = {} if path is None else _read_toml(Path(path))
    data: dict[str, Any] = msgspec.to_builtins(convert(raw, {}))
    origins: Origins = {}
    apply_env(data, os.environ if env is None else env, origins)
    _apply_overrides(data, overrides or {}, origins)
    settle_written(data, raw, origins)
    return checked(convert(data, origins))


def validate(settings: Settings) -> Settings:
    """The settings checked and completed, or ConfigError on the first invalid value.

    Checks every field's declared constraint (settings built in code skip them), fills
    the names left empty (a backend's from its URL, a client key's `key<N>`), and checks
    the rules across fields. Returns new settings: frozen ones cannot be filled in place.
    """
    return checked(convert(msgspec.to_builtins(settings), {}))


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


# --- CLI flags -------------------------------------------------------------------------------


def _apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any], origins: Origins) -> None:
    for dotted, value in overrides.items():
        if value is None:
            continue
        if dotted == "backends":
            if value:
                data["backends"] = backends_from_urls(list(value))
            continue
        section, _, key = dotted.partition(".")
        if section not in TABLES:
            raise ConfigError(f"override {dotted}: unknown section")
        if type_at([section, key]) is None:
            raise ConfigError(f"override {dotted}: unknown key")
        data[section][key] = value
        origins[(section, key)] = f"override {dotted}"
