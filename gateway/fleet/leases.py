"""Slot leases in Redis: each backend's `max_concurrency` (and prefill budget) holds
across every gateway replica in front of it.

Without them, three replicas in front of a backend with 8 slots put 24
requests on it, and the engine's own first-come-first-served queue, the thing
the lanes exist to avoid, comes back. So each replica's scheduler still orders
its own queues and picks a backend as before, and then, before sending, takes
a lease on that backend's slot with one Lua call (one round trip, the only one
on the request path): under the backend's slot limit and its prefill budget in
seconds, counted over all replicas, or refused. A refused request goes back to
the front of its lane's line, and this replica's view of the backend (the
slots and prefill the others hold) is updated from the answer, so its pool
does not pick that backend again until a slot frees.

Each lease expires `lease_ttl_s` after it was last renewed (Redis time, never a
replica's clock); the holder renews all of its leases in one pipelined round
trip per tick, so a crashed replica's slots come back within the TTL. Release
and the end of prefill are sent in the background, off the request path.

Order across replicas, as one gateway would keep it:
- A refused request joins the backend's line in Redis, ordered by lane and then by
  when it joined its lane's queue. A slot freed there (a release, the end of a
  prefill, an expired lease) is granted in the same step to the line's first, whose
  replica is told (published) and gives it to its next request for that backend,
  with no round trip; one nobody takes within PREPAID_GRACE_S is given back. A new
  request is refused while a request ahead of it waits in the line.
- Each replica publishes which of its lanes have requests waiting; the others hold
  their lower lanes back meanwhile (no new slot), as one gateway's scheduler does.

Per pool (#28): each model's pool has its own `SlotLeases` over its own backends and
scheduler. The keys of a backend (its slots, prefill, line) are named by its URL, so
they are that backend's wherever it is configured. What belongs to a fleet-wide
line rather than to one backend, the waiting set (which lanes wait on which replica)
and the channel of releases and grants, is per pool: pool B's waiting interactive
requests must not hold pool A's bulk lane back, and A's grants are no news to B. The
default pool keeps the one-pool names (`<prefix>:waiting`, `<prefix>:slots-freed`), so
during a rolling upgrade an older replica with a one-model config shares its pool with
the newer ones; every other pool's names end with `:<pool name>`.

Redis down or slow (`SharedStore`): leases are skipped and each backend counts
for this replica as only its share of the slots (`Fleet.local_share`). When
Redis answers again, every slot this replica holds is leased again, with or
without a lease before, and the counts are global again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.fleet.lease_scripts import (
    ACQUIRE,
    LEAVE_LINE,
    RELEASE,
    RENEW,
    WAITING,
    WAITING_CHANGED,
)
from gateway.fleet.store import SharedStore, mask_url_password
from gateway.observability.record import RequestRecord
from gateway.scheduling.scheduler import Grant, Scheduler
from gateway.upstream.pool import Backend, BackendPool, Slot

#: How long a slot the fleet's line granted may wait here for a request to take it.
PREPAID_GRACE_S = 0.25
#: The release listener's longest wait for a pub/sub message before it looks again.
PUBSUB_POLL_S = 1.0


def _ms(seconds: float) -> int:
    return max(0, math.ceil(seconds * 1000))


class SlotLeases:
    """This replica's leases on the backends' slots, and its view of the others'."""

    def __init__(
        self,
        store: SharedStore,
        pool: BackendPool,
        scheduler: Scheduler,
        *,
        share: Callable[[], float],
        subscriber: aioredis.Redis | None = None,
        pool_name: str | None = None,
    ) -> None:
        """`pool_name`: None for the default pool (the one-pool key names, which older
        replicas use too), else the pool's name, which ends its fleet-wide keys' names."""
        self.store = store
        self.pool = pool
        self.scheduler = scheduler
        self.share = share
        self.pool_name = pool_name
        self.ttl_ms = _ms(store.settings.lease_ttl_s)
        self.channel = self._pool_key("slots-freed")
        self._acquire = store.script(ACQUIRE)
        self._release = store.script(RELEASE)
        self._renew = store.script(RENEW)
        self._leave_line = store.script(LEAVE_LINE)
        self._line_timers: dict[Backend, asyncio.TimerHandle] = {}
        self._key_lists: dict[Backend, list[str]] = {}
        #: Leases the fleet's line granted this replica, not yet used by a request.
        #: Their names, with the prefill ms each was granted with (in Redis' prefill sum).
        self._prepaid: dict[Backend, dict[str, int]] = {b: {} for b in pool.backends}
        self._waiting = store.script(WAITING)
        self.waiting_key = self._pool_key("waiting")
        #: The lanes in priority order, and this replica's lanes with requests waiting.
        self._lanes = [lane.name for lane in scheduler.lanes]
        scheduler.on_waiting = self._queue_changed
        self._waiting_sent: dict[str, bool] = {}
        #: Requests per lane whose lease is being taken (they still count as waiting).
        self._leasing: dict[str, int] = {}
        self._waiting_sync: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        #: Slots this replica holds on each backend, leased or taken while Redis was down.
        self._held: dict[Backend, set[Slot]] = {b: set() for b in pool.backends}
        self._by_url = {b.url: b for b in pool.backends}
        self._background: set[asyncio.Task[Any]] = set()
        self._subscriber = subscriber
        self._listener: asyncio.Task[None] | None = None
        #: Set by `stop`: the listener ends at its next turn even if redis-py swallowed
        #: the cancellation (it can, inside a pub/sub connection's teardown).
        self._stopping = False
        pool.on_prefill_done = self._prefill_done
        pool.on_give_back = self._given_back
        self._local = False

    def _pool_key(self, name: str) -> str:
        """A fleet-wide key (or channel) of this pool: the default pool's is unchanged."""
        if self.pool_name is None:
            return self.store.key(name)
        return self.store.key(name, self.pool_name)

    def _keys(self, backend: Backend) -> list[str]:
        """The backend's keys, as every script takes them (built once)."""
        keys = self._key_lists.get(backend)
        if keys is None:
            names = ("slots", "prefill", "wanted", "line", "grants")
            keys = self._key_lists[backend] = [self.store.key(n, backend.url) for n in names]
        return keys

    # -- the request path ------------------------------------------------------------

    def ticket(self) -> str:
        """A request's name in the fleet's lines (the same for all its attempts)."""
        return f"{self.store.replica_id}#{next(self._ids)}"

    @staticmethod
    def line_ticket(ticket: str, slot: Slot) -> str:
        """The request's entry in its slot's backend's line: its ticket and the prefill
        it needs there (ms; 0 without a prefill budget), which the line's grant reserves."""
        needs = _ms(slot.prefill_s) if slot.backend.prefill_budget_s else 0
        return f"{ticket}#{needs}"

    async def take(
        self,
        slot: Slot,
        lane: str | None = None,
        *,
        ticket: str | None = None,
        waited_s: float = 0.0,
    ) -> bool:
        """Lease the slot the scheduler granted; False when the other replicas hold the
        backend's slots (or its prefill budget): then give it back and wait again.
        True at once while Redis is down (the slot counts against the local share).

        While it is being leased, a request of `lane` still counts as waiting for the
        fleet (its queue may be empty): the other replicas keep their lower lanes back
        until it has its slot."""
        place = self._lanes.index(lane) if lane in self._lanes else 0
        ticket = ticket or self.ticket()
        if lane is None:
            return await self._take(slot, ticket, place, waited_s)
        self._leasing[lane] = self._leasing.get(lane, 0) + 1
        try:
            return await self._take(slot, ticket, place, waited_s)
        finally:
            self._leasing[lane] -= 1
            self._queue_changed(lane, False)

    async def _take(self, slot: Slot, ticket: str, place: int, waited_s: float) -> bool:
        backend = slot.backend
        self._held[backend].add(slot)
        if not self.store.up:
            self.go_local()
            return True
        prepaid = self._prepaid[backend]
        if prepaid:  # a slot the fleet's line granted this replica: no round trip
            slot.lease = next(iter(prepaid))
            del prepaid[slot.lease]
            return True
        # Named before the call: a client that leaves while it runs still gets its lease
        # (if Redis granted it) released when the slot is given back.
        slot.lease = lease = f"{self.store.replica_id}:{next(self._ids)}"
        budget_ms = _ms(backend.prefill_budget_s)
        needs = _ms(slot.prefill_s) if budget_ms else 0
        answer = await self.store.call(
            "lease",
            lambda: self._acquire(
                keys=self._keys(backend),
                args=[
                    lease,
                    backend.slot_limit,
                    self.ttl_ms,
                    needs,
                    budget_ms,
                    self.line_ticket(ticket, slot),
                    place,
                    _ms(waited_s),
                    self.channel,
                    backend.url,
                ],
            ),
        )
        if answer is None:  # Redis failed: this replica is on its share from now on
            self.go_local()
            return True
        granted, count, prefill_ms = (int(x) for x in answer[:3])
        if granted != 1:
            slot.lease = None
            self._held[backend].discard(slot)
            if granted == 0:  # full: if a crashed replica holds slots, serve at their end
                self._serve_line_at(backend, int(answer[3]) / 1000)
        self._note_counts(backend, count, prefill_ms)
        return granted == 1

    def adopt(self, slot: Slot) -> None:
        """A slot taken without asking Redis first (a retry moved to another backend at
        once, before any byte): lease it in the background, over the limit if need be,
        since it is already running; a retry is rare and the overshoot ends with it."""
        self._held[slot.backend].add(slot)
        if self._local or not self.store.up:
            return
        slot.lease = f"{self.store.replica_id}:{next(self._ids)}"
        backend = slot.backend
        lease = slot.lease
        args = [*self._renew_head(backend), lease, _ms(slot.prefill_s)]
        self._in_background(
            "lease",
            lambda: self._renew(keys=self._keys(backend), args=args),
            backend,
            after=lambda: self._release_renewed_but_gone(backend, [lease]),
        )

    def _serve_line_at(self, backend: Backend, delay_s: float) -> None:
        """Serve `backend`'s line when its first lease would expire: a replica that died
        holding slots gives them back then (within the TTL), not at the next tick."""
        timer = self._line_timers.get(backend)
        loop = asyncio.get_running_loop()
        when = loop.time() + delay_s + 0.005
        if timer is not None and not timer.cancelled() and timer.when() <= when:
            return
        if timer is not None:
            timer.cancel()

        async def serve() -> None:
            if self._local or not self.store.up:
                return
            args = self._renew_head(backend)
            answer = await self.store.call(
                "serve_line", lambda: self._renew(keys=self._keys(backend), args=args)
            )
            if answer is None:
                return
            self._note_counts(backend, int(answer[0]), int(answer[1]))
            if backend.free_slots <= 0 and any(lane.queue for lane in self.scheduler.lanes):
                self._serve_line_at(backend, int(answer[2]) / 1000)  # renewed: look again

        def start() -> None:
            self._line_timers.pop(backend, None)
            task = loop.create_task(serve())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

        self._line_timers[backend] = loop.call_at(when, start)

    def _renew_head(self, backend: Backend) -> list[Any]:
        """RENEW's first arguments for `backend`."""
        budget = _ms(backend.prefill_budget_s)
        return [self.ttl_ms, backend.slot_limit, budget, self.channel, backend.url]

    def leave_line(self, tickets: dict[Backend, str]) -> None:
        """A request that joined backends' lines no longer waits there."""
        if self._local or not self.store.up:
            return
        for backend, ticket in tickets.items():
            key = self._keys(backend)[3]

            def leave(key: str = key, ticket: str = ticket) -> Awaitable[Any]:
                return self._leave_line(keys=[key], args=[ticket])

            task = asyncio.get_running_loop().create_task(self.store.call("leave_line", leave))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _prefill_done(self, slot: Slot) -> None:
        """Its first byte came: its prefill leaves the fleet's prefill budget."""
        leased = slot.lease is not None and self.store.up
        if leased and slot.prefill_s and slot.backend.prefill_budget_s:
            self._send(slot, release=False)

    def _given_back(self, slot: Slot) -> None:
        held = self._held.get(slot.backend)
        if held is None or slot not in held:
            return
        held.discard(slot)
        if slot.lease is not None and self.store.up:
            self._send(slot, release=True)

    def _send(self, slot: Slot, *, release: bool) -> None:
        """Release a lease (or end its prefill) in the background: a lost one only holds
        the slot until its TTL."""
        backend, lease = slot.backend, slot.lease
        budget = _ms(backend.prefill_budget_s)
        args: list[Any] = [lease, "1" if release else "0", self.channel, backend.url]
        args += [backend.slot_limit, self.ttl_ms, budget]
        self._in_background(
            "release" if release else "prefill_done",
            lambda: self._release(keys=self._keys(backend), args=args),
            backend,
        )

    def _in_background(
        self,
        op: str,
        call: Callable[[], Awaitable[Any]],
        backend: Backend,
        *,
        after: Callable[[], None] | None = None,
    ) -> None:
        """Run a lease call off the request path; its answer updates the counts (and
        then `after` runs)."""

        async def run() -> None:
            answer = await self.store.call(op, call)
            if answer is not None:
                self._note_counts(backend, int(answer[0]), int(answer[1]))
                if after is not None:
                    after()

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- priority across the fleet --------------------------------------------------

    def _member(self, lane: str) -> str:
        return f"{self._lanes.index(lane)}|{self.store.replica_id}"

    def _queue_changed(self, lane: str, waiting: bool) -> None:
        """A lane's queue filled or emptied here: tell the fleet, whose replicas hold
        their lower lanes back while a higher one waits anywhere (one gateway would).
        One call at a time, each sending the lanes' state as it is then, so that a
        quick fill-empty-fill cannot arrive out of order."""
        if lane == self._lanes[-1] or self._local or not self.store.up:
            return  # the lowest lane holds nobody back
        if self._waiting_sync is None or self._waiting_sync.done():
            self._waiting_sync = asyncio.get_running_loop().create_task(self._sync_waiting())

    async def _sync_waiting(self) -> None:
        while not self._local and self.store.up:
            pairs: list[str] = []
            for lane in self.scheduler.lanes[:-1]:
                waiting = lane.had_waiters or self._leasing.get(lane.name, 0) > 0
                if self._waiting_sent.get(lane.name, False) != waiting:
                    pairs += [self._member(lane.name), "1" if waiting else "0"]
                    self._waiting_sent[lane.name] = waiting
            if not pairs:
                return
            await self._call_waiting(self.channel, pairs)

    def _in_background_waiting(self, channel: str, pairs: list[str]) -> None:
        task = asyncio.get_running_loop().create_task(self._call_waiting(channel, pairs))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _call_waiting(self, channel: str, pairs: list[str]) -> None:
        members = await self.store.call(
            "waiting",
            lambda: self._waiting(keys=[self.waiting_key], args=[self.ttl_ms, channel, *pairs]),
        )
        if members is not None:
            self._hold_back_below(members)

    def _hold_back_below(self, members: list[bytes]) -> None:
        """Hold back the lanes below the highest one another replica has waiting."""
        highest = len(self._lanes)
        for member in members:
            text = member.decode() if isinstance(member, bytes) else str(member)
            index, _, replica = text.partition("|")
            if replica != self.store.replica_id and index.isdigit():
                highest = min(highest, int(index))
        self.scheduler.hold_back(set(self._lanes[highest + 1 :]))

    def _refresh_waiting(self) -> None:
        """Renew this replica's waiting lanes and read the fleet's (each tick)."""
        pairs: list[str] = []
        for lane in self.scheduler.lanes[:-1]:
            if lane.had_waiters and self._waiting_sent.get(lane.name):
                pairs += [self._member(lane.name), "1"]
        self._in_background_waiting("", pairs)

    # -- the view of the other replicas ---------------------------------------------

    def _note_counts(self, backend: Backend, leases: int, prefill_ms: int) -> None:
        """What Redis says is running on `backend`, all replicas together: the rest of
        what this replica does not hold is the others'. Serves the queues when it fell."""
        if self._local:
            return
        leased = [slot for slot in self._held[backend] if slot.lease is not None]
        mine_prefill_ms = sum(_ms(slot.prefill_s) for slot in leased if slot.prefilling)
        prepaid = self._prepaid[backend]
        mine_prefill_ms += sum(prepaid.values())
        others = max(0, leases - len(leased) - len(prepaid))
        others_prefill_s = max(0.0, (prefill_ms - mine_prefill_ms) / 1000)
        fell = others < backend.others_in_flight or others_prefill_s < backend.others_prefilling_s
        backend.others_in_flight, backend.others_prefilling_s = others, others_prefill_s
        if fell:
            self.scheduler.notify_capacity()

    def go_local(self) -> None:
        """Redis is down: count only this replica's share of each backend's slots."""
        if self._local:
            return
        self._local = True
        self.scheduler.hold_back(set())  # no fleet to defer to
        share = self.share()
        for backend in self.pool.backends:
            own = max(1, math.floor(backend.max_concurrency * share))
            backend.others_in_flight = max(0, backend.max_concurrency - own)
            backend.others_prefilling_s = 0.0

    async def tick(self) -> None:
        """Renew this replica's leases and refresh the counts: one pipelined round trip."""
        if self._local:  # Redis came back without the store noticing it went (a rejoin)
            await self.rejoin()
            return
        if await self._renew_all():
            self._refresh_waiting()

    async def rejoin(self) -> None:
        """Redis is back: lease again every slot held now (leased before or not)."""
        for held in self._held.values():
            for slot in held:
                if slot.lease is None:
                    slot.lease = f"{self.store.replica_id}:{next(self._ids)}"
        self._local = False
        if await self._renew_all():  # else back on the local share: Redis failed again
            self._waiting_sent.clear()  # sent again, as they are now
            self._queue_changed(self._lanes[0], True)

    async def _renew_all(self) -> bool:
        backends = self.pool.backends
        #: The leases each backend's renewal names (to check against what is held after).
        renewed: dict[Backend, list[str]] = {}

        async def renew() -> list[Any]:
            async with self.store.client.pipeline(transaction=False) as pipe:
                for backend in backends:
                    args: list[Any] = self._renew_head(backend)
                    names = renewed[backend] = []
                    for slot in self._held[backend]:
                        if slot.lease is not None:
                            prefill = _ms(slot.prefill_s) if slot.prefilling else 0
                            args += [slot.lease, prefill]
                            names.append(slot.lease)
                    for lease, prefill in self._prepaid[backend].items():
                        args += [lease, prefill]
                        names.append(lease)
                    await self._renew(keys=self._keys(backend), args=args, client=pipe)
                return list(await pipe.execute())

        answers = await self.store.call("renew", renew)
        if answers is None:
            self.go_local()
            return False
        for backend, (leases, prefill_ms, *_) in zip(backends, answers, strict=True):
            self._note_counts(backend, int(leases), int(prefill_ms))
            self._release_renewed_but_gone(backend, renewed.get(backend, []))
        return True

    def _release_renewed_but_gone(self, backend: Backend, renewed: list[str]) -> None:
        """Release again the leases a renewal named that are no longer held here.

        RENEW re-adds a lease that is not in Redis (it expired, its request still runs),
        so a release that reached Redis while the renewal was on its way (the pipeline's
        script check is a round trip of its own) was undone by it: the slot would count
        as taken, for every replica, until its TTL. Measured before this: 156 of 160
        leases released during a tick came back (4 slots, 40 rounds). A second release
        of a lease already gone is a no-op in Redis."""
        if not renewed:
            return
        held = {slot.lease for slot in self._held[backend]}
        held.update(self._prepaid[backend])
        for lease in renewed:
            if lease not in held:
                placeholder = Slot(backend, 0, 0)
                placeholder.lease = lease
                self._send(placeholder, release=True)

    def global_in_flight(self, backend: Backend) -> int:
        """Requests on `backend` over all replicas, as last heard (for /debug/backends)."""
        return backend.in_flight + backend.others_in_flight

    @property
    def local(self) -> bool:
        return self._local

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Listen for releases on contended backends (a connection of its own: it blocks)."""
        if self._subscriber is None:
            self._subscriber = aioredis.Redis.from_url(
                self.store.settings.url, socket_connect_timeout=1.0
            )
        self._listener = asyncio.create_task(self._listen(), name="slot-leases-freed")

    async def _listen(self) -> None:
        assert self._subscriber is not None
        while not self._stopping:
            try:
                async with self._subscriber.pubsub() as pubsub:
                    await pubsub.subscribe(self.channel)
                    while not self._stopping:
                        message = await pubsub.get_message(
                            ignore_subscribe_messages=True, timeout=PUBSUB_POLL_S
                        )
                        if message is not None:
                            self._freed(message["data"])
            except (RedisError, OSError):
                # Redis away: the store falls back; listen again once it may be back.
                await asyncio.sleep(self.store.settings.interval_s)

    def _freed(self, data: bytes) -> None:
        if data == WAITING_CHANGED:
            if not self._local and self.store.up:
                self._in_background_waiting("", [])
            return
        if data.startswith(b"grant "):
            self._granted(data)
            return
        try:
            url, leases, prefill_ms = data.decode().rsplit(" ", 2)
            backend = self._by_url.get(url)
            if backend is not None:
                self._note_counts(backend, int(leases), int(prefill_ms))
        except ValueError:
            self.store.events.warning("slot_leases_bad_message", data=repr(data)[:120])

    def _granted(self, data: bytes) -> None:
        """The fleet's line gave a freed slot to one of this replica's requests: the next
        request here to take that backend uses it (given back if none does soon)."""
        try:
            _, url, ticket, lease = data.decode().split(" ")
        except ValueError:
            self.store.events.warning("slot_leases_bad_message", data=repr(data)[:120])
            return
        backend = self._by_url.get(url)
        if backend is None or not ticket.startswith(self.store.replica_id + "#"):
            return
        if self._local:  # no fleet to share with right now: give it back at once
            self._release_prepaid(backend, lease)
            return
        needs = ticket.rsplit("#", 1)[-1]
        self._prepaid[backend][lease] = int(needs) if needs.isdigit() else 0
        # It was one of the others' slots a moment ago (released and granted in one step).
        backend.others_in_flight = max(0, backend.others_in_flight - 1)
        asyncio.get_running_loop().call_later(
            PREPAID_GRACE_S, self._release_prepaid, backend, lease
        )
        self.scheduler.notify_capacity()

    def _release_prepaid(self, backend: Backend, lease: str) -> None:
        """A granted slot nobody here took (its request went elsewhere or away)."""
        prepaid = self._prepaid[backend]
        if lease in prepaid:
            del prepaid[lease]
        elif not self._local:
            return  # used by a request: released with its slot
        placeholder = Slot(backend, 0, 0)
        placeholder.lease = lease
        self._send(placeholder, release=True)

    async def stop(self) -> None:
        """Give back every lease still held (best effort; the TTL frees the rest)."""
        self._stopping = True
        if self._listener is not None:
            self._listener.cancel()
            # Not `await`: a cancellation redis-py swallowed would hang the shutdown. The
            # flag ends the loop within one poll or retry pause.
            longest_turn_s = max(PUBSUB_POLL_S, self.store.settings.interval_s)
            await asyncio.wait((self._listener,), timeout=longest_turn_s + 0.5)
        for held in self._held.values():
            for slot in list(held):
                if slot.lease is not None and self.store.up:
                    self._send(slot, release=True)
        if self._waiting_sync is not None:
            self._waiting_sync.cancel()
        for timer in self._line_timers.values():
            timer.cancel()
        if self.store.up and not self._local:  # this replica's waiting lanes wait no more
            pairs: list[str] = []
            for lane in self._lanes[:-1]:
                pairs += [self._member(lane), "0"]
            self._in_background_waiting(self.channel, pairs)
        if self._background:
            await asyncio.wait(self._background, timeout=1.0)
        if self._subscriber is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._subscriber.aclose()


async def leased(
    leases: SlotLeases,
    scheduler: Scheduler,
    grant: Grant,
    record: RequestRecord,
    *,
    prompt_tokens: int,
    output_tokens: int,
    deadline_s: float,
    hint: Any = None,
) -> Grant:
    """`grant` with its slot leased; while the other replicas hold that backend's slots,
    the request waits again at the front of its line (within its queue deadline) for
    another slot. The time spent on Redis goes to the log line's `lease_ms`."""
    spent = 0.0
    ticket = leases.ticket()
    #: The backends whose line this request joined (refused there), and its ticket.
    lines: dict[Backend, str] = {}
    try:
        while True:
            started = time.perf_counter()
            backend = grant.slot.backend
            taken = await leases.take(
                grant.slot, grant.lane, ticket=ticket, waited_s=grant.queued_s
            )
            spent += time.perf_counter() - started
            if taken:  # its tickets leave the lines it joined, in `finally`
                return grant
            lines[backend] = leases.line_ticket(ticket, grant.slot)
            grant = await scheduler.requeue(
                grant, prompt_tokens, output_tokens, deadline_s=deadline_s, hint=hint
            )
    finally:
        record.lease_ms = round(spent * 1000, 3)
        if lines:
            leases.leave_line(lines)


def describe(leases: SlotLeases | None, backend: Backend) -> dict[str, Any]:
    """The lease figures of a backend for /debug/backends."""
    if leases is None:
        return {}
    return {
        "fleet_in_flight": leases.global_in_flight(backend),
        "others_in_flight": backend.others_in_flight,
        "others_prefilling_s": round(backend.others_prefilling_s, 3),
        "shared_state": "local" if leases.local else "redis",
        "redis_url": mask_url_password(leases.store.settings.url),
    }
