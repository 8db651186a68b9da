"""The simulator's TGI native API over real HTTP on 127.0.0.1: shapes, errors, shared engine, aborts.

The wire format checked here is text-generation-inference's router (axum): `data:{json}`
events with no space and no `[DONE]`, the last one carrying `generated_text` and `details`,
422 `{"error", "error_type": "validation"}` refusals, and `/` answering a list.
`huggingface_hub.InferenceClient` is synchronous: it runs in a thread so the simulator's loop
(the test's own) keeps serving.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from gateway.admission.tokens import TokenCounter, completion_prompt_parts, load_encoding
from gateway.tools.simulator import tgi_api

StartSim = Callable[..., Awaitable[str]]
LONG_PROMPT = "hello " * 2000  # ~2000 tokens: ~1 s of prefill with the defaults
TOKEN_KEYS = {"id", "text", "logprob", "special"}


def tgi_body(inputs: str = "The simulator says", **parameters: Any) -> dict[str, Any]:
    return {"inputs": inputs, "parameters": parameters}


def parse_tgi_sse(raw: str) -> list[dict[str, Any]]:
    """TGI's framing exactly: `data:` with no space, blank line between events, no [DONE]."""
    assert raw.endswith("\n\n")
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data:{"), block
        events.append(json.loads(block[len("data:") :]))
    return events


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as resp:
        return await resp.json()


async def wait_for_stats(
    session: aiohttp.ClientSession, url: str, check: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2.0
    while True:
        snapshot = await get_json(session, f"{url}/sim/stats")
        if check(snapshot) or loop.time() > deadline:
            return snapshot
        await asyncio.sleep(0.02)


def count_prompt(text: str) -> int:
    counter = TokenCounter(load_encoding("cl100k_base"))
    try:
        return counter.count(completion_prompt_parts(text))
    finally:
        counter.close()


# --------------------------------------------------------------------------- /generate


async def test_generate_without_details(start_sim: StartSim, session: aiohttp.ClientSession):
    url = await start_sim()
    async with session.post(f"{url}/generate", json=tgi_body(max_new_tokens=4)) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("application/json")
        assert resp.headers["x-generated-tokens"] == "4"
        assert resp.headers["x-prompt-tokens"] == str(count_prompt("The simulator says"))
        assert resp.headers["x-compute-type"]
        data = await resp.json()
    assert set(data) == {"generated_text"}  # details only when asked
    assert len(data["generated_text"].split()) == 4


async def test_generate_with_details(start_sim: StartSim, session: aiohttp.ClientSession):
    url = await start_sim()
    body = tgi_body(max_new_tokens=5, details=True, do_sample=True, seed=42, stop=["x"],
                    unknown_knob={"ignored": True})  # fmt: skip
    async with session.post(f"{url}/generate", json=body) as resp:
        assert resp.status == 200
        data = await resp.json()
    assert set(data) == {"generated_text", "details"}
    details = data["details"]
    assert set(details) == {"finish_reason", "generated_tokens", "seed", "prefill", "tokens"}
    assert details["finish_reason"] == "length"
    assert details["generated_tokens"] == 5
    assert details["seed"] == 42
    assert details["prefill"] == []
    assert len(details["tokens"]) == 5
    for token in details["tokens"]:
        assert set(token) == TOKEN_KEYS
        assert token["special"] is False
        assert isinstance(token["id"], int) and token["logprob"] <= 0
    assert "".join(t["text"] for t in details["tokens"]) == data["generated_text"]

    # Greedy: no seed. decoder_input_details: the prompt's tokens, the first without logprob.
    # return_full_text: the prompt leads the text.
    body = tgi_body("Hello there world", max_new_tokens=2, decoder_input_details=True,
                    return_full_text=True)  # fmt: skip
    async with session.post(f"{url}/generate", json=body) as resp:
        data = await resp.json()
    details = data["details"]  # decoder_input_details alone turns details on, as in TGI
    assert details["seed"] is None
    prefill = details["prefill"]
    assert len(prefill) == count_prompt("Hello there world")
    assert "".join(t["text"] for t in prefill) == "Hello there world"
    assert prefill[0]["logprob"] is None and all(t["logprob"] < 0 for t in prefill[1:])
    assert data["generated_text"].startswith("Hello there world")
    assert data["generated_text"].endswith("".join(t["text"] for t in details["tokens"]))


async def test_max_new_tokens_default_and_prompt_count(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim(default_max_tokens=7, max_model_len=20)
    async with session.post(f"{url}/generate", json={"inputs": "a b c"}) as resp:
        assert resp.status == 200
        assert resp.headers["x-generated-tokens"] == "7"  # absent: the server-side default
    long_inputs = "one two three four five six seven eight nine ten eleven twelve thirteen"
    prompt = count_prompt(long_inputs)
    body = tgi_body(long_inputs, max_new_tokens=None, details=True)
    async with session.post(f"{url}/generate", json=body) as resp:
        data = await resp.json()
    # The default never overflows the window: it is capped by the room left.
    assert data["details"]["generated_tokens"] == min(7, 20 - prompt)
    records = (await get_json(session, f"{url}/sim/requests"))["requests"]
    assert [r["max_tokens"] for r in records] == [7, min(7, 20 - prompt)]
    assert [r["prompt_tokens"] for r in records] == [3, prompt]


# --------------------------------------------------------------------------- /generate_stream


async def test_generate_stream_shape(start_sim: StartSim, session: aiohttp.ClientSession):
    url = await start_sim()
    body = tgi_body(max_new_tokens=5, details=True)
    async with session.post(f"{url}/generate_stream", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-Accel-Buffering"] == "no"
        raw = await resp.text()
    assert "[DONE]" not in raw
    events = parse_tgi_sse(raw)
    assert len(events) == 5  # one event per token, nothing else
    assert [e["index"] for e in events] == [1, 2, 3, 4, 5]
    for event in events[:-1]:
        assert event["generated_text"] is None and event["details"] is None
        assert set(event["token"]) == TOKEN_KEYS
    last = events[-1]
    assert last["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert last["details"] == {
        "finish_reason": "length",
        "generated_tokens": 5,
        "seed": None,
        "input_length": count_prompt("The simulator says"),
    }

    async with session.post(f"{url}/generate_stream", json=tgi_body(max_new_tokens=2)) as resp:
        events = parse_tgi_sse(await resp.text())
    assert len(events) == 2
    assert events[-1]["details"] is None and events[-1]["generated_text"]


async def test_stream_events_leave_as_tokens_are_produced(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim(step_base_ms=40)  # ~40 ms between tokens
    loop = asyncio.get_running_loop()
    arrivals = []
    async with session.post(f"{url}/generate_stream", json=tgi_body(max_new_tokens=6)) as resp:
        async for line in resp.content:
            if line.startswith(b"data:"):
                arrivals.append(loop.time())
    assert len(arrivals) == 6
    assert arrivals[-1] - arrivals[0] > 0.1  # not buffered until the end


async def test_keep_alive_comment_while_waiting(
    start_sim: StartSim, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(tgi_api, "TGI_KEEP_ALIVE_S", 0.05)
    url = await start_sim(max_batch=1)
    hog = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
    hog_task = asyncio.create_task(session.post(f"{url}/v1/chat/completions", json=hog))
    await wait_for_stats(session, url, lambda s: s["running"] == 1)
    async with session.post(f"{url}/generate_stream", json=tgi_body(max_new_tokens=2)) as resp:
        raw = await resp.text()
    (await hog_task).release()
    assert raw.startswith(":\n\n")  # axum's empty comment while the request waited
    events = [b for b in raw.split("\n\n") if b.startswith("data:")]
    assert len(events) == 2


# --------------------------------------------------------------------------- /info and /


async def test_info(start_sim: StartSim, session: aiohttp.ClientSession):
    url = await start_sim(model="org/my-model", max_model_len=4096)
    info = await get_json(session, f"{url}/info")
    assert info["model_id"] == "org/my-model"
    assert info["max_total_tokens"] == 4096
    assert info["max_input_tokens"] == 4095
    # Its batch's KV tokens: the bound it was given (TGI's router reserves prompt +
    # max_new_tokens in it), posing as TGI its sequences at full context, else unsaid.
    assert "max_batch_total_tokens" not in info
    bounded = await start_sim(max_batch_tokens=20_000)
    assert (await get_json(session, f"{bounded}/info"))["max_batch_total_tokens"] == 20_000
    posing = await start_sim(pose_as="tgi", max_model_len=4096)
    assert (await get_json(session, f"{posing}/info"))["max_batch_total_tokens"] == 8 * 4096
    assert info["model_pipeline_tag"] == "text-generation"
    assert info["router"] == "text-generation-router"
    assert isinstance(info["version"], str)
    for key in ("max_concurrent_requests", "max_best_of", "max_stop_sequences",
                "validation_workers", "max_client_batch_size"):  # fmt: skip
        assert isinstance(info[key], int) and info[key] > 0
    assert {"model_sha", "sha", "docker_label"} <= set(info)


async def test_compat_route(start_sim: StartSim, session: aiohttp.ClientSession):
    url = await start_sim()
    async with session.post(f"{url}/", json=tgi_body("Hi", max_new_tokens=3)) as resp:
        assert resp.status == 200
        data = await resp.json()
    assert isinstance(data, list) and len(data) == 1  # `/` wraps the answer in a list
    # For a text-generation model TGI's `/` defaults return_full_text to true.
    assert data[0]["generated_text"].startswith("Hi")
    body = {**tgi_body("Hi", max_new_tokens=3, return_full_text=False), "stream": True}
    async with session.post(f"{url}/", json=body) as resp:
        events = parse_tgi_sse(await resp.text())
    assert len(events) == 3
    assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)
    records = (await get_json(session, f"{url}/sim/requests"))["requests"]
    assert [(r["route"], r["stream"]) for r in records] == [
        ("tgi_compat", False),
        ("tgi_compat", True),
    ]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (tgi_body(max_new_tokens=0), "`max_new_tokens` must be strictly positive"),
        (tgi_body(""), "`inputs` cannot be empty"),
        (tgi_body(max_new_tokens=40000), "`inputs` tokens + `max_new_tokens` must be <= 32768"),
        (tgi_body(stop=["a", "b", "c", "d", "e"]), "`stop` supports up to 4 stop sequences"),
        (tgi_body(temperature=0), "`temperature` must be strictly positive"),
        (tgi_body(top_p=1.0), "`top_p` must be > 0.0 and < 1.0"),
        (tgi_body(best_of=2), "you must use sampling when `best_of` is > 1"),
    ],
    ids=["max-new-tokens-0", "empty-inputs", "too-long", "stop-5", "temperature-0", "top-p-1",
         "best-of-greedy"],
)  # fmt: skip
async def test_validation_errors_are_422_with_tgi_shape(
    start_sim: StartSim, session: aiohttp.ClientSession, body: dict[str, Any], message: str
):
    url = await start_sim()
    async with session.post(f"{url}/generate", json=body) as resp:
        assert resp.status == 422
        data = await resp.json()
    assert set(data) == {"error", "error_type"}
    assert data["error_type"] == "validation"
    assert data["error"].startswith("Input validation error: " + message)
    snapshot = await get_json(session, f"{url}/sim/stats")
    assert (snapshot["received"], snapshot["rejected"], snapshot["submitted"]) == (1, 1, 0)
    (record,) = (await get_json(session, f"{url}/sim/requests"))["requests"]
    assert (record["outcome"], record["status"], record["error_code"]) == (
        "rejected",
        422,
        "validation",
    )


@pytest.mark.parametrize(
    ("raw", "content_type", "status", "prefix"),
    [
        (b"{not json", "application/json", 400, "Failed to parse the request body as JSON"),
        (b'{"parameters": {}}', "application/json", 422,
         "Failed to deserialize the JSON body into the target type: missing field `inputs`"),
        (b'{"inputs": 5}', "application/json", 422,
         "Failed to deserialize the JSON body into the target type: inputs: invalid type"),
        (b'{"inputs": "x", "parameters": {"max_new_tokens": -1}}', "application/json", 422,
         "Failed to deserialize the JSON body into the target type: parameters.max_new_tokens"),
        (b'{"inputs": "x"}', "text/plain", 415, "Expected request with `Content-Type: application/json`"),
    ],
    ids=["bad-json", "no-inputs", "inputs-not-string", "negative-max-new-tokens", "not-json-type"],
)  # fmt: skip
async def test_undeserializable_bodies_get_axums_plain_text_rejection(
    start_sim: StartSim,
    session: aiohttp.ClientSession,
    raw: bytes,
    content_type: str,
    status: int,
    prefix: str,
):
    url = await start_sim()
    for route in ("generate", "generate_stream"):  # before any streaming starts
        headers = {"Content-Type": content_type}
        async with session.post(f"{url}/{route}", data=raw, headers=headers) as resp:
            assert resp.status == status
            assert resp.headers["Content-Type"].startswith("text/plain")
            assert (await resp.text()).startswith(prefix)
    snapshot = await get_json(session, f"{url}/sim/stats")
    assert (snapshot["rejected"], snapshot["submitted"]) == (2, 0)


async def test_stream_validation_errors_are_in_band(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim()
    cases = [
        ("generate_stream", tgi_body("", max_new_tokens=3), "`inputs` cannot be empty"),
        ("generate_stream", tgi_body(decoder_input_details=True),
         "`decoder_input_details` == true is not supported when streaming tokens"),
        ("", {**tgi_body(max_new_tokens=0), "stream": True},
         "`max_new_tokens` must be strictly positive"),
    ]  # fmt: skip
    for route, body, message in cases:
        async with session.post(f"{url}/{route}", json=body) as resp:
            assert resp.status == 200  # TGI has answered before it validates
            (event,) = parse_tgi_sse(await resp.text())
        assert event == {"error": f"Input validation error: {message}", "error_type": "validation"}
    snapshot = await get_json(session, f"{url}/sim/stats")
    assert (snapshot["rejected"], snapshot["submitted"]) == (3, 0)


# --------------------------------------------------------------------------- engine


async def test_tgi_and_openai_requests_share_the_engine(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim()
    loop = asyncio.get_running_loop()

    async def tgi_ttft(request_id: str) -> float:
        start = loop.time()
        headers = {"x-request-id": request_id}
        body = tgi_body(max_new_tokens=3)
        async with session.post(f"{url}/generate_stream", json=body, headers=headers) as resp:
            line = b""
            while not line.startswith(b"data:"):
                line = await resp.content.readline()
            first = loop.time()
            await resp.read()
        return first - start

    alone = await tgi_ttft("tgi-alone")
    body = {"prompt": LONG_PROMPT, "max_tokens": 2}
    long_task = asyncio.create_task(session.post(f"{url}/v1/completions", json=body))
    await wait_for_stats(session, url, lambda s: s["running"] == 1)
    behind = await tgi_ttft("tgi-behind")
    (await long_task).release()

    assert alone < 0.3
    assert behind > 0.4 and behind > 4 * alone  # FCFS prefill: it waited for the OpenAI prompt
    records = {
        r["request_id"]: r for r in (await get_json(session, f"{url}/sim/requests"))["requests"]
    }
    record = records["tgi-behind"]
    assert (record["route"], record["stream"], record["max_tokens"]) == (
        "tgi_generate_stream",
        True,
        3,
    )
    assert record["model"] == "sim-model"
    assert record["outcome"] == "completed" and record["completion_tokens"] == 3
    long_record = next(r for r in records.values() if r["route"] == "completions")
    assert record["first_token"] >= long_record["first_token"]


async def test_disconnect_mid_stream_aborts_the_sequence(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim()
    body = tgi_body(max_new_tokens=2000)  # ~11 s if it ran to the end
    async with session.post(f"{url}/generate_stream", json=body) as resp:
        seen = 0
        async for line in resp.content:
            seen += line.startswith(b"data:")
            if seen >= 5:
                break
        resp.close()
    snapshot = await wait_for_stats(session, url, lambda s: s["aborted"] == 1 and not s["running"])
    assert (snapshot["aborted"], snapshot["running"], snapshot["completed"]) == (1, 0, 0)
    (record,) = (await get_json(session, f"{url}/sim/requests"))["requests"]
    assert record["outcome"] == "aborted"
    assert 4 <= record["completion_tokens"] < 2000


async def test_disconnect_while_waiting_aborts_a_non_streamed_generate(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    url = await start_sim()
    timeout = aiohttp.ClientTimeout(total=0.3)
    with pytest.raises(asyncio.TimeoutError):
        body = tgi_body(LONG_PROMPT, max_new_tokens=5)
        async with session.post(f"{url}/generate", json=body, timeout=timeout) as resp:
            await resp.read()
    snapshot = await wait_for_stats(session, url, lambda s: s["aborted"] == 1 and not s["running"])
    assert (snapshot["aborted"], snapshot["running"], snapshot["waiting"]) == (1, 0, 0)
    assert snapshot["prefilled_tokens"] < 2000  # the prefill stopped with the client


# --------------------------------------------------------------------------- huggingface_hub


async def test_huggingface_hub_inference_client(start_sim: StartSim):
    hub = pytest.importorskip("huggingface_hub")
    url = await start_sim()

    def run() -> dict[str, Any]:
        client = hub.InferenceClient(base_url=url)
        stream = list(client.text_generation("Tell me", max_new_tokens=4, stream=True))
        detailed = list(
            client.text_generation("Tell me", max_new_tokens=3, stream=True, details=True)
        )
        output = client.text_generation(
            "Tell me", max_new_tokens=2, details=True, return_full_text=False
        )
        with pytest.raises(hub.errors.ValidationError, match="cannot be empty"):
            list(client.text_generation("", max_new_tokens=2, stream=True))
        return {"stream": stream, "detailed": detailed, "output": output}

    result = await asyncio.to_thread(run)
    assert len(result["stream"]) == 4
    assert all(isinstance(t, str) and t.endswith(" ") for t in result["stream"])

    detailed = result["detailed"]
    assert len(detailed) == 3
    assert [d.index for d in detailed] == [1, 2, 3]
    assert all(d.details is None for d in detailed[:-1])
    last = detailed[-1]
    assert last.details.finish_reason == "length"
    assert last.details.generated_tokens == 3
    assert last.details.input_length == count_prompt("Tell me")
    # InferenceClient(base_url) posts to TGI's `/`, where return_full_text defaults to true.
    assert last.generated_text == "Tell me" + "".join(d.token.text for d in detailed)

    output = result["output"]
    assert output.details.generated_tokens == 2
    assert output.generated_text == "".join(t.text for t in output.details.tokens)
