"""A client's own deadline: `x-request-deadline-ms`, its budget for the first token.

A client that will give up after 3 s gains nothing from a gateway that queues
its request for 5 s: the answer would reach nobody and the slot would be spent
for nothing. With this header the request's queue deadline is the smaller of
its lane's and the client's (less the predicted prefill of its own prompt),
and a request that cannot make it is refused at once with 429 wait_too_long.
"""

from __future__ import annotations

from gateway.outcomes import InvalidRequest

DEADLINE_HEADER = "x-request-deadline-ms"
#: Longest deadline accepted: a day (a larger value is a mistake, not a deadline).
MAX_DEADLINE_MS = 86_400_000


def client_deadline_s(header: str | None) -> float | None:
    """The header's deadline in seconds; None without it; 400 when it is not a number of ms."""
    if header is None:
        return None
    text = header.strip()
    if not text.isdigit() or not text.isascii() or len(text) > 9:
        raise InvalidRequest(
            f"The {DEADLINE_HEADER} header must be a whole number of milliseconds "
            f"(1 to {MAX_DEADLINE_MS}).",
            param=DEADLINE_HEADER,
        )
    milliseconds = int(text)
    if not 1 <= milliseconds <= MAX_DEADLINE_MS:
        raise InvalidRequest(
            f"The {DEADLINE_HEADER} header must be between 1 and {MAX_DEADLINE_MS} ms.",
            param=DEADLINE_HEADER,
        )
    return milliseconds / 1000.0
