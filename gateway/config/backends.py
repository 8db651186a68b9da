"""[[backends]]: the model servers, their slots, prefill budget and what they serve."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import field

from gateway.config.constraints import Positive, PositiveFloat, rule

#: The engines whose way of continuing an answer the gateway knows (`dialects/`).
EngineKind = Literal["vllm", "sglang", "llama.cpp", "tgi"]

#: Which names a backend without `models` serves (`upstream/served.py`).
ServesMode = Literal["auto", "listed", "any"]

#: Slots of a backend whose config does not set them and whose engine does not say.
DEFAULT_MAX_CONCURRENCY = 8


#: `dns`: a host name and a port, as a Kubernetes headless Service is reached.
#: (Empty: the entry has a `url`.)
DNS_PATTERN = r"^([A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_.])?:[0-9]{1,5})?$"


class BackendSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    #: The server's base URL (empty: the entry has a `dns` name instead).
    url: Annotated[str, rule("be http(s)://host:port", pattern=r"(?i)^(https?://[^/?#\s]+|$)")] = ""
    #: Instead of `url`: a DNS name and port whose A/AAAA records are the servers (a
    #: Kubernetes headless Service, `tgi.models.svc.cluster.local:80`), re-resolved every
    #: [discovery] interval_s: each address is a backend of its own, named
    #: `<name>@<address>`, with this entry's other settings (`upstream/discovery.py`).
    dns: Annotated[str, rule("be host:port (a DNS name and a port)", pattern=DNS_PATTERN)] = ""
    name: str = ""
    #: Relative capacity: balancing divides outstanding tokens by it.
    weight: PositiveFloat = 1.0
    #: Requests the gateway lets run at once on this backend (its slots). Unset: what
    #: the engine reports (llama.cpp /props total_slots, TGI /info
    #: max_concurrent_requests), else DEFAULT_MAX_CONCURRENCY.
    max_concurrency: Positive | None = None
    #: Predicted prefill seconds this backend may have in flight (dispatched, no first
    #: byte yet), from its learned prefill rate; a bigger prompt goes alone. It bounds
    #: how long a short request waits behind long prompts. Unset: one long prompt's
    #: prefill at the learned rate (recent prompts' 95th percentile), at most 0.5 s, so
    #: an H100 prefills one long prompt at a time as a CPU does. 0: no such budget.
    prefill_budget_s: Annotated[float, rule("be >= 0 (0: no budget)", ge=0)] | None = None
    #: An optional hard cap in prompt tokens on top of the budget in seconds. 0: none.
    max_prefill_tokens: Annotated[int, rule("be >= 0 (0: no limit)", ge=0)] = 0
    #: Sent to this backend as `Authorization: Bearer ...` (the client's own never is).
    api_key: str | None = None
    #: Put the lane's priority in the body's `priority` (vLLM --scheduling-policy priority).
    priority_field: bool = False
    #: The model names it serves. Backends with the same list form one pool (their own
    #: queues and slots); a request goes only to a pool that serves its `model`. Empty:
    #: the catch-all pool, where each backend serves what its engine lists (`serves`).
    models: list[Annotated[str, rule("be a non-empty name", min_length=1)]] = field(
        default_factory=list
    )
    #: Without `models`: which names it serves. "listed": the names its engine lists,
    #: read on every health check (/v1/models, or TGI's /info model_id); "any": any name,
    #: its list not read (the catch-all of earlier releases); "auto": by the engine, vLLM
    #: and SGLang only what they list; llama.cpp, TGI and the simulator (unless strict)
    #: that and any name nobody lists; another engine only what it lists, or any name
    #: when it lists nothing (`upstream/served.py`).
    serves: ServesMode = "auto"
    #: What engine it is, for continuing an answer there when another backend broke off
    #: mid-stream (`upstream/resume.py`). Unset: what the engine says of itself (its
    #: /props, /info, /v1/models); an engine that says nothing is never resumed on.
    engine: EngineKind | None = None
