"""The shared start/stop state machine (lifecycle.py) and wait_any (waiting.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from triage_proxy.errors import StateError
from triage_proxy.lifecycle import Lifecycle, State
from triage_proxy.waiting import wait_any


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 10))


class Probe(Lifecycle):
    """Runs until closing (or forever when `stubborn`); records the hooks in order."""

    name = "probe"

    def __init__(self, *, stubborn: bool = False, fail: bool = False) -> None:
        super().__init__(stop_timeout_s=0.1)
        self.stubborn = stubborn
        self.fail = fail
        self.hooks: list[str] = []

    async def _run(self) -> None:
        if self.fail:
            raise RuntimeError("bug in the task")
        await (asyncio.Event() if self.stubborn else self._closing).wait()

    def _on_started(self) -> None:
        self.hooks.append("started")

    def _on_stopping(self) -> None:
        self.hooks.append("stopping")

    def _on_overran(self) -> None:
        self.hooks.append("overran")

    def _on_stopped(self) -> None:
        self.hooks.append("stopped")

    def _on_finished(self) -> None:
        self.hooks.append("finished")


def test_start_once_stop_twice_in_order() -> None:
    async def main() -> None:
        probe = Probe()
        async with probe:
            assert probe.state is State.RUNNING
            with pytest.raises(StateError, match="probe already running"):
                await probe.start()
        await probe.stop()
        assert probe.state.value == "stopped"  # (`is` here would confuse mypy's narrowing)
        assert probe.hooks == ["started", "stopping", "stopped", "finished"]
        with pytest.raises(StateError):
            await probe.start()

    run(main())


def test_stop_before_start_releases_without_running() -> None:
    async def main() -> None:
        probe = Probe()
        await probe.stop()
        assert probe.state is State.STOPPED
        assert probe.hooks == ["stopped"]

    run(main())


def test_concurrent_stops_both_wait_for_the_end() -> None:
    async def main() -> None:
        probe = Probe()
        await probe.start()
        await asyncio.gather(probe.stop(), probe.stop())
        assert probe.hooks.count("stopped") == 1

    run(main())


def test_a_task_that_outlives_the_timeout_is_cancelled() -> None:
    async def main() -> None:
        probe = Probe(stubborn=True)
        await probe.start()
        await probe.stop()
        assert probe.hooks == ["started", "stopping", "overran", "stopped", "finished"]

    run(main())


def test_the_error_the_task_died_of_surfaces_at_stop() -> None:
    async def main() -> None:
        probe = Probe(fail=True)
        await probe.start()
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="bug in the task"):
            await probe.stop()
        assert probe.state is State.STOPPED

    run(main())


def test_wait_any_waits_out_the_timeout_through_the_given_sleep() -> None:
    slept: list[float] = []

    async def sleep(delay: float) -> None:
        slept.append(delay)

    async def main() -> None:
        event = asyncio.Event()
        assert not await wait_any(event, timeout=3600, sleep=sleep)
        assert slept == [3600]
        event.set()
        assert await wait_any(event, timeout=3600, sleep=sleep)
        assert slept == [3600]  # already set: no wait at all

    run(main())


def test_wait_any_is_cut_short_by_an_event_and_raises_what_the_sleep_raised() -> None:
    async def forever(delay: float) -> None:
        await asyncio.Event().wait()

    async def broken(delay: float) -> None:
        raise RuntimeError("clock broke")

    async def main() -> None:
        event = asyncio.Event()
        asyncio.get_running_loop().call_soon(event.set)
        assert await wait_any(event, timeout=1, sleep=forever)
        with pytest.raises(RuntimeError, match="clock broke"):
            await wait_any(asyncio.Event(), timeout=1, sleep=broken)

    run(main())
