"""The log-end watcher: the partition's high watermark, polled for lag.

Why polled and not read per scrape: each query is a broker round trip (on Tansu p50
18-52 ms, up to 200 ms), run on the pipeline's query thread, beside the fetch's thread
so it never holds a fetch up. Asking every `interval_s` bounds that cost whatever
scrapes or `triage status` calls arrive; a reading is at most that old (its age is
reported). A broker outage only makes the reading stale: the watcher logs once and
keeps trying.

Tansu's high watermark can trail the true log end (see DESIGN.md), so the log end
reported is never below what the proxy already fetched.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from triage_proxy.errors import BrokerUnavailable
from triage_proxy.kafka.client import KafkaThread, PartitionLog
from triage_proxy.pipeline.tracker import CommitTracker
from triage_proxy.waiting import wait_any

logger = logging.getLogger(__name__)

LOG_END_INTERVAL_S = 2.0
"""How often the high watermark is asked for."""


class LogEndWatcher:
    """Owns the latest high-watermark reading of one partition."""

    def __init__(
        self,
        log: PartitionLog,
        thread: KafkaThread,
        tracker: CommitTracker,
        closing: asyncio.Event,
        *,
        interval_s: float = LOG_END_INTERVAL_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._thread = thread
        self._tracker = tracker
        self._closing = closing
        self._interval_s = interval_s
        self._monotonic = monotonic
        self.high: int | None = None
        """The broker's last reported high watermark (None until the first answer)."""
        self.checked_at: float | None = None
        """When `high` was read (monotonic seconds)."""
        self.degraded = False
        """True while the broker does not answer (the reading is getting old)."""

    @property
    def log_end(self) -> int | None:
        """The log end offset: the high watermark, at least what was already fetched."""
        if self.high is None:
            return None
        return max(self.high, self._tracker.next_offset)

    async def run(self) -> None:
        """Poll until `closing` is set (owned by the proxy's task group)."""
        while True:
            await self.poll()
            if await wait_any(self._closing, timeout=self._interval_s):
                break
        logger.debug("log-end watcher stopped")

    async def poll(self) -> None:
        try:
            high = await self._thread.run(self._log.log_end)
        except BrokerUnavailable as exc:
            if not self.degraded:
                logger.warning("log end offset unknown (%s); will retry", exc)
                self.degraded = True
            return
        if self.degraded:
            logger.info("log end offset readable again")
            self.degraded = False
        self.high, self.checked_at = high, self._monotonic()
