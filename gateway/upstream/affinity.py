"""Session affinity by rendezvous hashing: every replica picks the same backend for a key.

A conversation's turns should land where its history is cached. The first turn
of a conversation has no cached prefix anywhere, so without a rule each
replica of the gateway would place it differently; with rendezvous (highest
random weight) hashing of a client key against each backend's name, all
replicas agree without sharing any state, and when a backend goes away only
its own keys move (to their second choice), nobody else's.

The hash must be the same in every process (Python's `hash` of a string is
not), so it is BLAKE2b, cut to 64 bits.
"""

from __future__ import annotations

import hashlib

#: Header naming the conversation (or user) a request belongs to.
SESSION_HEADER = "x-session-id"
#: Longest session key used; longer ones are cut (a key is not a payload).
MAX_SESSION_KEY_CHARS = 256


def session_key(header: str | None, user: object, client: str | None) -> str | None:
    """The request's affinity key: `x-session-id`, else OpenAI's `user`, else the API key's
    name; None when there is none."""
    if header:
        return header[:MAX_SESSION_KEY_CHARS]
    if isinstance(user, str) and user:
        return "user:" + user[:MAX_SESSION_KEY_CHARS]
    if client:
        return "key:" + client
    return None


def rendezvous_weight(key: str, backend: str) -> int:
    """The key's weight on a backend; the highest among the candidates wins."""
    digest = hashlib.blake2b(f"{key}\x00{backend}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
