"""LLM tail-latency gateway: token-budget lanes, fail-fast queues and SSE passthrough."""

__version__ = "0.1.0"
