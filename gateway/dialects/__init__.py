"""The APIs the gateway speaks, one `Dialect` each; routes are a path and a dialect."""

from gateway.dialects.base import Dialect
from gateway.dialects.openai import ChatDialect, CompletionDialect
from gateway.dialects.tgi import TgiDialect

__all__ = ["ChatDialect", "CompletionDialect", "Dialect", "TgiDialect"]
