"""How the gateway asks a backend about itself: its size, its load, its adapters, one timed
first token.

The sizer (`sizing.py`) and the start-up probe (`probe.py`) decide what to do with the
answers; this says where the answers come from. `serve` asks over HTTP
(`HttpQuestions`); `gateway replay` and the engine matrix answer from the engine model
they run in virtual time, so the very sizing code that serves learns the modelled
engine the way it learns a real one, at the same moments.
"""

from __future__ import annotations

import time
from typing import Protocol

import aiohttp

from gateway.upstream.pool import Backend
from gateway.upstream.telemetry import (
    BackendFacts,
    EngineLoad,
    fetch_adapters,
    fetch_load,
    probe_facts,
)

#: Longest one timed first token (a probe) may take.
PROBE_TIMEOUT_S = 120.0


class BackendQuestions(Protocol):
    """What the sizer and the probe may ask a backend; None wherever it did not say."""

    async def facts(self, backend: Backend) -> BackendFacts | None:
        """What it is: engine, slots, context, model (`telemetry.probe_facts`)."""

    async def load(self, backend: Backend) -> EngineLoad | None:
        """Its engine's own view of its load (`telemetry.fetch_load`)."""

    async def adapters(self, backend: Backend) -> tuple[str, ...] | None:
        """The LoRA adapters it lists now (empty: none)."""

    async def first_token_s(
        self, backend: Backend, model: str | None, prompt: str, prompt_tokens: int
    ) -> float | None:
        """Seconds from sending a streamed one-token completion of `prompt` (about
        `prompt_tokens` tokens) to its first bytes."""


class HttpQuestions:
    """The questions asked over HTTP, on one client session."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def facts(self, backend: Backend) -> BackendFacts | None:
        return await probe_facts(self.session, backend.url, backend.auth_headers)

    async def load(self, backend: Backend) -> EngineLoad | None:
        return await fetch_load(self.session, backend.url, backend.auth_headers)

    async def adapters(self, backend: Backend) -> tuple[str, ...] | None:
        return await fetch_adapters(self.session, backend.url, backend.auth_headers)

    async def first_token_s(
        self, backend: Backend, model: str | None, prompt: str, prompt_tokens: int
    ) -> float | None:
        body: dict[str, object] = {
            "prompt": prompt,
            "max_tokens": 1,
            "stream": True,
            "temperature": 0,
        }
        if model:
            body["model"] = model
        # A fresh connection each time: the probe reads only the first bytes, and a server
        # such as llama.cpp's closes the connection after the answer (a pooled one would fail).
        headers = {"Connection": "close", **(backend.auth_headers or {})}
        started = time.perf_counter()
        try:
            async with self.session.post(
                backend.url + "/v1/completions",
                json=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S),
            ) as resp:
                if resp.status != 200:
                    return None
                await resp.content.readany()
                elapsed = time.perf_counter() - started
                await resp.read()
                return elapsed
        except (aiohttp.ClientError, TimeoutError):
            return None


def asked(through: aiohttp.ClientSession | BackendQuestions) -> BackendQuestions:
    """`through` as questions: a client session asks over HTTP."""
    if isinstance(through, aiohttp.ClientSession):
        return HttpQuestions(through)
    return through
