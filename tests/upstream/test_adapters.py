"""Where a LoRA adapter's request goes, on plain data with a clock; and what vLLM says of it.

The choice: a backend that runs the adapter now (the sticky one first), else one with
room for another adapter, else a full one; never one that does not list it. The
bookkeeping: scrapes lag, so the gateway's own in-flight requests count at once, and
an adapter the scrape showed is forgotten once ours ended after that scrape. The
telemetry texts follow vLLM's source (vllm/v1/metrics/loggers.py: `lora_requests_info`,
labels `max_lora`, `waiting_lora_adapters`, `running_lora_adapters`, set to the current
time; old label sets stay) and its `/v1/models` cards (serving_models.py: an adapter's
card has `root` = its path and `parent` = the base model).
"""

from __future__ import annotations

from gateway.upstream.adapters import (
    BY_ADAPTER_FULL,
    BY_ADAPTER_ROOM,
    BY_ADAPTER_RUNNING,
    AdapterCandidate,
    BackendAdapters,
    preferred_backends,
)
from gateway.upstream.telemetry import LoraLoad, facts_from_models, parse_engine_metrics


def _c(name: str, active: str = "", max_lora: int | None = 2, lists: bool = True):
    return AdapterCandidate(name, lists, frozenset(a for a in active.split(",") if a), max_lora)


def test_a_backend_running_the_adapter_wins_and_the_sticky_one_among_several():
    candidates = [_c("b1", "a2"), _c("b2", "a1,a2"), _c("b3", "a1")]
    assert preferred_backends("a1", candidates, None) == (["b2", "b3"], BY_ADAPTER_RUNNING)
    assert preferred_backends("a1", candidates, "b3") == (["b3"], BY_ADAPTER_RUNNING)
    # A sticky backend that no longer runs it is no reason to go there.
    assert preferred_backends("a1", candidates, "b1") == (["b2", "b3"], BY_ADAPTER_RUNNING)


def test_a_new_adapter_goes_where_there_is_most_room_and_a_full_backend_only_when_all_are():
    assert preferred_backends("a3", [_c("b1", "a1,a2"), _c("b2", "a4")], None) == (
        ["b2"],
        BY_ADAPTER_ROOM,
    )
    assert preferred_backends("a3", [_c("b1", "a1"), _c("b2", "")], None) == (
        ["b2"],
        BY_ADAPTER_ROOM,
    )
    assert preferred_backends("a3", [_c("b1", "a1,a2"), _c("b2", "a4,a5")], None) == (
        ["b1", "b2"],
        BY_ADAPTER_FULL,
    )
    # An engine that does not say its max_lora is taken to have room.
    assert preferred_backends("a3", [_c("b1", "a1,a2"), _c("b2", "a4,a5", None)], None) == (
        ["b2"],
        BY_ADAPTER_ROOM,
    )


def test_a_backend_that_does_not_list_the_adapter_is_never_chosen():
    candidates = [_c("b1", "", lists=False), _c("b2", "a1,a2")]
    assert preferred_backends("a3", candidates, "b1") == (["b2"], BY_ADAPTER_FULL)
    assert preferred_backends("a3", [_c("b1", lists=False)], None) == ([], None)


def test_our_requests_count_at_once_and_an_ended_one_outdates_the_scrape():
    lora = BackendAdapters()
    lora.note_scrape(["a1"], ["a2"], 2, now=10.0)
    assert lora.active() == {"a1", "a2"} and lora.max_lora == 2
    lora.dispatched("a3")
    lora.dispatched("a3")
    assert lora.active() == {"a1", "a2", "a3"}
    lora.ended("a3", now=10.5)
    assert "a3" in lora.active()  # one still in flight
    lora.ended("a3", now=11.0)
    assert lora.active() == {"a1", "a2"}
    # Ours of a1 ended after the scrape that showed a1: it was ours, it is gone.
    lora.dispatched("a1")
    lora.ended("a1", now=12.0)
    assert lora.active() == {"a2"}
    # The next scrape shows a1 again (another replica's, say): it counts again.
    lora.note_scrape(["a1"], [], 2, now=13.0)
    assert lora.active() == {"a1"}


def test_an_adapter_that_ran_last_stays_loaded_after_its_requests_end():
    lora = BackendAdapters()
    lora.note_scrape([], [], 2, now=1.0)
    for adapter in ("a1", "a2", "a3"):
        lora.dispatched(adapter)
        lora.ended(adapter, now=2.0)
    # The engine keeps the last max_lora it ran (LRU): a1 is out, a2 and a3 are in.
    assert lora.active() == frozenset() and lora.loaded() == {"a2", "a3"}
    lora.dispatched("a2")  # used again: now the most recent
    lora.ended("a2", now=3.0)
    lora.dispatched("a4")
    assert lora.loaded() == {"a2", "a4"}
    # An engine that does not say its max_lora: only the last one counts as loaded.
    assert BackendAdapters(recent=lora.recent.copy()).loaded() == {"a4"}


def test_a_backend_with_the_adapter_still_loaded_wins_and_new_ones_avoid_evicting():
    def c(name: str, active: str, loaded: str) -> AdapterCandidate:
        split = lambda text: frozenset(a for a in text.split(",") if a)  # noqa: E731
        return AdapterCandidate(name, True, split(active), 2, split(loaded))

    # Idle backends: a1 goes back where it was loaded, not to the one with most room.
    candidates = [c("b1", "", "a1,a2"), c("b2", "", "a3")]
    assert preferred_backends("a1", candidates, None) == (["b1"], BY_ADAPTER_RUNNING)
    # Loaded but no room to run it (two others running): not a place that runs it.
    assert preferred_backends("a1", [c("b1", "a3,a4", "a1,a3,a4"), c("b2", "", "")], None) == (
        ["b2"],
        BY_ADAPTER_ROOM,
    )
    # A new adapter goes where it evicts none that is loaded: b2 has a free place.
    assert preferred_backends("a4", candidates, None) == (["b2"], BY_ADAPTER_ROOM)


# vLLM 0.8+ with --enable-lora --max-loras 2: the gauge keeps every label set it was ever
# set with, valued at the time it was last set; the newest is the current one.
VLLM_LORA = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="base"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="base"} 1.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7500000012e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters="math"} 1.7500000314e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters=""} 1.7500000209e+09
"""  # noqa: E501


def test_the_newest_label_set_of_lora_requests_info_is_read_with_the_load():
    load = parse_engine_metrics(VLLM_LORA)
    assert load is not None and (load.running, load.waiting) == (3.0, 1.0)
    assert load.lora == LoraLoad(running=("sql", "chat"), waiting=("math",), max_lora=2)
    plain = parse_engine_metrics(VLLM_LORA.split("# HELP vllm:lora")[0])
    assert plain is not None and plain.lora is None


def test_models_listing_records_the_adapters_of_the_base():
    listing = {
        "object": "list",
        "data": [
            {"id": "base", "object": "model", "owned_by": "vllm", "root": "base",
             "parent": None, "max_model_len": 4096},
            {"id": "sql", "object": "model", "owned_by": "vllm", "root": "/lora/sql",
             "parent": "base", "max_model_len": None},
            {"id": "odd", "parent": ["base"]},
            {"id": "orphan", "parent": "elsewhere"},
        ],
    }  # fmt: skip
    facts = facts_from_models(listing)
    assert facts is not None and facts.adapters == ("sql",) and facts.model == "base"
    listing["data"] = listing["data"][:1]
    facts = facts_from_models(listing)
    assert facts is not None and facts.adapters is None


def test_a_request_waits_for_a_full_backend_running_its_adapter_rather_than_evict_one():
    from gateway.upstream.adapters import WAIT_FOR_ADAPTER

    # b1 runs a1 but has no free slot (no candidate); b2 has room but a2 and a3 loaded.
    b2 = AdapterCandidate("b2", True, frozenset({"a2"}), 2, frozenset({"a2", "a3"}))
    assert preferred_backends("a1", [b2], None, runs_elsewhere=True) == ([], WAIT_FOR_ADAPTER)
    # Past its wait (the pool passes runs_elsewhere=False), it takes the room.
    assert preferred_backends("a1", [b2], None) == (["b2"], BY_ADAPTER_ROOM)
    # A free place costs nobody a swap: taken at once.
    b3 = AdapterCandidate("b3", True, frozenset(), 2, frozenset({"a4"}))
    assert preferred_backends("a1", [b2, b3], None, runs_elsewhere=True) == (
        ["b3"],
        BY_ADAPTER_ROOM,
    )


def test_an_adapter_probably_still_loaded_is_preferred_while_there_is_room_to_run_it():
    lora = BackendAdapters()
    lora.note_scrape([], [], 2, now=0.0)
    for adapter in ("a1", "a2", "a3"):
        lora.dispatched(adapter)
        lora.ended(adapter, now=1.0)
    assert lora.loaded() == {"a2", "a3"} and lora.active() == frozenset()
    idle = AdapterCandidate("b1", True, lora.active(), 2, lora.loaded())
    empty = AdapterCandidate("b2", True, frozenset(), 2, frozenset())
    assert preferred_backends("a3", [idle, empty], None) == (["b1"], BY_ADAPTER_RUNNING)
    # a1 was unloaded there (least recently used): it goes where nothing is evicted.
    assert preferred_backends("a1", [idle, empty], None) == (["b2"], BY_ADAPTER_ROOM)
    busy = AdapterCandidate("b1", True, frozenset({"a5", "a6"}), 2, lora.loaded())
    assert preferred_backends("a3", [busy, empty], None) == (["b2"], BY_ADAPTER_ROOM)
