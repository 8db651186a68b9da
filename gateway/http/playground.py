"""GET /playground: a one-file chat page that streams through this gateway (off by default).

It shows, under each reply, what an SRE asks first about a slow answer: its lane, the
queue wait the gateway measured, and the time to first token and tokens per second the
browser saw. The page is shipped as package data and has no external assets, so it
works on a machine with no internet. Its Content-Security-Policy allows exactly its own
inline script and style (by hash) and calls to this origin only.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.resources
import re

from aiohttp import web

PAGE_PATH = "/playground"
_INLINE = re.compile(r"<(script|style)>(.*?)</\1>", re.DOTALL)


def load_page() -> bytes:
    return importlib.resources.files("gateway.http").joinpath("playground.html").read_bytes()


def content_security_policy(page: bytes) -> str:
    """The page's own inline blocks by hash, fetches to this origin, nothing else."""
    hashes: dict[str, list[str]] = {"script": [], "style": []}
    for kind, body in _INLINE.findall(page.decode("utf-8")):
        digest = base64.b64encode(hashlib.sha256(body.encode("utf-8")).digest()).decode()
        hashes[kind].append(f"'sha256-{digest}'")
    return "; ".join(
        [
            "default-src 'none'",
            f"script-src {' '.join(hashes['script'])}",
            f"style-src {' '.join(hashes['style'])}",
            "connect-src 'self'",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )


def install(app: web.Application, enabled: bool) -> None:
    """Serve the page at /playground when `enabled`; without it the path is a 404."""
    if not enabled:
        return
    page = load_page()
    headers = {
        "Content-Security-Policy": content_security_policy(page),
        "X-Content-Type-Options": "nosniff",
        "Cache-Control": "no-cache",
    }

    async def playground(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/html", charset="utf-8", headers=headers)

    app.router.add_get(PAGE_PATH, playground)
