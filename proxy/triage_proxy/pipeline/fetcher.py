"""The fetcher: pulls the partition into the dispatcher's window, never past it.

Each fetch runs on the partition's Kafka thread; with the process's shared reader, what
the reader already holds for the partition is taken on the event loop instead (`buffered`),
and while it holds nothing the fetcher waits on the loop for the reader thread's call
(`arm`), not on a thread.

When the window is full it stops taking records (librdkafka's capped prefetch then
stops fetching from the broker, see kafka/client.py) and waits for room; it never drops.
Broker trouble is retried with backoff and reported once as degraded, then once as
recovered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from triage_proxy.errors import BrokerUnavailable
from triage_proxy.kafka.client import KafkaThread, PartitionLog
from triage_proxy.pipeline.dispatch import Dispatcher
from triage_proxy.pipeline.policies import backoff
from triage_proxy.structs import Record
from triage_proxy.waiting import wait_any

logger = logging.getLogger(__name__)

RETRY_INITIAL_S = 0.1
"""First wait after a failed fetch; doubles up to RETRY_MAX_S."""
RETRY_MAX_S = 5.0


class Fetcher:
    """Runs the fetch loop until `closing` is set."""

    def __init__(
        self,
        log: PartitionLog,
        thread: KafkaThread,
        dispatcher: Dispatcher,
        batch: int,
        closing: asyncio.Event,
        buffered: Callable[[int], list[Record]] | None = None,
        arm: Callable[[Callable[[], None]], bool] | None = None,
    ) -> None:
        """`buffered`: takes up to n records already fetched for the partition, without
        waiting (the process's reader: kafka/reader.py); tried on the event loop before a
        fetch goes to `thread`, so records already here cost no hop to a thread and back.
        `arm`: with `buffered`, has the reader call a function (from its thread) once
        records or an error come in, False if some wait already (`ReaderPartition.arm`):
        then an empty buffer is waited for on the loop, and no fetch goes to `thread`."""
        self._log = log
        self._buffered = buffered
        self._arm = arm if buffered is not None else None
        self._thread = thread
        self._dispatcher = dispatcher
        self._batch = batch
        self._closing = closing
        self.paused = False
        self.degraded = False

    async def run(self) -> None:
        dispatcher = self._dispatcher
        buffered = self._buffered
        arm = self._arm
        arrived = asyncio.Event()
        wake = _waker(asyncio.get_running_loop(), arrived)
        failures = 0
        while not self._closing.is_set():
            room = dispatcher.room_for
            if not dispatcher.room.is_set():
                self._set_paused(True)
                await wait_any(dispatcher.room, self._closing)
                continue
            self._set_paused(False)
            want = min(room, self._batch)
            on_loop = armed = False
            try:
                records = buffered(want) if buffered is not None else None
                on_loop = bool(records)
                if not on_loop and arm is not None:
                    # Nothing here: the reader thread calls `wake` when records (or an
                    # error) come; if some came meanwhile, the next take has them.
                    arrived.clear()
                    armed = arm(wake)
                elif not on_loop:
                    records = await self._thread.run(self._log.fetch, want)
            except BrokerUnavailable as exc:
                if not self.degraded:
                    logger.warning("degraded: fetch failing (%s); retrying", exc)
                    self.degraded = True
                failures += 1
                delay = backoff(failures, initial=RETRY_INITIAL_S, cap=RETRY_MAX_S)
                await wait_any(self._closing, timeout=delay)
                continue
            if self.degraded:
                logger.info("recovered: fetching again")
                self.degraded = False
            failures = 0
            if armed:
                await wait_any(self._closing, arrived)
                continue
            if records:
                dispatcher.add(records)
            if on_loop:
                # Taken on the loop: let the other tasks (the streams' reads and writes)
                # run before the next take, as an awaited fetch would.
                await asyncio.sleep(0)
        self._set_paused(True)
        logger.debug("fetcher stopped")

    def _set_paused(self, paused: bool) -> None:
        if paused != self.paused:
            self.paused = paused
            logger.debug("partition %s", "paused" if paused else "resumed")


def _waker(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> Callable[[], None]:
    """What the reader thread calls to set `event` on `loop` (a closed loop: nothing)."""

    def wake() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(event.set)

    return wake
