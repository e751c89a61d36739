"""The committer: commits the tracker's committable offset on an interval.

It commits only when the offset advanced, retries a failed commit on the next
tick (the offset stays uncommitted, so nothing is lost), and makes one final
commit on shutdown.
"""

from __future__ import annotations

import asyncio
import logging

from triage_proxy.errors import BrokerUnavailable
from triage_proxy.kafka import KafkaThread, PartitionLog
from triage_proxy.tracker import CommitTracker
from triage_proxy.waiting import wait_any

logger = logging.getLogger(__name__)


class Committer:
    """Owns the partition's committed offset as Kafka knows it."""

    def __init__(
        self,
        log: PartitionLog,
        thread: KafkaThread,
        tracker: CommitTracker,
        start_offset: int,
        interval_s: float,
        closing: asyncio.Event,
    ) -> None:
        self._log = log
        self._thread = thread
        self._tracker = tracker
        self._interval_s = interval_s
        self._closing = closing
        self.committed = start_offset
        """The last offset Kafka acknowledged as committed."""
        self.degraded = False

    async def run(self) -> None:
        while not await wait_any(self._closing, timeout=self._interval_s):
            await self.commit()
        logger.debug("committer stopped")

    async def commit(self) -> bool:
        """Commit if the committable offset advanced; False if the broker refused."""
        offset = self._tracker.committable
        if offset <= self.committed:
            return True
        try:
            await self._thread.run(self._log.commit, offset)
        except BrokerUnavailable as exc:
            if not self.degraded:
                logger.warning("degraded: commit of %d failed (%s); will retry", offset, exc)
                self.degraded = True
            return False
        if self.degraded:
            logger.info("recovered: committed offset %d", offset)
            self.degraded = False
        self.committed = offset
        return True
