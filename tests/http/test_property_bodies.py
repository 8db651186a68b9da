"""Hypothesis throws hostile request bodies at a real gateway in front of the simulator.

Random JSON values and byte strings, valid chat/completions/TGI bodies with a field
given the wrong type, a bad number, removed or added, unknown roles and content
parts, huge `n`, deep nesting, invalid UTF-8, compressed bodies. Whatever comes in:

- never a 5xx (the simulator is healthy, so any 5xx is the gateway's);
- a 4xx the gateway produced itself is a parseable OpenAI error envelope
  (a backend's 4xx, recognisable by the queue headers of a dispatched request, is
  passed through unchanged, and on the OpenAI routes is an envelope as well);
- a wrongly typed field the gateway checks is refused by the gateway (400, its
  `param` naming the field) before it costs a queue place;
- nothing is left holding a slot, a queue entry or a prefill budget, and a valid
  request still succeeds afterwards.

How it runs: hypothesis' `@given` drives *synchronous* tests, and the gateway and
the simulator run on their own event loop in a background thread for the whole
module. That keeps hypothesis out of any event loop (it does not run async tests
itself, and a module-scoped aiohttp server under pytest-asyncio's function-scoped
loops is fragile), lets one gateway serve every example (a start per example would
cost more than the examples), and lets the checks read the gateway's state on its
own loop through `run_coroutine_threadsafe`. Requests go out with `requests` on one
keep-alive session, one at a time.
"""

from __future__ import annotations

import gzip
import http.client
import json
import math
import socket
import time
import zlib
from collections.abc import Iterator
from typing import Any, TypeVar

import aiohttp
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config import Settings
from tests.conftest import StartGateway, StartSimulator
from tests.http.live import LiveGateway, gateway_settings

T = TypeVar("T")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
GENERATE_STREAM = "/generate_stream"
COMPAT = "/"
ROUTES = [CHAT, COMPLETIONS, GENERATE, GENERATE_STREAM, COMPAT]
OPENAI_ROUTES = {CHAT, COMPLETIONS}
MAX_N = 4
MAX_BODY_BYTES = 256 * 1024

PROPERTY_SETTINGS = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ----------------------------------------------------------------------------- servers


def property_settings(backend_url: str) -> Settings:
    return gateway_settings(backend_url, max_n=MAX_N, max_body_bytes=MAX_BODY_BYTES)


@pytest.fixture(scope="module")
def live() -> Iterator[LiveGateway]:
    gateway = LiveGateway(property_settings).start()
    try:
        yield gateway
    finally:
        gateway.stop()


@pytest.fixture(autouse=True)
def still_serving(live: LiveGateway, session: requests.Session) -> Iterator[None]:
    """After every test: nothing held, and a valid request still gets its answer."""
    yield
    assert live.leftovers() == []
    response = session.post(live.url + CHAT, json=valid_body(CHAT), timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"]
    assert live.leftovers() == []


# ----------------------------------------------------------------------------- checks


def valid_body(route: str) -> dict[str, Any]:
    if route == CHAT:
        return {
            "model": "sim-model",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello!"}]},
            ],
            "max_tokens": 4,
        }
    if route == COMPLETIONS:
        return {"model": "sim-model", "prompt": "Once upon a time", "max_tokens": 4}
    return {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 4}}


def post(
    live: LiveGateway,
    session: requests.Session,
    route: str,
    data: bytes,
    headers: dict[str, str] | None = None,
) -> requests.Response:
    sent = {"Content-Type": "application/json", **(headers or {})}
    return session.post(live.url + route, data=data, headers=sent, timeout=30)


def is_envelope(payload: Any) -> bool:
    if not isinstance(payload, dict) or set(payload) != {"error"}:
        return False
    error = payload["error"]
    return (
        isinstance(error, dict)
        and isinstance(error.get("message"), str)
        and isinstance(error.get("type"), str)
        and "param" in error
        and (error["param"] is None or isinstance(error["param"], str))
        and isinstance(error.get("code"), str)
    )


def reached_backend(response: requests.Response) -> bool:
    """A request that got a slot carries its queue time; refusals before that do not."""
    return "x-gateway-queue-ms" in response.headers


def check_answer(route: str, response: requests.Response) -> Any:
    """The properties every answer has; returns the parsed error envelope of a 4xx, if any."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code < 400:
        return None
    if not reached_backend(response) or route in OPENAI_ROUTES:
        assert response.headers["Content-Type"].startswith("application/json"), response.headers
        payload = response.json()
        assert is_envelope(payload), payload
        assert "x-request-id" in response.headers or response.status_code in (404, 405)
        return payload
    return None  # a TGI backend's own 4xx, passed through as it is


def check_refused_by_gateway(
    route: str, response: requests.Response, param: str | None, status: int = 400
) -> None:
    payload = check_answer(route, response)
    assert response.status_code == status, (response.status_code, response.text[:500])
    assert not reached_backend(response)
    assert payload is not None
    if param is not None:
        assert payload["error"]["param"] == param, payload


# ----------------------------------------------------------------------------- strategies

#: Numbers and strings that look like a number to a lenient parser but are not one to the API.
NOT_AN_INT = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["10", "1e3", "", "ten", "0x10", " 5"]),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
NOT_A_STRING = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.lists(st.text(max_size=3), max_size=2),
    st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
)
HUGE_INTS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**31, 2**32, 2**53 + 1, 2**63, 2**64, 10**100, -(10**100), 10**4000]),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    HUGE_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    # No lone surrogate ("\ud800") here: such a body is refused whole (not valid JSON
    # for the gateway), see test_a_model_name_with_a_lone_surrogate_is_not_a_failure.
    st.sampled_from(["\u0000", "\U0010ffff" * 3, "😀" * 5, "\u202e", "\ufffd"]),
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=25,
)


def dumps(value: Any) -> bytes:
    """JSON as a permissive client writes it: NaN and Infinity tokens, lone surrogates escaped."""
    return json.dumps(value, allow_nan=True).encode()


@st.composite
def positive_ints_over(draw: st.DrawFn, low: int) -> int:
    return draw(st.one_of(st.integers(min_value=low, max_value=10**6), st.just(10**30)))


# Gateway-checked fields, a strategy of values the gateway must refuse, and where they go.
# Each yields (route, body, param) with `param` the field the refusal must name.
def _set(path: tuple[str | int, ...], value: Any, route: str) -> dict[str, Any]:
    body = valid_body(route)
    target: Any = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


NON_POSITIVE = st.one_of(NOT_AN_INT, st.integers(max_value=0))
WRONG_FIELDS: list[tuple[str, tuple[str | int, ...], str, st.SearchStrategy[Any]]] = [
    (
        CHAT,
        ("messages",),
        "messages",
        st.one_of(
            st.none(), st.booleans(), HUGE_INTS, st.text(max_size=5), st.just([]), st.just({})
        ),
    ),
    (CHAT, ("max_tokens",), "max_tokens", NON_POSITIVE.filter(lambda v: v is not None)),
    (
        CHAT,
        ("max_completion_tokens",),
        "max_completion_tokens",
        NON_POSITIVE.filter(lambda v: v is not None),
    ),
    (
        CHAT,
        ("n",),
        "n",
        st.one_of(NON_POSITIVE, positive_ints_over(MAX_N + 1)).filter(lambda v: v is not None),
    ),
    (CHAT, ("stream",), "stream", st.one_of(HUGE_INTS, st.text(max_size=5), st.lists(st.none()))),
    (CHAT, ("model",), "model", st.one_of(HUGE_INTS, st.booleans(), st.lists(st.none()))),
    (
        CHAT,
        ("stream_options",),
        "stream_options",
        st.one_of(HUGE_INTS, st.booleans(), st.text(max_size=5), st.lists(st.none())),
    ),
    (
        CHAT,
        ("messages", 1, "role"),
        "messages[1].role",
        st.one_of(
            st.text(max_size=12).filter(
                lambda r: r not in {"system", "developer", "user", "assistant", "tool", "function"}
            ),
            NOT_AN_INT,
        ),
    ),
    (
        CHAT,
        ("messages", 1, "content"),
        "messages[1].content",
        st.one_of(HUGE_INTS, st.booleans(), st.dictionaries(st.text(max_size=3), SCALARS)),
    ),
    (
        CHAT,
        ("messages", 1, "content", 0, "type"),
        "messages[1].content[0].type",
        st.text(max_size=12).filter(
            lambda t: t not in {"text", "refusal", "image_url", "input_audio", "file"}
        ),
    ),
    (
        CHAT,
        ("messages", 1, "content", 0),
        "messages[1].content[0]",
        st.one_of(SCALARS, st.lists(SCALARS, max_size=2)),
    ),
    (CHAT, ("messages", 1, "content", 0, "text"), "messages[1].content[0].text", NOT_A_STRING),
    (CHAT, ("messages", 0, "name"), "messages[0].name", st.one_of(HUGE_INTS, st.booleans())),
    (CHAT, ("messages", 0), "messages[0]", st.one_of(SCALARS, st.lists(SCALARS, max_size=2))),
    (CHAT, ("tools",), "tools", st.one_of(HUGE_INTS, st.booleans(), st.text(max_size=5))),
    (CHAT, ("tools",), "tools[0]", st.lists(SCALARS, min_size=1)),
    (COMPLETIONS, ("max_tokens",), "max_tokens", NON_POSITIVE.filter(lambda v: v is not None)),
    (
        COMPLETIONS,
        ("prompt",),
        "prompt",
        st.one_of(
            st.none(),
            st.booleans(),
            HUGE_INTS,
            st.just([]),
            st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
            st.lists(st.integers(min_value=2**31), min_size=1, max_size=3),
            st.tuples(st.text(max_size=3), st.integers()).map(list),
            st.just([[]]),
            st.just([[1, 2], []]),
            st.just([[1, "a"]]),
            st.dictionaries(st.text(max_size=3), SCALARS, min_size=1, max_size=2),
        ),
    ),
    (COMPLETIONS, ("n",), "n", positive_ints_over(MAX_N + 1)),
    (GENERATE, ("inputs",), "inputs", NOT_A_STRING),
    (
        GENERATE,
        ("parameters",),
        "parameters",
        st.one_of(HUGE_INTS, st.booleans(), st.text(max_size=5), st.lists(SCALARS, max_size=2)),
    ),
    (
        GENERATE,
        ("parameters", "max_new_tokens"),
        "parameters.max_new_tokens",
        NON_POSITIVE.filter(lambda v: v is not None),
    ),
    (
        GENERATE_STREAM,
        ("parameters", "best_of"),
        "parameters.best_of",
        st.one_of(NON_POSITIVE, positive_ints_over(MAX_N + 1)).filter(lambda v: v is not None),
    ),
    (COMPAT, ("stream",), "stream", st.one_of(st.none(), HUGE_INTS, st.text(max_size=5))),
]


@st.composite
def wrongly_typed_fields(draw: st.DrawFn) -> tuple[str, dict[str, Any], str]:
    route, path, param, values = draw(st.sampled_from(WRONG_FIELDS))
    return route, _set(path, draw(values), route), param


def _paths(value: Any, prefix: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    found: list[tuple[str | int, ...]] = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += _paths(child, (*prefix, index))
    return found


@st.composite
def mutated_bodies(draw: st.DrawFn) -> tuple[str, Any]:
    """A valid body with a few random edits: replace, delete, add, or wrap a part of it."""
    route = draw(st.sampled_from(ROUTES))
    body: Any = valid_body(route)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        paths = _paths(body)
        action = draw(st.sampled_from(["replace", "delete", "add", "wrap", "stream"]))
        if action == "stream" and isinstance(body, dict):
            body["stream"] = draw(st.one_of(st.booleans(), SCALARS))
            continue
        if not paths or action == "add":
            parent = draw(st.sampled_from([(), *paths]))
            target = _get(body, parent)
            if isinstance(target, dict):
                target[draw(st.text(max_size=10))] = draw(JSON_VALUES)
            elif isinstance(target, list):
                target.append(draw(JSON_VALUES))
            continue
        path = draw(st.sampled_from(paths))
        parent_value = _get(body, path[:-1])
        if action == "delete":
            del parent_value[path[-1]]
        elif action == "wrap":
            parent_value[path[-1]] = draw(st.sampled_from([[parent_value[path[-1]]], {"v": 1}]))
        else:
            parent_value[path[-1]] = draw(JSON_VALUES)
    return route, body


def _get(value: Any, path: tuple[str | int, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


def nested(depth: int, innermost: Any = 1, kind: str = "list") -> Any:
    value = innermost
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


def nested_text(depth: int, kind: str = "list") -> bytes:
    """`depth` levels of nesting written directly (json.dumps of it would itself recurse)."""
    opener, closer = ("[", "]") if kind == "list" else ('{"a":', "}")
    return (opener * depth + "1" + closer * depth).encode()


# ----------------------------------------------------------------------------- properties


@settings(PROPERTY_SETTINGS, max_examples=150)
@given(route=st.sampled_from(ROUTES), value=JSON_VALUES)
def test_any_json_value_gets_an_answer_not_a_failure(
    live: LiveGateway, session: requests.Session, route: str, value: Any
) -> None:
    response = post(live, session, route, dumps(value))
    check_answer(route, response)
    assert live.leftovers() == []
    if not isinstance(value, dict):
        check_refused_by_gateway(route, response, None)


@settings(PROPERTY_SETTINGS, max_examples=150)
@given(
    route=st.sampled_from(ROUTES),
    raw=st.one_of(
        st.binary(max_size=200),
        st.sampled_from(
            [
                b"",
                b"\xff\xfe\xfd",
                b'{"messages": "\xff"}',
                b'{"prompt": "\xc3\x28", "max_tokens": 2}',
                b'{"inputs": "\xc3\x28"}',
                b"\xef\xbb\xbf{}",
                b'{"a": NaN, "b": -Infinity}',
                b"{" * 3,
                b'{"messages": [}',
                b"null",
                b"\x00" * 10,
            ]
        ),
        st.text(max_size=100).map(lambda s: s.encode("utf-16")),
    ),
    content_type=st.sampled_from(
        [
            None,
            "application/json",
            "application/json; charset=latin-1",
            "application/json; charset=utf-16",
            "application/vnd.api+json",
            "text/plain",
            "",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
        ]
    ),
)
def test_any_bytes_get_an_answer_not_a_failure(
    live: LiveGateway,
    session: requests.Session,
    route: str,
    raw: bytes,
    content_type: str | None,
) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    request = requests.Request("POST", live.url + route, data=raw, headers=headers).prepare()
    if content_type is None:
        request.headers.pop("Content-Type", None)
    response = session.send(request, timeout=30)
    check_answer(route, response)
    assert live.leftovers() == []
    if content_type in ("text/plain", "", "application/x-www-form-urlencoded"):
        check_refused_by_gateway(route, response, None, status=415)


def sendable_header(value: bytes) -> bool:
    """What HTTP allows in a header value (field-vchar, obs-text, inner spaces and tabs);
    aiohttp's parser refuses anything else before the gateway sees the request."""
    return value == value.strip() and all(c == 9 or 32 <= c <= 126 or c >= 128 for c in value)


HEADER_BYTES = st.binary(min_size=1, max_size=200).filter(sendable_header)


@settings(PROPERTY_SETTINGS, max_examples=60)
@given(
    request_id=st.one_of(
        HEADER_BYTES,
        st.text(min_size=1, max_size=200).map(str.encode).filter(sendable_header),
    )
)
def test_any_request_id_is_echoed_when_sane_and_replaced_otherwise(
    live: LiveGateway, session: requests.Session, request_id: bytes
) -> None:
    response = session.post(
        live.url + COMPLETIONS,
        json=valid_body(COMPLETIONS),
        headers={"X-Request-Id": request_id},
        timeout=30,
    )
    check_answer(COMPLETIONS, response)
    assert live.leftovers() == []
    assert response.status_code == 200, response.text[:300]
    echoed = response.headers["x-request-id"].encode("latin-1")
    try:
        text = request_id.decode("utf-8")
        sane = len(text) <= 128 and text.isprintable()
    except UnicodeDecodeError:
        sane = False
    if sane:
        assert echoed == request_id
    else:
        assert len(echoed) == 32 and all(c in b"0123456789abcdef" for c in echoed), echoed


@settings(PROPERTY_SETTINGS, max_examples=250)
@given(case=wrongly_typed_fields())
def test_a_wrongly_typed_field_is_refused_by_the_gateway_naming_it(
    live: LiveGateway, session: requests.Session, case: tuple[str, dict[str, Any], str]
) -> None:
    route, body, param = case
    response = post(live, session, route, dumps(body))
    # NaN and Infinity are not JSON: such a body is refused whole (400, no field named).
    check_refused_by_gateway(route, response, param if is_strict_json(body) else None)
    assert live.leftovers() == []


def is_strict_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True


@settings(PROPERTY_SETTINGS, max_examples=300)
@given(case=mutated_bodies())
def test_a_mutated_valid_body_gets_an_answer_not_a_failure(
    live: LiveGateway, session: requests.Session, case: tuple[str, Any]
) -> None:
    route, body = case
    response = post(live, session, route, dumps(body))
    check_answer(route, response)
    assert live.leftovers() == []


@settings(PROPERTY_SETTINGS, max_examples=60)
@given(
    route=st.sampled_from(ROUTES),
    depth=st.one_of(st.integers(min_value=1, max_value=3000), st.just(10_000), st.just(100_000)),
    kind=st.sampled_from(["list", "dict"]),
    where=st.sampled_from(
        ["top", "unknown_field", "content", "tools", "tools_function", "parameters"]
    ),
)
def test_deep_nesting_gets_an_answer_not_a_failure(
    live: LiveGateway, session: requests.Session, route: str, depth: int, kind: str, where: str
) -> None:
    response = post(live, session, route, deeply_nested_body(route, depth, kind, where))
    check_answer(route, response)
    assert live.leftovers() == []


def deeply_nested_body(route: str, depth: int, kind: str, where: str) -> bytes:
    """A body with `depth` levels of nesting at `where`, written without recursion."""
    inner = nested_text(depth, kind)
    if where == "top":
        return inner
    body = valid_body(route)
    marker = "__NESTED__"
    if where == "content" and route == CHAT:
        body["messages"][1]["content"] = [{"type": "image_url", "image_url": marker}]
    elif where == "tools" and route == CHAT:
        body["tools"] = [marker]
    elif where == "tools_function" and route == CHAT:
        body["tools"] = [{"type": "function", "function": marker}]
    elif where == "parameters" and route not in OPENAI_ROUTES:
        body["parameters"]["details"] = marker
    else:
        body["extra"] = marker
    return json.dumps(body).encode().replace(f'"{marker}"'.encode(), inner)


@pytest.mark.parametrize(
    ("route", "where"),
    [
        (CHAT, "tools"),
        (CHAT, "tools_function"),
        (CHAT, "unknown_field"),
        (CHAT, "content"),
        (COMPLETIONS, "unknown_field"),
        (GENERATE, "parameters"),
        (COMPAT, "unknown_field"),
    ],
)
def test_nesting_just_below_the_parser_limit_is_never_a_500(
    live: LiveGateway, session: requests.Session, route: str, where: str
) -> None:
    """The parser refuses a body too deep for Python's recursion limit with a 400; a body
    just shallow enough to parse must not fail later, where the gateway encodes parts of
    it again (tool definitions for counting, the body for the backend) a few frames deeper.

    At commit a94ea69 a `tools` entry without `function` nested to the parser's limit was
    a 500 (RecursionError in tokens._add_tools' json.dumps); the handler refactor of
    3f79844 moved the stack by a frame or two and hid it. The encodes are still unguarded,
    so this sweeps a band below the limit rather than one depth.
    """
    limit = deepest_parsed(live, session, route, where)
    assert limit > 100
    for depth in range(limit - 20, limit + 3):
        for kind in ("list", "dict"):
            body = deeply_nested_body(route, depth, kind, where)
            check_answer(route, post(live, session, route, body))


def deepest_parsed(live: LiveGateway, session: requests.Session, route: str, where: str) -> int:
    """The deepest nesting the gateway still parses (its 400 says 'not valid JSON' beyond)."""
    low, high = 1, 50_000
    while low < high:
        middle = (low + high + 1) // 2
        response = post(live, session, route, deeply_nested_body(route, middle, "list", where))
        check_answer(route, response)
        not_json = response.status_code == 400 and "not valid JSON" in response.text
        if not_json:
            high = middle - 1
        else:
            low = middle
    return low


# ----------------------------------------------------------------------------- fixed cases


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (CHAT, {"messages": "hello"}, "messages"),
        (CHAT, {"model": "m"}, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (CHAT, {**valid_body(CHAT), "max_tokens": "10"}, "max_tokens"),
        (CHAT, {**valid_body(CHAT), "max_tokens": -1}, "max_tokens"),
        (CHAT, {**valid_body(CHAT), "max_tokens": True}, "max_tokens"),
        (CHAT, {**valid_body(CHAT), "max_tokens": 10.0}, "max_tokens"),
        (CHAT, {**valid_body(CHAT), "n": 10**12}, "n"),
        (CHAT, {**valid_body(CHAT), "n": True}, "n"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "video", "video": "x"}]}]},
            "messages[0].content[0].type",
        ),
        (COMPLETIONS, {"max_tokens": 3}, "prompt"),
        (COMPLETIONS, {"prompt": [1, "a"]}, "prompt"),
        (COMPLETIONS, {"prompt": [2**31]}, "prompt"),
        (GENERATE, {"parameters": {}}, "inputs"),
        (GENERATE, {"inputs": "x", "parameters": {"best_of": 99}}, "parameters.best_of"),
        (COMPAT, {"inputs": "x", "stream": "true"}, "stream"),
    ],
)
def test_known_bad_bodies_are_refused_by_the_gateway(
    live: LiveGateway, session: requests.Session, route: str, body: Any, param: str
) -> None:
    check_refused_by_gateway(route, post(live, session, route, dumps(body)), param)


def test_huge_max_tokens_is_clamped_not_refused(
    live: LiveGateway, session: requests.Session
) -> None:
    body = {**valid_body(CHAT), "max_tokens": 10**4000}
    response = post(live, session, CHAT, dumps(body))
    assert response.status_code == 200, response.text[:300]
    assert response.headers["x-gateway-max-tokens"] == "8"
    assert response.headers["x-gateway-max-tokens-clamped-from"] == str(10**4000)


@pytest.mark.parametrize("route", ROUTES)
def test_bodies_over_the_byte_limit_get_a_413_envelope(
    live: LiveGateway, session: requests.Session, route: str
) -> None:
    big = valid_body(route)
    big["padding"] = "x" * (MAX_BODY_BYTES + 1)
    check_refused_by_gateway(route, post(live, session, route, dumps(big)), None, status=413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        data = dumps(big)
        for start in range(0, len(data), 65536):
            yield data[start : start + 65536]

    response = session.post(
        live.url + route, data=chunks(), headers={"Content-Type": "application/json"}, timeout=30
    )
    check_refused_by_gateway(route, response, None, status=413)


def test_a_compression_bomb_is_refused_without_being_inflated(
    live: LiveGateway, session: requests.Session
) -> None:
    # 16 MiB of spaces after a valid body's opening: ~16 KiB compressed.
    bomb = gzip.compress(b'{"messages": [' + b" " * (16 * 1024 * 1024), compresslevel=9)
    assert len(bomb) < MAX_BODY_BYTES
    response = post(live, session, CHAT, bomb, headers={"Content-Encoding": "gzip"})
    check_refused_by_gateway(CHAT, response, None, status=415)


def exchange(
    live: LiveGateway,
    route: str,
    body: bytes,
    headers: dict[str, str],
    *,
    split: bool,
    timeout_s: float = 5.0,
) -> tuple[int, str, bytes] | None:
    """One request on a fresh connection with the body sent with its headers or 50 ms after
    them (what reaches the server in one read decides where aiohttp's parser fails); the
    status, Content-Type and body, or None when no answer came within `timeout_s`."""
    host, port = live.url.removeprefix("http://").split(":")
    lines = [f"POST {route} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        if split:
            sock.sendall(head)
            time.sleep(0.05)
            sock.sendall(body)
        else:
            sock.sendall(head + body)
        response = http.client.HTTPResponse(sock)
        try:
            response.begin()
            return response.status, response.getheader("Content-Type", ""), response.read()
        except TimeoutError:
            return None


def check_exchange_is_an_envelope(answer: tuple[int, str, bytes] | None, status: int) -> None:
    assert answer is not None, "no answer within the timeout"
    got_status, content_type, raw = answer
    assert got_status == status, answer
    assert content_type.startswith("application/json"), answer
    assert is_envelope(json.loads(raw)), answer


TRUNCATED_DEFLATE = zlib.compress(dumps(valid_body(CHAT)))[:10]


@pytest.mark.parametrize("split", [False, True], ids=["together", "split"])
@pytest.mark.parametrize(
    ("encoding_name", "raw"),
    [
        pytest.param("gzip", gzip.compress(dumps(valid_body(CHAT)), mtime=0), id="gzip"),
        pytest.param("gzip", b"this is not gzip", id="gzip-garbage"),
        pytest.param("deflate", b"not deflate either", id="deflate-garbage"),
        pytest.param("deflate", TRUNCATED_DEFLATE, id="deflate-truncated"),
        pytest.param("gzip", gzip.compress(dumps(valid_body(CHAT)), mtime=0)[:15], id="gzip-head"),
        pytest.param("br", b"garbage", id="br"),
    ],
)
def test_a_compressed_body_gets_a_415_envelope_without_being_decoded(
    live: LiveGateway, encoding_name: str, raw: bytes, split: bool
) -> None:
    """No client of an LLM API compresses its requests; decoding them would let a
    truncated or bomb-like body hang or bloat the gateway, so they are refused."""
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding_name}
    answer = exchange(live, CHAT, raw, headers, split=split, timeout_s=3.0)
    check_exchange_is_an_envelope(answer, 415)


def test_a_body_cut_short_leaves_nothing_behind(live: LiveGateway) -> None:
    """The client promises more bytes than it sends, then goes away."""
    host, port = live.url.removeprefix("http://").split(":")
    body = dumps(valid_body(CHAT))
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body) + 100}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(head + body)
        time.sleep(0.2)
    assert live.leftovers() == []


def test_nan_and_infinity_in_passed_through_fields_are_not_a_failure(
    live: LiveGateway, session: requests.Session
) -> None:
    body = {**valid_body(CHAT), "temperature": math.nan, "top_p": math.inf}
    check_answer(CHAT, post(live, session, CHAT, dumps(body)))
    tgi = valid_body(GENERATE)
    tgi["parameters"]["temperature"] = -math.inf
    check_answer(GENERATE, post(live, session, GENERATE, dumps(tgi)))


def check_logged(live: LiveGateway, response: requests.Response) -> None:
    """The request's log line was written (the log is strict UTF-8, like stdout) and
    records the status the client got."""
    assert live.leftovers() == []  # ended: its line is written when its slot is given back
    request_id = response.headers["x-request-id"]
    lines = [line for line in live.log_lines() if line.get("request_id") == request_id]
    assert [line["status"] for line in lines] == [response.status_code], lines


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_a_model_name_with_a_lone_surrogate_is_not_a_failure(
    live: LiveGateway, session: requests.Session, route: str
) -> None:
    """JSON may spell a lone surrogate (`"\\ud800"`), but no UTF-8 can carry it on to a
    backend: decided, it is refused whole as not valid JSON (400), and logged."""
    body = {**valid_body(route), "model": "\ud800"}
    response = post(live, session, route, dumps(body))
    check_refused_by_gateway(route, response, None)
    check_logged(live, response)


@pytest.mark.parametrize(
    ("route", "raw"),
    [
        (CHAT, b'{"messages": [{"role": "user", "content": "\xff"}]}'),
        (COMPLETIONS, b'{"prompt": "caf\xe9"}'),
        (GENERATE, b'{"inputs": "\xc3\x28"}'),
        (CHAT, b'{"model": "\xed\xa0\x80", "messages": [{"role": "user", "content": "hi"}]}'),
    ],
)
def test_a_body_that_is_not_utf8_is_refused_by_the_gateway(
    live: LiveGateway, session: requests.Session, route: str, raw: bytes
) -> None:
    check_refused_by_gateway(route, post(live, session, route, raw), None)


@pytest.mark.parametrize(
    ("route", "path"),
    [
        (CHAT, ("messages", 0, "content")),
        (CHAT, ("messages", 1, "content", 0, "text")),
        (CHAT, ("messages", 0, "name")),
        (CHAT, ("user",)),
        (COMPLETIONS, ("prompt",)),
        (GENERATE, ("inputs",)),
        (COMPAT, ("inputs",)),
    ],
)
def test_a_lone_surrogate_in_a_counted_or_passed_field_is_not_a_failure(
    live: LiveGateway, session: requests.Session, route: str, path: tuple[str | int, ...]
) -> None:
    body = _set(path, "a\ud800b\udfff", route)
    response = post(live, session, route, dumps(body))
    check_refused_by_gateway(route, response, None)  # as the model-name case above
    check_logged(live, response)


async def test_client_mistakes_do_not_eject_a_healthy_backend(
    start_simulator_at: StartSimulator, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """Uses a gateway of its own with the default health settings (the module's gateway
    has passive ejection turned off)."""
    gateway = await start_gateway([await start_simulator_at()])
    for _ in range(gateway.state.settings.health.failures_to_eject):
        async with http.post(gateway.url + GENERATE_STREAM, json={"inputs": ""}) as resp:
            raw = await resp.read()
        assert resp.status == 200 and b'"error_type":"validation"' in raw
    async with http.post(gateway.url + CHAT, json=valid_body(CHAT)) as resp:
        answer = await resp.read()
    assert resp.status == 200, answer
