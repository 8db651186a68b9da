"""The door on a real `python -m gateway serve` process: slow clients cannot hold it.

A client that trickles its header lines is closed at `header_timeout_s` (counted in
/metrics), an idle kept-alive one at `keepalive_timeout_s`; bodies and streams that
take longer than the header deadline are not cut; a busy port is one line, exit 2.
The clients are raw sockets (a trickle is what no HTTP client library sends) and aiohttp.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import StartSimulator, chat, free_port, sse_events, wait_ready

ROOT = Path(__file__).resolve().parents[2]
#: The start of a request whose headers never end (a header line follows every 0.5 s).
REQUEST_START = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n"


def gateway_env() -> dict[str, str]:
    """This environment without GATEWAY_* (each test's config says what it tests)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}


@contextlib.asynccontextmanager
async def gateway_process(
    tmp_path: Path, backend: str, http: aiohttp.ClientSession, server: str
) -> AsyncIterator[str]:
    """A gateway process in front of `backend`, with these `[server]` lines; its URL."""
    port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[server]\n{server}\n\n[health]\nprobe_on_start = false\n\n[[backends]]\nurl = "{backend}"\n'
    )
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", str(port)),
        cwd=ROOT,
        env=gateway_env(),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(http, url)
        yield url
    finally:
        process.kill()  # its own child: by the handle, not by name
        await process.wait()


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def seconds_until_closed(reader: asyncio.StreamReader, within_s: float) -> float | None:
    """Seconds until the gateway closes the connection (EOF or reset); None: still open."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        async with asyncio.timeout(within_s):
            while await reader.read(4096):
                pass
    except TimeoutError:
        return None
    except ConnectionError:
        pass
    return loop.time() - start


async def trickle_headers(writer: asyncio.StreamWriter, interval_s: float = 0.5) -> None:
    """One more header line every `interval_s`, never the blank line that ends them."""
    try:
        for n in range(1000):
            writer.write(b"X-Trickle-%d: still coming\r\n" % n)
            await writer.drain()
            await asyncio.sleep(interval_s)
    except ConnectionError:
        pass  # closed by the gateway


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """Status and body of one HTTP/1.1 answer with a Content-Length."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(
        int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:")
    )
    return int(lines[0].split()[1]), await reader.readexactly(length)


async def closed_count(http: aiohttp.ClientSession, url: str, reason: str) -> float:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    sample = f'gateway_connections_closed_total{{reason="{reason}"}} '
    return sum(float(line[len(sample) :]) for line in text.splitlines() if line.startswith(sample))


@pytest.mark.parametrize("uvloop", ["true", "false"])
async def test_a_client_trickling_its_headers_is_closed_at_the_deadline(
    uvloop: str, start_simulator_at: StartSimulator, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    server = f"header_timeout_s = 2\nuvloop = {uvloop}"
    async with gateway_process(tmp_path, await start_simulator_at(), http, server) as url:
        reader, writer = await connect(url)
        writer.write(REQUEST_START)
        trickle = asyncio.create_task(trickle_headers(writer))
        closing = asyncio.create_task(seconds_until_closed(reader, within_s=8))
        # Meanwhile, a normal request on another connection is served.
        async with http.post(url + "/v1/chat/completions", json=chat(max_tokens=2)) as resp:
            assert resp.status == 200
        closed_after = await closing
        trickle.cancel()
        writer.close()
        assert closed_after is not None, "still open after 8 s"
        assert 1.5 <= closed_after <= 6
        assert await closed_count(http, url, "header_timeout") == 1


async def test_with_the_deadline_off_a_trickling_client_is_not_closed(
    start_simulator_at: StartSimulator, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    server = "header_timeout_s = 0"
    async with gateway_process(tmp_path, await start_simulator_at(), http, server) as url:
        reader, writer = await connect(url)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n")
        trickle = asyncio.create_task(trickle_headers(writer))
        assert await seconds_until_closed(reader, within_s=3) is None
        trickle.cancel()
        writer.write(b"\r\n")  # the headers end at last: the connection still answers
        status, _ = await read_answer(reader)
        writer.close()
        assert status == 200
        assert await closed_count(http, url, "header_timeout") == 0


async def test_a_body_and_a_stream_longer_than_the_header_deadline_are_not_cut(
    start_simulator_at: StartSimulator, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    sim = await start_simulator_at(step_base_ms=20.0)  # 150 tokens: a 3 s stream
    async with gateway_process(tmp_path, sim, http, "header_timeout_s = 1") as url:
        start = time.monotonic()
        async with http.post(
            url + "/v1/chat/completions", json=chat(max_tokens=150, stream=True)
        ) as resp:
            assert resp.status == 200
            events = sse_events(await resp.read())
        assert time.monotonic() - start > 2
        assert events[-1] == "[DONE]"
        # A body that takes 2.4 s to arrive (its headers in time) is read, not cut.
        body = b'{"model": "sim-model", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}'
        reader, writer = await connect(url)
        writer.write(
            REQUEST_START
            + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        for piece in (body[:10], body[10:30], body[30:60], body[60:]):
            await asyncio.sleep(0.6)
            writer.write(piece)
        status, _ = await read_answer(reader)
        writer.close()
        assert status == 200
        assert await closed_count(http, url, "header_timeout") == 0


async def test_a_kept_alive_connection_times_the_next_headers_from_their_first_byte(
    start_simulator_at: StartSimulator, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    server = "header_timeout_s = 1.5\nkeepalive_timeout_s = 30"
    async with gateway_process(tmp_path, await start_simulator_at(), http, server) as url:
        reader, writer = await connect(url)
        writer.write(HEALTHZ)
        assert (await read_answer(reader))[0] == 200
        # Idle longer than the header deadline: idleness is keepalive_timeout's business.
        assert await seconds_until_closed(reader, within_s=2.5) is None
        writer.write(REQUEST_START)
        trickle = asyncio.create_task(trickle_headers(writer))
        closed_after = await seconds_until_closed(reader, within_s=8)
        trickle.cancel()
        writer.close()
        assert closed_after is not None and 1.0 <= closed_after <= 6
        assert await closed_count(http, url, "header_timeout") == 1


async def test_an_idle_kept_alive_connection_is_closed_after_keepalive_timeout(
    start_simulator_at: StartSimulator, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    server = "keepalive_timeout_s = 1"
    async with gateway_process(tmp_path, await start_simulator_at(), http, server) as url:
        reader, writer = await connect(url)
        writer.write(HEALTHZ)
        assert (await read_answer(reader))[0] == 200
        closed_after = await seconds_until_closed(reader, within_s=6)
        writer.close()
        assert closed_after is not None and 0.5 <= closed_after <= 4
        # wait_ready's own kept-alive connection may have been closed idle too.
        assert await closed_count(http, url, "keepalive_idle") >= 1
        assert await closed_count(http, url, "header_timeout") == 0


@pytest.mark.parametrize("uvloop", ["true", "false"])
async def test_serve_on_a_busy_port_says_so_in_one_line_and_exits_2(
    uvloop: str, start_simulator_at: StartSimulator, tmp_path: Path
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        f"[server]\nuvloop = {uvloop}\n\n[health]\nprobe_on_start = false\n\n"
        f'[[backends]]\nurl = "{await start_simulator_at()}"\n'
    )
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "gateway", "serve", "--config", str(config)),
            *("--port", str(port)),
            cwd=ROOT,
            env=gateway_env(),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            _, stderr = await asyncio.wait_for(process.communicate(), 30)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    text = stderr.decode()
    assert "Traceback" not in text and "Unclosed" not in text, text
    assert text.splitlines() == [
        f"startup error: cannot listen on 127.0.0.1:{port}: address already in use"
    ]
    assert process.returncode == 2
