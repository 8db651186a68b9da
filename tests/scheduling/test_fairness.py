"""The fair order between tenants inside one lane (the Virtual Token Counter), as plain data."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count

from gateway.scheduling.fairness import (
    MAX_IDLE_TENANTS,
    FairQueue,
    TokenCost,
    learned_output_weight,
)

_arrivals = count()


@dataclass(eq=False)
class Req:
    tenant: str
    prompt_tokens: int = 100
    enqueued_at: float = field(default_factory=lambda: float(next(_arrivals)))


def serve(queue: FairQueue[Req], n: int, output_cost: float = 0.0) -> list[str]:
    """Dispatch the first `n` in fair order one at a time, each ending at once costing its
    prompt plus `output_cost`; the tenants served, in order."""
    served = []
    for _ in range(n):
        waiter = next(queue.order(1))
        charged = queue.dispatched(waiter)
        queue.settle(waiter.tenant, charged, waiter.prompt_tokens + output_cost)
        served.append(waiter.tenant)
    return served


def test_one_tenant_is_first_come() -> None:
    queue: FairQueue[Req] = FairQueue()
    waiters = [Req("a") for _ in range(5)]
    for waiter in waiters:
        queue.push(waiter)
    assert list(queue.order(10)) == waiters
    assert len(queue) == 5


def test_off_is_first_come_across_tenants() -> None:
    queue: FairQueue[Req] = FairQueue(fair=False)
    waiters = [Req(t) for t in "aaaab"]
    for waiter in waiters:
        queue.push(waiter)
    assert list(queue.order(10)) == waiters
    assert queue.place_for("b", 1.0, 100) == 6


def test_a_flood_does_not_go_before_a_light_tenant() -> None:
    queue: FairQueue[Req] = FairQueue()
    for _ in range(20):
        queue.push(Req("flood"))
    serve(queue, 3)
    light = Req("light")
    queue.push(light)
    # The light tenant is lifted to the flood's counter and goes next (fewer running).
    assert next(queue.order(1)) is light
    # Its next one: after its own queued one and one of the flood's.
    assert queue.place_for("light", 1.0, 100) == 3


def test_backlogged_tenants_are_served_by_weight_in_tokens() -> None:
    queue: FairQueue[Req] = FairQueue()
    for _ in range(60):
        queue.push(Req("heavy", prompt_tokens=100), weight=2.0)
        queue.push(Req("light", prompt_tokens=100), weight=1.0)
    served = serve(queue, 60)
    assert served.count("heavy") == 40 and served.count("light") == 20


def test_service_counts_tokens_not_turns() -> None:
    queue: FairQueue[Req] = FairQueue()
    for _ in range(40):
        queue.push(Req("big", prompt_tokens=400))
        queue.push(Req("small", prompt_tokens=100))
    served = serve(queue, 50)
    # Equal tokens: four small requests for each big one.
    assert served.count("small") == 40 and served.count("big") == 10


def test_output_tokens_settled_at_the_end_count_too() -> None:
    queue: FairQueue[Req] = FairQueue()
    for _ in range(30):
        queue.push(Req("talkative", prompt_tokens=100))
        queue.push(Req("terse", prompt_tokens=100))
    served = []
    for _ in range(30):
        waiter = next(queue.order(1))
        charged = queue.dispatched(waiter)
        output = 300.0 if waiter.tenant == "talkative" else 0.0
        queue.settle(waiter.tenant, charged, waiter.prompt_tokens + output)
        served.append(waiter.tenant)
    assert served.count("terse") == 24 and served.count("talkative") == 6


def test_an_idle_tenant_banks_no_credit() -> None:
    queue: FairQueue[Req] = FairQueue()
    for _ in range(10):
        queue.push(Req("a"))
        queue.push(Req("b"))
    serve(queue, 20)  # both served equally, both idle now
    for _ in range(100):  # a alone for a long while
        queue.push(Req("a"))
    serve(queue, 50)
    for _ in range(20):
        queue.push(Req("b"))
    # b comes back level with a, not 50 requests ahead: it gets its share, no burst.
    assert serve(queue, 20).count("b") in (10, 11)


def test_a_tenant_back_while_nobody_waits_is_lifted_to_the_last_served() -> None:
    queue: FairQueue[Req] = FairQueue()
    for _ in range(30):
        queue.push(Req("a"))
    serve(queue, 30)
    queue.push(Req("b"))
    serve(queue, 1)
    for _ in range(10):
        queue.push(Req("a"))
        queue.push(Req("b"))
    assert serve(queue, 10).count("b") in (5, 6)


def test_a_request_put_back_goes_first() -> None:
    queue: FairQueue[Req] = FairQueue()
    for _ in range(3):
        queue.push(Req("a"))
    back = Req("b")
    queue.push_front(back)
    assert next(queue.order(1)) is back
    assert queue.oldest_enqueued_at() == min(w.enqueued_at for w in queue.order(10))


def test_order_interleaves_as_service_would() -> None:
    queue: FairQueue[Req] = FairQueue()
    for _ in range(4):
        queue.push(Req("a"))
    for _ in range(4):
        queue.push(Req("b"))
    ahead = [w.tenant for w in queue.order(6)]
    assert ahead == ["a", "b", "a", "b", "a", "b"]
    assert [w.tenant for w in queue.order(6)] == serve(queue, 6)


def test_place_of_a_newcomer_counts_only_its_turn() -> None:
    queue: FairQueue[Req] = FairQueue()
    for _ in range(30):
        queue.push(Req("flood", prompt_tokens=100))
    serve(queue, 1)  # the flood has a settled mean cost per request
    assert queue.place_for("new", 1.0, 100) <= 3
    assert queue.place_for("flood", 1.0, 100) == 30


def test_a_full_line_takes_the_newest_of_the_heaviest() -> None:
    queue: FairQueue[Req] = FairQueue()
    flood = [Req("flood") for _ in range(6)]
    for waiter in flood:
        queue.push(waiter)
    queue.push(Req("light"))
    assert queue.displaced_by("newcomer", 1.0, depth=7) is flood[-1]
    # The heaviest never displaces itself, and a tenant at its share displaces nobody.
    assert queue.displaced_by("flood", 1.0, depth=7) is None
    even: FairQueue[Req] = FairQueue()
    for tenant in "aabb":
        even.push(Req(tenant))
    assert even.displaced_by("a", 1.0, depth=4) is None


def test_removing_a_waiter_keeps_the_counts() -> None:
    queue: FairQueue[Req] = FairQueue()
    first, second = Req("a"), Req("b")
    queue.push(first)
    queue.push(second)
    assert queue.remove(first) and not queue.remove(first)
    assert len(queue) == 1 and queue.queued_of("a") == 0
    assert queue.pop_all() == [second] and not queue


def test_idle_tenants_are_forgotten_within_bounds() -> None:
    queue: FairQueue[Req] = FairQueue()
    queue.push(Req("anchor", prompt_tokens=1))
    for index in range(MAX_IDLE_TENANTS + 200):
        waiter = Req(f"t{index}", prompt_tokens=1000)
        queue.push(waiter)
        charged = queue.dispatched(waiter)
        queue.settle(waiter.tenant, charged, 1000)
    assert len(queue.tenants()) <= MAX_IDLE_TENANTS + 2


def test_token_cost_and_learned_output_weight() -> None:
    assert TokenCost(output_weight=3).of(100, 10) == 130
    assert TokenCost().of(-5, 0) == 0
    # llama.cpp on a CPU: ~550 prompt tokens/s, 40 ms per output token.
    assert learned_output_weight(550.0, 0.04) == 22.0
    assert learned_output_weight(10.0, 0.001) == 1.0  # bounded below
