"""The fleet's queueing, seen from any replica: what an autoscaler should act on.

Every replica's `/metrics` already says how long *its* queues are; an autoscaler
reading one replica (Prometheus scraping through a Service, KEDA's metrics-api
scaler) would see a third of the truth in a fleet of three. So each fleet tick
every replica publishes its figures per pool and lane (queue depth, slots in flight,
the wait predicted for a request arriving now; each model pool has its own scheduler
and its own queues) and whether it is draining, and reads every live replica's
figures back in the same Lua call: one round trip per tick, none on the request
path. Each replica then exports the same fleet view (`gateway_fleet_*{pool,lane}`):
dashboards and autoscalers aggregate it with `max()` over replicas, never `sum()`
(that would count the fleet once per replica).

Rolling upgrade: the default pool's lanes stay where a one-pool replica put them
(`lanes`, untagged), the pool they are of goes beside them (`pool`), and the other
pools' lanes go in a field an older replica ignores (`pools`). An older replica's
untagged lanes are counted as the reader's default pool; an older reader counts the
default pool's lanes only, as before.

Liveness is Redis time, never a replica's clock: a sorted set of replica ids
scored by when each one's figures expire (~3 ticks after it last published),
members past their score dropped in the same script, the set itself expiring with
its last member. A replica that stops ticking (crashed, partitioned) leaves the
view within that time. (The script reads the other replicas' keys by name, so on
a Redis Cluster the prefix needs a hash tag, `{llmgw}`, to keep them in one slot.)

Redis down or slow: the view is this replica alone, its age
(`gateway_fleet_view_age_seconds`) grows, and `Fleet.replicas_seen` keeps the
last count (the local share of slots and quotas is computed from it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.fleet.fleet import Fleet
from gateway.fleet.store import SharedStore
from gateway.scheduling.scheduler import Scheduler
from gateway.upstream.models import CATCH_ALL

#: A replica's figures expire this many ticks after it published them: one late tick
#: (a busy loop, a slow Redis) does not make it vanish; a dead one is gone in ~3.
EXPIRY_TICKS = 3

#: KEYS: the live replicas (zset), this replica's figures. ARGV: this replica's id,
#: expiry ms, its figures (JSON), the prefix of every replica's figures key.
#: Returns {id, figures, id, figures, ...} of every live replica, this one included.
PUBLISH_AND_READ = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('SET', KEYS[2], ARGV[3], 'PX', ttl)
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[1], last[2])
local out = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local figures = redis.call('GET', ARGV[4] .. id)
  if figures then
    out[#out + 1] = id
    out[#out + 1] = figures
  end
end
return out
"""

Count = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]


class LaneFigures(msgspec.Struct, frozen=True):
    queue_depth: Count = 0
    in_flight: Count = 0
    #: None: requests would wait, for how long is not learned yet.
    predicted_wait_s: Seconds | None = None


class ReplicaFigures(msgspec.Struct, frozen=True):
    """What one replica publishes. Unknown fields are ignored: a newer replica may
    publish more, and an older one reading it still counts what it knows."""

    #: The default pool's lanes (where a one-pool replica published its only ones).
    lanes: dict[str, LaneFigures] = {}
    draining: bool = False
    #: The pool `lanes` are of. None (a replica from before pools): the reader's default.
    pool: str | None = None
    #: Every other pool's lanes, by pool name.
    pools: dict[str, dict[str, LaneFigures]] = {}

    def by_pool(self, default_pool: str) -> Iterator[tuple[str, dict[str, LaneFigures]]]:
        """(pool, its lanes) for every pool in these figures; untagged lanes are
        `default_pool`'s."""
        yield (self.pool if self.pool is not None else default_pool), self.lanes
        yield from self.pools.items()


_decoder = msgspec.json.Decoder(ReplicaFigures)


def decode_figures(raw: bytes) -> ReplicaFigures | None:
    """A replica's published figures; None when garbled (it still counts as live)."""
    try:
        return _decoder.decode(raw)
    except msgspec.DecodeError:
        return None


#: A lane of one pool: (pool name, lane name).
PoolLane = tuple[str, str]


@dataclass(frozen=True)
class FleetView:
    """Sums and maxima over the replicas in view, by (pool, lane)."""

    replicas: int = 1
    draining: int = 0
    queue_depth: dict[PoolLane, int] = field(default_factory=dict)
    in_flight: dict[PoolLane, int] = field(default_factory=dict)
    #: The worst replica's predicted wait: the one the next request may land on. A lane
    #: is left out while any replica cannot predict it (requests wait there, nothing
    #: learned yet): an idle replica's 0 must not stand for a busy one's unknown.
    predicted_wait_s: dict[PoolLane, float] = field(default_factory=dict)


def combine(
    replicas: Iterable[ReplicaFigures | None],
    *,
    default_pool: str = CATCH_ALL,
    pools: Collection[str] | None = None,
) -> FleetView:
    """The fleet view of these replicas (a None one is live but says nothing).

    Untagged lanes (an older replica's) are `default_pool`'s. With `pools`, a pool
    not in it (another replica's config; garbage) is left out: the exported series'
    labels stay this replica's configured pools."""
    count = draining = 0
    depth: dict[PoolLane, int] = {}
    in_flight: dict[PoolLane, int] = {}
    wait: dict[PoolLane, float] = {}
    for figures in replicas:
        count += 1
        if figures is None:
            continue
        draining += figures.draining
        for pool, lanes in figures.by_pool(default_pool):
            if pools is not None and pool not in pools:
                continue
            for lane, lane_figures in lanes.items():
                key = (pool, lane)
                depth[key] = depth.get(key, 0) + lane_figures.queue_depth
                in_flight[key] = in_flight.get(key, 0) + lane_figures.in_flight
                predicted = lane_figures.predicted_wait_s
                # Unknown (a replica with no free slot that has not measured its waits
                # yet) is left out; an idle replica's 0 is real: a free slot there.
                if predicted is not None and math.isfinite(predicted):
                    wait[key] = max(wait.get(key, 0.0), predicted)
    return FleetView(count, draining, depth, in_flight, wait)


class FleetSignals:
    """Publishes this replica's queueing, keeps the fleet's, exports it."""

    def __init__(
        self,
        store: SharedStore,
        fleet: Fleet,
        schedulers: Mapping[str, Scheduler],
        *,
        default_pool: str,
        draining: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`schedulers`: every pool's, by pool name (the `pool` label of
        `gateway_pool_*`), `default_pool`'s among them."""
        if default_pool not in schedulers:
            raise ValueError(f"default pool {default_pool!r} has no scheduler")
        self.store = store
        self.fleet = fleet
        self.schedulers = dict(schedulers)
        self.default_pool = default_pool
        self._draining = draining
        self._clock = clock
        self._script = store.script(PUBLISH_AND_READ)
        self._live_key = store.key("replicas")
        self._own_key = store.key("replica", store.replica_id)
        self._key_prefix = store.key("replica", "")
        #: The other replicas' figures at the last successful read (by replica id).
        self._others: dict[str, ReplicaFigures | None] = {}
        #: When the view was last read from Redis; before any read, when this replica
        #: started (its view of itself alone is known from the start).
        self._read_at = clock()

    @property
    def expiry_s(self) -> float:
        return EXPIRY_TICKS * self.fleet.settings.interval_s

    def install(self, registry: CollectorRegistry) -> None:
        """Publish on every fleet tick and at once on rejoin; export the fleet view."""
        self.fleet.ticks.append(self.tick)
        self.store.on_up.append(self.tick)
        registry.register(FleetViewCollector(self))

    def own_figures(self) -> ReplicaFigures:
        """This replica's figures now, read from every pool's scheduler."""
        others = {
            name: _lane_figures(scheduler)
            for name, scheduler in self.schedulers.items()
            if name != self.default_pool
        }
        return ReplicaFigures(
            lanes=_lane_figures(self.schedulers[self.default_pool]),
            draining=self._draining(),
            pool=self.default_pool,
            pools=others,
        )

    async def tick(self) -> None:
        """Publish this replica's figures and read every live replica's (one call)."""
        expiry_ms = max(1, math.ceil(self.expiry_s * 1000))
        figures = msgspec.json.encode(self.own_figures())
        reply = await self.store.call(
            "signals",
            lambda: self._script(
                keys=[self._live_key, self._own_key],
                args=[self.store.replica_id, expiry_ms, figures, self._key_prefix],
            ),
        )
        if reply is None:
            return
        others: dict[str, ReplicaFigures | None] = {}
        pairs: list[Any] = list(reply)
        for index in range(0, len(pairs) - 1, 2):
            replica = _text(pairs[index])
            if replica != self.store.replica_id:
                others[replica] = decode_figures(pairs[index + 1])
        self._others = others
        self._read_at = self._clock()
        self.fleet.replicas_seen = len(others) + 1

    @property
    def view_age_s(self) -> float:
        """Seconds since the fleet's figures were last read (or since start)."""
        return max(0.0, self._clock() - self._read_at)

    @property
    def fleet_wide(self) -> bool:
        """The others' figures can be trusted: Redis is up and they are not older
        than they would be kept in Redis."""
        return self.store.up and self.view_age_s <= self.expiry_s

    def view(self) -> FleetView:
        """This replica's figures as they are now, plus the others' at the last read;
        this replica alone while Redis is down (or the last read is too old)."""
        others = self._others.values() if self.fleet_wide else ()
        return combine(
            [self.own_figures(), *others], default_pool=self.default_pool, pools=self.schedulers
        )


def _lane_figures(scheduler: Scheduler) -> dict[str, LaneFigures]:
    lanes = {}
    for lane in scheduler.lanes:
        wait = scheduler.predicted_wait_s(lane.name)
        lanes[lane.name] = LaneFigures(
            queue_depth=len(lane.queue),
            in_flight=lane.in_flight,
            predicted_wait_s=wait if wait is not None and math.isfinite(wait) else None,
        )
    return lanes


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


_MAX_NOT_SUM = " Every replica exports the same fleet view: aggregate with max(), not sum()."


class FleetViewCollector(Collector):
    """`gateway_fleet_*`, computed at scrape time from the last read and this replica."""

    def __init__(self, signals: FleetSignals) -> None:
        self.signals = signals

    def collect(self) -> Iterator[GaugeMetricFamily]:
        view = self.signals.view()
        yield GaugeMetricFamily(
            "gateway_fleet_replicas",
            "Gateway replicas in the fleet view (live in Redis; 1 while Redis is down)."
            + _MAX_NOT_SUM,
            value=view.replicas,
        )
        yield GaugeMetricFamily(
            "gateway_fleet_replicas_draining",
            "Replicas in the fleet view that are draining (SIGTERM)." + _MAX_NOT_SUM,
            value=view.draining,
        )
        depth = GaugeMetricFamily(
            "gateway_fleet_queue_depth",
            "Requests waiting, by pool and lane, summed over the replicas." + _MAX_NOT_SUM,
            labels=["pool", "lane"],
        )
        in_flight = GaugeMetricFamily(
            "gateway_fleet_in_flight",
            "Slots held, by pool and lane, summed over the replicas." + _MAX_NOT_SUM,
            labels=["pool", "lane"],
        )
        wait = GaugeMetricFamily(
            "gateway_fleet_predicted_wait_seconds",
            "Wait predicted for a request arriving now, by pool and lane: the worst "
            "replica's (absent while a replica with requests waiting has learned none yet)."
            + _MAX_NOT_SUM,
            labels=["pool", "lane"],
        )
        for key, value in sorted(view.queue_depth.items()):
            depth.add_metric(list(key), value)
        for key, value in sorted(view.in_flight.items()):
            in_flight.add_metric(list(key), value)
        for key, seconds in sorted(view.predicted_wait_s.items()):
            wait.add_metric(list(key), seconds)
        yield from (depth, in_flight, wait)
        yield GaugeMetricFamily(
            "gateway_fleet_view_age_seconds",
            "Seconds since this replica last read the fleet's figures from Redis (since "
            "start before the first read); while Redis is down the view is this replica "
            "alone and this grows.",
            value=self.signals.view_age_s,
        )
