"""LoRA adapters as vLLM serves them: few run at once, and loading one costs a step's time.

vLLM serves adapters of one base model (`--lora-modules`, or at run time through
`POST /v1/load_lora_adapter`) and lists each in `/v1/models` with `parent` set to
the base model. Its scheduler lets at most `--max-loras` distinct adapters into one
batch: a waiting request whose adapter is not among the running ones while that
many already run is skipped (it keeps its place; requests behind it may go first).
The GPU holds `max_loras` adapter slots, kept in LRU order; admitting an adapter
that is not in one loads it (evicting the least recently used one that no running
request needs), and that load stalls the step: a *swap*, what a gateway that keeps
an adapter's requests together on one backend saves.

This module is the bookkeeping alone (which adapters are served, resident, running,
waiting); the engine asks it whether a sequence may join the batch and what its
admission costs. It also remembers the label sets of vLLM's `vllm:lora_requests_info`
gauge, which vLLM never removes: every set ever seen stays in /metrics with the time
it was last current, so a reader must take the newest one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

#: How many past label sets of `vllm:lora_requests_info` are kept (vLLM keeps all of them;
#: bounded here so that a long run does not grow /metrics without end).
LORA_INFO_HISTORY = 64


class AdapterSet:
    """The served adapters of one simulator, which are loaded on the GPU, and the swaps."""

    def __init__(
        self,
        names: Iterable[str],
        max_lora: int,
        swap_ms: float,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if max_lora < 1:
            raise ValueError(f"max_lora must be >= 1, got {max_lora}")
        #: Served adapter name -> its path (what load_lora_adapter was given).
        self.served: dict[str, str] = {name: name for name in names}
        self.max_lora = max_lora
        self.swap_ms = swap_ms
        #: Adapters loaded on the GPU, least recently used first; at most max_lora.
        self.resident: OrderedDict[str, None] = OrderedDict()
        self.swaps = 0
        self._wall_clock = wall_clock
        #: (running, waiting) label values -> the wall time they were last current.
        self.info_history: OrderedDict[tuple[str, str], float] = OrderedDict()

    def serves(self, name: str) -> bool:
        return name in self.served

    def load(self, name: str, path: str) -> bool:
        """Serve one more adapter (vLLM's dynamic loading); False if it is served already."""
        if name in self.served:
            return False
        self.served[name] = path
        return True

    def unload(self, name: str) -> bool:
        """Stop serving an adapter; False if it was not served."""
        if self.served.pop(name, None) is None:
            return False
        self.resident.pop(name, None)
        return True

    def may_join(self, adapter: str | None, running: Iterable[str | None]) -> bool:
        """Whether a sequence of `adapter` may join a batch running these sequences' adapters:
        the base model always may; an adapter when it already runs or fewer than max_lora do."""
        if adapter is None:
            return True
        distinct = {a for a in running if a is not None}
        return adapter in distinct or len(distinct) < self.max_lora

    def admit(self, adapter: str | None, running: Iterable[str | None]) -> float:
        """An adapter joins the batch: the milliseconds its load adds to the step (0 when it
        is resident). Evicts the least recently used resident adapter no running one needs."""
        if adapter is None:
            return 0.0
        if adapter in self.resident:
            self.resident.move_to_end(adapter)
            return 0.0
        if len(self.resident) >= self.max_lora:
            needed = {a for a in running if a is not None}
            victim = next((a for a in self.resident if a not in needed), None)
            if victim is not None:
                del self.resident[victim]
        self.resident[adapter] = None
        self.swaps += 1
        return self.swap_ms

    def note_batch(self, running: Iterable[str | None], waiting: Iterable[str | None]) -> None:
        """Record the current label set of `vllm:lora_requests_info` (as vLLM does each step):
        the distinct adapters of the running and of the waiting requests, comma-joined in
        order of first appearance."""
        key = (_joined(running), _joined(waiting))
        self.info_history.pop(key, None)
        self.info_history[key] = self._wall_clock()
        while len(self.info_history) > LORA_INFO_HISTORY:
            self.info_history.popitem(last=False)


def _joined(adapters: Iterable[str | None]) -> str:
    return ",".join(dict.fromkeys(a for a in adapters if a is not None))


def parse_adapter_list(text: str) -> tuple[str, ...]:
    """`--lora-adapters a1,a2`: the names, stripped, empty ones dropped, first of each kept."""
    return tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
