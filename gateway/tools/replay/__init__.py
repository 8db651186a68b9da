"""`gateway replay`: the same traffic, direct to the engines and through the gateway's own
scheduler, on one virtual clock (no sleeping, no sockets)."""

from gateway.tools.replay.cli import add_arguments, main

__all__ = ["add_arguments", "main"]
