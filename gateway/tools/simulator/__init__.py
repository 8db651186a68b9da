"""An OpenAI- and TGI-compatible model server that simulates continuous batching.

The gateway's claims (short requests are not stuck behind long prompts, waits
fail fast, streams are relayed as they are produced) can only be shown against
a backend that has the problem. This one does: its engine prefills prompts
first come first served in bounded chunks, so a short prompt waits for a long
one ahead of it, as in vLLM, TGI and llama.cpp. It speaks vLLM's OpenAI API
closely enough for the gateway, the `openai` SDK and load generators, and
Hugging Face TGI's native API closely enough for
`huggingface_hub.InferenceClient`; both kinds of request share one engine. It
records what it received so tests can check what the gateway forwarded
(`/sim/requests`, `/sim/stats`).

It is an independent witness: nothing here imports the gateway. It counts
tokens with tiktoken itself and shapes its own errors, so a bug in the
gateway's counting or error shapes cannot agree with itself in the tests.

The parts, one job each: `config` (the knobs), `engine` (steps, batch,
prefill; no HTTP), `prefix_cache` (the LRU of KV blocks by chained hash that
lets a repeated prefix skip its prefill), `tokens` (its own prompt count and
token ids), `errors` (OpenAI and TGI error shapes), `state` (what the routes
share), `openai_api`, `tgi_request` and `tgi_api` (the two APIs, which never
import each other), `server` (the app that wires both), `cli` (flags and the
serving process). See docs/simulator.md for the model and its knobs.
"""

from gateway.tools.simulator.cli import add_arguments, config_from_args, main
from gateway.tools.simulator.config import SimulatorConfig
from gateway.tools.simulator.engine import Engine
from gateway.tools.simulator.server import build_simulator_app, start_simulator

__all__ = [
    "Engine",
    "SimulatorConfig",
    "add_arguments",
    "build_simulator_app",
    "config_from_args",
    "main",
    "start_simulator",
]
