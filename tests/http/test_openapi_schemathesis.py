"""Schemathesis against the gateway's own OpenAPI document, on a real gateway and simulator.

Schemathesis' pytest integration runs synchronous tests and sends requests with
`requests`, so the simulator and the gateway run on an event loop of their own in a
background thread for the whole module (started once: a gateway start loads nothing
slow, but hundreds of per-example starts would). Checks run from the test thread
ask that loop for the gateway's state through `run_coroutine_threadsafe`, never
touching it from outside.

What it holds the gateway to, for positive (schema-valid) and negative
(schema-violating) requests of schemathesis' coverage and fuzzing phases: no 5xx at
all (the simulator is healthy, so even a 502/503/504 is a failure here), documented
status codes, content types, headers (`Retry-After`) and response schemas (SSE
events included), schema-violating bodies refused with a 4xx *by the gateway itself*
before they take a slot (so the document says what admission checks, no more, no
less), and no slot, queue entry or prefill budget left behind afterwards. A
backend's own 4xx (the simulator refusing what the gateway passes through) is fine.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.core.parameters import ParameterLocation
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.http import openapi
from tests.http.live import LiveGateway, gateway_settings

T = TypeVar("T")

#: Examples per operation in the fuzzing phase (the examples and coverage phases add theirs).
MAX_EXAMPLES = 50


@pytest.fixture(scope="module")
def live() -> Iterator[LiveGateway]:
    gateway = LiveGateway().start()
    try:
        yield gateway
    finally:
        gateway.stop()


class UnreadLog:
    """The gateway's log lines that no case has looked at yet.

    Each case checks the lines written since the previous one, so the check does not
    depend on what ran before it (another file, another order, `-k`) and a failure
    names the example that caused it.
    """

    def __init__(self, live: LiveGateway) -> None:
        self.live = live
        self.read = 0

    def lines(self) -> list[dict[str, Any]]:
        lines = self.live.log_lines()
        new, self.read = lines[self.read :], len(lines)
        return new

    def server_errors(self) -> list[dict[str, Any]]:
        return [line for line in self.lines() if (line.get("status") or 0) >= 500]


@pytest.fixture(scope="module")
def unread_log(live: LiveGateway) -> Iterator[UnreadLog]:
    log = UnreadLog(live)
    yield log
    # A line written after the last case's check (a handler that ended late) is still seen.
    assert live.leftovers() == []
    assert log.server_errors() == []


# The document does not depend on the ports, only on the settings (max_n).
schema = schemathesis.openapi.from_dict(
    openapi.openapi_document(gateway_settings("http://127.0.0.1:9"))
)


def schema_violations_stop_at_the_gateway(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> bool | None:
    """A body the document calls invalid is refused by the gateway itself, before it takes
    a slot: the document describes what the gateway checks, not what the backend does.

    A dispatched request carries `x-gateway-queue-ms`; a refusal at admission does not.
    """
    meta = case.meta
    if meta is None or not meta.is_negative_at(ParameterLocation.BODY):
        return None
    if "x-gateway-queue-ms" in response.headers:
        raise AssertionError(
            f"A schema-violating body reached the backend (it answered {response.status_code}): "
            f"{case.body!r:.300}"
        )
    return True


CHECKS = [
    schema_violations_stop_at_the_gateway,
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_gateway_keeps_to_its_openapi_document(
    case: schemathesis.Case, live: LiveGateway, session: requests.Session, unread_log: UnreadLog
) -> None:
    case.call_and_validate(base_url=live.url, session=session, checks=CHECKS, timeout=30)
    assert live.leftovers() == []
    # The log line records the real outcome, also of a stream that failed after its 200.
    assert unread_log.server_errors() == []


def test_the_served_document_is_the_one_for_the_settings_in_force(
    live: LiveGateway, session: requests.Session
) -> None:
    response = session.get(live.url + "/openapi.json", timeout=10)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("application/json")
    document = response.json()
    assert document == openapi.openapi_document(live.state.settings)
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    (n_integer,) = [o for o in chat["properties"]["n"]["anyOf"] if o.get("type") == "integer"]
    assert n_integer["maximum"] == live.state.settings.limits.max_n


def test_the_document_is_valid_openapi() -> None:
    document = openapi.openapi_document()
    assert document["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/generate"} <= set(document["paths"])
    schemathesis.openapi.from_dict(document).validate()  # raises if it is not
    # ... and the validation is not vacuous: the same document with one bad field fails it.
    with pytest.raises(ValueError, match="info"):
        schemathesis.openapi.from_dict({**document, "info": "not an object"}).validate()
