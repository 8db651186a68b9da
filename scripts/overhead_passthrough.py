#!/usr/bin/env python3
"""The floor for any aiohttp proxy: stream the backend's bytes to the client, nothing else.

No parsing, no admission, no timeouts, no log line: one keep-alive client
session, `iter_any()` from the backend, `write()` to the client. What the
gateway costs beyond this is what its features cost; what this costs beyond
the backend directly is what aiohttp costs. Runs on asyncio's own loop unless
`--uvloop` (the gateway runs on uvloop by default, `[server] uvloop`; the
benchmarks start this one without it).

    python scripts/overhead_passthrough.py --port 8081 --backend http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

FORWARDED = ("Content-Type", "Accept", "Authorization", "X-Request-Id")
BACKEND = web.AppKey("backend", str)
SESSION = web.AppKey("session", aiohttp.ClientSession)


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    headers = {k: v for k in FORWARDED if (v := request.headers.get(k)) is not None}
    url = request.app[BACKEND] + request.path_qs
    async with request.app[SESSION].request(
        request.method, url, data=body, headers=headers
    ) as upstream:
        response = web.StreamResponse(status=upstream.status)
        response.content_type = upstream.content_type
        await response.prepare(request)
        async for data in upstream.content.iter_any():
            await response.write(data)
        await response.write_eof()
        return response


async def session_lifecycle(app: web.Application) -> AsyncIterator[None]:
    app[SESSION] = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None),
        auto_decompress=False,
    )
    yield
    await app[SESSION].close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8081)
    parser.add_argument("--backend", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop (if installed)")
    args = parser.parse_args()
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app[BACKEND] = args.backend.rstrip("/")
    app.cleanup_ctx.append(session_lifecycle)
    app.router.add_route("*", "/{tail:.*}", forward)
    loop = None
    if args.uvloop:
        try:
            import uvloop

            loop = uvloop.new_event_loop()
        except ImportError:
            pass
    web.run_app(
        app,
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        backlog=2048,
        handler_cancellation=True,
        loop=loop,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
