"""Waiting on whichever of several events comes first, with no leftover tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

Sleep = Callable[[float], Awaitable[None]]
"""An injectable `asyncio.sleep` (tests pass one that records or skips the wait)."""


async def wait_any(
    *events: asyncio.Event,
    timeout: float | None = None,  # noqa: ASYNC109
    sleep: Sleep | None = None,
) -> bool:
    """Wait until any event is set or `timeout` passes; True if an event was set.

    Unlike asyncio.timeout, running out of time is an answer here, not an error. With
    `sleep`, the timeout is waited out by `sleep(timeout)` instead of the loop's timer
    (a test seam); an error it raises is raised here.
    """
    if any(e.is_set() for e in events):
        return True
    if len(events) == 1 and sleep is None:
        # The common case (a loop ticking until its closing event): waited in this task,
        # with no helper tasks to create, cancel and gather. A proxy process runs several
        # such loops per partition it serves, each waking many times a second.
        try:
            async with asyncio.timeout(timeout):
                await events[0].wait()
        except TimeoutError:
            return events[0].is_set()
        return True
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    timer = None
    if sleep is not None and timeout is not None:
        timer = asyncio.ensure_future(sleep(timeout))
        timeout = None
    pending = waiters if timer is None else [*waiters, timer]
    try:
        done, _ = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in pending:
            w.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    if timer is not None and not timer.cancelled():
        timer.result()
    return any(w in done for w in waiters)
