"""Retries, seen and damped: the same request coming back, told apart from new work.

Seed §9 says to spot a retry storm by the same request reappearing in the log; under
overload the clients that retry at once, without backoff, are what turns a slow
moment into an outage: every copy takes a place in the queue that new work needed.
So the gateway remembers, for a while, a *fingerprint* of each request (who sent it
and a hash of its body bytes, never the body) with what it got, and a request whose
fingerprint it has seen is logged as a retry of the earlier one (`retry_of`, the gap,
what the earlier got), when the earlier one was refused, failed or given up on: the
same body while the first is still in flight, or after it was served, is new work (a
chat UI's server sends its users' identical "hi" from one address), unless it reuses
the client's own `x-request-id`.

Who sent it: the API key's name, else the tenant (the tenant header or the body's
`user`), else the peer's address (and `X-Forwarded-For`, as sent); the `x-session-id`
header is part of it when present. A client-sent `x-request-id` that comes again from
the same sender is a retry too, whatever its body (the seed's sign; nginx in front
passes the client's id or makes a unique one). A request that reuses the id of one
still in flight (a client that timed out and tried again while the gateway still
serves the first) is a retry of it, with `retried_outcome` "in_flight" and no gap.

Damping: a retry that comes before the `Retry-After` its earlier refusal for capacity
was given (`queue_full`, `wait_too_long`, `queue_timeout`, `no_backend`) is refused
again at once, with the same code and the time left, and never takes a place in the
queue; the copies a storm sends cost a dictionary lookup, not a queue slot
and a prediction. It is conservative, since refusing someone else's request would be
a wrong refusal: it applies only when the bodies are the same bytes and the sender is
one the client named (a key, a tenant, a session, a `user`) or the client reused its
own `x-request-id`. Two people behind one proxy (or without any identity) who send the
same "hi" share an address, so an address alone makes a retry *seen*, never damped.
A client that waits its Retry-After is never damped: the deadline is the earlier
refusal's end plus the unrounded Retry-After (the header rounds it up), less a grace.

Memory: one entry per request and one more for its client-sent `x-request-id`, for
`window_s` after the request ended (and while it is in flight), at most
`max_remembered` entries (the oldest go first). An entry is a 64-bit key in an
ordered dict and a small record holding the request's id string: at most
`BYTES_PER_ENTRY` bytes with a 32-character id (measured with tracemalloc: 253 bytes
and the id's 81 for a request without an id of its own, 394 and 81 for one with its
two entries), so the default 100 000 entries hold ~34 MB at most.
The hash is Python's own `hash()` of the bytes (SipHash-1-3 with a random
per-process key, 64 bits): ~4 GB/s, against ~0.9 for blake2b and ~1.7 for SHA-256 on
this project's machines, and not predictable by a client, so nobody can make up a
body that collides with someone else's. The memory is per process; replicas behind
one balancer each see the retries they get.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from gateway.outcomes import REFUSALS, Outcome, Refusal
from gateway.scheduling.scheduler import DEFAULT_TENANT

#: `retried_outcome` of a retry whose earlier request had not ended when it came.
IN_FLIGHT = "in_flight"
#: An identical body whose earlier copy is still in flight or was served is new work,
#: not a retry (unless it reuses the client's x-request-id): a chat UI's server is one
#: address for all its users, and 40 of them saying "hi" at once retried nothing (the
#: analyzer called such a burst a retry storm).
NOT_RETRIED = frozenset({IN_FLIGHT, Outcome.OK.value})
#: A retry this close (seconds) before its Retry-After ran out is not damped: a client
#: that waited measured its wait from another moment than the gateway did.
DAMP_GRACE_S = 0.25
#: The refusals a retry that comes too soon gets again: those of capacity (the lanes'
#: queues, the backends), whose copies would otherwise be measured and scheduled. Not
#: `quota_exceeded`: the quota is its own authority, checked in one atomic step before
#: any queue, and its answers carry the x-ratelimit-* headers a damped copy would lack.
DAMPED_CODES = frozenset({"queue_full", "wait_too_long", "queue_timeout", "no_backend"})
#: Bytes one remembered entry holds (see the module's docstring).
BYTES_PER_ENTRY = 340

#: Refusal kinds by code: a damped retry is refused with its earlier one's kind.
_REFUSAL_OF_CODE: dict[str, type[Refusal]] = {kind.code: kind for kind in REFUSALS}


@dataclass(slots=True, frozen=True)
class Fingerprint:
    """What tells a request's copies apart from other requests (keys are 64-bit hashes)."""

    body_key: int
    #: The client-sent x-request-id with its sender; None when the client sent none.
    request_id_key: int | None
    #: The sender is one the client named (key, tenant, session, `user`): may be damped.
    named: bool


def fingerprint(
    body: bytes,
    *,
    client: str | None,
    tenant: str | None,
    session: str | None = None,
    user: object = None,
    peer: str | None = None,
    forwarded: str | None = None,
    request_id: str | None = None,
) -> Fingerprint:
    """The fingerprint of a request with these body bytes, sent by this sender.

    `client` is the API key's name, `tenant` the request's tenant, `session` the
    `x-session-id` header, `user` the body's `user`, `peer` the connection's address,
    `forwarded` the `X-Forwarded-For` header, `request_id` the client's own x-request-id.
    """
    if client is not None:
        sender: tuple[str | None, ...] = ("key", client, session)
    elif tenant is not None and tenant != DEFAULT_TENANT:
        sender = ("tenant", tenant, session)
    else:
        sender = ("peer", peer, forwarded, session)
    named = (
        client is not None
        or sender[0] == "tenant"
        or bool(session)
        or (isinstance(user, str) and bool(user))
    )
    body_hash = hash(body)
    return Fingerprint(
        hash((sender, body_hash)),
        None if request_id is None else hash((sender, "x-request-id", request_id)),
        named,
    )


def retried_outcome(outcome: Outcome | None, error_code: str | None) -> str:
    """What a request got, as a retry of it names it: the gateway's refusal code when it
    refused it (`wait_too_long`), else its outcome (`ok`, `backend_error`, ...)."""
    if error_code is not None and error_code in _REFUSAL_OF_CODE:
        return error_code
    return str(outcome) if outcome is not None else "unknown"


@dataclass(slots=True)
class Seen:
    """A remembered request: its id, and once it ended what it got."""

    request_id: str
    body_key: int
    #: The key of its client-sent x-request-id; None: the client sent none.
    request_id_key: int | None
    #: Its arrival while in flight, its end after.
    at: float
    outcome: str = IN_FLIGHT
    lane: str | None = None
    #: Its end plus the Retry-After its refusal carried (unrounded); None: none given.
    retry_until: float | None = None


@dataclass(slots=True, frozen=True)
class Retry:
    """An arriving request found to be a retry of an earlier one."""

    of: str
    #: Milliseconds from the earlier one's end to this arrival; None while it is in flight.
    gap_ms: float | None
    outcome: str
    lane: str | None
    #: Seconds of the earlier refusal's Retry-After left, when this retry is to be damped.
    damp_s: float | None = None

    def refusal(self) -> Refusal | None:
        """The refusal a damped retry gets: its earlier one's kind, with the time left."""
        kind = _REFUSAL_OF_CODE.get(self.outcome)
        if self.damp_s is None or kind is None:
            return None
        return kind(
            f"This request repeats one refused {self.gap_ms / 1000.0 if self.gap_ms else 0:.1f} "
            f"s ago ({self.of}) before the time its Retry-After gave: retry after the "
            "time left in Retry-After.",
            retry_after_s=self.damp_s,
        )


class RetryMemory:
    """Fingerprints of recent requests, bounded in time and in entries.

    Times are passed in (`now`, the records' clock), so the memory is plain logic.
    """

    def __init__(self, window_s: float, max_entries: int, *, damp: bool = True) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self.damp = damp
        self._entries: OrderedDict[int, Seen] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.window_s > 0 and self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def arrive(self, fp: Fingerprint, request_id: str, now: float) -> tuple[Seen, Retry | None]:
        """Remember a request arriving now (in flight); the earlier one it retries, if any.

        The new request takes the place of the earlier one: a third copy is a retry of
        the second, and the chain keeps the first refusal's Retry-After deadline.
        """
        self._expire(now)
        entries = self._entries
        earlier, by_id = None, False
        if fp.request_id_key is not None:
            earlier = entries.get(fp.request_id_key)
            by_id = earlier is not None and self._live(earlier, now)
        if not by_id:
            earlier = entries.get(fp.body_key)
            if earlier is not None and not self._live(earlier, now):
                earlier = None
        seen = Seen(request_id, fp.body_key, fp.request_id_key, now)
        self._put(seen, replace=True)
        if earlier is None or (not by_id and earlier.outcome in NOT_RETRIED):
            return seen, None
        same_sender = fp.named or by_id
        return seen, self._retry(earlier, now, damp=same_sender and earlier.body_key == fp.body_key)

    def end(
        self, seen: Seen, outcome: str, retry_after_s: float | None, lane: str | None, now: float
    ) -> None:
        """The request `seen` ended now with `outcome` (and Retry-After, when refused)."""
        seen.outcome, seen.lane, seen.at = outcome, lane, now
        seen.retry_until = None if retry_after_s is None else now + retry_after_s
        self._put(seen, replace=False)

    def _put(self, seen: Seen, *, replace: bool) -> None:
        """`seen` last in line under its keys; unless `replace`, not under a key that a
        later copy took over."""
        entries = self._entries
        for key in (seen.body_key, seen.request_id_key):
            if key is None:
                continue
            current = entries.get(key)
            if replace or current is None or current is seen:
                entries[key] = seen
                entries.move_to_end(key)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def _retry(self, earlier: Seen, now: float, *, damp: bool) -> Retry:
        if earlier.outcome == IN_FLIGHT:
            return Retry(earlier.request_id, None, IN_FLIGHT, earlier.lane)
        damp_s = None
        if (
            self.damp
            and damp
            and earlier.retry_until is not None
            and earlier.outcome in DAMPED_CODES
        ):
            left = earlier.retry_until - now
            if left > DAMP_GRACE_S:
                damp_s = left
        gap_ms = round((now - earlier.at) * 1000.0, 3)
        return Retry(earlier.request_id, gap_ms, earlier.outcome, earlier.lane, damp_s)

    def _live(self, seen: Seen, now: float) -> bool:
        return seen.outcome == IN_FLIGHT or now - seen.at <= self.window_s

    def _expire(self, now: float) -> None:
        """Drop the entries that ended over `window_s` ago, oldest first; one in flight
        found among them goes to the back (it is remembered until it ends)."""
        entries, horizon = self._entries, now - self.window_s
        for _ in range(len(entries)):
            if not entries:
                return
            key = next(iter(entries))
            seen = entries[key]
            if seen.at >= horizon:
                return
            if seen.outcome == IN_FLIGHT:
                entries.move_to_end(key)
            else:
                del entries[key]
