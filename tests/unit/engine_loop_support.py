"""Helpers of the engine-loop tests (the in-process thread and the child process)."""

import asyncio


def run_within(coro, timeout_s: float):
    """Run an async test body on a fresh event loop, failing it after `timeout_s`."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def drain(queue: asyncio.Queue) -> list:
    """Every delta of one request's stream, up to and including the finished one."""
    deltas = []
    while True:
        d = await queue.get()
        deltas.append(d)
        if d.finished:
            return deltas
