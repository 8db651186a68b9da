"""The fleet's queueing, seen from any replica: what an autoscaler should act on.

Every replica's `/metrics` already says how long *its* queues are; an autoscaler
reading one replica (Prometheus scraping through a Service, KEDA's metrics-api
scaler) would see a third of the truth in a fleet of three. So each fleet tick
every replica publishes its figures per lane (queue depth, slots in flight, the
wait predicted for a request arriving now) and whether it is draining, and reads
every live replica's figures back in the same Lua call: one round trip per tick,
none on the request path. Each replica then exports the same fleet view
(`gateway_fleet_*`): dashboards and autoscalers aggregate it with `max()` over
replicas, never `sum()` (that would count the fleet once per replica).

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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.fleet.fleet import Fleet
from gateway.fleet.store import SharedStore
from gateway.scheduling.scheduler import Scheduler

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

    lanes: dict[str, LaneFigures] = {}
    draining: bool = False


_decoder = msgspec.json.Decoder(ReplicaFigures)


def decode_figures(raw: bytes) -> ReplicaFigures | None:
    """A replica's published figures; None when garbled (it still counts as live)."""
    try:
        return _decoder.decode(raw)
    except msgspec.DecodeError:
        return None


@dataclass(frozen=True)
class FleetView:
    """Sums and maxima over the replicas in view, by lane."""

    replicas: int = 1
    draining: int = 0
    queue_depth: dict[str, int] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    #: The worst replica's predicted wait: the one the next request may land on. A lane
    #: is left out while any replica cannot predict it (requests wait there, nothing
    #: learned yet): an idle replica's 0 must not stand for a busy one's unknown.
    predicted_wait_s: dict[str, float] = field(default_factory=dict)


def combine(replicas: Iterable[ReplicaFigures | None]) -> FleetView:
    """The fleet view of these replicas (a None one is live but says nothing)."""
    count = draining = 0
    depth: dict[str, int] = {}
    in_flight: dict[str, int] = {}
    wait: dict[str, float] = {}
    for figures in replicas:
        count += 1
        if figures is None:
            continue
        draining += figures.draining
        for lane, lane_figures in figures.lanes.items():
            depth[lane] = depth.get(lane, 0) + lane_figures.queue_depth
            in_flight[lane] = in_flight.get(lane, 0) + lane_figures.in_flight
            predicted = lane_figures.predicted_wait_s
            # Unknown (a replica with no free slot that has not measured its waits yet)
            # is left out; an idle replica's 0 is real: its backends have a free slot.
            if predicted is not None and math.isfinite(predicted):
                wait[lane] = max(wait.get(lane, 0.0), predicted)
    return FleetView(count, draining, depth, in_flight, wait)


class FleetSignals:
    """Publishes this replica's queueing, keeps the fleet's, exports it."""

    def __init__(
        self,
        store: SharedStore,
        fleet: Fleet,
        scheduler: Scheduler,
        *,
        draining: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.fleet = fleet
        self.scheduler = scheduler
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
        """This replica's figures now, read from its scheduler."""
        lanes = {}
        for lane in self.scheduler.lanes:
            wait = self.scheduler.predicted_wait_s(lane.name)
            lanes[lane.name] = LaneFigures(
                queue_depth=len(lane.queue),
                in_flight=lane.in_flight,
                predicted_wait_s=wait if wait is not None and math.isfinite(wait) else None,
            )
        return ReplicaFigures(lanes=lanes, draining=self._draining())

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
        return combine([self.own_figures(), *others])


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
            "Requests waiting, by lane, summed over the fleet's replicas." + _MAX_NOT_SUM,
            labels=["lane"],
        )
        in_flight = GaugeMetricFamily(
            "gateway_fleet_in_flight",
            "Slots held, by lane, summed over the fleet's replicas." + _MAX_NOT_SUM,
            labels=["lane"],
        )
        wait = GaugeMetricFamily(
            "gateway_fleet_predicted_wait_seconds",
            "Wait predicted for a request arriving now, by lane: the worst replica's (absent "
            "while a replica with requests waiting has learned none yet)." + _MAX_NOT_SUM,
            labels=["lane"],
        )
        for lane, value in sorted(view.queue_depth.items()):
            depth.add_metric([lane], value)
        for lane, value in sorted(view.in_flight.items()):
            in_flight.add_metric([lane], value)
        for lane, seconds in sorted(view.predicted_wait_s.items()):
            wait.add_metric([lane], seconds)
        yield from (depth, in_flight, wait)
        yield GaugeMetricFamily(
            "gateway_fleet_view_age_seconds",
            "Seconds since this replica last read the fleet's figures from Redis (since "
            "start before the first read); while Redis is down the view is this replica "
            "alone and this grows.",
            value=self.signals.view_age_s,
        )
