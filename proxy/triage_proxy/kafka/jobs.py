"""Calls handed to the one thread that drives a Kafka client.

Why: the fleet's group member (assignment.py) and a multi-partition process's reader
(reader.py) each call their librdkafka Consumer from one thread only; other threads queue
work here and wait on a future, which that thread runs between its polls.
"""

from __future__ import annotations

import concurrent.futures
import queue
from collections.abc import Callable
from typing import Any, TypeVar

from triage_proxy.errors import BrokerUnavailable

T = TypeVar("T")


class ThreadJobs:
    """A queue of calls that one owning thread runs, in order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._queue = queue.SimpleQueue()

    def submit(self, job: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Queue `job` for the owning thread (any thread)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((job, future))
        return future

    def run(self) -> None:
        """Run every queued call (the owning thread); a call's exception goes to its caller."""
        while True:
            try:
                job, future = self._queue.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except Exception as exc:  # noqa: BLE001 - handed to the caller, who raises it
                future.set_exception(exc)

    def refuse(self, reason: str) -> None:
        """Fail every queued call with BrokerUnavailable(`reason`): the thread has stopped."""
        while True:
            try:
                _, future = self._queue.get_nowait()
            except queue.Empty:
                return
            future.set_exception(BrokerUnavailable(reason))
