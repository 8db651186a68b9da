"""The retry memory: fingerprints, its window and bound, x-request-id reuse, damping's sums.

Plain logic over plain data: every time is passed in, so no test sleeps.
"""

from __future__ import annotations

import math

import pytest

from gateway.admission.retries import (
    DAMP_GRACE_S,
    IN_FLIGHT,
    Fingerprint,
    RetryMemory,
    fingerprint,
    retried_outcome,
)
from gateway.outcomes import NoBackend, Outcome, QueueTimeout, WaitTooLong

BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


def of(tenant: str = "team-a", body: bytes = BODY, **sender: object) -> Fingerprint:
    return fingerprint(body, client=None, tenant=tenant, **sender)  # type: ignore[arg-type]


def served(memory: RetryMemory, fp: Fingerprint, rid: str, at: float, end: float) -> None:
    seen, _ = memory.arrive(fp, rid, at)
    memory.end(seen, "ok", None, "interactive", end)


def failed(memory: RetryMemory, fp: Fingerprint, rid: str, at: float, end: float) -> None:
    seen, _ = memory.arrive(fp, rid, at)
    memory.end(seen, "backend_error", None, "interactive", end)


def refused(
    memory: RetryMemory,
    fp: Fingerprint,
    rid: str,
    at: float,
    retry_after_s: float,
    code: str = "wait_too_long",
) -> None:
    seen, _ = memory.arrive(fp, rid, at)
    memory.end(seen, code, retry_after_s, "interactive", at)


def test_the_same_body_from_the_same_tenant_within_the_window_is_a_retry() -> None:
    memory = RetryMemory(60.0, 100)
    failed(memory, of(), "r1", 0.0, 2.0)
    _, retry = memory.arrive(of(), "r2", 2.5)
    assert retry is not None
    assert (retry.of, retry.gap_ms, retry.outcome, retry.lane) == (
        "r1",
        500.0,
        "backend_error",
        "interactive",
    )
    assert retry.damp_s is None and retry.refusal() is None  # not refused: nothing to damp


def test_the_same_body_in_flight_or_served_is_new_work_not_a_retry() -> None:
    """A chat UI's server sends its users' identical "hi" from one address: copies while
    the first is in flight, or after it was served, retried nothing."""
    memory = RetryMemory(60.0, 100)
    peer = of(tenant="default", peer="10.0.0.1")
    first, _ = memory.arrive(peer, "r1", 0.0)
    assert memory.arrive(peer, "r2", 0.1)[1] is None  # in flight beside it
    memory.end(first, "ok", None, "interactive", 1.0)
    served(memory, of(), "t1", 2.0, 3.0)
    assert memory.arrive(of(), "t2", 3.5)[1] is None  # after it was served


def test_another_body_or_another_sender_is_new_work() -> None:
    memory = RetryMemory(60.0, 100)
    failed(memory, of(), "r1", 0.0, 1.0)
    assert memory.arrive(of(body=BODY + b" "), "r2", 2.0)[1] is None
    assert memory.arrive(of(tenant="team-b"), "r3", 2.0)[1] is None
    assert memory.arrive(fingerprint(BODY, client="key-a", tenant="team-a"), "r4", 2.0)[1] is None
    # Without identity, two addresses, or two sessions, are two senders.
    peer = of(tenant="default", peer="10.0.0.1")
    failed(memory, peer, "p1", 3.0, 3.1)
    assert memory.arrive(of(tenant="default", peer="10.0.0.2"), "p2", 3.5)[1] is None
    assert memory.arrive(of(tenant="default", peer="10.0.0.1", session="s2"), "p3", 3.5)[1] is None
    assert memory.arrive(peer, "p4", 3.5)[1] is not None


def test_a_request_is_forgotten_window_s_after_it_ended() -> None:
    memory = RetryMemory(10.0, 100)
    failed(memory, of(), "r1", 0.0, 5.0)
    _, retry = memory.arrive(of(), "r2", 15.0)  # 10 s after its end: still remembered
    assert retry is not None and retry.gap_ms == 10_000.0
    failed(memory, of(body=b"later"), "r3", 20.0, 21.0)
    assert memory.arrive(of(body=b"later"), "r4", 31.5)[1] is None
    # Ended entries past the window are dropped, not only ignored; the two arrivals
    # above never ended: in flight, they are kept (with "last", three in all).
    memory.arrive(of(body=b"last"), "r5", 100.0)
    assert len(memory) == 3


def test_the_memory_holds_at_most_max_entries_the_oldest_go_first() -> None:
    memory = RetryMemory(60.0, 3)
    for i in range(5):
        failed(memory, of(body=b"body %d" % i), f"r{i}", float(i), float(i) + 0.5)
    assert len(memory) == 3
    assert memory.arrive(of(body=b"body 1"), "again1", 6.0)[1] is None  # evicted
    # (that arrival evicted body 2 in turn); the newest are still there
    _, retry = memory.arrive(of(body=b"body 4"), "again4", 6.0)
    assert retry is not None and retry.of == "r4"
    assert len(memory) == 3


def test_a_reused_x_request_id_is_a_retry_whatever_its_body() -> None:
    memory = RetryMemory(60.0, 100)
    served(memory, of(request_id="client-1"), "client-1", 0.0, 1.0)
    _, retry = memory.arrive(of(body=b'{"changed": true}', request_id="client-1"), "client-1", 3.0)
    assert retry is not None and (retry.of, retry.gap_ms) == ("client-1", 2000.0)
    # The same id from another sender is another request.
    assert memory.arrive(of(tenant="team-b", request_id="client-1"), "client-1", 3.0)[1] is None
    # A request with its own id takes two entries: its body's and its id's.
    assert len(RetryMemory(60.0, 100)) == 0
    fresh = RetryMemory(60.0, 100)
    fresh.arrive(of(request_id="id-9"), "id-9", 0.0)
    assert len(fresh) == 2


def test_a_retry_while_the_first_is_in_flight_is_seen_with_no_gap() -> None:
    memory = RetryMemory(5.0, 100)
    mine = of(request_id="impatient")
    first, _ = memory.arrive(mine, "impatient", 0.0)
    _, retry = memory.arrive(mine, "impatient", 30.0)  # past the window: still in flight
    assert retry is not None and (retry.of, retry.gap_ms, retry.outcome) == (
        "impatient",
        None,
        IN_FLIGHT,
    )
    assert retry.refusal() is None
    # The first ends after its copy arrived: the copy stays the one remembered.
    memory.end(first, "ok", None, "interactive", 31.0)
    _, third = memory.arrive(mine, "impatient", 31.5)
    assert third is not None and third.outcome == IN_FLIGHT


def test_an_in_flight_request_outlives_the_window_in_memory() -> None:
    memory = RetryMemory(5.0, 100)
    long_one, _ = memory.arrive(of(body=b"long", request_id="L"), "L", 0.0)
    for i in range(20):  # arrivals long after it started expire the old ones around it
        failed(memory, of(body=b"short %d" % i), f"s{i}", 10.0 * i, 10.0 * i + 1)
    _, retry = memory.arrive(of(body=b"long", request_id="L"), "L", 200.0)
    assert retry is not None and retry.outcome == IN_FLIGHT
    memory.end(long_one, "ok", None, "bulk", 201.0)


def test_damping_a_retry_before_its_retry_after_with_the_time_left() -> None:
    memory = RetryMemory(60.0, 100)
    refused(memory, of(), "r1", 10.0, retry_after_s=5.0)
    _, retry = memory.arrive(of(), "r2", 12.0)
    assert retry is not None and retry.damp_s == pytest.approx(3.0)
    refusal = retry.refusal()
    assert isinstance(refusal, WaitTooLong) and refusal.code == "wait_too_long"
    assert refusal.retry_after_s == pytest.approx(3.0) and "r1" in refusal.message
    # The Retry-After header rounds up, at least 1 (http/errors.py): 3 here.
    assert max(1, math.ceil(refusal.retry_after_s)) == 3


def test_the_damping_deadline_holds_along_a_chain_of_copies() -> None:
    memory = RetryMemory(60.0, 100)
    refused(memory, of(), "r1", 10.0, retry_after_s=5.0)
    for i, at in enumerate((10.1, 10.2, 13.0)):
        seen, retry = memory.arrive(of(), f"c{i}", at)
        assert retry is not None and retry.damp_s == pytest.approx(15.0 - at)
        assert retry.of == ("r1" if i == 0 else f"c{i - 1}")
        memory.end(seen, retry.outcome, retry.damp_s, retry.lane, at)  # as the proxy does


def test_a_client_that_honours_retry_after_is_never_damped() -> None:
    memory = RetryMemory(60.0, 100)
    refused(memory, of(), "r1", 10.0, retry_after_s=4.2)  # the header said 5
    _, on_time = memory.arrive(of(), "r2", 15.0)
    assert on_time is not None and on_time.damp_s is None and on_time.outcome == "wait_too_long"
    # Within the grace before the deadline: measured from another moment, not damped.
    refused(memory, of(body=b"b"), "b1", 20.0, retry_after_s=2.0)
    _, close = memory.arrive(of(body=b"b"), "b2", 22.0 - DAMP_GRACE_S / 2)
    assert close is not None and close.damp_s is None


def test_only_a_sender_the_client_named_is_damped() -> None:
    memory = RetryMemory(60.0, 100)
    nobody = of(tenant="default", peer="10.0.0.1")  # an address: two people behind a proxy
    refused(memory, nobody, "a1", 0.0, retry_after_s=10.0)
    _, retry = memory.arrive(nobody, "a2", 1.0)
    assert retry is not None and retry.damp_s is None and retry.refusal() is None
    for named in (
        of(tenant="default", peer="10.0.0.1", user="end-user-7"),
        of(tenant="default", peer="10.0.0.1", session="conv-3"),
        of(tenant="default", peer="10.0.0.1", request_id="mine-1"),
        fingerprint(BODY, client="key-a", tenant="key-a"),
        of(tenant="team-a"),
    ):
        refused(memory, named, "n1", 0.0, retry_after_s=10.0)
        _, retry = memory.arrive(named, "n2", 1.0)
        assert retry is not None and retry.damp_s == pytest.approx(9.0), named


def test_a_reused_id_with_another_body_is_seen_not_damped() -> None:
    memory = RetryMemory(60.0, 100)
    refused(memory, of(request_id="same"), "same", 0.0, retry_after_s=10.0)
    _, retry = memory.arrive(of(body=b"another", request_id="same"), "same", 1.0)
    assert retry is not None and retry.outcome == "wait_too_long" and retry.damp_s is None


def test_with_damping_off_retries_are_only_seen() -> None:
    memory = RetryMemory(60.0, 100, damp=False)
    refused(memory, of(), "r1", 0.0, retry_after_s=10.0)
    _, retry = memory.arrive(of(), "r2", 1.0)
    assert retry is not None and retry.outcome == "wait_too_long" and retry.damp_s is None


def test_capacity_refusals_are_damped_with_their_own_kind_a_quota_is_not() -> None:
    memory = RetryMemory(60.0, 100)
    for code, kind in (("queue_timeout", QueueTimeout), ("no_backend", NoBackend)):
        refused(memory, of(body=code.encode()), "c1", 0.0, retry_after_s=10.0, code=code)
        _, retry = memory.arrive(of(body=code.encode()), "c2", 1.0)
        assert retry is not None and isinstance(retry.refusal(), kind)
    # The quota answers every request itself, with its x-ratelimit-* headers: only seen.
    refused(memory, of(), "q1", 0.0, retry_after_s=30.5, code="quota_exceeded")
    _, retry = memory.arrive(of(), "q2", 0.5)
    assert retry is not None and retry.outcome == "quota_exceeded" and retry.refusal() is None


def test_zero_window_or_entries_turn_it_off() -> None:
    assert not RetryMemory(0.0, 100).enabled and not RetryMemory(60.0, 0).enabled
    assert RetryMemory(60.0, 100).enabled


def test_retried_outcome_is_the_refusal_code_else_the_outcome() -> None:
    assert retried_outcome(Outcome.REJECTED_WAIT_TOO_LONG, "wait_too_long") == "wait_too_long"
    assert retried_outcome(Outcome.OK, None) == "ok"
    # A backend's own status code is no refusal of the gateway's: its outcome names it.
    assert retried_outcome(Outcome.BACKEND_REJECTED, "backend_400") == "backend_rejected"
    assert retried_outcome(Outcome.CLIENT_DISCONNECTED, None) == "client_disconnected"
    assert retried_outcome(None, None) == "unknown"
