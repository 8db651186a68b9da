"""What a modelled engine says about itself, as the server it stands for would say it.

The gateway's sizer asks each backend what it is (`/props`, `/info`, `/v1/models`), reads
its `/metrics` and times a few one-token probes (`upstream/questions.py`). In a replay the
backends are the simulator's engines on the virtual clock, so this answers those
questions from the engine, as the kind of server it models answers them: llama.cpp
reports its slots (and serves `/metrics` only with `--metrics`, off by default), TGI
reports its router's request limit (128 by default, not its batch), vLLM and SGLang
report no slots at all, only their context and their queue. The gateway then learns the
modelled engine exactly as far as it would learn the real one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.tools.simulator.config import SimulatorConfig
from gateway.tools.simulator.engine import Engine
from gateway.tools.simulator.engine import Sequence as EngineSequence
from gateway.upstream.pool import Backend
from gateway.upstream.telemetry import BackendFacts, EngineLoad

#: The kinds of server an engine model may stand for.
ENGINE_KINDS = ("simulator", "llama.cpp", "vllm", "sglang", "tgi")
#: TGI's `--max-concurrent-requests` default, what its /info reports as its limit.
TGI_MAX_CONCURRENT_REQUESTS = 128


@dataclass(frozen=True, slots=True)
class ModelledEngine:
    """One backend's engine model, and the kind of server whose answers it gives."""

    config: SimulatorConfig
    kind: str = "simulator"
    #: Whether it serves /metrics (llama.cpp only with --metrics).
    metrics: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ENGINE_KINDS:
            raise ValueError(f"engine kind must be one of {', '.join(ENGINE_KINDS)}")

    def facts(self) -> BackendFacts:
        """What its /props, /info or /v1/models tell the gateway (`telemetry.probe_facts`)."""
        config = self.config
        if self.kind == "simulator":
            return BackendFacts(
                engine="simulator",
                slots=config.max_batch,
                context_tokens=config.max_model_len,
                model=config.model,
                prefill=config.prefill,
            )
        if self.kind == "llama.cpp":
            return BackendFacts(
                engine="llama.cpp",
                slots=config.max_batch,
                context_tokens=config.max_model_len,
                model=config.model,
            )
        if self.kind == "tgi":
            return BackendFacts(
                engine="tgi",
                slots=TGI_MAX_CONCURRENT_REQUESTS,
                context_tokens=config.max_model_len,
                max_input_tokens=config.max_model_len - 1,
                batch_tokens=config.tgi_batch_tokens,
                model=config.model,
            )
        return BackendFacts(
            engine=self.kind, context_tokens=config.max_model_len, model=config.model
        )


class Tracking(Protocol):
    """Futures of a sequence's first and last token's times (`runs.TokenWatch`)."""

    def track(self, seq: EngineSequence) -> tuple[asyncio.Future[float], asyncio.Future[float]]: ...


def modelled_engines(
    config: SimulatorConfig | Sequence[ModelledEngine], count: int
) -> list[ModelledEngine]:
    """One engine model per backend: the same config for all, or one each as given."""
    if isinstance(config, SimulatorConfig):
        return [ModelledEngine(config) for _ in range(count)]
    engines = list(config)
    if len(engines) != count:
        raise ValueError(f"{len(engines)} engine models for {count} backends")
    return engines


class EngineAnswers:
    """`BackendQuestions` answered by the running engine models, by backend name."""

    def __init__(self, engines: dict[str, tuple[ModelledEngine, Engine]], watch: Tracking):
        self._engines = engines
        self._watch = watch

    async def facts(self, backend: Backend) -> BackendFacts | None:
        return self._engines[backend.name][0].facts()

    async def load(self, backend: Backend) -> EngineLoad | None:
        modelled, engine = self._engines[backend.name]
        if not modelled.metrics:
            return None
        return EngineLoad(
            engine=modelled.kind,
            waiting=float(len(engine.waiting)),
            running=float(len(engine.running)),
            kv_usage=engine.kv_cache_usage(),
        )

    async def adapters(self, backend: Backend) -> tuple[str, ...] | None:
        return None

    async def first_token_s(
        self, backend: Backend, model: str | None, prompt: str, prompt_tokens: int
    ) -> float | None:
        modelled, engine = self._engines[backend.name]
        started = asyncio.get_running_loop().time()
        seq = engine.submit(modelled.config.backend_tokens(prompt_tokens), 1)
        first, end = self._watch.track(seq)
        first_token = await first
        await end
        return first_token - started
