"""Hugging Face TGI's native API: `inputs`, `parameters.max_new_tokens`, token events.

TGI reports generated tokens only in `details`, which a client may not ask
for. For a whole answer the gateway asks for the details itself and removes
them again before the client sees the answer; a stream's token events are
counted as they pass.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.admission.admit import RequestShape
from gateway.admission.limits import OutputBudget, check_n
from gateway.admission.schema import TgiCompatRequest, TgiGenerateRequest, parse
from gateway.admission.tokens import PromptParts, TokenCounter
from gateway.config import LimitsSettings
from gateway.dialects.base import IN_BAND_FIELDS, Dialect, sse_event
from gateway.upstream.seam import (
    LOGPROBS,
    REQUEST_SHAPE,
    Continuation,
    Seam,
    TgiContinuation,
    read_tgi_seam,
)
from gateway.upstream.sse import StreamWatcher, TgiStreamWatcher

#: Engines that serve TGI's `/generate_stream` (the simulator speaks it too).
TGI_ENGINES = frozenset({"tgi", "simulator"})


class TgiDialect(Dialect):
    """`stream` is fixed by the route, or None for TGI's `/`, which reads the body's."""

    def __init__(self, backend_path: str, *, stream: bool | None) -> None:
        super().__init__(backend_path)
        self.stream = stream
        self.request_type: type[TgiGenerateRequest] = (
            TgiCompatRequest if stream is None else TgiGenerateRequest
        )

    async def measure(
        self, body: dict[str, Any], limits: LimitsSettings, counter: TokenCounter
    ) -> RequestShape:
        request = parse(body, self.request_type)
        stream = request.stream if isinstance(request, TgiCompatRequest) else bool(self.stream)
        parameters = request.parameters
        size = await counter.measure_async(PromptParts(texts=[request.inputs]))
        return RequestShape(
            body=body,
            prompt_param="inputs",
            model=None,
            stream=stream,
            prompt_tokens=size.total,
            longest_prompt_tokens=size.longest,
            requested_max_tokens=parameters.max_new_tokens if parameters else None,
            max_tokens_fields=("max_new_tokens",),
            n=check_n(parameters.best_of if parameters else None, limits, "parameters.best_of"),
            prompt_count=1,
            # For TGI: the client asked for `details` itself (so they must stay).
            client_wants_usage=bool((body.get("parameters") or {}).get("details")),
            prefix=size.prefix,
        )

    def backend_body(self, shape: RequestShape, budget: OutputBudget) -> dict[str, Any]:
        body = dict(shape.body)
        parameters = dict(shape.body.get("parameters") or {})
        parameters["max_new_tokens"] = budget.max_tokens
        if not shape.stream and not shape.client_wants_usage:
            parameters["details"] = True
        body["parameters"] = parameters
        return body

    def stream_watcher(self, shape: RequestShape) -> StreamWatcher:
        return TgiStreamWatcher()

    def completion_tokens(self, body: bytes) -> int | None:
        """`details.generated_tokens` of the answer (`/` answers a one-element list)."""
        try:
            answer = msgspec.json.decode(body)
        except msgspec.DecodeError:
            return None
        if isinstance(answer, list) and len(answer) == 1:
            answer = answer[0]
        details = answer.get("details") if isinstance(answer, dict) else None
        tokens = details.get("generated_tokens") if isinstance(details, dict) else None
        return tokens if type(tokens) is int else None

    def client_body(self, shape: RequestShape, body: bytes) -> bytes:
        """Remove the details the gateway asked for but the client did not."""
        if shape.client_wants_usage:
            return body
        try:
            answer = msgspec.json.decode(body)
        except msgspec.DecodeError:
            return body
        items = answer if isinstance(answer, list) else [answer]
        if not all(isinstance(item, dict) and "details" in item for item in items):
            return body
        for item in items:
            del item["details"]
        return msgspec.json.encode(answer)

    def error_event(self, error: dict[str, Any]) -> bytes:
        # huggingface_hub reads a TGI stream's error as a string with an `error_type`.
        event = {"error": error["message"], "error_type": error["code"]}
        # An early stream's in-band error also says when to retry and how long it queued.
        event.update((key, error[key]) for key in IN_BAND_FIELDS if key in error)
        return sse_event(event)

    def not_resumable(self, shape: RequestShape) -> str | None:
        parameters = shape.body.get("parameters") or {}
        if shape.n > 1 or parameters.get("return_full_text") or parameters.get("grammar"):
            return REQUEST_SHAPE
        if parameters.get("top_n_tokens") or parameters.get("decoder_input_details"):
            return LOGPROBS
        return None

    def read_seam(self, relayed: bytes) -> Seam:
        return read_tgi_seam(relayed)

    def continuation(
        self, fields: dict[str, Any], seam: Seam, max_tokens: int, engine: str | None
    ) -> dict[str, Any] | None:
        """TGI: the inputs followed by the text so far, `max_new_tokens` what is left."""
        if engine not in TGI_ENGINES:
            return None
        parameters = dict(fields.get("parameters") or {}, max_new_tokens=max_tokens)
        return dict(fields, inputs=fields["inputs"] + seam.sent_text, parameters=parameters)

    def continued_stream(self, seam: Seam, shape: RequestShape) -> Continuation:
        return TgiContinuation(seam, strip_usage=False)
