"""The OCI image, for real: build it, run it, stream a completion from it.

Built with deploy/image/build.sh --local (a debootstrap base made once and kept,
wheels built here), run with `buildah run --isolation chroot --network host` (no
daemon, no cgroups v2 needed) on a free loopback port, with nothing configured, so
it fronts its built-in simulator, as `make run` does. Opt-in: `make test-image`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "localhost/llm-tail-gateway:latest"
UID = 10001

pytestmark = [pytest.mark.slow, pytest.mark.image, pytest.mark.timeout(900)]


def _need(binary: str, why: str) -> str:
    path = shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/usr/bin")
    if path is None or os.geteuid() != 0:
        text = f"{why} (needs root and `{binary}`: apt-get install -y buildah debootstrap)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{text}, and CI=true: CI must have it", pytrace=False)
        pytest.skip(text)
    return path


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _uids(pid: int) -> set[int]:
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("Uid:"))
    return {int(value) for value in line.split()[1:]}


def _gateway_pids() -> list[int]:
    """The image's `python -m gateway serve` processes (not the buildah wrapping them)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[:4] == [b"python", b"-m", b"gateway", b"serve"]:
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def image() -> str:
    buildah = _need("buildah", "the image test builds with buildah")
    _need("debootstrap", "the image test makes its base with debootstrap")
    built = subprocess.run(
        ["deploy/image/build.sh", "--local"],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    inspected = subprocess.run(
        [buildah, "inspect", "--type", "image", IMAGE],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    oci = json.loads(inspected.stdout)["OCIv1"]["config"]
    assert oci["User"] == f"{UID}:{UID}"
    assert oci["Entrypoint"] + oci["Cmd"] == ["python", "-m", "gateway", "serve"]
    assert "GATEWAY_SERVER_HOST=0.0.0.0" in oci["Env"]
    assert "GATEWAY_SERVER_PORT=8080" in oci["Env"]
    return buildah


@pytest.fixture
def container(image: str) -> Iterator[str]:
    name = f"gateway-image-test-{os.getpid()}"
    subprocess.run(
        [image, "from", "--name", name, IMAGE], capture_output=True, timeout=120, check=True
    )
    try:
        yield name
    finally:
        subprocess.run([image, "rm", name], capture_output=True, timeout=60)


def test_the_image_has_no_compiler_and_runs_as_its_user(image: str, container: str) -> None:
    found = subprocess.run(
        [
            image,
            "run",
            "--isolation",
            "chroot",
            container,
            "--",
            "sh",
            "-c",
            "id -u; for c in gcc cc g++ clang; do command -v $c; done; true",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert found.stdout.split() == [str(UID)], found.stdout


def test_the_image_streams_a_completion_from_its_simulator(image: str, container: str) -> None:
    port = _free_port()
    before = set(_gateway_pids())
    # The image's own command with the port moved off 8080 (a shared machine).
    run = subprocess.Popen(
        [
            image,
            "run",
            "--isolation",
            "chroot",
            "--network",
            "host",
            container,
            "--",
            "env",
            f"GATEWAY_SERVER_PORT={port}",
            "python",
            "-m",
            "gateway",
            "serve",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        ready = None
        while time.monotonic() < deadline and run.poll() is None:
            try:
                with urllib.request.urlopen(f"{base}/readyz", timeout=2) as answer:
                    ready = json.load(answer)
                    break
            except OSError:
                time.sleep(0.5)
        assert ready == {"status": "ready", "backends": ["simulator"]}, run.poll()

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=30, max_retries=0)
        stream = client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "Say something short."}],
            max_tokens=8,
            stream=True,
        )
        chunks = [chunk for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(chunks) >= 3 and text.strip()
        assert chunks[-1].choices[0].finish_reason in {"length", "stop"}

        pids = [pid for pid in _gateway_pids() if pid not in before]
        assert pids, "the gateway's process was not found"
        assert all(_uids(pid) == {UID} for pid in pids)
    finally:
        os.killpg(run.pid, signal.SIGTERM)
        try:
            output, _ = run.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            output, _ = run.communicate(timeout=30)
    # SIGTERM drains and exits; the log says it started on the port asked for.
    assert f'"url":"http://0.0.0.0:{port}"' in output.decode(errors="replace")
