"""The built-in simulator ends with the gateway that started it, even on a SIGKILL.

`serve` with no backend runs `gateway simulate` as a child; a SIGKILL leaves `serve` no
chance to stop it, so the kernel must (`gateway/tools/child.py`, PR_SET_PDEATHSIG). The
child is found and watched through /proc, by PID and start time (a PID may be reused,
and an orphan nobody reaps stays a zombie, which counts as ended): Linux only.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import free_port, wait_ready
from tests.helpers import eventually
from tests.integration.test_shutdown import served_gateway

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's"
)

#: How long the orphaned simulator may take to stop after the kernel's SIGTERM.
CHILD_GONE_WITHIN_S = 10.0


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields from the state on (the name may hold spaces); None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2 :].split()


def children(parent: int) -> list[int]:
    """Every process whose parent is `parent` (read from each /proc/<pid>/stat)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(int(entry.name))
        if fields is not None and int(fields[1]) == parent:
            found.append(int(entry.name))
    return found


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except (FileNotFoundError, ProcessLookupError):
        return []


def running(pid: int, started: str) -> bool:
    """The process that had start time `started` still runs (not exited, not a zombie)."""
    fields = stat_fields(pid)
    # fields[0] is the state, fields[19] the start time (stat's 3rd and 22nd fields).
    return fields is not None and fields[19] == started and fields[0] != "Z"


async def simulator_child(gateway: int, within_s: float = 5.0) -> tuple[int, str]:
    """The PID and start time of `gateway`'s `gateway simulate` child."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while loop.time() < deadline:
        for pid in children(gateway):
            fields = stat_fields(pid)
            if fields is not None and "simulate" in cmdline(pid):
                return pid, fields[19]
        await asyncio.sleep(0.05)
    raise AssertionError(f"no `gateway simulate` child of {gateway} within {within_s:g} s")


async def test_sigkill_of_the_gateway_ends_its_simulator(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    config = tmp_path / "gateway.toml"
    # No backend: `serve` starts the simulator. No state file in the user's home.
    config.write_text('[health]\nstate_file = "off"\n')
    port = free_port()
    gateway = await served_gateway(config, port, tmp_path / "requests.jsonl")
    child: tuple[int, str] | None = None
    try:
        await wait_ready(http, f"http://127.0.0.1:{port}", timeout_s=30)
        child = await simulator_child(gateway.pid)
        pid, started = child
        assert running(pid, started)

        gateway.kill()
        assert await asyncio.wait_for(gateway.wait(), 10) == -signal.SIGKILL

        # The kernel's SIGTERM, then the simulator's own stop (its streams, its port).
        await eventually(lambda: not running(pid, started), within_s=CHILD_GONE_WITHIN_S)
    finally:
        if gateway.returncode is None:
            gateway.kill()
            await gateway.wait()
        if child is not None and running(*child):
            os.kill(child[0], signal.SIGKILL)
