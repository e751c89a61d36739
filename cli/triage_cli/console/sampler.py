"""The console's one background reader: every few seconds, what `triage status` reads.

`Sampler` owns one task. Each round it runs `triage_cli.status.sources.gather` (the broker's
committed offsets and log ends, every proxy's /status, the table's pending counts) and
reads the partitions' lease items, in a worker thread, then adds the report to the
`History` the plots are drawn from. The pages read `latest()`; they never wait on a
source.

A source that does not answer costs only its part: the report names it (the broker, a
proxy that is down, the table), and the next round tries again, so the page says what is
wrong and recovers by itself. The pending count is a Query per partition over the whole
table, so it is refreshed every `PENDING_EVERY_S`, not every round.

Lifecycle: `start()` (once), `stop()` (safe twice): stop sets the closing event, the
loop ends after the round in hand, then the clients close.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from triage_cli.console.history import History
from triage_cli.status.sources import Sources, gather

if TYPE_CHECKING:
    from triage_proxy.config.settings import Settings

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 3.0
"""Seconds between samples."""
PENDING_EVERY_S = 15.0
"""Seconds between counts of pending dead letters (a Query per partition)."""


class SamplerState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


class CachedSources(Sources):
    """`Sources` whose pending dead-letter counts are read at most every `every_s`."""

    def __init__(
        self,
        settings: Settings,
        host: str | None,
        *,
        every_s: float = PENDING_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        state_dir: Path | None = None,
    ) -> None:
        super().__init__(settings, host, state_dir=state_dir)
        self._every_s = every_s
        self._clock = clock
        self._counted: tuple[float, int, tuple[dict[int, int | None], str | None, bool]] | None = (
            None
        )
        self._reader: Any = None

    def close(self) -> None:
        super().close()
        if self._reader is not None:
            self._reader.close()

    def dead_letters(self, partitions: int) -> tuple[dict[int, int | None], str | None, bool]:
        now = self._clock()
        cached = self._counted
        if (
            cached is not None
            and cached[1] == partitions
            and cached[2][1] is None
            and now - cached[0] < self._every_s
        ):
            return cached[2]
        counts = super().dead_letters(partitions)
        self._counted = (now, partitions, counts)
        return counts

    def leases(self, partitions: int) -> tuple[dict[int, dict[str, Any]], str | None]:
        """Each partition's lease item (holder, until, endpoint), or why it was not read."""
        from triage_proxy.errors import TriageError
        from triage_proxy.store.leases import DynamoDBLeaseReader

        settings = self.settings
        try:
            if self._reader is None:
                self._reader = DynamoDBLeaseReader(
                    settings.dead_letters, settings.kafka.topic, settings.kafka.group_id
                )
            found = self._reader.get_many(list(range(partitions)))
        except TriageError as exc:
            return {}, str(exc)
        now_ms = int(time.time() * 1000)
        return {
            p: {
                "owner": lease.owner,
                "until_ms": lease.until_ms,
                "endpoint": lease.endpoint or None,
                "live": lease.until_ms > now_ms,
            }
            for p, lease in found.items()
        }, None


class Sampler:
    """Reads the fleet every `interval_s` (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        host: str | None = None,
        config: str = "<config>",
        wall: Callable[[], float] = time.time,
        state_dir: Path | None = None,
    ) -> None:
        self.settings = settings
        self.interval_s = interval_s
        self.history = History()
        self._host = host
        self._config = config
        self._state_dir = state_dir
        """The local deployment's project folder (`triage status --state-dir`)."""
        self._wall = wall
        self._sources: CachedSources | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._state = SamplerState.NEW
        self._latest: dict[str, Any] | None = None
        self._latest_at: float | None = None
        self._error: str | None = None
        self._leases: dict[int, dict[str, Any]] = {}
        self._leases_error: str | None = None

    async def start(self) -> None:
        from triage_proxy.errors import StateError

        if self._state is not SamplerState.NEW:
            raise StateError("the sampler was started already")
        self._state = SamplerState.RUNNING
        self._sources = await asyncio.to_thread(
            functools.partial(CachedSources, state_dir=self._state_dir), self.settings, self._host
        )
        self._sources.config = self._config
        self._task = asyncio.create_task(self._run(), name="console-sampler")
        logger.info("sampling the fleet every %.1f s", self.interval_s)

    async def stop(self) -> None:
        if self._state is not SamplerState.RUNNING:
            self._state = SamplerState.STOPPED
            return
        self._state = SamplerState.STOPPED
        self._closing.set()
        if self._task is not None:
            await self._task
        if self._sources is not None:
            await asyncio.to_thread(self._sources.close)
        logger.debug("sampler stopped")

    async def _run(self) -> None:
        while not self._closing.is_set():
            started = asyncio.get_running_loop().time()
            await self.sample_once()
            spent = asyncio.get_running_loop().time() - started
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._closing.wait(), timeout=max(0.1, self.interval_s - spent)
                )

    async def sample_once(self) -> None:
        """One round: gather, read the leases, add to the history."""
        from triage_proxy.errors import TriageError

        sources = self._sources
        assert sources is not None
        try:
            report = await asyncio.to_thread(gather, sources)
        except TriageError as exc:
            self._error = str(exc)
            logger.warning("cannot read the fleet: %s", exc)
        else:
            doc = report.to_json()
            count = len(doc["partitions"])
            self._leases, self._leases_error = await asyncio.to_thread(sources.leases, count)
            at = self._wall()
            self.history.add(doc, at)
            self._latest, self._latest_at, self._error = doc, at, None

    def latest(self) -> dict[str, Any]:
        """The last report with its age, and why the last round failed (if it did)."""
        age = None if self._latest_at is None else max(0.0, self._wall() - self._latest_at)
        return {
            "report": self._latest,
            "sampled_at": self._latest_at,
            "age_s": None if age is None else round(age, 1),
            "error": self._error,
            "interval_s": self.interval_s,
        }

    def fleet(self) -> dict[str, Any]:
        """Processes, leases and the rebalances of the last hour."""
        report = self._latest or {}
        return {
            "processes": report.get("processes", []),
            "partitions": [
                {
                    "partition": row["partition"],
                    "proxy": row["proxy"],
                    "served_by": row.get("served_by"),
                    "lease": self._leases.get(row["partition"]),
                }
                for row in report.get("partitions", [])
            ],
            "leases_error": self._leases_error,
            "rebalances": [
                {"at": r.at, "partition": r.partition, "before": r.before, "after": r.after}
                for r in reversed(self.history.rebalances)
            ],
            "error": self._error,
            "sampled_at": self._latest_at,
        }
