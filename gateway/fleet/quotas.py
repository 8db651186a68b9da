"""Tenant quotas per API key: requests and tokens per minute, over every replica.

A per-key limit kept by each replica alone is N replicas times too generous, and
one charged only after the answer (what Envoy AI Gateway does) is overshot by a
burst of concurrent requests. So a request *reserves* at admission, before it
queues: one request and its prompt tokens plus its whole output budget, in one
Lua call that checks both limits and adds both or neither. Concurrent requests
from any replica cannot overshoot. At the request's end the part it did not use
is *given back* (its backend's `usage`), in the background: a lost give-back only
makes the quota stricter for the rest of one window, while awaiting Redis after
the answer would delay it.

Windows are fixed minutes counted in Redis time (`TIME` inside the script, never
a replica's clock); one hash per key name holds the window's index and its two
counts and expires after two windows. The quota belongs to the key's `name`, so a
rotated key and its successor with the same name share one.

Redis down or slow (`SharedStore.call` gave None): the same windows are kept in
this process, each limit times this replica's share (`Fleet.local_share`), so no
request fails because Redis did. When Redis answers again the local counts are
dropped and the shared windows count again. Without `[redis] url` the quotas are
local with share 1: one replica, exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter

from gateway.config import ApiKeySettings
from gateway.fleet.fleet import Fleet
from gateway.fleet.store import SharedStore
from gateway.observability.record import RequestRecord
from gateway.outcomes import Outcome, QuotaExceeded

#: The quotas' window: the config's limits are per minute.
WINDOW_S = 60.0

#: KEYS: the key's quota hash. ARGV: window ms, request limit (0: none), token limit (0:
#: none), the request's tokens. Returns {admitted (1/0), window index, requests and
#: tokens counted in the window (with this request when admitted), ms until the window
#: ends, the limit that refused it (0: none, 1: requests, 2: tokens)}.
RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window_ms = tonumber(ARGV[1])
local window = math.floor(now / window_ms)
local reset_ms = (window + 1) * window_ms - now
local request_limit = tonumber(ARGV[2])
local token_limit = tonumber(ARGV[3])
local tokens = tonumber(ARGV[4])
local held = redis.call('HMGET', KEYS[1], 'w', 'r', 't')
local requests, used = 0, 0
if tonumber(held[1]) == window then
  requests = tonumber(held[2]) or 0
  used = tonumber(held[3]) or 0
end
if request_limit > 0 and requests + 1 > request_limit then
  return {0, window, requests, used, reset_ms, 1}
end
if token_limit > 0 and used + tokens > token_limit then
  return {0, window, requests, used, reset_ms, 2}
end
redis.call('HSET', KEYS[1], 'w', window, 'r', requests + 1, 't', used + tokens)
redis.call('PEXPIRE', KEYS[1], window_ms * 2)
return {1, window, requests + 1, used + tokens, reset_ms, 0}
"""

#: KEYS: the key's quota hash. ARGV: the reservation's window index, then the change of
#: its requests and tokens (negative: given back; tokens positive when it used more than
#: it reserved). Nothing when the window is over (its counts went with it); never below 0.
GIVE_BACK = """
local window = redis.call('HGET', KEYS[1], 'w')
if not window or tonumber(window) ~= tonumber(ARGV[1]) then return 0 end
if redis.call('HINCRBY', KEYS[1], 'r', ARGV[2]) < 0 then
  redis.call('HSET', KEYS[1], 'r', 0)
end
if redis.call('HINCRBY', KEYS[1], 't', ARGV[3]) < 0 then
  redis.call('HSET', KEYS[1], 't', 0)
end
return 1
"""

_LIMIT_NAMES = {1: "requests", 2: "tokens"}

#: A key's (requests, tokens) per window; None: that one is not limited.
Limits = tuple[int | None, int | None]


class WindowCount(NamedTuple):
    """A window's counts after one reservation was decided."""

    window: int
    requests: int
    tokens: int
    reset_s: float
    #: 0: admitted; 1: refused by the request limit, 2: by the token limit.
    refused_by: int


def openai_duration(seconds: float) -> str:
    """A duration as OpenAI's `x-ratelimit-reset-*` headers write it (Go's format):
    `12ms`, `1s`, `59.2s`, `6m0s`, `1h0m0s`."""
    ms = max(0, round(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest_ms = divmod(ms, 60_000)
    hours, minutes = divmod(minutes, 60)
    text = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    if hours:
        text = f"{hours}h{text}"
    return text


def rate_limit_headers(
    limits: Limits, requests: int, tokens: int, reset_s: float
) -> dict[str, str]:
    """OpenAI's `x-ratelimit-*` headers for the limits that are set (limit, remaining
    after this request, time until the window resets)."""
    reset = openai_duration(reset_s)
    headers: dict[str, str] = {}
    for kind, limit, used in (("requests", limits[0], requests), ("tokens", limits[1], tokens)):
        if limit is None:
            continue
        headers[f"x-ratelimit-limit-{kind}"] = str(limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, limit - used))
        headers[f"x-ratelimit-reset-{kind}"] = reset
    return headers


@dataclass(slots=True)
class QuotaReservation:
    """What one request of a quota'd key reserved (or was refused), until its end."""

    client: str
    prompt_tokens: int
    output_tokens: int
    #: The window's index (Redis time, or this process's clock when local).
    window: int
    #: Reserved in Redis (else in this process's windows, of generation `epoch`).
    shared: bool
    epoch: int
    #: The x-ratelimit-* headers for the answer.
    headers: dict[str, str]
    #: Set when the request is over the quota (nothing was reserved).
    refusal: QuotaExceeded | None = None

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def check(self) -> None:
        """Raise the quota refusal, if it is one."""
        if self.refusal is not None:
            raise self.refusal


@dataclass(slots=True)
class _LocalWindow:
    index: int
    requests: int = 0
    tokens: int = 0


def unused(reservation: QuotaReservation, record: RequestRecord) -> tuple[int, int]:
    """(requests, tokens) a finished request gives back; tokens < 0 when it used more.

    A request the gateway refused after reserving (queued and timed out, no backend, a
    backend that broke before its first byte) never reached the model: all of it comes
    back. One served gives back its reservation less what its backend reported (its own
    prompt count when it said, else the gateway's); one the backend answered with an
    error generated nothing and gives back its tokens. Any other without a completion
    count (a client gone during a non-streamed answer) may have cost the whole budget:
    nothing is given back.
    """
    never_served = record.dispatched is None or (
        record.outcome is Outcome.BACKEND_ERROR and record.first_byte is None
    )
    if never_served:
        return 1, reservation.tokens
    if record.completion_tokens is None:
        if record.outcome in (Outcome.BACKEND_ERROR, Outcome.BACKEND_REJECTED):
            return 0, reservation.tokens
        return 0, 0
    prompt = (
        record.backend_prompt_tokens
        if record.backend_prompt_tokens is not None
        else reservation.prompt_tokens
    )
    return 0, reservation.tokens - (prompt + record.completion_tokens)


class TenantQuotas:
    """Every key's requests- and tokens-per-minute windows, shared in Redis or local."""

    def __init__(
        self,
        keys: Sequence[ApiKeySettings] = (),
        *,
        store: SharedStore | None = None,
        share: Callable[[], float] = lambda: 1.0,
        registry: CollectorRegistry | None = None,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`store` None: local windows with `share` (1: one replica). With a store, this
        registers itself to drop its local counts when Redis comes back."""
        self.limits: dict[str, Limits] = {}
        self.set_keys(keys)
        self.store = store
        self.share = share
        self.window_s = window_s
        self.window_ms = max(1, round(window_s * 1000))
        self.clock = clock
        self._local: dict[str, _LocalWindow] = {}
        #: Bumped whenever the local counts are dropped: a give-back to older ones is void.
        self._epoch = 0
        self._background: set[asyncio.Task[Any]] = set()
        if store is not None:
            self._reserve = store.script(RESERVE)
            self._give_back = store.script(GIVE_BACK)
            store.on_up.append(self.rejoin)
        registry = registry or CollectorRegistry()
        self._refusals = Counter(
            "gateway_quota_refusals",
            "Requests refused with 429 quota_exceeded, by API key name and the limit that "
            "refused them (requests or tokens per minute).",
            ["client", "limit"],
            registry=registry,
        )
        self._fallbacks = Counter(
            "gateway_quota_fallback",
            "Quota reservations decided on this replica's local share because Redis was "
            "down or slow (the quotas are not global meanwhile).",
            registry=registry,
        )

    def set_keys(self, keys: Sequence[ApiKeySettings]) -> None:
        """The keys' quotas in force for the reservations from now on (a reload keeps the
        windows' counts: a key's minute goes on)."""
        self.limits = {
            k.name: (k.requests_per_minute, k.tokens_per_minute)
            for k in keys
            if k.requests_per_minute is not None or k.tokens_per_minute is not None
        }

    @classmethod
    def for_fleet(
        cls,
        keys: Sequence[ApiKeySettings],
        fleet: Fleet | None,
        registry: CollectorRegistry | None = None,
    ) -> TenantQuotas:
        """Shared through the fleet's Redis; without a fleet, local (one replica)."""
        if fleet is None:
            return cls(keys, registry=registry)
        return cls(keys, store=fleet.store, share=fleet.local_share, registry=registry)

    # -- at admission ------------------------------------------------------------------

    async def reserve(
        self, client: ApiKeySettings | None, prompt_tokens: int, output_tokens: int
    ) -> QuotaReservation | None:
        """Reserve one request and `prompt_tokens + output_tokens` for the client's key;
        None when it has no quota. A refused reservation reserves nothing and carries its
        QuotaExceeded (`check()` raises it) and the headers for the 429."""
        if client is None or client.name not in self.limits:
            return None
        name = client.name
        limits = self.limits[name]
        tokens = prompt_tokens + output_tokens
        if self.store is not None:
            answer = await self.store.call(
                "quota",
                lambda: self._reserve(
                    keys=[self.store_key(name)],
                    args=[self.window_ms, limits[0] or 0, limits[1] or 0, tokens],
                ),
            )
            if answer is not None:
                _, window, requests, used, reset_ms, refused_by = (int(x) for x in answer)
                count = WindowCount(window, requests, used, reset_ms / 1000, refused_by)
                reservation = QuotaReservation(
                    name, prompt_tokens, output_tokens, window, shared=True, epoch=0, headers={}
                )
                return self._judged(reservation, limits, count)
            self._fallbacks.inc()
        limits = self.local_limits(limits)
        count = self._count_locally(name, limits, tokens)
        reservation = QuotaReservation(
            name, prompt_tokens, output_tokens, count.window, False, self._epoch, headers={}
        )
        return self._judged(reservation, limits, count)

    def store_key(self, name: str) -> str:
        assert self.store is not None
        return self.store.key("quota", name)

    def local_limits(self, limits: Limits) -> Limits:
        """Each limit times this replica's share, at least 1."""
        share = 1.0 if self.store is None else self.share()
        return (
            None if limits[0] is None else max(1, math.floor(limits[0] * share)),
            None if limits[1] is None else max(1, math.floor(limits[1] * share)),
        )

    def _count_locally(self, name: str, limits: Limits, tokens: int) -> WindowCount:
        """The Lua script's decision, in this process (its own clock: only it counts)."""
        now_ms = self.clock() * 1000
        index = math.floor(now_ms / self.window_ms)
        reset_s = ((index + 1) * self.window_ms - now_ms) / 1000
        window = self._local.get(name)
        if window is None or window.index != index:
            window = self._local[name] = _LocalWindow(index)
        refused_by = 0
        if limits[0] is not None and window.requests + 1 > limits[0]:
            refused_by = 1
        elif limits[1] is not None and window.tokens + tokens > limits[1]:
            refused_by = 2
        else:
            window.requests += 1
            window.tokens += tokens
        return WindowCount(index, window.requests, window.tokens, reset_s, refused_by)

    def _judged(
        self, reservation: QuotaReservation, limits: Limits, count: WindowCount
    ) -> QuotaReservation:
        """The reservation with its headers, and its refusal when it was one."""
        reservation.headers = rate_limit_headers(
            limits, count.requests, count.tokens, count.reset_s
        )
        if count.refused_by:
            limit_name = _LIMIT_NAMES[count.refused_by]
            self._refusals.labels(reservation.client, limit_name).inc()
            reservation.refusal = self._refusal(limit_name, limits, reservation.tokens, count)
        return reservation

    @staticmethod
    def _refusal(limit_name: str, limits: Limits, asked: int, count: WindowCount) -> QuotaExceeded:
        """Says which limit, how much is left and when it resets (Retry-After: then)."""
        retry_after_s = max(1, math.ceil(count.reset_s))
        if limit_name == "requests":
            message = (
                f"This API key's quota of {limits[0]} requests per minute is used up; "
                f"it resets in {retry_after_s} s."
            )
        elif limits[1] is not None and asked > limits[1]:
            message = (
                f"This request needs {asked} tokens (prompt and max_tokens), more than this "
                f"API key's whole quota of {limits[1]} tokens per minute: lower max_tokens "
                "or shorten the prompt."
            )
        else:
            message = (
                f"This request needs {asked} tokens (prompt and max_tokens); this API key "
                f"has {max(0, (limits[1] or 0) - count.tokens)} of its {limits[1]} tokens per "
                f"minute left, and the quota resets in {retry_after_s} s. A lower "
                "max_tokens may fit now."
            )
        return QuotaExceeded(message, retry_after_s=retry_after_s)

    # -- at the request's end --------------------------------------------------------

    def give_back(self, reservation: QuotaReservation | None, record: RequestRecord) -> None:
        """Return what the finished request did not use; never waits for Redis."""
        if reservation is None or reservation.refusal is not None:
            return
        requests, tokens = unused(reservation, record)
        if requests == 0 and tokens == 0:
            return
        if not reservation.shared:
            self._give_back_locally(reservation, requests, tokens)
            return
        if self.store is None or not self.store.up:
            return  # its window is in Redis: lost, the quota is only stricter for a while
        task = asyncio.get_running_loop().create_task(
            self._give_back_shared(reservation, requests, tokens), name="quota-give-back"
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _give_back_shared(
        self, reservation: QuotaReservation, requests: int, tokens: int
    ) -> None:
        assert self.store is not None
        key = self.store_key(reservation.client)
        await self.store.call(
            "quota_give_back",
            lambda: self._give_back(keys=[key], args=[reservation.window, -requests, -tokens]),
        )

    def _give_back_locally(self, reservation: QuotaReservation, requests: int, tokens: int) -> None:
        window = self._local.get(reservation.client)
        if window is None or window.index != reservation.window:
            return
        if reservation.epoch != self._epoch:
            return
        window.requests = max(0, window.requests - requests)
        window.tokens = max(0, window.tokens - tokens)

    # -- Redis back, shutdown --------------------------------------------------------

    async def rejoin(self) -> None:
        """Redis answers again: its windows count from now on, the local ones are dropped."""
        self._local.clear()
        self._epoch += 1

    async def stop(self, timeout_s: float = 1.0) -> None:
        """Let the give-backs still in flight finish (briefly) before the store closes."""
        if not self._background:
            return
        _, pending = await asyncio.wait(set(self._background), timeout=timeout_s)
        for task in pending:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
