"""What every route of one simulator shares: the engine, the counter and the request log.

The OpenAI and TGI routes queue for the same engine and record into the same
log, so `/sim/requests` shows one timeline whichever API a request spoke. These
types live apart from the app assembly (`server`) so that each API module
depends on them alone, never on the other API or on the module that wires both.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from gateway.tools.simulator.config import SimulatorConfig
from gateway.tools.simulator.engine import Engine, Sequence
from gateway.tools.simulator.tokens import PromptCounter

Route = Literal["chat", "completions", "tgi_generate", "tgi_generate_stream", "tgi_compat"]

#: How many received requests `/sim/requests` remembers.
REQUEST_LOG_SIZE = 200


@dataclass(slots=True)
class RequestInfo:
    """What the simulator saw of one request, for `/sim/requests`."""

    request_id: str | None
    route: Route
    arrival: float
    model: str | None = None
    stream: bool | None = None
    max_tokens: int | None = None
    include_usage: bool = False
    prompt_tokens: int | None = None
    status: int | None = None
    error_code: str | None = None
    #: The text it was asked to continue (a gateway resuming an answer elsewhere): the
    #: last assistant message of a chat continued, or the prompt of a completion or TGI
    #: request (whole; a witness of what came before the seam); None for a new chat turn.
    continued: str | None = None
    #: How a chat asked for that: "continue_final_message" (vLLM, SGLang) or
    #: "last_assistant" (llama.cpp continues a last assistant message by default).
    continue_form: str | None = None
    seq: Sequence | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        seq = self.seq
        outcome = seq.state if seq is not None else ("rejected" if self.status else "received")
        first_token = seq.first_token if seq else None
        end = seq.end if seq else None
        admitted = seq.admitted if seq else None
        return {
            "request_id": self.request_id,
            "route": self.route,
            "model": self.model,
            "stream": self.stream,
            "max_tokens": self.max_tokens,
            "include_usage": self.include_usage,
            "prompt_tokens": self.prompt_tokens,
            # Known once the engine admitted the sequence and looked its prompt up.
            "cached_tokens": seq.cached_tokens if seq and admitted is not None else None,
            "completion_tokens": seq.generated if seq else None,
            "outcome": outcome,
            "status": self.status,
            "error_code": self.error_code,
            "continued": self.continued,
            "continue_form": self.continue_form,
            # What it generated, so a test can check what a client got across a seam.
            "reply": "".join(seq.reply) if seq is not None else None,
            "arrival": self.arrival,
            "admitted": admitted,
            "first_token": first_token,
            "end": end,
            "queue_ms": _ms(self.arrival, admitted),
            "ttft_ms": _ms(self.arrival, first_token),
            "e2e_ms": _ms(self.arrival, end),
        }


def _ms(start: float, end: float | None) -> float | None:
    return None if end is None else round((end - start) * 1000.0, 3)


@dataclass(slots=True)
class SimulatorState:
    """Everything the handlers share; one per app."""

    config: SimulatorConfig
    engine: Engine
    counter: PromptCounter
    received: int = 0
    rejected: int = 0
    #: Requests accepted, by the `model` they named (what a gateway sent where).
    by_model: dict[str, int] = field(default_factory=dict)
    requests: deque[RequestInfo] = field(default_factory=lambda: deque(maxlen=REQUEST_LOG_SIZE))

    def receive(self, request: web.Request, route: Route, model: str | None = None) -> RequestInfo:
        """Count an arriving request and start its `/sim/requests` entry, before any parsing."""
        info = RequestInfo(
            request_id=request.headers.get("x-request-id"),
            route=route,
            arrival=self.engine.now(),
            model=model,
        )
        self.received += 1
        self.requests.append(info)
        request[INFO_KEY] = info  # for the server-log middleware (server_logs)
        return info


INFO_KEY = "simulator_request_info"
STATE_KEY = web.AppKey("simulator_state", SimulatorState)
CONFIG_KEY = web.AppKey("simulator_config", SimulatorConfig)
