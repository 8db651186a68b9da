"""[resume]: answers carried over to another backend when theirs fails mid-stream."""

from __future__ import annotations

from typing import Annotated

import msgspec

from gateway.config.constraints import PositiveFloat, rule


class ResumeSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """When a backend breaks off, stalls or is drained mid-answer, the answer goes on on
    another backend of its pool (`upstream/resume.py` says what can be and how)."""

    #: Resume answers at all. Off: a stream whose backend fails ends with an error event.
    enabled: bool = True
    #: Bytes of a stream's relayed events kept for a resume (the seam needs the text the
    #: client has). A longer answer is not resumed: its buffer is dropped at this size.
    buffer_bytes: Annotated[int, rule("be from 1024 to 67108864", ge=1024, le=64 << 20)] = (
        256 * 1024
    )
    #: Most times one answer is carried over (each to a backend it was not on).
    max_resumes: Annotated[int, rule("be from 1 to 8", ge=1, le=8)] = 2
    #: A stream silent, after its first token, for this many times the longest silence
    #: its backend's recent streams had (their 95th percentile, or its own longest so far
    #: if longer) is stalled: aborted, resumed elsewhere, its backend marked unhealthy
    #: until its checks pass. Never less than `stall_floor_s`, never more than
    #: [timeouts] idle_s.
    stall_multiple: Annotated[float, rule("be from 1 to 1000", ge=1, le=1000)] = 4.0
    stall_floor_s: PositiveFloat = 3.0
    #: Seconds a drained backend's streams may run on where they are
    #: (`POST /admin/backends/{name}/drain`); those still running then are carried over.
    drain_timeout_s: Annotated[float, rule("be from 0 to 3600", ge=0, le=3600)] = 30.0
