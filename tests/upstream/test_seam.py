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


def test_a_seam_after_a_space_goes_on_from_the_word_and_the_space_is_not_written_twice() -> None:
    """Seen on the real vLLM: at a seam after "hundred: " the other engine (sent the text,
    which its chat template trims) went on with " 1", and the client read a double space.
    The text is sent without its trailing whitespace; the continuation's, which the
    client has already, is dropped, and a whitespace-only token is no token."""
    seam = read_openai_seam(chunk("", role=True) + chunk("Count") + chunk(" to: ") + chunk("\n "))
    assert (seam.sent_text, seam.held_back) == ("Count to:", " \n ")
    stream = OpenAIContinuation(seam, strip_usage=True)
    out = stream.feed(chunk(" ", id_="b") + chunk("\n 1", id_="b") + chunk(" 2", id_="b"))
    texts = [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in out.split(b"\n\n") if e]
    assert texts == ["1", " 2"] and stream.tokens == 2
    assert seam.text + "".join(texts) == "Count to: \n 1 2"


def test_whitespace_the_engine_writes_differently_at_the_seam_is_kept() -> None:
    seam = read_openai_seam(chunk("A") + chunk(" list: "))
    stream = OpenAIContinuation(seam, strip_usage=True)
    out = stream.feed(chunk("\n- a", id_="b") + chunk(" b", id_="b"))
    texts = [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in out.split(b"\n\n") if e]
    assert texts == ["\n- a", " b"]  # not the held space: the engine's own, kept
    # A text of whitespace alone is sent as it is (nothing to go on from otherwise).
    blank = read_openai_seam(chunk("\n") + chunk("\n"))
    assert (blank.sent_text, blank.held_back) == ("\n\n", "")


def test_a_tgi_seam_after_a_space_heals_tokens_and_generated_text() -> None:
    def tgi(index: int, text: str, final: str | None = None) -> bytes:
        token = {"id": 1, "text": text, "logprob": -1.0, "special": False}
        body = {"index": index, "token": token, "generated_text": final, "details": None}
        return b"data:" + json.dumps(body).encode() + b"\n\n"

    seam = read_tgi_seam(tgi(1, "Paris") + tgi(2, " is "))
    assert seam.sent_text == "Paris is"
    stream = TgiContinuation(seam, strip_usage=False)
    out = stream.feed(tgi(1, " big") + tgi(2, ".", " big."))
    first, last = (json.loads(e[5:]) for e in out.split(b"\n\n") if e)
    assert first["token"]["text"] == "big" and last["generated_text"] == "Paris is big."


def test_the_continuation_request_is_sent_the_text_without_its_trailing_space() -> None:
    from gateway.dialects.openai import ChatDialect, CompletionDialect
    from gateway.dialects.tgi import TgiDialect

    seam = read_openai_seam(chunk("one") + chunk(" hundred: "))
    chat = ChatDialect("/v1/chat/completions").continuation(
        {"messages": [{"role": "user", "content": "q"}]}, seam, 9, "vllm"
    )
    assert chat is not None and chat["messages"][-1]["content"] == "one hundred:"
    completion = CompletionDialect("/v1/completions").continuation(
        {"prompt": "q "}, seam, 9, "vllm"
    )
    assert completion is not None and completion["prompt"] == "q one hundred:"
    tgi = TgiDialect("/generate_stream", stream=True).continuation({"inputs": "q "}, seam, 9, "tgi")
    assert tgi is not None and tgi["inputs"] == "q one hundred:"
