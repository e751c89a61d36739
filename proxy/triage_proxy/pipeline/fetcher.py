"""The fetcher: pulls the partition into the dispatcher's window, never past it.

When the window is full it stops taking records (librdkafka's capped prefetch then
stops fetching from the broker, see kafka/client.py) and waits for room; it never drops.
Broker trouble is retried with backoff and reported once as degraded, then once as
recovered.
"""

from __future__ import annotations

import asyncio
import logging

from triage_proxy.errors import BrokerUnavailable
from triage_proxy.kafka.client import KafkaThread, PartitionLog
from triage_proxy.pipeline.dispatch import Dispatcher
from triage_proxy.pipeline.policies import backoff
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
    ) -> None:
        self._log = log
        self._thread = thread
        self._dispatcher = dispatcher
        self._batch = batch
        self._closing = closing
        self.paused = False
        self.degraded = False

    async def run(self) -> None:
        dispatcher = self._dispatcher
        failures = 0
        while not self._closing.is_set():
            room = dispatcher.room_for
            if not dispatcher.room.is_set():
                self._set_paused(True)
                await wait_any(dispatcher.room, self._closing)
                continue
            self._set_paused(False)
            try:
                records = await self._thread.run(self._log.fetch, min(room, self._batch))
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
            if records:
                dispatcher.add(records)
        self._set_paused(True)
        logger.debug("fetcher stopped")

    def _set_paused(self, paused: bool) -> None:
        if paused != self.paused:
            self.paused = paused
            logger.debug("partition %s", "paused" if paused else "resumed")
