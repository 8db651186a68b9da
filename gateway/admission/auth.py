"""Client API keys: who is calling, and which lanes they may use.

Keys are looked up by their SHA-256 so a lookup takes the same time whatever
the key; the key itself never reaches a log line (its `name` does).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from gateway.config import ApiKeySettings, LaneSettings
from gateway.outcomes import InvalidLane, LaneNotAllowed, Unauthorized

BEARER = "bearer "


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ClientKeys:
    def __init__(self, keys: Sequence[ApiKeySettings]) -> None:
        self._by_digest = {_digest(k.key): k for k in keys}

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    def identify(self, authorization: str | None) -> ApiKeySettings | None:
        """The caller's key; None when keys are off; 401 when on and missing or wrong."""
        if not self._by_digest:
            return None
        if not authorization or not authorization.lower().startswith(BEARER):
            raise Unauthorized("This gateway needs an API key: send 'Authorization: Bearer <key>'.")
        client = self._by_digest.get(_digest(authorization[len(BEARER) :].strip()))
        if client is None:
            raise Unauthorized("Incorrect API key provided.")
        return client


def lane_override(
    client: ApiKeySettings | None, requested: str | None, lanes: Sequence[LaneSettings]
) -> LaneSettings | None:
    """The lane named by X-Gateway-Lane, if this client may choose; None otherwise."""
    if not requested or client is None or not client.allow_lane_override:
        return None
    for lane in lanes:
        if lane.name == requested:
            return lane
    raise InvalidLane(
        f"X-Gateway-Lane names no lane; lanes: {', '.join(lane.name for lane in lanes)}.",
        param="X-Gateway-Lane",
    )


def check_lane_allowed(client: ApiKeySettings | None, lane: LaneSettings) -> None:
    if client is not None and client.lanes is not None and lane.name not in client.lanes:
        raise LaneNotAllowed(
            f"This request belongs in the '{lane.name}' lane, which this API key may not use "
            f"(it may use: {', '.join(client.lanes) or 'none'}).",
        )
