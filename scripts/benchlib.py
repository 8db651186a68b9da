"""Helpers the benchmark scripts share: free loopback ports and waiting for a server."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import aiohttp


def free_port() -> int:
    """A port nobody listens on right now, on 127.0.0.1."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def wait_ready(
    url: str, path: str, timeout_s: float = 30, check: Callable[[], None] | None = None
) -> None:
    """Poll `url + path` until it answers 200; `check` may raise when a child died."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if check is not None:
                check()
            try:
                async with session.get(url + path) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit(f"{url}{path} did not answer 200 within {timeout_s:g} s")
