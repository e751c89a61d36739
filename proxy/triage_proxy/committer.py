"""The committer: commits the tracker's committable offset on an interval.

It commits when the committable offset advanced or, with `commit.encode_settled`,
when the set of offsets settled above it changed: that set rides along encoded in
the commit's metadata (and in a checkpoint item, see table/checkpoints.py) so a
restarted proxy does not redeliver it. When the encoding does not fit the broker's
metadata limit it commits the plain offset (at-least-once) and counts the overflow.
A failed commit is retried on the next tick (the offset stays uncommitted, so
nothing is lost), and there is one final commit on shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from triage_proxy.errors import BrokerUnavailable, TableUnavailable
from triage_proxy.kafka import KafkaThread, PartitionLog
from triage_proxy.settled import encode_settled
from triage_proxy.table.checkpoints import CheckpointStore
from triage_proxy.tracker import CommitTracker
from triage_proxy.waiting import wait_any

logger = logging.getLogger(__name__)

CHECKPOINT_INTERVAL_S = 1.0
"""Least time between checkpoint-item writes. A checkpoint that trails Kafka's commit is
still used (see app.py), so writing it on every fast commit would only cost DynamoDB
writes and proxy CPU (measured ~10% of no-op throughput at 10 commits/s)."""


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
        *,
        checkpoints: CheckpointStore | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._thread = thread
        self._tracker = tracker
        self._interval_s = interval_s
        self._closing = closing
        self._checkpoints = checkpoints
        self._monotonic = monotonic
        """The clock of the checkpoint interval (a test passes its own)."""
        self.committed = start_offset
        """The last offset Kafka acknowledged as committed."""
        self.metadata: str | None = None
        """The settled-above encoding committed with it (None: plain commit)."""
        self.degraded = False
        self.commits = 0
        self.metadata_overflows = 0
        """Commits made without the encoding because it did not fit."""
        self._checkpoint_degraded = False
        self._checkpoint_at = -CHECKPOINT_INTERVAL_S
        self._checkpoint_due: tuple[int, str] | None = None
        """The latest (committed, encoding) not yet written to the checkpoint item."""

    async def run(self) -> None:
        while not await wait_any(self._closing, timeout=self._interval_s):
            await self.commit()
            await self._flush_checkpoint()
        logger.debug("committer stopped")

    def _encoding(self, offset: int) -> str | None:
        if self._checkpoints is None:
            return None
        settled = self._tracker.settled_above()
        if not settled:
            return ""
        text = encode_settled(offset, settled)
        if text is None:
            self.metadata_overflows += 1
        return text

    async def commit(self) -> bool:
        """Commit if anything changed; False if the broker refused."""
        offset = self._tracker.committable
        metadata = self._encoding(offset)
        if offset < self.committed or (offset == self.committed and metadata == self.metadata):
            return True
        try:
            await self._thread.run(self._log.commit, offset, metadata)
        except BrokerUnavailable as exc:
            if not self.degraded:
                logger.warning("degraded: commit of %d failed (%s); will retry", offset, exc)
                self.degraded = True
            return False
        if self.degraded:
            logger.info("recovered: committed offset %d", offset)
            self.degraded = False
        self.committed, self.metadata = offset, metadata
        self.commits += 1
        if self._checkpoints is not None:
            self._checkpoint_due = (offset, metadata or "")
            await self._flush_checkpoint(force=self._closing.is_set())
        return True

    async def _flush_checkpoint(self, *, force: bool = False) -> None:
        """Write the due checkpoint if CHECKPOINT_INTERVAL_S passed since the last write."""
        now = self._monotonic()
        if self._checkpoint_due is None or (
            not force and now - self._checkpoint_at < CHECKPOINT_INTERVAL_S
        ):
            return
        (offset, text), self._checkpoint_due = self._checkpoint_due, None
        self._checkpoint_at = now
        await self._write_checkpoint(offset, text)

    async def _write_checkpoint(self, offset: int, text: str) -> None:
        """Best effort: a missing or stale checkpoint only means more redeliveries."""
        assert self._checkpoints is not None
        try:
            await asyncio.to_thread(self._checkpoints.put, offset, text)
        except TableUnavailable as exc:
            if not self._checkpoint_degraded:
                logger.warning("commit checkpoint not written (%s); retrying next commit", exc)
                self._checkpoint_degraded = True
            return
        self._checkpoint_degraded = False
