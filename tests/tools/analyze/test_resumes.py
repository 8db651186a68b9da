"""The analyzer's RESUMES section: answers carried over, why, and the backends that broke them."""

from __future__ import annotations

from gateway.tools.analyze import analyze, format_report
from tests.tools.analyze.support import rec


def test_resumes_are_counted_and_the_backends_that_broke_streams_named() -> None:
    lines = [
        rec(resumes=0, resumed_from=None, resume_reason=None),
        rec(resumes=1, resumed_from=["b1"], resume_reason="broken"),
        rec(resumes=2, resumed_from=["b1", "b2"], resume_reason="stalled"),
        rec(resumes=1, resumed_from=["b3"], resume_reason="drained"),
        rec("interactive", "backend_error", resumes=0, resume_failed="logprobs"),
    ]
    analysis = analyze(lines)
    resumes = analysis["resumes"]
    assert (resumes["resumed"], resumes["carry_overs"], resumes["resumed_ok"]) == (3, 4, 3)
    assert resumes["reasons"] == {"broken": 1, "stalled": 1, "drained": 1}
    assert resumes["broke_streams"] == {"b1": 2, "b2": 1}
    assert resumes["drained_from"] == {"b3": 1}
    assert resumes["not_resumed_why"] == {"logprobs": 1}
    text = format_report(analysis)
    assert "RESUMES: 3 answers carried over mid-stream" in text
    assert "backends that broke or stalled streams: b1 2, b2 1" in text
    assert "not carried over (ended with an error event): 1 (logprobs 1)" in text


def test_a_log_from_before_resumes_keeps_its_shape() -> None:
    analysis = analyze([rec(), rec()])
    assert "resumes" not in analysis
    assert "RESUMES" not in format_report(analysis)
