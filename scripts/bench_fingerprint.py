#!/usr/bin/env python3
"""What remembering a request costs on the hot path: its fingerprint, arrival and end.

Issue #27 asks that retries be seen without slowing every request. Per body size
(1, 10 and 100 KB, the JSON a chat request carries), the time of `fingerprint()` (the
hash of the bytes and of the sender) and of a memory's `arrive` + `end` with the
memory full (100 000 entries: every call also evicts), next to the hashes the
standard library offers for the same bytes.

    python scripts/bench_fingerprint.py
"""

from __future__ import annotations

import hashlib
import os
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.admission.retries import RetryMemory, fingerprint  # noqa: E402

SIZES = (1_000, 10_000, 100_000)
FULL = 100_000


def per_call_us(fn: object, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6  # type: ignore[arg-type]


def full_memory() -> RetryMemory:
    memory = RetryMemory(60.0, FULL)
    for i in range(FULL):
        fp = fingerprint(b"filler %d" % i, client=None, tenant="t")
        seen, _ = memory.arrive(fp, f"r{i}", 0.0)
        memory.end(seen, "ok", None, "interactive", 0.0)
    return memory


def measure(size: int, memory: RetryMemory, start: float) -> tuple[float, ...]:
    """µs per call: fingerprint, arrive + end, blake2b, SHA-256 (the copy's time taken off)."""
    bodies = [bytearray(os.urandom(size)) for _ in range(64)]
    n = 2000 if size < 100_000 else 200
    index = [0]
    clock = [start]

    def fresh() -> bytes:
        # A new bytes object each call: hash() caches its value on the object.
        index[0] += 1
        return bytes(bodies[index[0] % 64])

    def fingerprint_of_fresh() -> None:
        fingerprint(
            fresh(),
            client=None,
            tenant="team-a",
            peer="127.0.0.1",
            request_id="client-id-0001",
        )

    fp = fingerprint(bytes(bodies[0]), client=None, tenant="team-a", request_id="x")

    def arrive_end() -> None:
        clock[0] += 1e-4
        seen, _ = memory.arrive(fp, "rid", clock[0])
        memory.end(seen, "ok", None, "interactive", clock[0])

    copy_us = per_call_us(fresh, n)
    return (
        per_call_us(fingerprint_of_fresh, n) - copy_us,
        per_call_us(arrive_end, n),
        per_call_us(lambda: hashlib.blake2b(fresh(), digest_size=8).digest(), n) - copy_us,
        per_call_us(lambda: hashlib.sha256(fresh()).digest(), n) - copy_us,
    )


def main() -> int:
    memory = full_memory()
    print(
        f"{'body':>8} {'fingerprint':>12} {'arrive+end':>11} {'blake2b-8':>10} {'sha256':>8}  (µs)"
    )
    for i, size in enumerate(SIZES):
        fp_us, mem_us, blake_us, sha_us = measure(size, memory, 1.0 + i * 10.0)
        print(
            f"{size // 1000:>6}KB {fp_us:>12.2f} {mem_us:>11.2f} {blake_us:>10.2f} {sha_us:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
