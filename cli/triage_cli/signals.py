"""The one way a `triage` command handles SIGINT and SIGTERM: both mean "stop
gracefully", so Ctrl-C in a terminal and `kill`/systemd/ECS stopping a process end the
same way.

    on_stop_signals(callback)        either signal calls `callback` while the block runs
    on_stop_signals(callback, loop)  the same, from an asyncio loop (the proxy)
    stop_on_signals()                an Event either signal sets, for polling loops
    stop_signals_held()              neither signal does anything: a stop underway ends
    on_stop_signals(interrupt)       either signal raises KeyboardInterrupt, for blocking
                                     work that cannot poll (`exitcodes.exit_on_errors`
                                     does this around every command's body)

The previous handlers come back when the block ends, so nested commands and tests that
invoke commands in-process keep their own.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop a command gracefully."""


@contextlib.contextmanager
def on_stop_signals(
    callback: Callable[[], None], loop: asyncio.AbstractEventLoop | None = None
) -> Iterator[None]:
    """Call `callback` on SIGINT or SIGTERM while the block runs.

    With `loop`, through the loop (the callback runs on it, between its tasks). Without
    it, as a plain handler in the main thread; outside the main thread (a command invoked
    from a worker thread) Python cannot install handlers, and the block runs without."""
    if loop is not None:
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, callback)
        try:
            yield
        finally:
            for signum in STOP_SIGNALS:
                loop.remove_signal_handler(signum)
        return
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        callback()

    previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """An event that SIGINT or SIGTERM sets while the block runs."""
    stop = threading.Event()
    with on_stop_signals(stop.set):
        yield stop


def interrupt() -> None:
    """A callback for `on_stop_signals` that ends blocking work the way Ctrl-C does."""
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM do nothing while the block runs: for a stop already underway
    that stops processes by PID, each within its bound. A second Ctrl-C raised
    KeyboardInterrupt inside it and left what it had not reached yet running, orphaned
    (`triage dev`'s broker and moto server)."""
    with on_stop_signals(lambda: None):
        yield
