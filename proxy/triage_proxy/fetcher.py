"""The fetcher: pulls the partition into the dispatcher's window, never past it.

When the window is full it pauses the partition (librdkafka stops prefetching
too) and waits for room; it never drops. Broker trouble is retried with backoff
and reported once as degraded, then once as recovered.
"""

from __future__ import annotations

import asyncio
import logging

from triage_proxy.dispatcher import Dispatcher
from triage_proxy.errors import BrokerUnavailable
from triage_proxy.kafka import PartitionLog
from triage_proxy.waiting import wait_any

logger = logging.getLogger(__name__)

RETRY_INITIAL_S = 0.1
RETRY_MAX_S = 5.0


class Fetcher:
    """Runs the fetch loop until `closing` is set."""

    def __init__(
        self, log: PartitionLog, dispatcher: Dispatcher, batch: int, closing: asyncio.Event
    ) -> None:
        self._log = log
        self._dispatcher = dispatcher
        self._batch = batch
        self._closing = closing
        self.paused = False
        self.degraded = False

    async def run(self) -> None:
        dispatcher = self._dispatcher
        backoff = RETRY_INITIAL_S
        while not self._closing.is_set():
            room = dispatcher.room_for
            if room == 0:
                self._pause()
                await wait_any(dispatcher.room, self._closing)
                continue
            self._resume()
            try:
                records = await asyncio.to_thread(self._log.fetch, min(room, self._batch))
            except BrokerUnavailable as exc:
                if not self.degraded:
                    logger.warning("degraded: fetch failing (%s); retrying", exc)
                    self.degraded = True
                await wait_any(self._closing, timeout=backoff)
                backoff = min(backoff * 2, RETRY_MAX_S)
                continue
            if self.degraded:
                logger.info("recovered: fetching again")
                self.degraded = False
            backoff = RETRY_INITIAL_S
            if records:
                dispatcher.add(records)
        self._pause()
        logger.debug("fetcher stopped")

    def _pause(self) -> None:
        if not self.paused:
            self._log.pause()
            self.paused = True
            logger.debug("partition paused")

    def _resume(self) -> None:
        if self.paused:
            self._log.resume()
            self.paused = False
            logger.debug("partition resumed")
