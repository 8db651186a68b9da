"""A real nginx (Debian's) running the shipped `config/nginx.conf`, for the tests.

The file under test is the shipped one: only its listen port, its upstream address
and, where a test says so, its `proxy_read_timeout` are replaced, by exact text that
must occur once (a change to the shipped file that moves them fails here, loudly,
instead of testing something else). nginx runs in the foreground from a prefix
directory of its own, as the unprivileged `nobody` when the tests run as root (as CI
does), so the test also proves that the file needs no root: every path it writes is
inside the prefix. It is stopped by its PID (SIGTERM to the master, which takes its
workers down), and the prefix removed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.ops.conftest import ROOT, require_binary

SHIPPED_CONFIG = ROOT / "config" / "nginx.conf"
#: The shipped file's text that the tests replace; each must occur exactly once.
LISTEN = "listen 8000;"
UPSTREAM = "server 127.0.0.1:8080;"
READ_TIMEOUT = "proxy_read_timeout 630s;"
#: Debian puts nginx in /usr/sbin, which a non-root PATH often lacks.
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")
#: The user nginx runs as when the tests run as root: Debian's `nobody`.
NOBODY_UID = 65534
NOBODY_GID = 65534
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


def nginx_binary() -> str:
    """nginx's path; skipped without it (failed under CI, see `require_binary`)."""
    path = shutil.which("nginx", path=os.pathsep.join([os.environ.get("PATH", ""), *SBIN_DIRS]))
    return path if path is not None else require_binary("nginx")


def render(
    *, listen_port: int, upstream: str, read_timeout: str | None = None, text: str | None = None
) -> str:
    """The shipped config with the test's port, upstream (host:port) and read timeout."""
    config = SHIPPED_CONFIG.read_text(encoding="utf-8") if text is None else text
    replacements = {LISTEN: f"listen 127.0.0.1:{listen_port};", UPSTREAM: f"server {upstream};"}
    if read_timeout is not None:
        replacements[READ_TIMEOUT] = f"proxy_read_timeout {read_timeout};"
    for old, new in replacements.items():
        count = config.count(old)
        assert count == 1, f"config/nginx.conf has {old!r} {count} times, not once"
        config = config.replace(old, new)
    return config


def _as_nobody() -> list[str]:
    """The command prefix that drops root to nobody (nothing when not root)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv") or require_binary("setpriv")
    return [setpriv, f"--reuid={NOBODY_UID}", f"--regid={NOBODY_GID}", "--clear-groups"]


def make_prefix(config: str) -> Path:
    """A fresh prefix directory holding `config` as nginx.conf, owned by nginx's user."""
    prefix = Path(tempfile.mkdtemp(prefix="gateway-nginx-"))
    (prefix / "nginx.conf").write_text(config, encoding="utf-8")
    if os.geteuid() == 0:
        for path in (prefix, prefix / "nginx.conf"):
            os.chown(path, NOBODY_UID, NOBODY_GID)
    return prefix


def check_syntax(binary: str, prefix: Path) -> subprocess.CompletedProcess[str]:
    """`nginx -t` on the prefix's config, as nginx's user."""
    command = [*_as_nobody(), binary, "-t", "-p", str(prefix), "-c", str(prefix / "nginx.conf")]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)


@dataclass
class RunningNginx:
    url: str
    port: int
    prefix: Path
    process: subprocess.Popen[bytes]

    def access_log(self) -> list[dict[str, Any]]:
        """The access log's JSON lines (the shipped `log_format gateway`)."""
        path = self.prefix / "access.log"
        if not path.exists():
            return []
        lines = path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def error_log(self) -> str:
        texts = []
        for name in ("error.log", "stderr.log"):
            path = self.prefix / name
            if path.exists():
                texts.append(path.read_text(encoding="utf-8", errors="replace"))
        return "\n".join(texts)

    def stop(self) -> None:
        """SIGTERM to the master (fast shutdown: it stops its workers), by PID."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=STOP_TIMEOUT_S)
        shutil.rmtree(self.prefix, ignore_errors=True)


def spawn(binary: str, prefix: Path) -> subprocess.Popen[bytes]:
    """nginx in the foreground on the prefix's config, its stderr in the prefix."""
    command = [
        *_as_nobody(),
        binary,
        "-p",
        str(prefix),
        "-c",
        str(prefix / "nginx.conf"),
        # Foreground: the PID we hold is the master's (the file's own default, a
        # daemon, is what a service manager with a pid file wants).
        "-g",
        "daemon off;",
    ]
    with open(prefix / "stderr.log", "wb") as stderr:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)


async def start_nginx(
    binary: str, *, listen_port: int, upstream: str, read_timeout: str | None = None
) -> RunningNginx:
    """nginx on 127.0.0.1:`listen_port` in front of `upstream`, ready to accept."""
    prefix = make_prefix(
        render(listen_port=listen_port, upstream=upstream, read_timeout=read_timeout)
    )
    process = spawn(binary, prefix)
    running = RunningNginx(f"http://127.0.0.1:{listen_port}", listen_port, prefix, process)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_TIMEOUT_S
    while loop.time() < deadline:
        if process.poll() is not None:
            log = running.error_log()
            running.stop()
            raise AssertionError(f"nginx exited with {process.returncode}:\n{log}")
        if _accepts(listen_port):
            return running
        await asyncio.sleep(0.05)
    log = running.error_log()
    running.stop()
    raise AssertionError(f"nginx did not listen within {START_TIMEOUT_S:g} s:\n{log}")


def _accepts(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex(("127.0.0.1", port)) == 0
