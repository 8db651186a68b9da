"""The stream watcher: bytes unchanged, first token, usage, end markers, and linear cost."""

from __future__ import annotations

import time

from gateway.upstream.sse import OpenAIStreamWatcher, TgiStreamWatcher

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"word "}}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n'
DONE = b"data: [DONE]\n\n"


def feed_all(watcher: OpenAIStreamWatcher | TgiStreamWatcher, stream: bytes, size: int) -> bytes:
    out = b"".join(watcher.feed(stream[i : i + size]) for i in range(0, len(stream), size))
    return out + watcher.flush()


def test_any_chunking_gives_the_same_bytes_and_facts() -> None:
    stream = ROLE + TOKEN * 3 + USAGE + DONE
    for size in (1, 3, 7, 64, len(stream)):
        kept = OpenAIStreamWatcher(strip_usage=False)
        assert feed_all(kept, stream, size) == stream
        assert kept.first_token_seen and kept.done and kept.completion_tokens == 3
        stripped = OpenAIStreamWatcher(strip_usage=True)
        assert feed_all(stripped, stream, size) == ROLE + TOKEN * 3 + DONE
        assert stripped.completion_tokens == 3


def test_role_chunk_is_not_a_first_token() -> None:
    watcher = OpenAIStreamWatcher(strip_usage=False)
    watcher.feed(ROLE)
    assert not watcher.first_token_seen
    watcher.feed(TOKEN)
    assert watcher.first_token_seen


def test_crlf_framing_and_comments_pass_unchanged() -> None:
    stream = (ROLE + b": keep-alive\n\n" + TOKEN + DONE).replace(b"\n", b"\r\n")
    watcher = OpenAIStreamWatcher(strip_usage=True)
    assert feed_all(watcher, stream, 5) == stream
    assert watcher.first_token_seen and watcher.done


def test_big_buffers_cut_mid_event_cost_linear_time() -> None:
    """A slow client makes aiohttp hand over big buffers; they must not cost O(n^2)."""
    watcher = OpenAIStreamWatcher(strip_usage=True)
    watcher.feed(ROLE + TOKEN)
    timings = {}
    for events in (200, 2000):
        buffer = TOKEN * events + TOKEN[:20]  # ends mid-event
        started = time.perf_counter()
        for _ in range(5):
            out = watcher.feed(buffer)
            watcher.feed(TOKEN[20:])  # completes the cut event
        timings[events] = (time.perf_counter() - started) / 5
        assert out == TOKEN * events
    # 10x the events should cost ~10x the time; a quadratic scan costs ~100x.
    assert timings[2000] < 30 * timings[200] + 0.002, timings


def test_a_stream_without_event_ends_is_not_buffered_without_bound() -> None:
    watcher = OpenAIStreamWatcher(strip_usage=False)
    junk = b"x" * (1 << 20)
    assert watcher.feed(junk) == b""
    assert watcher.feed(b"y" * 10) == junk + b"y" * 10


def test_tgi_stream_first_token_final_details_and_errors() -> None:
    token = b'data:{"index":1,"token":{"id":1,"text":"a","special":false},"generated_text":null,"details":null}\n\n'
    final = b'data:{"index":2,"token":{"id":2,"text":"b","special":false},"generated_text":"ab","details":{"finish_reason":"length","generated_tokens":2}}\n\n'
    watcher = TgiStreamWatcher()
    assert feed_all(watcher, token + final, 9) == token + final
    assert watcher.first_token_seen and watcher.done and watcher.completion_tokens == 2
    failed = TgiStreamWatcher()
    failed.feed(b'data:{"error":"boom","error_type":"generation"}\n\n')
    assert failed.done and failed.backend_error


def test_a_fast_backends_last_buffer_is_read_only_from_its_usage_event() -> None:
    """Hundreds of token events then the usage chunk in one buffer: the token events are
    forwarded unread, the usage is still found and stripped, [DONE] still seen."""
    inspected: list[bytes] = []

    class Counting(OpenAIStreamWatcher):
        def _inspect(self, event: bytes) -> bool:
            inspected.append(event)
            return super()._inspect(event)

    watcher = Counting(strip_usage=True)
    watcher.feed(ROLE + TOKEN)
    inspected.clear()
    out = watcher.feed(TOKEN * 500 + USAGE + DONE)
    assert out == TOKEN * 500 + DONE
    assert inspected == [USAGE, DONE]
    assert watcher.done and watcher.completion_tokens == 3


def test_an_error_before_the_usage_is_still_read() -> None:
    error = b'data: {"error":{"message":"boom"}}\n\n'
    watcher = OpenAIStreamWatcher(strip_usage=False)
    watcher.feed(ROLE + TOKEN)
    assert watcher.feed(TOKEN * 3 + error + USAGE) == TOKEN * 3 + error + USAGE
    assert watcher.backend_error and watcher.completion_tokens == 3


def test_done_followed_by_a_comment_in_the_same_chunk_still_ends_the_stream() -> None:
    watcher = OpenAIStreamWatcher(strip_usage=False)
    watcher.feed(ROLE + TOKEN)
    stream = TOKEN * 40 + DONE + b": bye\n\n"
    assert watcher.feed(stream) == stream
    assert watcher.done


def test_events_after_the_first_token_in_the_first_chunk_are_not_read() -> None:
    """The first chunk of a fast backend holds the role, the first token and many more:
    once the first token has passed, the rest goes the boring way (usage still found)."""
    inspected: list[bytes] = []

    class Counting(OpenAIStreamWatcher):
        def _inspect(self, event: bytes) -> bool:
            inspected.append(event)
            return super()._inspect(event)

    watcher = Counting(strip_usage=True)
    out = watcher.feed(ROLE + TOKEN * 30 + USAGE + DONE)
    assert out == ROLE + TOKEN * 30 + DONE
    assert inspected == [ROLE, TOKEN, USAGE, DONE]
    assert watcher.first_token_seen and watcher.done and watcher.completion_tokens == 3


#: vLLM 0.32's last events, as it writes them: with `include_usage` its fingerprint is on
#: the usage chunk; without, on the finishing chunk (as the last member).
VLLM_FINISH = (
    b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gemma",'
    b'"choices":[{"index":0,"delta":{"content":" three"},"logprobs":null,'
    b'"finish_reason":"length","stop_reason":null,"token_ids":null}]}\n\n'
)
VLLM_USAGE = (
    b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gemma",'
    b'"choices":[],"usage":{"prompt_tokens":13,"total_tokens":18,"completion_tokens":5},'
    b'"system_fingerprint":"vllm-0.32.0-8e553bf1"}\n\n'
)
VLLM_FINISH_STAMPED = VLLM_FINISH.replace(
    b"}]}\n\n", b'}],"system_fingerprint":"vllm-0.32.0-8e553bf1"}\n\n'
)


def test_a_stripped_usage_chunks_fingerprint_goes_where_the_engine_puts_it_without() -> None:
    """The gateway asked for the usage, the client did not: it gets the bytes vLLM sends
    a client that did not, the fingerprint on the finishing chunk, in any chunking."""
    stream = ROLE + TOKEN * 4 + VLLM_FINISH + VLLM_USAGE + DONE
    for size in (1, 5, 64, 300, len(stream)):
        stripped = OpenAIStreamWatcher(strip_usage=True)
        out = b"".join(stripped.feed(stream[i : i + size]) for i in range(0, len(stream), size))
        assert out + stripped.release_held() + stripped.flush() == (
            ROLE + TOKEN * 4 + VLLM_FINISH_STAMPED + DONE
        ), size
        assert stripped.completion_tokens == 5 and stripped.done
        kept = OpenAIStreamWatcher(strip_usage=False)
        assert feed_all(kept, stream, size) == stream  # asked for: nothing moves


def test_a_finishing_event_is_held_only_until_the_next_event() -> None:
    watcher = OpenAIStreamWatcher(strip_usage=True)
    assert watcher.feed(ROLE + TOKEN) == ROLE + TOKEN
    assert watcher.feed(VLLM_FINISH) == b""  # what follows decides
    assert watcher.feed(DONE) == VLLM_FINISH + DONE  # no usage came: unchanged
    # A stream that ends after its finishing event (a backend gone) still delivers it.
    cut = OpenAIStreamWatcher(strip_usage=True)
    cut.feed(ROLE + TOKEN + VLLM_FINISH)
    assert cut.release_held() == VLLM_FINISH and cut.release_held() == b""
    # An engine that stamps every chunk (OpenAI's way) is not held at all.
    own = VLLM_FINISH_STAMPED
    assert OpenAIStreamWatcher(strip_usage=True).feed(ROLE + TOKEN + own) == ROLE + TOKEN + own
