"""Pinned partitions: a process serving the partitions named on its command line.

What differs from fleet membership (fleet.py): the partitions are known before
anything starts, so a pin the topic does not have is a ConfigError (exit 2); every
pipeline starts at once and waits as a standby until it holds its partition's lease;
the process listens only once it holds every one (a standby is watched through HTTP,
and consumers never reach it); and a pipeline that fails stops the process, which
exits with its error (a supervisor restarts it as a standby).

    check the pins against the topic
    -> start a pipeline per pin (each takes its lease, then opens Kafka)
    -> once every lease is held: bind the gRPC port, advertise the endpoint
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from triage_proxy.config.settings import Settings
from triage_proxy.errors import ConfigError, OwnershipLost
from triage_proxy.pipeline.partition import PartitionPipeline

logger = logging.getLogger(__name__)


class PinnedPartitions:
    """The partitions a pinned process serves, and how it starts them."""

    def __init__(self, settings: Settings, partitions: int | Sequence[int]) -> None:
        if isinstance(partitions, int):
            partitions = (partitions,)
        self._settings = settings
        self.pins: tuple[int, ...] = tuple(sorted(set(partitions)))
        if not self.pins:
            raise ConfigError("--partition", "give at least one, or none to join the fleet")

    def wanted(self) -> frozenset[int]:
        return frozenset(self.pins)

    async def check(self) -> None:
        """ConfigError (exit 2) for a pinned partition the topic does not have."""
        from triage_proxy.kafka.assignment import topic_partitions

        count = await asyncio.to_thread(topic_partitions, self._settings.kafka)
        outside = [p for p in self.pins if p >= count]
        if outside:
            raise ConfigError(
                "--partition",
                f"{', '.join(map(str, outside))} outside topic {self._settings.kafka.topic!r}, "
                f"which has {count} partition(s): 0..{count - 1}",
            )

    async def start(
        self,
        launch: Callable[[int], PartitionPipeline],
        listen: Callable[[], Awaitable[str | None]],
        closing: asyncio.Event,
    ) -> None:
        """Start every pinned pipeline; once each holds its lease (or `closing` is set
        first), `listen` and advertise the endpoint it returns (None: it failed)."""
        pipelines = [launch(p) for p in self.pins]
        await _all_leased(pipelines, closing)
        if closing.is_set():
            return
        endpoint = await listen()
        if endpoint is not None:
            for pipeline in pipelines:
                pipeline.advertise(endpoint)

    def lost(self, pipeline: PartitionPipeline, exc: OwnershipLost) -> bool:
        """A pinned pipeline lost its lease: the process stops (True: fail it)."""
        return True


async def _all_leased(pipelines: Sequence[PartitionPipeline], closing: asyncio.Event) -> None:
    waiters = [asyncio.ensure_future(p.leased.wait()) for p in pipelines]
    closed = asyncio.ensure_future(closing.wait())
    try:
        pending = set(waiters)
        while pending and not closed.done():
            _, pending = await asyncio.wait({*pending, closed}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(closed)
    finally:
        for w in [*waiters, closed]:
            w.cancel()
        await asyncio.gather(*waiters, closed, return_exceptions=True)
