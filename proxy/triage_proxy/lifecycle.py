"""The one start/stop state machine of a component that runs one background task.

Why: the dead-letter writer, the notifier and the push targets (each target, and the
table of them) each run a task until told to stop, and all must start once, stop safely
twice (or before they started, or from two callers at once), give their task a bounded
time to finish, and surface a bug it died of. That logic lives here once; a component
supplies its task (`_run`) and what to log or release at each step (the `_on_*` hooks).

`stop()`: signal `_closing` -> let the task finish on its own, up to `stop_timeout_s`
-> cancel it only if it outlives that -> STOPPED, then re-raise what the task died of.
"""

from __future__ import annotations

import asyncio
import enum
from types import TracebackType
from typing import Self

from triage_proxy.errors import StateError


class State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    """stop() was called; the background task is finishing."""
    STOPPED = "stopped"


class Lifecycle:
    """Base of a component with one background task: `start()`, `stop()`, `async with`."""

    name: str
    """What the component is, for errors and its task's name (e.g. "dead-letter writer";
    a class attribute, or set per instance: "push target orders")."""

    def __init__(self, stop_timeout_s: float) -> None:
        self._stop_timeout_s = stop_timeout_s
        self._state = State.NEW
        self._task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        """Set by stop(): the background task should finish."""
        self._ended = asyncio.Event()
        """Set once STOPPED (a second, concurrent stop() waits for it)."""

    @property
    def state(self) -> State:
        return self._state

    async def start(self) -> None:
        """Launch the background task; a component starts once."""
        if self._state is not State.NEW:
            raise StateError(f"{self.name} already {self._state.value}")
        self._task = asyncio.create_task(self._run(), name=self.name.replace(" ", "-"))
        self._state = State.RUNNING
        self._on_started()

    async def stop(self) -> None:
        """Signal the task, wait for it (cancel it past the stop timeout); safe twice.

        Re-raises an unexpected error the background task died of (a bug).
        """
        if self._state is State.NEW:
            self._state = State.STOPPED
            self._ended.set()
            self._on_stopped()
            return
        if self._state is State.STOPPING:
            await self._ended.wait()
            return
        if self._state is State.STOPPED:
            return
        task = self._task
        assert task is not None
        self._state = State.STOPPING
        self._closing.set()
        self._on_stopping()
        try:
            done, _ = await asyncio.wait({task}, timeout=self._stop_timeout_s)
            if not done:
                self._on_overran()
                task.cancel()
                await asyncio.wait({task})
        finally:
            self._state = State.STOPPED
            self._ended.set()
            self._on_stopped()
        self._on_finished()
        if not task.cancelled() and (exc := task.exception()) is not None:
            raise exc

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # --- what a component supplies --------------------------------------------------

    async def _run(self) -> None:
        """The background task: work until `_closing` is set, then return."""
        raise NotImplementedError

    def _on_started(self) -> None:
        """The task is launched (log it)."""

    def _on_stopping(self) -> None:
        """stop() set `_closing`: wake the task if it waits on something else; log it."""

    def _on_overran(self) -> None:
        """The task outlived the stop timeout and is cancelled now (log it)."""

    def _on_stopped(self) -> None:
        """STOPPED now, whether the task ran or not: release what the component holds."""

    def _on_finished(self) -> None:
        """A run ended (after `_on_stopped`; not when stopped before start): log a summary."""
