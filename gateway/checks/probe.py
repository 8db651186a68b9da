"""`check-config --probe`: each backend asked what it is and timed, before any traffic."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from typing import Any

from gateway.config import Settings


def probe_backends(settings: Settings) -> int:
    """`check-config --probe`: what each backend says and how fast it prefills, printed as
    JSON, and a warning for each lane whose deadline is below the measured engine floor."""
    if not settings.backends:
        print("note: no backend to probe", file=sys.stderr)
        return 0
    report = asyncio.run(_probe(settings))
    print(json.dumps({"probe": report}, indent=2))
    for lane in report["lanes"]:
        floor = lane["engine_floor_s"]
        if floor is not None and floor > lane["configured_timeout_s"]:
            print(
                f"warning: lane '{lane['lane']}': queue_timeout_s {lane['configured_timeout_s']:g} s "
                f"is below the measured engine floor {floor:.2f} s (one long prefill ahead plus "
                f"its own); the deadline in force is {lane['deadline_s']:.2f} s",
                file=sys.stderr,
            )
    return 0


async def _probe(settings: Settings) -> dict[str, Any]:
    import aiohttp

    from gateway.app import build_app
    from gateway.state import GATEWAY
    from gateway.upstream.telemetry import fetch_listing, fetch_load

    state = build_app(settings, log_stream=io.StringIO())[GATEWAY]
    timeout = aiohttp.ClientTimeout(total=settings.health.timeout_s)
    backends: list[dict[str, Any]] = []
    lanes: list[dict[str, Any]] = []
    await state.reloader.start()  # `[[backends]] dns` names resolved: their addresses
    await state.reloader.stop()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for each in state.pools.pools:
            for backend in each.pool.backends:
                load = await fetch_load(session, backend.url, backend.auth_headers)
                each.sizer.apply_load(backend, load)
                if backend.served.from_engine:  # what a health check would read
                    listing = await fetch_listing(session, backend.url, backend.auth_headers)
                    configured = backend.engine if backend.engine_configured else None
                    backend.served.note(listing, configured)
            await each.sizer.warm_up(session)
            for described in each.sizer.describe():
                described["pool"] = each.name
                if each.serves:  # the config's list; else what its engine said (`serves`)
                    described["serves"] = sorted(each.serves)
                backends.append(described)
            lanes += [{**lane, "pool": each.name} for lane in each.sizer.describe_lanes()]
    for each in state.pools.pools:  # those DNS brought in run their checks
        await each.health.stop()
    state.counter.close()
    return {"backends": backends, "lanes": lanes}
