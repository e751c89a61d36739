"""Waiting in a test for a condition that another task makes true, shared by the suites.

For state a component changes from its own task (a writer's counters, a proxy's
state): poll it on the event loop until it holds, and fail the test with one message
when it does not in time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(
    predicate: Callable[[], object], within: float = 10.0, poll_s: float = 0.005
) -> None:
    """Return once `predicate()` holds, polling every `poll_s`; fail after `within` s."""
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(poll_s)
