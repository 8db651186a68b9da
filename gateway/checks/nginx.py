"""Check an nginx config in front of the gateway against the gateway's own settings.

An nginx whose timeouts are shorter than the gateway's cuts requests the gateway
would still have answered, and the client sees nginx's bare 504 instead of the
gateway's 503 with `Retry-After`; one that buffers holds a stream back until it
ends; one whose body limit is lower refuses what the gateway accepts. Each outer
layer must wait longer than the one inside it. `python -m gateway check-config
--nginx FILE` prints a warning for each place where it does not.

What the gateway waits for, from its settings:
- a non-streamed request sends nothing until its whole answer, which the gateway
  waits for up to `[timeouts].total_s` end to end (the queue included; a lane whose
  queue timeout is longer still can hold it that long): `proxy_read_timeout` must
  be above that;
- a streamed one gets an SSE comment every `[server].sse_keepalive_s` while it waits
  (when that is on), or else nothing until its first byte, up to the longest lane
  queue timeout plus `[timeouts].first_token_s`; between chunks the gateway itself
  cuts a stream silent for `[timeouts].idle_s` (with an SSE error event, which nginx
  would pre-empt if it gave up first). Lanes with `fit_timeout_to_engine` may raise
  their deadline above the configured one at run time; this check uses the file's.

The nginx file is read with a small tokenizer for nginx's syntax (directives, blocks,
quotes, escapes, comments, `include`), not a library: crossplane, the one parser on
PyPI, is untyped and unmaintained since 2022, and the checks need only the tree. The
checked locations are those nginx would pick for the gateway's generation routes
(exact, longest prefix, `^~`, then regexes in order, as nginx does), with each
directive's value inherited from server and http as nginx inherits it.
"""

from __future__ import annotations

import glob
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gateway.config import Settings

#: The POST routes that generate (see gateway/app.py): the API locations.
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/generate", "/generate_stream", "/")

#: nginx's defaults for the directives checked (ngx_http_proxy_module, ngx_http_core_module).
NGINX_DEFAULTS = {
    "proxy_buffering": "on",
    "proxy_http_version": "1.0",
    "proxy_read_timeout": "60s",
    "proxy_send_timeout": "60s",
    "send_timeout": "60s",
    "client_max_body_size": "1m",
    "proxy_next_upstream": "error timeout",
}

_TIME_UNITS = {
    "ms": 0.001,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
    "d": 86400.0,
    "w": 604800.0,
    "M": 2592000.0,
    "y": 31536000.0,
}
_TIME_PART = re.compile(r"(\d+)(ms|s|m|h|d|w|M|y)?")
_SIZE = re.compile(r"(\d+)([kKmMgG]?)")
_SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


class NginxConfigError(ValueError):
    """The nginx file cannot be read or parsed; the message names file and line."""


@dataclass(frozen=True, slots=True)
class Directive:
    """One directive: `name args...;` or `name args... { block }`."""

    name: str
    args: tuple[str, ...]
    file: str
    line: int
    block: tuple[Directive, ...] | None = None

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


# --- the tokenizer and parser ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Token:
    text: str
    line: int
    #: `;`, `{` and `}` are syntax only when not quoted.
    quoted: bool


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r"}


def tokenize(text: str, file: str = "nginx.conf") -> Iterator[_Token]:
    """nginx's tokens: words, quoted strings, `;`, `{`, `}`; `#` comments dropped."""
    i, line, end = 0, 1, len(text)
    while i < end:
        ch = text[i]
        if ch == "\n":
            line += 1
            i += 1
        elif ch.isspace():
            i += 1
        elif ch == "#":
            while i < end and text[i] != "\n":
                i += 1
        elif ch in ";{}":
            yield _Token(ch, line, quoted=False)
            i += 1
        elif ch in "\"'":
            start_line, i, parts = line, i + 1, []
            while i < end and text[i] != ch:
                if text[i] == "\\" and i + 1 < end:
                    i += 1
                    parts.append(_ESCAPES.get(text[i], text[i]))
                else:
                    parts.append(text[i])
                line += text[i] == "\n"
                i += 1
            if i >= end:
                raise NginxConfigError(f"{file}:{start_line}: unterminated {ch} string")
            yield _Token("".join(parts), start_line, quoted=True)
            i += 1
        else:
            parts = []
            while i < end and not text[i].isspace() and text[i] not in ";{}\"'":
                if text[i] == "\\" and i + 1 < end:
                    parts.append(text[i + 1])
                    i += 2
                elif text[i] == "$" and text.startswith("${", i):  # ${var} inside a word
                    close = text.find("}", i)
                    if close < 0:
                        raise NginxConfigError(f"{file}:{line}: unterminated ${{ in a word")
                    parts.append(text[i : close + 1])
                    i = close + 1
                else:
                    parts.append(text[i])
                    i += 1
            yield _Token("".join(parts), line, quoted=False)


def parse(text: str, file: str = "nginx.conf") -> list[Directive]:
    """The directives of one file (includes not followed: see `load`)."""
    tokens = list(tokenize(text, file))
    directives, position = _parse_block(tokens, 0, file, top=True)
    assert position == len(tokens)
    return directives


def _parse_block(
    tokens: list[_Token], position: int, file: str, *, top: bool
) -> tuple[list[Directive], int]:
    directives: list[Directive] = []
    words: list[_Token] = []
    while position < len(tokens):
        token = tokens[position]
        position += 1
        syntax = None if token.quoted else token.text
        if syntax == ";":
            if not words:
                raise NginxConfigError(f"{file}:{token.line}: unexpected ';'")
            directives.append(_directive(words, file))
            words = []
        elif syntax == "{":
            if not words:
                raise NginxConfigError(f"{file}:{token.line}: unexpected '{{'")
            block, position = _parse_block(tokens, position, file, top=False)
            directives.append(_directive(words, file, tuple(block)))
            words = []
        elif syntax == "}":
            if top:
                raise NginxConfigError(f"{file}:{token.line}: unexpected '}}'")
            if words:
                raise NginxConfigError(f"{file}:{words[0].line}: {words[0].text!r} lacks ';'")
            return directives, position
        else:
            words.append(token)
    if words:
        raise NginxConfigError(f"{file}:{words[0].line}: {words[0].text!r} lacks ';'")
    if not top:
        raise NginxConfigError(f"{file}: unexpected end of file, expecting '}}'")
    return directives, position


def _directive(
    words: list[_Token], file: str, block: tuple[Directive, ...] | None = None
) -> Directive:
    return Directive(words[0].text, tuple(w.text for w in words[1:]), file, words[0].line, block)


def load(path: str | Path) -> list[Directive]:
    """The directives of an nginx file, with its `include`s read in place.

    Relative include paths are taken from the file's own directory (where nginx's
    conf prefix is when started with `-c` on this file); a glob that matches nothing
    includes nothing, as in nginx.
    """
    return _load(Path(path), seen=())


def _load(path: Path, seen: tuple[Path, ...]) -> list[Directive]:
    resolved = path.resolve()
    if resolved in seen:
        raise NginxConfigError(f"{path}: includes itself")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise NginxConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise NginxConfigError(f"{path}: is not UTF-8 text") from None
    return _expand(parse(text, str(path)), path.parent, (*seen, resolved))


def _expand(directives: Sequence[Directive], base: Path, seen: tuple[Path, ...]) -> list[Directive]:
    result: list[Directive] = []
    for d in directives:
        if d.name == "include" and d.block is None and len(d.args) == 1:
            pattern = d.args[0] if Path(d.args[0]).is_absolute() else str(base / d.args[0])
            names = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
            for name in names:
                result.extend(_load(Path(name), seen))
        elif d.block is not None:
            block = tuple(_expand(d.block, base, seen))
            result.append(Directive(d.name, d.args, d.file, d.line, block))
        else:
            result.append(d)
    return result


# --- values ----------------------------------------------------------------------------------


def parse_time_s(text: str) -> float | None:
    """An nginx time (`630s`, `1m30s`, `500ms`, `90` = seconds) in seconds; None if not one."""
    position, total = 0, 0.0
    for match in _TIME_PART.finditer(text):
        if match.start() != position:
            return None
        total += int(match[1]) * _TIME_UNITS[match[2] or "s"]
        position = match.end()
    return total if position == len(text) and text else None


def parse_size_bytes(text: str) -> int | None:
    """An nginx size (`4m`, `512k`, `1g`, `1048576`) in bytes; None if not one."""
    match = _SIZE.fullmatch(text)
    if match is None:
        return None
    return int(match[1]) * _SIZE_UNITS[match[2].lower()]


# --- which location serves a path ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scope:
    """A location as nginx serves it: the directive and the blocks around it, inner first."""

    location: Directive
    #: The enclosing location(s), then server, then http (main's own are not inherited).
    outer: tuple[Directive, ...]
    server: Directive

    def value(self, name: str) -> tuple[str, ...] | None:
        """The directive's arguments as inherited here (None: nginx's default)."""
        for block in (self.location, *self.outer):
            assert block.block is not None
            for d in reversed(block.block):  # a repeated directive: nginx refuses; take last
                if d.name == name:
                    return d.args
        return None

    def label(self) -> str:
        listen = next((d.args[0] for d in self.server.block or () if d.name == "listen"), "80")
        return f"location {' '.join(self.location.args)} (server {listen})"


def servers(directives: Sequence[Directive]) -> Iterator[tuple[Directive, Directive]]:
    """(http, server) for every server block."""
    for http in directives:
        if http.name == "http" and http.block is not None:
            for server in http.block:
                if server.name == "server" and server.block is not None:
                    yield http, server


def location_for(path: str, block: Directive) -> list[Directive]:
    """The location nginx picks for `path` in `block` (a server or a location), with the
    nested locations it picks inside: [outermost, ..., innermost]; [] if none matches."""
    return _find_location(path, block)[0]


def _find_location(path: str, block: Directive) -> tuple[list[Directive], bool]:
    """nginx's ngx_http_core_find_location: (chain, final). An exact or a regex match is
    final; a prefix match is not (the regexes of the level around it may still win)."""
    prefix: Directive | None = None
    for d in _locations(block):
        modifier, uri = _location_pattern(d)
        if modifier == "=" and uri == path:
            return [d], True
        if modifier in ("", "^~") and path.startswith(uri):
            if prefix is None or len(uri) > len(_location_pattern(prefix)[1]):
                prefix = d
    chain: list[Directive] = []
    if prefix is not None:
        inner, final = _find_location(path, prefix)
        chain = [prefix, *inner]
        if final or _location_pattern(prefix)[0] == "^~":  # ^~: no regexes at this level
            return chain, final
    for d in _locations(block):
        modifier, uri = _location_pattern(d)
        if modifier in ("~", "~*") and _regex_matches(uri, path, modifier == "~*"):
            return [d, *_find_location(path, d)[0]], True
    return chain, False


def _locations(block: Directive) -> Iterator[Directive]:
    for d in block.block or ():
        if (
            d.name == "location"
            and d.block is not None
            and d.args
            and not d.args[0].startswith("@")
        ):
            yield d


def _location_pattern(location: Directive) -> tuple[str, str]:
    """(modifier, uri): `location = /x` -> ("=", "/x"), `location /x` -> ("", "/x")."""
    args = location.args
    if len(args) >= 2 and args[0] in ("=", "~", "~*", "^~"):
        return args[0], args[1]
    first = args[0]
    for modifier in ("^~", "~*", "=", "~"):  # `location =/x` and `location ~^/x` also parse
        if first.startswith(modifier) and len(first) > len(modifier):
            return modifier, first[len(modifier) :]
    return "", first


def _regex_matches(pattern: str, path: str, ignore_case: bool) -> bool:
    try:
        return re.search(pattern, path, re.IGNORECASE if ignore_case else 0) is not None
    except re.error:  # a PCRE-only construct: not evaluated
        return False


def api_scopes(directives: Sequence[Directive]) -> list[Scope]:
    """Each location that nginx picks for a generation route and that proxies it."""
    found: dict[int, Scope] = {}
    for http, server in servers(directives):
        for path in GENERATION_PATHS:
            chain = location_for(path, server)
            if not chain:
                continue
            location = chain[-1]
            scope = Scope(location, (*reversed(chain[:-1]), server, http), server)
            if scope.value("proxy_pass") is None:
                continue
            found.setdefault(id(location), scope)
    return list(found.values())


# --- the checks ------------------------------------------------------------------------------


@dataclass
class _Checker:
    settings: Settings
    warnings: list[str] = field(default_factory=list)

    def warn(self, scope: Scope, name: str, text: str) -> None:
        where = _where(scope, name)
        self.warnings.append(f"nginx {where}: {scope.label()}: {text}")

    def time_of(self, scope: Scope, name: str) -> tuple[float, str] | None:
        args = scope.value(name)
        shown = args[0] if args else NGINX_DEFAULTS[name]
        seconds = parse_time_s(shown)
        if seconds is None:
            self.warn(scope, name, f"{name} {shown!r} is not an nginx time")
            return None
        return seconds, shown if args else f"{shown} (nginx's default)"

    def check(self, scope: Scope) -> None:
        self.check_streaming(scope)
        self.check_body_size(scope)
        self.check_read_timeout(scope)
        self.check_send_timeouts(scope)
        retries = scope.value("proxy_next_upstream") or ()
        if "non_idempotent" in retries:
            self.warn(
                scope,
                "proxy_next_upstream",
                "proxy_next_upstream has non_idempotent: a POST that failed on one gateway "
                "is sent to another, and a generation can run twice",
            )

    def check_streaming(self, scope: Scope) -> None:
        buffering = (scope.value("proxy_buffering") or (NGINX_DEFAULTS["proxy_buffering"],))[0]
        if buffering != "off":
            self.warn(
                scope,
                "proxy_buffering",
                f"proxy_buffering is {buffering}: nginx buffers the gateway's answers (with "
                "gzip on, a whole stream arrives in one piece at its end); streams escape "
                "it only by the gateway's X-Accel-Buffering: no; set proxy_buffering off",
            )
        version = (scope.value("proxy_http_version") or (NGINX_DEFAULTS["proxy_http_version"],))[0]
        if version != "1.1":
            self.warn(
                scope,
                "proxy_http_version",
                f"proxy_http_version is {version}: a new connection to the gateway for "
                "every request (no upstream keep-alive), and a stream ends only by closing "
                'it; set proxy_http_version 1.1 (and proxy_set_header Connection "")',
            )

    def check_body_size(self, scope: Scope) -> None:
        args = scope.value("client_max_body_size")
        shown = args[0] if args else NGINX_DEFAULTS["client_max_body_size"]
        size = parse_size_bytes(shown)
        limit = self.settings.server.max_body_bytes
        if size is None:
            self.warn(
                scope, "client_max_body_size", f"client_max_body_size {shown!r} is not a size"
            )
        elif size != 0 and size < limit:  # 0: no limit in nginx
            default = "" if args else " (nginx's default)"
            self.warn(
                scope,
                "client_max_body_size",
                f"client_max_body_size {shown}{default} = {size} bytes is below "
                f"[server].max_body_bytes ({limit}): nginx refuses bodies the gateway "
                f"accepts; set client_max_body_size {_size_text(limit)}",
            )

    def check_read_timeout(self, scope: Scope) -> None:
        read = self.time_of(scope, "proxy_read_timeout")
        if read is None:
            return
        seconds, shown = read
        s = self.settings
        longest = max(s.lanes, key=lambda lane: lane.queue_timeout_s)
        whole_answer_s = max(s.timeouts.total_s, longest.queue_timeout_s)
        if seconds <= whole_answer_s:
            self.warn(
                scope,
                "proxy_read_timeout",
                f"proxy_read_timeout {shown} is not above {whole_answer_s:g} s, how long the "
                "gateway may wait for a non-streamed answer (sent whole, nothing before it: "
                f"[timeouts].total_s {s.timeouts.total_s:g} s end to end, lane "
                f"'{longest.name}' queues up to {longest.queue_timeout_s:g} s): nginx answers "
                "504 where the gateway would have answered",
            )
        keepalive_s = s.server.sse_keepalive_s
        first_byte_s = min(longest.queue_timeout_s + s.timeouts.first_token_s, s.timeouts.total_s)
        if keepalive_s > 0 and seconds <= keepalive_s:
            self.warn(
                scope,
                "proxy_read_timeout",
                f"proxy_read_timeout {shown} is not above [server].sse_keepalive_s "
                f"({keepalive_s:g} s): a waiting stream is cut between two keepalive comments",
            )
        elif keepalive_s == 0 and seconds <= first_byte_s:
            self.warn(
                scope,
                "proxy_read_timeout",
                f"proxy_read_timeout {shown} is not above {first_byte_s:g} s, how long a "
                f"stream may wait silent for its first byte with [server].sse_keepalive_s "
                f"off (lane '{longest.name}' queue_timeout_s {longest.queue_timeout_s:g} s + "
                f"[timeouts].first_token_s {s.timeouts.first_token_s:g} s): turn the "
                "keepalive on, or raise proxy_read_timeout",
            )
        if seconds <= s.timeouts.idle_s:
            self.warn(
                scope,
                "proxy_read_timeout",
                f"proxy_read_timeout {shown} is not above [timeouts].idle_s "
                f"({s.timeouts.idle_s:g} s): a stalled stream is cut by nginx, without the "
                "gateway's final SSE error event",
            )

    def check_send_timeouts(self, scope: Scope) -> None:
        keepalive_s = self.settings.server.sse_keepalive_s
        if keepalive_s <= 0:
            return
        for name in ("proxy_send_timeout", "send_timeout"):
            found = self.time_of(scope, name)
            if found is not None and found[0] < keepalive_s:
                self.warn(
                    scope,
                    name,
                    f"{name} {found[1]} is shorter than [server].sse_keepalive_s "
                    f"({keepalive_s:g} s), the longest a waiting stream goes without a write",
                )


def _where(scope: Scope, name: str) -> str:
    """file:line of the directive in force, else of the location."""
    for block in (scope.location, *scope.outer):
        for d in reversed(block.block or ()):
            if d.name == name:
                return d.where
    return scope.location.where


def _size_text(size: int) -> str:
    for unit, factor in (("g", 1024**3), ("m", 1024**2), ("k", 1024)):
        if size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def nginx_warnings(directives: Sequence[Directive], settings: Settings) -> list[str]:
    """Every place where the nginx config does not fit the gateway's settings."""
    scopes = api_scopes(directives)
    if not scopes:
        return [
            "nginx: no location proxies the gateway's generation routes "
            f"({', '.join(GENERATION_PATHS)}): nothing to check"
        ]
    checker = _Checker(settings)
    for scope in scopes:
        checker.check(scope)
    return checker.warnings


def check_nginx_file(settings: Settings, path: str | Path) -> int:
    """`check-config --nginx FILE`: print the warnings; 2 when the file cannot be read."""
    try:
        directives = load(path)
    except NginxConfigError as exc:
        print(f"nginx config error: {exc}", file=sys.stderr)
        return 2
    for warning in nginx_warnings(directives, settings):
        print(f"warning: {warning}", file=sys.stderr)
    return 0
