"""From msgspec's error to one line naming the key: `[server].port: expected an integer,
got 'x'`, `[[lanes]] bulk.max_slots (from GATEWAY_LANES_BULK_MAX_SLOTS): must be > 0`.

The key comes from the error's path; what was expected from the field's declared type
(`msgspec.inspect`), what was got from the data itself (never a secret's value).
"""

from __future__ import annotations

import copy
import difflib
import functools
import re
from typing import Any

import msgspec
from msgspec import inspect as mi

from gateway.config.constraints import ConfigError
from gateway.config.settings import ARRAYS, Origins, Settings

_ERROR = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<key>[^`]+)`$")
_WRONG_TYPE = re.compile(r"^Expected `[^`]+`, got `[^`]+`$")
#: Values never repeated in a message.
_SECRETS = {("api_keys", "key"), ("backends", "api_key"), ("shadow", "api_key"), ("redis", "url")}


#: Problems reported from one config at most: enough for any file typed by hand.
MAX_PROBLEMS = 20


def convert(data: dict[str, Any], origins: Origins) -> Settings:
    """msgspec's strict conversion: a bool is no integer, a string no number (an integer
    is a float, though: `total_s = 120` is 120.0).

    msgspec stops at the first bad value; to say every one, each is taken out of a copy
    of the data (an unknown key, or a bad value whose key has a default) and the copy
    converted again. A bad value that cannot be taken out without inventing an error
    (a required key, an item of an array) ends the list there.
    """
    problems: list[str] = []
    work = data
    while True:
        try:
            settings = msgspec.convert(work, Settings)
        except msgspec.ValidationError as exc:
            problems.append(_message(str(exc), work, origins))
            if work is data:
                work = copy.deepcopy(data)
            if len(problems) >= MAX_PROBLEMS or not _take_out(str(exc), work):
                raise ConfigError(*problems) from None
            continue
        if problems:
            raise ConfigError(*problems)
        return settings


def _take_out(error: str, data: Any) -> bool:
    """Remove what `error` is about from `data`, if that leaves a valid neighbourhood."""
    match = _ERROR.match(error)
    if match is None or not match["path"]:
        return False
    path = _parse_path(match["path"])
    unknown = _UNKNOWN_FIELD.match(match["what"])
    if unknown:
        return _delete(data, [*path, unknown["key"]])
    path = _field_path(path)
    if not path or not isinstance(path[-1], str):
        return False
    parent = unwrap(type_at(path[:-1]))
    if isinstance(parent, mi.StructType):
        field = next((f for f in parent.fields if f.name == path[-1]), None)
        if field is None or field.required:
            return False
    return _delete(data, path)


def _delete(data: Any, path: list[str | int]) -> bool:
    parent = _value_at(data, path[:-1])
    if isinstance(parent, dict) and path[-1] in parent:
        del parent[path[-1]]
        return True
    return False


def _parse_path(text: str) -> list[str | int]:
    return [name if name else int(index) for name, index in _PATH_PART.findall(text)]


def _message(error: str, data: Any, origins: Origins) -> str:
    """Rewrite msgspec's `Expected `int`, got `str` - at `$.server.port`` in our terms.

    The key comes from the error's path; what was expected from the field's declared
    type (`msgspec.inspect`), and what was got from the data itself.
    """
    match = _ERROR.match(error)
    what, path_text = (match["what"], match["path"] or "") if match else (error, "")
    path = _parse_path(path_text)
    unknown = _UNKNOWN_FIELD.match(what)
    if unknown:
        hint = _did_you_mean(unknown["key"], path)
        if not path:
            return f"unknown section [{unknown['key']}]{hint}"
        return f"{key_name(path, data)}: unknown key {unknown['key']!r}{hint}"
    if not path:
        return f"the settings: {what}"
    path = _field_path(path)
    kind = type_at(path)
    where = key_name(path, data)
    origin = origins.get(tuple(path))
    if origin:
        where = f"{where} (from {origin})"
    problem = (
        f"expected {kind_words(kind)}" if _WRONG_TYPE.match(what) else f"must {_must(kind, what)}"
    )
    if path and (path[0], path[-1]) in _SECRETS:
        return f"{where}: {problem}"
    return f"{where}: {problem}, got {_shown(_value_at(data, path))}"


def _did_you_mean(key: str, path: list[str | int]) -> str:
    """`; did you mean 'max_prompt_tokens'?` when a known key is one typo away."""
    table = unwrap(type_at(path))
    if not isinstance(table, mi.StructType):
        return ""
    close = difflib.get_close_matches(key, [f.name for f in table.fields], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def key_name(path: list[str | int], data: Any) -> str:
    """`[server].port`, `[[backends]] #1.url`, `[[lanes]] bulk.max_slots` (lanes by name)."""
    section = str(path[0])
    if section not in ARRAYS:
        return f"[{section}]" + "".join(f".{p}" for p in path[1:])
    if len(path) == 1:
        return f"[[{section}]]"
    index = int(path[1])
    label = f"#{index + 1}"
    if section in ("lanes", "models") and len(path) > 2 and path[2] != "name":
        name = _value_at(data, [section, index, "name"])
        if isinstance(name, str) and name:
            label = name
    if len(path) == 2:
        return f"[[{section}]] {label}"
    return f"[[{section}]] {label}" + "".join(
        f"[{p}]" if isinstance(p, int) else f".{p}" for p in path[2:]
    )


def _field_path(path: list[str | int]) -> list[str | int]:
    """The path of the field an error is in: an item of a list of strings is named by
    its list (the whole list is shown); an item of an array of tables by its index."""
    for end, part in enumerate(path):
        if isinstance(part, int) and end > 0:
            kind = unwrap(type_at(path[:end]))
            if isinstance(kind, mi.ListType) and not isinstance(
                unwrap(kind.item_type), mi.StructType
            ):
                return path[:end]
    return path


def _value_at(data: Any, path: list[str | int]) -> Any:
    for part in path:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None
    return data


@functools.cache
def _settings_type() -> mi.StructType:
    info = mi.type_info(Settings)
    assert isinstance(info, mi.StructType)
    return info


def type_at(path: list[str | int]) -> mi.Type | None:
    """The declared type of the key at `path` (None optional members dropped)."""
    kind: mi.Type | None = _settings_type()
    for part in path:
        kind = unwrap(kind)
        if isinstance(part, int) and isinstance(kind, mi.ListType):
            kind = kind.item_type
        elif isinstance(part, str) and isinstance(kind, mi.StructType):
            kind = next((f.type for f in kind.fields if f.name == part), None)
        else:
            return None
    return kind


def _without_none(kind: mi.Type | None) -> mi.Type | None:
    if isinstance(kind, mi.UnionType):
        members = [t for t in kind.types if not isinstance(t, mi.NoneType)]
        return members[0] if len(members) == 1 else kind
    return kind


def unwrap(kind: mi.Type | None) -> mi.Type | None:
    """Drop `| None` and constraint metadata: the type a value must have."""
    kind = _without_none(kind)
    return kind.type if isinstance(kind, mi.Metadata) else kind


def kind_words(kind: mi.Type | None) -> str:
    """What a value of this type is, in TOML's words."""
    base = unwrap(kind)
    if isinstance(base, mi.BoolType):
        return "true or false"
    if isinstance(base, mi.IntType):
        return "an integer"
    if isinstance(base, mi.FloatType):
        return "a number"
    if isinstance(base, mi.LiteralType):
        return " or ".join(f'"{v}"' for v in base.values)
    if isinstance(base, mi.StrType):
        return "a string"
    if isinstance(base, mi.StructType):
        return "a table"
    if isinstance(base, mi.ListType):
        items = unwrap(base.item_type)
        return "an array of tables" if isinstance(items, mi.StructType) else "an array of strings"
    return "a valid value"


def _must(kind: mi.Type | None, error: str) -> str:
    """The rule a value broke: the words declared with it, else msgspec's own."""
    kind = _without_none(kind)
    if isinstance(kind, mi.Metadata) and kind.extra and "must" in kind.extra:
        return str(kind.extra["must"])
    if isinstance(kind, mi.LiteralType):
        return f"be {kind_words(kind)}"
    return f"be valid ({error})"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
