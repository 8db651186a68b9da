"""Seeded traffic that shows whether short requests keep a low P99 (`python -m gateway loadgen`).

The product's promise is a number measured from the client's side, so this
tool produces the traffic (a mix of short and long requests, open or closed
loop, or a replayed production trace) and measures what users would feel,
against the gateway, a backend directly, or the simulator.

The parts: `mix` (classes, schedules, trace replay), `conversations`
(multi-turn workloads whose history grows by the replies), `prompts` (prompts of an
exact token size), `client` (sending one request and timing it), `run` (open
and closed loops), `report` (summaries, tables, JSON) and `cli` (the flags).
Unlike the simulator it may lean on the gateway: prompt sizes are the
gateway's own count and trace requests are classed by its first default lane,
so a class's bounds line up with the lanes it is meant to exercise.
"""

from gateway.tools.loadgen.cli import add_arguments, main
from gateway.tools.loadgen.client import RequestResult, RetryPolicy, RunResult
from gateway.tools.loadgen.conversations import (
    MULTI_TURN,
    MULTI_TURN_HOT,
    NAMED_CONVERSATION_MIXES,
    ConversationMix,
    ConversationPlan,
    Dialogue,
    plan_conversations,
)
from gateway.tools.loadgen.mix import (
    DEFAULT_MIX,
    NAMED_MIXES,
    PREFILL_HEAVY_MIX,
    PlannedRequest,
    TrafficClass,
    closed_schedule,
    load_mix,
    parse_class,
    poisson_schedule,
    resolve_mix,
    trace_class,
    trace_schedule,
)
from gateway.tools.loadgen.report import (
    format_conversation_tables,
    format_tables,
    summarize_run,
    summarize_turns,
    write_json,
)
from gateway.tools.loadgen.run import run_closed_loop, run_conversations, run_open_loop

__all__ = [
    "DEFAULT_MIX",
    "MULTI_TURN",
    "MULTI_TURN_HOT",
    "NAMED_CONVERSATION_MIXES",
    "NAMED_MIXES",
    "PREFILL_HEAVY_MIX",
    "PlannedRequest",
    "RequestResult",
    "RetryPolicy",
    "RunResult",
    "TrafficClass",
    "ConversationMix",
    "ConversationPlan",
    "Dialogue",
    "add_arguments",
    "closed_schedule",
    "format_conversation_tables",
    "format_tables",
    "load_mix",
    "main",
    "parse_class",
    "plan_conversations",
    "poisson_schedule",
    "resolve_mix",
    "run_closed_loop",
    "run_conversations",
    "run_open_loop",
    "summarize_run",
    "summarize_turns",
    "trace_class",
    "trace_schedule",
    "write_json",
]
