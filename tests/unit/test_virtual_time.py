"""The virtual-clock loop the fetcher and committer tests rely on."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.unit import virtual_time
from tests.unit.virtual_time import Deadlock, run


def test_timers_pass_at_once_and_exactly() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        seen: list[float] = []

        async def after(delay: float) -> None:
            await asyncio.sleep(delay)
            seen.append(loop.time())

        await asyncio.gather(after(3600), after(0.25), after(5))
        return seen

    started = time.monotonic()
    assert run(main()) == [0.25, 5, 3600]
    # An hour of timers in seconds of real time (a loaded machine's, too): they jumped.
    assert time.monotonic() - started < 30


def test_a_call_out_in_a_thread_holds_the_clock() -> None:
    async def main() -> list[str]:
        order: list[str] = []

        async def timer() -> None:
            await asyncio.sleep(0.001)
            order.append("timer")

        async def work() -> None:
            await asyncio.to_thread(time.sleep, 0.05)
            order.append("thread")

        await asyncio.gather(work(), timer())
        return order

    assert run(main()) == ["thread", "timer"]


def test_a_wait_nothing_can_end_is_a_deadlock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(virtual_time, "DEADLOCK_AFTER_S", 0.05)

    async def main() -> None:
        await asyncio.Event().wait()

    with pytest.raises(Deadlock):
        run(main())
