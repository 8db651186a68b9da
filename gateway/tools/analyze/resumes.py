"""Answers carried over mid-stream, in the log: how many, why, and which backends broke them.

A gateway that resumes answers (`upstream/resume.py`) marks each request line
with `resumes` (0 when none), `resumed_from` (the backends the answer left, in
order), `resume_reason` (`broken`, `stalled`, `drained`) and, for a stream whose
backend failed mid-answer but that could not be carried over, `resume_failed`
(why not: `request_shape`, `logprobs`, `unknown_engine`, `no_backend`,
`buffer_full`, ...). A backend named often in `resumed_from` for `broken` or
`stalled` is the one to look at (its engine's log, its GPU's Xid errors); many
`drained` are a rollout doing what it should.

Plain functions over plain dicts, like the rest of the analyzer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from gateway.tools.analyze.fields import Record

#: A log without this field comes from a gateway that did not resume answers.
RESUME_FIELD = "resumes"


def resume_analysis(records: Sequence[Record]) -> dict[str, Any]:
    """Every figure of the RESUMES section; `tagged` False for a log from before resumes."""
    tagged = any(RESUME_FIELD in record for record in records)
    resumed = [r for r in records if isinstance(r.get("resumes"), int) and r["resumes"] > 0]
    reasons: Counter[str] = Counter()
    broke: Counter[str] = Counter()
    drained: Counter[str] = Counter()
    for record in resumed:
        reason = record.get("resume_reason") or "broken"
        reasons[reason] += 1
        for backend in record.get("resumed_from") or ():
            (drained if reason == "drained" else broke)[str(backend)] += 1
    failed = Counter(str(r["resume_failed"]) for r in records if r.get("resume_failed") is not None)
    return {
        "tagged": tagged,
        "requests": len(records),
        "resumed": len(resumed),
        "carry_overs": sum(r["resumes"] for r in resumed),
        "resumed_ok": sum(1 for r in resumed if r.get("outcome") == "ok"),
        "reasons": dict(reasons.most_common()),
        "not_resumed": sum(failed.values()),
        "not_resumed_why": dict(failed.most_common()),
        #: The backends that broke or stalled streams, most first (drains apart).
        "broke_streams": dict(broke.most_common()),
        "drained_from": dict(drained.most_common()),
    }
