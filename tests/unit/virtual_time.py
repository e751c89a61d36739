"""An asyncio event loop whose clock jumps: timing logic tested without sleeping.

Like trio's `autojump_clock`: `loop.time()` is virtual and stands still while anything
can run; when every task waits and the next thing that can happen is a timer, the
clock jumps straight to it. So a 5 s backoff or a 1 s commit interval passes at once,
and the waits a test observes (`loop.time()` before and after) are exact.

Work in a thread (`run_in_executor`, `asyncio.to_thread`, `KafkaThread`) holds the
clock: while a call is out, the loop really waits for it, so a timer never fires
early because a thread was slow. A wait that nothing can end (every task waits on an
event no one sets, no timer, no thread) raises `Deadlock` (after DEADLOCK_AFTER_S of real
time) instead of hanging the test.
"""

from __future__ import annotations

import asyncio
import itertools
import selectors
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any, TypeVar

T = TypeVar("T")

DEADLOCK_AFTER_S = 5.0
"""Real seconds a loop with no timer and no thread out waits before it calls it a deadlock."""


class Deadlock(RuntimeError):
    """Every task waits and nothing (timer, thread, I/O) can wake any of them."""


class _JumpingSelector:
    """Wraps the loop's selector: a wait for the next timer becomes a clock jump."""

    def __init__(self, loop: VirtualClockLoop, inner: selectors.BaseSelector) -> None:
        self._loop = loop
        self._inner = inner

    def select(self, timeout: float | None = None) -> list[Any]:
        loop = self._loop
        if loop.in_threads or (timeout is not None and timeout <= 0):
            return self._inner.select(timeout)
        events = self._inner.select(0)  # I/O already waiting (e.g. a thread's wake-up)
        if events:
            return events
        if timeout is None:
            # Nothing virtual to wait for; a thread the loop does not track (the default
            # executor's shutdown) may still wake it, so wait a bounded real while.
            events = self._inner.select(DEADLOCK_AFTER_S)
            if not events:
                raise Deadlock("every task waits, and no timer, thread or I/O woke one")
            return events
        loop.advance(timeout)
        return []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """See the module docstring; `asyncio.Runner(loop_factory=VirtualClockLoop)`."""

    def __init__(self) -> None:
        self._now = 0.0
        self.in_threads = 0
        """Executor calls not finished yet: the clock holds while any is out."""
        inner = selectors.DefaultSelector()
        super().__init__(_JumpingSelector(self, inner))  # type: ignore[arg-type]

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds

    def run_in_executor(  # type: ignore[override]
        self, executor: Executor | None, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        future = super().run_in_executor(executor, func, *args)
        self.in_threads += 1
        future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _future: object) -> None:
        self.in_threads -= 1


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on a VirtualClockLoop."""
    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        return runner.run(main)


async def until(
    predicate: Callable[[], object], timeout: float = 60.0, poll: float = 0.005
) -> None:
    """Wait until `predicate()` holds, polling every `poll` s of (virtual) loop time.

    For state a component exposes as plain attributes (the fetcher's `paused`); raises
    TimeoutError after `timeout` s of loop time.
    """
    async with asyncio.timeout(timeout):
        while True:
            if predicate():
                return
            await asyncio.sleep(poll)


def gaps(times: list[float]) -> list[float]:
    """Differences between consecutive times."""
    return [b - a for a, b in itertools.pairwise(times)]
