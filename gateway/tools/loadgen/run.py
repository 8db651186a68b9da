"""Open- and closed-loop runs: one session, one clock, a progress bar, results in order.

Open-loop runs fire each request at its planned time whether or not earlier
answers came back, so a slow server cannot slow the offered load down and hide
its own tail; the connector has no connection limit for the same reason.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import aiohttp
from tqdm import tqdm

from gateway.tools.loadgen.client import Client, RequestResult, RetryPolicy, RunResult
from gateway.tools.loadgen.conversations import ConversationPlan, Dialogue, PlannedConversation
from gateway.tools.loadgen.mix import PlannedRequest

#: Sends one planned request (with a conversation's messages, when given) and records
#: its result, which it also returns.
_Send = Callable[..., Coroutine[Any, Any, RequestResult]]


def _session() -> aiohttp.ClientSession:
    # limit=0: an open-loop run opens as many connections as it has requests in flight, so
    # the client never queues requests itself and hides the server's queue.
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))


def _progress_bar(total: int, target: str, enabled: bool) -> Any:
    return tqdm(
        total=total,
        desc=target,
        unit="req",
        file=sys.stderr,
        disable=not enabled,
        leave=False,
        mininterval=0.25,
        dynamic_ncols=True,
    )


async def _run(
    target: str,
    total: int,
    drive: Callable[[Client, _Send], Awaitable[None]],
    *,
    retry: RetryPolicy,
    timeout_s: float,
    model: str,
    extra_body: dict[str, Any] | None,
    progress: bool,
) -> RunResult:
    run_tag = str(secrets.randbelow(900_000) + 100_000)
    results: list[RequestResult] = []
    async with _session() as session:
        client = Client(
            session,
            target,
            retry=retry,
            timeout_s=timeout_s,
            model=model,
            extra_body=extra_body,
            run_tag=run_tag,
        )
        bar = _progress_bar(total, target, progress)
        failed = 0

        async def one(
            planned: PlannedRequest, messages: list[dict[str, str]] | None = None
        ) -> RequestResult:
            nonlocal failed
            result = await client.send(planned, messages)
            results.append(result)
            failed += not result.ok
            bar.update(1)
            if failed:
                bar.set_postfix(failed=failed, refresh=False)
            return result

        try:
            await drive(client, one)
        finally:
            bar.close()
        wall_s = client.loop.time() - client.start
    results.sort(key=lambda r: r.index)
    return RunResult(target, results, wall_s, run_tag)


async def run_open_loop(
    target: str,
    schedule: Sequence[PlannedRequest],
    *,
    retry: RetryPolicy | None = None,
    timeout_s: float = 120.0,
    model: str = "sim-model",
    extra_body: dict[str, Any] | None = None,
    progress: bool = False,
) -> RunResult:
    """Send each request at its `at_s`, without waiting for earlier answers."""
    ordered = sorted(schedule, key=lambda p: p.at_s)

    async def drive(client: Client, one: _Send) -> None:
        tasks: list[asyncio.Task[RequestResult]] = []
        try:
            for planned in ordered:
                delay = client.start + planned.at_s - client.loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(planned)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    return await _run(
        target,
        len(ordered),
        drive,
        retry=retry or RetryPolicy(),
        timeout_s=timeout_s,
        model=model,
        extra_body=extra_body,
        progress=progress,
    )


async def run_closed_loop(
    target: str,
    schedule: Sequence[PlannedRequest],
    concurrency: int,
    *,
    retry: RetryPolicy | None = None,
    timeout_s: float = 120.0,
    model: str = "sim-model",
    extra_body: dict[str, Any] | None = None,
    progress: bool = False,
) -> RunResult:
    """`concurrency` workers, each sending the next request as soon as its last one ended."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    queue = list(reversed(schedule))

    async def drive(client: Client, one: _Send) -> None:
        async def worker() -> None:
            while queue:
                await one(queue.pop())

        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()

    return await _run(
        target,
        len(schedule),
        drive,
        retry=retry or RetryPolicy(),
        timeout_s=timeout_s,
        model=model,
        extra_body=extra_body,
        progress=progress,
    )


async def _sleep_until(client: Client, offset_s: float) -> None:
    delay = client.start + offset_s - client.loop.time()
    if delay > 0:
        await asyncio.sleep(delay)


async def _converse(client: Client, one: _Send, conversation: PlannedConversation) -> None:
    """One conversation: each turn resends the history with the last reply in it.

    The think time runs from the end of the previous answer, as a user reads before
    typing; a turn that failed is withdrawn from the history (see `Dialogue.withdraw`).
    """
    dialogue = Dialogue(conversation, client.run_tag)
    due = conversation.start_s
    for turn in conversation.turns:
        due += turn.think_s
        await _sleep_until(client, due)
        messages = dialogue.ask(turn)
        result = await one(dialogue.request(turn, due), messages)
        if result.ok and result.reply is not None:
            dialogue.answer(result.reply)
        else:
            dialogue.withdraw(turn)
        due = max(due, client.loop.time() - client.start)


async def run_conversations(
    target: str,
    plan: ConversationPlan,
    *,
    retry: RetryPolicy | None = None,
    timeout_s: float = 120.0,
    model: str = "sim-model",
    extra_body: dict[str, Any] | None = None,
    progress: bool = False,
) -> RunResult:
    """Every conversation on its own task from its start offset, one-offs at theirs.

    Conversations are closed loops (a turn waits for the last answer) and the one-offs
    an open loop, as a chat service's users and its batch callers would be.
    """

    async def drive(client: Client, one: _Send) -> None:
        async def one_off(planned: PlannedRequest) -> None:
            await _sleep_until(client, planned.at_s)
            await one(planned)

        tasks = [asyncio.create_task(_converse(client, one, c)) for c in plan.conversations]
        tasks += [asyncio.create_task(one_off(p)) for p in plan.one_offs]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    return await _run(
        target,
        plan.requests,
        drive,
        retry=retry or RetryPolicy(),
        timeout_s=timeout_s,
        model=model,
        extra_body=extra_body,
        progress=progress,
    )
