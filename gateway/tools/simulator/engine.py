"""The simulator's engine: continuous batching with first-come-first-served prefill.

Real model servers (vLLM, TGI, llama.cpp) run one loop of *steps*. Each step
prefills a bounded number of prompt tokens, taken from the running sequences in
arrival order, and decodes one token for every sequence whose prompt is done.
That order is what makes head-of-line blocking: a short prompt that arrives
while a long one is prefilling gets prefill budget only once the long one is
through. This module reproduces exactly that and nothing cleverer, so a gateway
tested against it meets the effect it exists to soften. Two ways of prefilling
(`SimulatorConfig.prefill`): in chunks of the step's token budget beside the
batch's decoding (vLLM, SGLang; llama.cpp, whose budget is `n_batch`), or in
whole prompts that fill a step of their own while decoding waits (TGI).

With the prefix cache on (as vLLM V1 and llama.cpp run by default), a sequence
admitted to the batch first looks up its prompt's leading blocks: those cached
are not prefilled again, so only the uncached tokens cost prefill time. The
blocks it fills are cached as they fill, pinned while it runs; when it ends,
the blocks of its reply are cached too (as the next turn's prompt will hold
them), and all of them stay until the LRU evicts them.

With LoRA adapters served (`adapters.py`), a waiting sequence whose adapter would be
one too many for the batch (`max_lora`) is passed over, as vLLM's scheduler does, and
a step that loads an adapter not resident takes the swap's time too.

It knows nothing about HTTP: a caller `submit()`s a sequence, reads its tokens
from `Sequence.next_event()`, and `abort()`s it when the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.tools.simulator.adapters import AdapterSet, parse_adapter_list
from gateway.tools.simulator.config import SimulatorConfig
from gateway.tools.simulator.prefix_cache import ROOT_HASH, PrefixCache, PromptBlocks, block_hashes

#: Words the fake model "generates"; one event per word, each followed by a space.
VOCABULARY = (
    "the", "model", "token", "stream", "latency", "queue", "batch", "prefill",
    "decode", "request", "gateway", "server", "lane", "slot", "first", "tail",
    "time", "fast", "slow", "short", "long", "prompt", "reply", "step",
    "cache", "budget", "engine", "client", "wait", "fair", "order", "load",
)  # fmt: skip

#: How far behind schedule a busy engine's step may start and still be timed from the
#: previous step's end. The process's own lateness (its event loop sharing a CPU with the
#: gateway and the client, a prompt being tokenized) is caught up, so the engine keeps
#: the pace its config models: at 2 ms a loaded 2-core machine lost 2-4 % of each
#: request's service time, and `gateway replay`'s virtual run (never late) was 10-20 %
#: optimistic at P99 against it. A longer stall (a stopped process) starts afresh.
MAX_CATCH_UP_S = 0.1

SequenceState = Literal["waiting", "running", "completed", "aborted"]

#: vLLM's buckets for its request time histograms (seconds; `request_latency_buckets`).
REQUEST_TIME_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclass(slots=True)
class TimeHistogram:
    """One Prometheus histogram of durations: counts per bucket (the last: above all)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(REQUEST_TIME_BUCKETS) + 1))
    sum_s: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        index = next(
            (i for i, top in enumerate(REQUEST_TIME_BUCKETS) if seconds <= top),
            len(REQUEST_TIME_BUCKETS),
        )
        self.counts[index] += 1
        self.sum_s += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, requests at or below it) as the exposition writes them, +Inf last."""
        total, buckets = 0, []
        for top, count in zip((*REQUEST_TIME_BUCKETS, float("inf")), self.counts, strict=True):
            total += count
            buckets.append(("+Inf" if top == float("inf") else repr(top), float(total)))
        return buckets


@dataclass(slots=True)
class RequestTimes:
    """Where the time of the completed sequences went, as vLLM's histograms tell it: queue
    (arrival to admission into the batch), prefill (admission to first token), decode
    (first token to last)."""

    queue: TimeHistogram = field(default_factory=TimeHistogram)
    prefill: TimeHistogram = field(default_factory=TimeHistogram)
    decode: TimeHistogram = field(default_factory=TimeHistogram)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token; the last one carries the finish reason."""

    text: str
    finish_reason: str | None = None


class EngineStopped(Exception):
    """The engine shut down while the sequence was still in flight."""


@dataclass(eq=False, slots=True)
class Sequence:
    """One request inside the engine; timestamps are the event loop's monotonic clock."""

    seq_id: int
    prompt_tokens: int
    max_tokens: int
    arrival: float
    rng: random.Random
    state: SequenceState = "waiting"
    prefilled: int = 0
    generated: int = 0
    admitted: float | None = None
    first_token: float | None = None
    end: float | None = None
    #: The prompt's blocks; None: not looked up in or added to the prefix cache.
    blocks: PromptBlocks | None = None
    #: Prompt tokens found in the prefix cache at admission, not prefilled.
    cached_tokens: int = 0
    #: The cached blocks this sequence pins, in prompt order.
    held: list[bytes] = field(default_factory=list)
    #: False once a block could not be cached: the blocks after it would be unreachable.
    caching: bool = True
    reply: list[str] = field(default_factory=list)
    #: The LoRA adapter it runs with; None: the base model.
    adapter: str | None = None
    _events: asyncio.Queue[TokenEvent | None] = field(default_factory=asyncio.Queue)

    @property
    def prefill_target(self) -> int:
        # An empty prompt still costs one position (the BOS token a real server adds).
        return max(1, self.prompt_tokens)

    @property
    def finished(self) -> bool:
        return self.state in ("completed", "aborted")

    def times(self) -> tuple[float, float, float] | None:
        """(queue, prefill, decode) seconds of a completed sequence; None before."""
        if self.admitted is None or self.first_token is None or self.end is None:
            return None
        return (
            self.admitted - self.arrival,
            self.first_token - self.admitted,
            self.end - self.first_token,
        )

    async def next_event(self) -> TokenEvent:
        """Wait for the next token; raises EngineStopped if the engine went away first."""
        event = await self._events.get()
        if event is None:
            raise EngineStopped("the simulator engine stopped")
        return event


class Engine:
    """Runs the step loop as one asyncio task that sleeps on an event while idle."""

    def __init__(
        self,
        config: SimulatorConfig,
        clock: Callable[[], float] | None = None,
        reply_token_ids: Callable[[str], list[int]] | None = None,
    ) -> None:
        """`reply_token_ids`: a reply's text as the next turn's prompt will encode it; without
        it only prompt blocks are cached."""
        self.config = config
        self._clock = clock
        self._reply_token_ids = reply_token_ids
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(config.prefix_cache_blocks, config.block_tokens)
            if config.prefix_cache
            else None
        )
        #: vLLM's prefix cache counters, in tokens: prompt tokens looked up, and found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        #: The served LoRA adapters; None: LoRA serving off.
        self.adapters: AdapterSet | None = (
            AdapterSet(parse_adapter_list(config.lora_adapters), config.max_lora,
                       config.lora_swap_ms)
            if config.lora
            else None
        )  # fmt: skip
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.completed = 0
        self.aborted = 0
        self.submitted = 0
        self.steps = 0
        self.prefilled_tokens = 0
        self.generated_tokens = 0
        self.busy_s = 0.0
        self.request_times = RequestTimes()
        #: The most sequences held at once (running + waiting) and the most in the batch, since
        #: start or `reset_peaks()`: the engine's own count, so a gateway's promise that no
        #: more than `max_concurrency` requests reach this server is checked by the server.
        self.in_flight_peak = 0
        self.running_peak = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._step_end = float("-inf")
        #: When set, each token goes to this callback instead of its sequence's queue: a
        #: replay in virtual time needs only the first and last token's time, not a task
        #: switch per token.
        self.on_token: Callable[[Sequence, TokenEvent], None] | None = None

    def now(self) -> float:
        if self._clock is not None:
            return self._clock()
        return asyncio.get_running_loop().time()

    def start(self) -> None:
        """Start the step loop on the running event loop."""
        if self._task is None:
            self._stopped = False
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        """Stop the loop and fail every sequence still in flight, so no reader hangs."""
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for seq in [*self.running, *self.waiting]:
            self._finish(seq, "aborted")
            seq._events.put_nowait(None)
        self.running.clear()
        self.waiting.clear()

    def submit(
        self,
        prompt_tokens: int,
        max_tokens: int,
        blocks: PromptBlocks | None = None,
        adapter: str | None = None,
        seed: int | None = None,
    ) -> Sequence:
        """Queue a sequence FIFO behind everything already waiting.

        `blocks`: the prompt's hashed blocks, for the prefix cache (None: bypass it);
        `adapter`: the served LoRA adapter it runs with (None: the base model); `seed`:
        the request's own (its words are then the same every time it is sent).
        """
        if self._stopped:
            raise EngineStopped("the simulator engine is stopped")
        seq_id = self.submitted
        self.submitted += 1
        seq = Sequence(
            seq_id=seq_id,
            prompt_tokens=prompt_tokens,
            max_tokens=max(1, max_tokens),
            arrival=self.now(),
            rng=random.Random(
                f"{self.config.seed}-{seq_id}" if seed is None else f"{self.config.seed}-s{seed}"
            ),
            blocks=blocks,
            adapter=adapter,
        )
        self.waiting.append(seq)
        self.in_flight_peak = max(self.in_flight_peak, self.in_flight)
        self._wakeup.set()
        return seq

    @property
    def in_flight(self) -> int:
        """Sequences this engine holds right now, in the batch or queued for it."""
        return len(self.running) + len(self.waiting)

    def reset_peaks(self) -> dict[str, int]:
        """Start the peaks again from the current counts (a benchmark's next phase); returns
        the peaks before the reset."""
        before = {"in_flight_peak": self.in_flight_peak, "running_peak": self.running_peak}
        self.in_flight_peak, self.running_peak = self.in_flight, len(self.running)
        return before

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence whose client went away, from the batch or the queue, at once."""
        if seq.finished:
            return
        if seq.state == "running":
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._finish(seq, "aborted")

    def stats(self) -> dict[str, Any]:
        cache = self.prefix_cache
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "in_flight": self.in_flight,
            "in_flight_peak": self.in_flight_peak,
            "running_peak": self.running_peak,
            "completed": self.completed,
            "aborted": self.aborted,
            "submitted": self.submitted,
            "steps": self.steps,
            "prefilled_tokens": self.prefilled_tokens,
            "generated_tokens": self.generated_tokens,
            "busy_s": round(self.busy_s, 6),
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_blocks": len(cache) if cache is not None else 0,
            "prefix_cache_pinned_blocks": cache.pinned_blocks if cache is not None else 0,
            "prefix_cache_evictions": cache.evictions if cache is not None else 0,
            "lora_swaps": self.adapters.swaps if self.adapters is not None else 0,
        }

    def kv_cache_usage(self) -> float:
        """The fraction of the KV cache the batch holds, as a /metrics gauge reports it.

        The cache is modelled as one context window per batch place (llama.cpp's slots);
        a running sequence holds its prefilled prompt and its generated tokens.
        """
        capacity = self.config.max_batch * self.config.max_model_len
        held = sum(seq.prefilled + seq.generated for seq in self.running)
        return min(1.0, held / capacity)

    async def _run(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                self._step_end = float("-inf")  # after an idle spell the next step starts now
                continue
            await self.step()

    async def step(self) -> None:
        """Admit, plan one step's work, take the step's time, then hand out its tokens."""
        swap_ms = self._admit()
        if self.config.prefill == "whole":
            prefills, decodes = self._plan_whole()
        else:
            prefills, decodes = self._plan_chunked()
        prefilled = sum(take for _, take in prefills)
        step_s = (self.config.step_ms(prefilled, len(decodes)) + swap_ms) / 1000.0
        # Back-to-back steps start where the previous one was due to end, so the event loop's
        # wake-up lag (~0.5 ms a sleep) and the process's own lateness do not slow decoding;
        # after an idle spell or a real stall the step starts now instead of bursting.
        start = self.now()
        if start - self._step_end <= MAX_CATCH_UP_S:
            start = self._step_end
        self._step_end = start + step_s
        await asyncio.sleep(max(0.0, self._step_end - self.now()))
        self.steps += 1
        self.busy_s += step_s
        self.prefilled_tokens += prefilled
        # All of a step's tokens come out together, at its end. Sequences aborted during the
        # step are no longer `running`: their share of the work is discarded.
        now = self.now()
        for seq, take in prefills:
            if seq.state == "running":
                seq.prefilled += take
                self._cache_filled_blocks(seq)
                if seq.prefilled >= seq.prefill_target:
                    self._emit(seq, now)  # the step that ends the prompt samples its first token
        for seq in decodes:
            if seq.state == "running":
                self._emit(seq, now)

    def _plan_chunked(self) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        """This step's prefill chunks and decodes: the budget goes to the running prompts in
        admission order (first come first served), a long one taking it over several steps;
        every sequence whose prompt is done decodes beside them."""
        budget = self.config.prefill_tokens_per_step
        prefills: list[tuple[Sequence, int]] = []
        decodes: list[Sequence] = []
        for seq in self.running:
            remaining = seq.prefill_target - seq.prefilled
            if remaining > 0:
                if budget > 0:
                    take = min(remaining, budget)
                    budget -= take
                    prefills.append((seq, take))
            else:
                decodes.append(seq)
        return prefills, decodes

    def _plan_whole(self) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        """TGI's batching: a step with prompts to prefill takes whole ones, first come first
        served, while they fit in the budget (the first one whatever its size), and the
        batch's decoding waits for it; a step with none decodes."""
        budget = self.config.prefill_tokens_per_step
        prefills: list[tuple[Sequence, int]] = []
        for seq in self.running:
            remaining = seq.prefill_target - seq.prefilled
            if remaining <= 0:
                continue
            if prefills and remaining > budget:
                break  # first come first served: nobody overtakes the prompt that does not fit
            prefills.append((seq, remaining))
            budget -= remaining
        if prefills:
            return prefills, []
        return [], list(self.running)

    def _admit(self) -> float:
        """Fill the batch first come first served; the milliseconds of adapter loads it took.

        A sequence whose adapter may not join (max_lora distinct adapters run already) keeps
        its place in the queue while the ones behind it are considered, as in vLLM.
        """
        adapters = self.adapters
        swap_ms = 0.0
        passed_over: list[Sequence] = []
        token_room = self._batch_token_room()
        while self.waiting and len(self.running) < self.config.max_batch:
            if token_room is not None:
                need = _reserved_tokens(self.waiting[0])
                if need > token_room and self.running:
                    break  # first come first served: nobody overtakes the one that waits
                token_room -= need
            seq = self.waiting.popleft()
            if adapters is not None:
                running = [s.adapter for s in self.running]
                if not adapters.may_join(seq.adapter, running):
                    passed_over.append(seq)
                    continue
                swap_ms += adapters.admit(seq.adapter, running)
            seq.state = "running"
            seq.admitted = self.now()
            self._look_up_prefix(seq)
            self.running.append(seq)
        self.waiting.extendleft(reversed(passed_over))
        self.running_peak = max(self.running_peak, len(self.running))
        if adapters is not None:
            adapters.note_batch(
                (s.adapter for s in self.running), (s.adapter for s in self.waiting)
            )
        return swap_ms

    def _batch_token_room(self) -> int | None:
        """What is left of `max_batch_tokens` beside the running sequences (None: no bound)."""
        budget = self.config.max_batch_tokens
        if not budget:
            return None
        return budget - sum(_reserved_tokens(seq) for seq in self.running)

    def _look_up_prefix(self, seq: Sequence) -> None:
        """Pin the prompt's cached leading blocks and skip their prefill, as vLLM schedules.

        The prompt's last token is always computed (its logits give the first token), so a
        prompt cached whole hits all but its last block, as in vLLM.
        """
        cache = self.prefix_cache
        if cache is None or seq.blocks is None:
            return
        usable = seq.blocks.hashes[: (seq.prefill_target - 1) // cache.block_tokens]
        hits = cache.acquire(usable)
        seq.held = list(usable[:hits])
        seq.cached_tokens = hits * cache.block_tokens
        seq.prefilled = seq.cached_tokens
        self.prefix_cache_queries += seq.prompt_tokens
        self.prefix_cache_hits += seq.cached_tokens

    def _cache_filled_blocks(self, seq: Sequence) -> None:
        """Cache the prompt blocks the last step filled, pinned by the sequence."""
        cache = self.prefix_cache
        if cache is None or seq.blocks is None:
            return
        filled = min(seq.prefilled // cache.block_tokens, len(seq.blocks.hashes))
        while seq.caching and len(seq.held) < filled:
            self._hold(cache, seq, seq.blocks.hashes[len(seq.held)])

    def _cache_reply_blocks(self, seq: Sequence) -> None:
        """Cache the full blocks of prompt + reply, as the next turn's prompt will hold them.

        The reply is taken as the text the client sends back, encoded as the next prompt
        encodes it (the simulator's words are not one token each).
        """
        cache = self.prefix_cache
        blocks = seq.blocks
        if cache is None or blocks is None or self._reply_token_ids is None:
            return
        if not seq.caching or len(seq.held) < len(blocks.hashes):
            return
        ids = [*blocks.tail, *self._reply_token_ids("".join(seq.reply))]
        parent = blocks.hashes[-1] if blocks.hashes else ROOT_HASH
        for block in block_hashes(ids, cache.block_tokens, parent):
            if not self._hold(cache, seq, block):
                return

    def _hold(self, cache: PrefixCache, seq: Sequence, block: bytes) -> bool:
        if cache.insert(block):
            seq.held.append(block)
            return True
        seq.caching = False
        return False

    def _emit(self, seq: Sequence, now: float) -> None:
        seq.generated += 1
        self.generated_tokens += 1
        if seq.first_token is None:
            seq.first_token = now
        text = seq.rng.choice(VOCABULARY) + " "
        seq.reply.append(text)
        if seq.generated >= seq.max_tokens:
            self.running.remove(seq)
            self._cache_reply_blocks(seq)
            self._finish(seq, "completed", now)
            self._deliver(seq, TokenEvent(text, "length"))
        else:
            self._deliver(seq, TokenEvent(text))

    def _deliver(self, seq: Sequence, event: TokenEvent) -> None:
        if self.on_token is not None:
            self.on_token(seq, event)
        else:
            seq._events.put_nowait(event)

    def _finish(self, seq: Sequence, state: SequenceState, now: float | None = None) -> None:
        seq.state = state
        seq.end = self.now() if now is None else now
        cache = self.prefix_cache
        if cache is not None and seq.held:
            cut_short = state == "aborted" and seq.prefilled < seq.prefill_target
            if cut_short and not self.config.keep_aborted_prefill:
                found = seq.cached_tokens // cache.block_tokens  # cached before it came
                cache.release(seq.held[:found])
                cache.drop(seq.held[found:])
            else:
                cache.release(seq.held)  # cached still, now evictable
            seq.held = []
        if state == "completed":
            self.completed += 1
            times = seq.times()
            if times is not None:
                self.request_times.queue.observe(times[0])
                self.request_times.prefill.observe(times[1])
                self.request_times.decode.observe(times[2])
        else:
            self.aborted += 1


def _reserved_tokens(seq: Sequence) -> int:
    """What a sequence holds of a token-bounded batch: its prompt and its whole output
    (TGI's router allocates both at admission)."""
    return seq.prompt_tokens + seq.max_tokens
