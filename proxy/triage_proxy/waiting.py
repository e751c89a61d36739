"""Waiting on whichever of several events comes first, with no leftover tasks."""

from __future__ import annotations

import asyncio


async def wait_any(*events: asyncio.Event, timeout: float | None = None) -> bool:  # noqa: ASYNC109
    """Wait until any event is set or `timeout` passes; True if an event was set.

    Unlike asyncio.timeout, running out of time is an answer here, not an error.
    """
    if any(e.is_set() for e in events):
        return True
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
    return bool(done)
