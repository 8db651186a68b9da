"""The seam's bytes (`upstream/seam.py`): what the client had, and the continuation rewritten."""

from __future__ import annotations

import json
from typing import Any

from gateway.upstream.seam import (
    FINISHED,
    TOOL_CALLS,
    OpenAIContinuation,
    RelayedEvents,
    TgiContinuation,
    read_openai_seam,
    read_tgi_seam,
)
from gateway.upstream.sse import OpenAIStreamWatcher


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunk(content: str | None, *, id_: str = "a", created: int = 1, finish: str | None = None,
          role: bool = False) -> bytes:  # fmt: skip
    delta: dict[str, Any] = {"content": content}
    if role:
        delta["role"] = "assistant"
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return event({"id": id_, "created": created, "model": "m", "choices": [choice]})


def test_the_buffer_keeps_whole_events_up_to_its_limit_then_nothing() -> None:
    buffer = RelayedEvents(100)
    buffer.keep(b"x" * 60)
    buffer.keep(b"y" * 40)
    assert buffer.data() == b"x" * 60 + b"y" * 40 and not buffer.overflowed
    buffer.keep(b"z")
    assert buffer.overflowed and buffer.data() == b""
    buffer.keep(b"more")
    assert buffer.overflowed


def test_the_seam_is_the_text_the_tokens_and_the_first_parts_head() -> None:
    data = chunk("", role=True) + chunk("Hello") + chunk(" world") + b": keep-alive\n\n"
    seam = read_openai_seam(data)
    assert (seam.text, seam.tokens, seam.obstacle) == ("Hello world", 2, None)
    assert seam.head == {"id": "a", "created": 1, "model": "m"}  # (these chunks have no object)


def test_a_tool_call_or_a_finish_in_progress_is_an_obstacle() -> None:
    tool = event({"id": "a", "choices": [{"index": 0, "delta": {"tool_calls": [{"id": "t"}]}}]})
    assert read_openai_seam(chunk("x") + tool).obstacle == TOOL_CALLS
    assert read_openai_seam(chunk("x", finish="stop")).obstacle == FINISHED


def test_the_continuation_is_rewritten_into_the_first_answer() -> None:
    seam = read_openai_seam(chunk("", role=True) + chunk("Hello") + chunk(" big"))
    stream = OpenAIContinuation(seam, strip_usage=False)
    usage = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
    leg = (
        chunk("", id_="b", created=9, role=True)
        + chunk(" wide", id_="b", created=9)
        + chunk(" world", id_="b", created=9, finish="length")
        + event({"id": "b", "created": 9, "model": "m", "choices": [], "usage": usage})
        + b"data: [DONE]\n\n"
    )
    # Cut anywhere: only whole events come out.
    out = stream.feed(leg[:37]) + stream.feed(leg[37:])
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and stream.done
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert {(c["id"], c["created"]) for c in chunks} == {("a", 1)}
    assert [c["choices"][0]["delta"]["content"] for c in chunks[:2]] == [" wide", " world"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    assert stream.completion_tokens == 5 and stream.total_tokens == 4


def test_the_usage_the_client_did_not_ask_for_is_dropped_and_an_error_held() -> None:
    stream = OpenAIContinuation(read_openai_seam(chunk("a")), strip_usage=True)
    usage = event({"id": "b", "choices": [], "usage": {"completion_tokens": 1}})
    assert stream.feed(usage) == b""
    out = stream.feed(chunk("b") + event({"error": {"message": "boom"}}) + chunk("c"))
    assert [json.loads(e[6:])["choices"][0]["delta"] for e in out.split(b"\n\n") if e] == [
        {"content": "b"}
    ]
    assert stream.backend_error


def test_tgi_continuation_carries_index_and_generated_text() -> None:
    def tgi(index: int, text: str, final: str | None = None) -> bytes:
        token = {"id": 1, "text": text, "logprob": -1.0, "special": False}
        details = {"generated_tokens": index} if final is not None else None
        body = {"index": index, "token": token, "generated_text": final, "details": details}
        return b"data:" + json.dumps(body).encode() + b"\n\n"

    seam = read_tgi_seam(tgi(1, "Par") + tgi(2, "is"))
    assert (seam.text, seam.tokens, seam.index, seam.data_prefix) == ("Paris", 2, 2, b"data:")
    stream = TgiContinuation(seam, strip_usage=False)
    out = stream.feed(tgi(1, " is", None) + tgi(2, " big", " is big"))
    first, last = (json.loads(e[5:]) for e in out.split(b"\n\n") if e)
    assert out.startswith(b"data:{")
    assert (first["index"], last["index"]) == (3, 4)
    assert last["generated_text"] == "Paris is big" and last["details"]["generated_tokens"] == 4
    assert stream.done and stream.completion_tokens == 4


def test_the_watcher_holds_an_error_event_mid_answer_and_what_follows() -> None:
    watcher = OpenAIStreamWatcher()
    watcher.hold_errors = True
    error = event({"error": {"message": "engine died"}})
    out = watcher.feed(chunk("a") + chunk("b") + error + b"data: [DONE]\n\n")
    assert out == chunk("a") + chunk("b")
    assert watcher.held_error and not watcher.done


def test_a_continuation_repeating_the_clients_text_first_has_the_repeat_dropped() -> None:
    """llama.cpp's server streams the assistant message it continues before its new
    tokens (seen on the portable build `scripts/real_backend.sh` makes): the client must
    not read its answer so far twice. Its repeat ends with a space the text had not."""
    seam = read_openai_seam(chunk("", role=True) + chunk("1, 2,") + chunk(" 3,"))
    stream = OpenAIContinuation(seam, strip_usage=True)
    leg = (
        chunk(None, id_="b", role=True)
        + chunk("1, 2, 3, ", id_="b")
        + chunk("4", id_="b")
        + chunk(",", id_="b", finish="length")
        + b"data: [DONE]\n\n"
    )
    out = stream.feed(leg)
    texts = [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in out.split(b"\n\n")[:-2]]
    assert seam.text + "".join(texts) == "1, 2, 3, 4,"
    assert stream.tokens == 3  # " ", "4", ",": the repeat is no token of the answer


def test_a_new_token_beginning_like_the_answer_is_no_repeat() -> None:
    """The simulator answers a continuation with the words it began with: those are new
    tokens, one a delta, not the whole text repeated in one."""
    seam = read_openai_seam(chunk("The") + chunk(" cat"))
    stream = OpenAIContinuation(seam, strip_usage=True)
    out = stream.feed(chunk("The") + chunk(" cat") + chunk(" sat"))
    texts = [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in out.split(b"\n\n") if e]
    assert texts == ["The", " cat", " sat"] and stream.tokens == 3
