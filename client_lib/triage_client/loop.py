"""The one event loop thread that every `Consumer.run()` with a sync handler in a process shares.

Why: a Consumer's event loop only moves frames (deliveries in, settlements out); a sync
handler runs in the Consumer's own threads. When each `run()` ran its own loop, several
Consumers in one process meant several loop threads contending for the GIL with each
other and with every handler thread, each woken on its own for a few deliveries or
results (bench_efficiency, one process of 4 Consumers x 8 sync handlers: 55-80% of the
FIFO bound with a loop each, 83-89% in one loop, same runs). One loop serves every
stream's I/O in one wake-up, as `run_async` under one `asyncio.gather` already did.

Lifecycle: the first `run()` starts the thread (`acquire`), the last one to return stops
it (`release`): closing the loop as `asyncio.run` does. A forked child starts its own.
A Consumer with an async handler keeps a loop of its own: its handlers run on the loop,
and one blocking handler must not stall another Consumer's streams.
"""

from __future__ import annotations

import asyncio
import os
import threading

__all__ = ["SHARED", "SharedLoop"]


class SharedLoop:
    """A reference-counted event loop running in a daemon thread (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def acquire(self) -> asyncio.AbstractEventLoop:
        """The running shared loop, started if nobody uses it yet; pair with `release()`."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                started = threading.Event()
                thread = threading.Thread(
                    target=_serve, args=(loop, started), name="triage-loop", daemon=True
                )
                thread.start()
                started.wait()
                self._loop, self._thread = loop, thread
            self._users += 1
            return self._loop

    def release(self) -> None:
        """One user is done; the last one stops the loop and waits for its thread."""
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()

    def _forget(self) -> None:
        """In a forked child: the parent's loop thread does not exist here."""
        self._lock = threading.Lock()
        self._users = 0
        self._loop = self._thread = None


def _serve(loop: asyncio.AbstractEventLoop, started: threading.Event) -> None:
    asyncio.set_event_loop(loop)
    loop.call_soon(started.set)
    try:
        loop.run_forever()
    finally:
        # What asyncio.run does on the way out.
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


SHARED = SharedLoop()
"""The process's shared loop."""
os.register_at_fork(after_in_child=SHARED._forget)
