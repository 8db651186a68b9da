"""GATEWAY_* variables: which setting each names, and its text as a value of that setting's
type (the names are listed in the package's docstring).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from msgspec import inspect as mi

from gateway.config.constraints import ConfigError
from gateway.config.messages import key_name, kind_words, type_at, unwrap
from gateway.config.settings import TABLES, KeyPath, Origins

ENV_PREFIX = "GATEWAY_"
#: GATEWAY_* names that are not settings but are ours (read by the CLI).
CLI_ENV_NAMES = frozenset({ENV_PREFIX + "CONFIG"})

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def apply_env(data: dict[str, Any], env: Mapping[str, str], origins: Origins) -> None:
    urls = env.get(ENV_PREFIX + "BACKENDS")
    if urls is not None:
        data["backends"] = backends_from_urls(urls.split(","))
    for name, text in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX + "BACKENDS":
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        section = next((s for s in TABLES if rest.startswith(s + "_")), None)
        if section is not None:
            _set_from_env(data, (section,), rest[len(section) + 1 :], text, name, origins)
        elif rest.startswith("lanes_"):
            _apply_env_lane(data, rest[len("lanes_") :], text, name, origins)
        elif rest.startswith("backends_"):
            _apply_env_indexed(data, "backends", rest[len("backends_") :], text, name, origins)
        elif rest.startswith("api_keys_"):
            _apply_env_indexed(data, "api_keys", rest[len("api_keys_") :], text, name, origins)
        elif rest.startswith("models_"):
            _apply_env_indexed(data, "models", rest[len("models_") :], text, name, origins)
        # Other GATEWAY_* names (the CLI's own, e.g. GATEWAY_CONFIG) are not settings.


def unrecognized_env_names(env: Mapping[str, str]) -> list[str]:
    """GATEWAY_* variables that configure nothing (typos, or another tool's)."""
    prefixes = [section + "_" for section in TABLES]
    prefixes += ["lanes_", "backends_", "api_keys_", "models_"]
    unknown = []
    for name in env:
        if not name.startswith(ENV_PREFIX) or name in CLI_ENV_NAMES:
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        if rest != "backends" and not any(rest.startswith(p) for p in prefixes):
            unknown.append(name)
    return sorted(unknown)


def _apply_env_lane(
    data: dict[str, Any], rest: str, text: str, name: str, origins: Origins
) -> None:
    lanes = data["lanes"]
    by_length = sorted(range(len(lanes)), key=lambda i: -len(lanes[i]["name"]))
    for index in by_length:
        prefix = lanes[index]["name"].lower().replace("-", "_") + "_"
        if rest.startswith(prefix):
            key = rest[len(prefix) :]
            if key == "name":
                raise ConfigError(f"{name}: a lane's name cannot be set (it finds the lane)")
            _set_from_env(data, ("lanes", index), key, text, name, origins)
            return
    names = ", ".join(lane["name"] for lane in lanes) or "none"
    raise ConfigError(f"{name}: no lane named in it (lanes: {names})")


def _apply_env_indexed(
    data: dict[str, Any], array: str, rest: str, text: str, name: str, origins: Origins
) -> None:
    """GATEWAY_<ARRAY>_<INDEX>_<KEY> sets a key of an existing entry, and
    GATEWAY_<ARRAY>_<INDEX>_<TABLE>_<KEY> a key of one of its tables
    (GATEWAY_MODELS_0_LIMITS_MAX_PROMPT_TOKENS)."""
    index_text, _, key = rest.partition("_")
    if not index_text.isdigit() or int(index_text) >= len(data.get(array) or []):
        raise ConfigError(f"{name}: expected <index>_<key> with an index of an existing entry")
    index = int(index_text)
    entry: KeyPath = (array, index)
    table = _sub_table(entry, key)
    if table is not None:
        owner = data[array][index]
        if owner.get(table) is None:  # unset in the file: the table starts empty
            owner[table] = {}
        entry, key = (*entry, table), key[len(table) + 1 :]
    _set_from_env(data, entry, key, text, name, origins)


def _sub_table(entry: KeyPath, key: str) -> str | None:
    """The table of the entry at `entry` that `key` names a key of ("limits" for
    "limits_max_prompt_tokens"), if `key` is not one of the entry's own keys."""
    if type_at([*entry, key]) is not None:
        return None
    kind = unwrap(type_at(list(entry)))
    fields = kind.fields if isinstance(kind, mi.StructType) else ()
    return next(
        (
            f.name
            for f in fields
            if key.startswith(f.name + "_") and isinstance(unwrap(f.type), mi.StructType)
        ),
        None,
    )


def _set_from_env(
    data: dict[str, Any], table: KeyPath, key: str, text: str, name: str, origins: Origins
) -> None:
    kind = type_at([*table, key])
    if kind is None:
        raise ConfigError(f"{name}: unknown setting {key!r}")
    path = (*table, key)
    try:
        value = _parse_text(text, kind)
    except ValueError:
        where = key_name(list(path), data)
        raise ConfigError(
            f"{where} (from {name}): expected {kind_words(kind)}, got {text!r}"
        ) from None
    target: Any = data
    for part in table:
        target = target[part]
    target[key] = value
    origins[path] = name


def _parse_text(text: str, kind: mi.Type) -> Any:
    """An environment variable's text as a value of the field's type (then checked by msgspec).

    Floats are parsed as Python does, so `nan` and `inf` parse and are then refused by the
    field's bounds, naming the variable.
    """
    optional = isinstance(kind, mi.UnionType) and any(
        isinstance(t, mi.NoneType) for t in kind.types
    )
    if optional and text.strip().lower() in ("", "none"):
        return None
    base = unwrap(kind)
    if isinstance(base, mi.BoolType):
        word = text.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise ValueError(text)
    if isinstance(base, mi.IntType):
        return int(text)
    if isinstance(base, mi.FloatType):
        return float(text)
    if isinstance(base, mi.ListType):
        return [item.strip() for item in text.split(",") if item.strip()]
    return text


def backends_from_urls(urls: list[str]) -> list[dict[str, Any]]:
    return [{"url": u.strip()} for u in urls if u.strip()]
