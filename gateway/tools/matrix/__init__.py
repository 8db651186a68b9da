"""`gateway matrix`: the gateway's defaults replayed on a matrix of engines, traffic mixes
and loads in virtual time, against direct and the ideal two-lane scheduler."""

from gateway.tools.matrix.cli import add_arguments, main

__all__ = ["add_arguments", "main"]
