"""Following a deployment's topology: which partitions to consume, and where each is served.

The first read (`discover`) comes from the Consumer's target and is retried while the target
is not up yet; a target that is not a Triage proxy raises, one that predates Topology
(UNIMPLEMENTED) means "consume that proxy's only partition". Then `run` reads it again
every `topology_interval`, at once when a stream asks (`wake`), and every second or so
while a wanted partition has no serving proxy or a stream is reconnecting, from the target
or any endpoint a stream uses (any proxy answers). Each answer opens streams for wanted
partitions new to the Consumer and points the others at the endpoints serving them now.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping
from contextlib import suppress
from typing import Any

import grpc

from triage_client.channels import Channels
from triage_client.errors import EndpointError, PartitionError, error_for_status, speaks_grpc
from triage_client.stream import PartitionStream, backoff_delay
from triage_client.topology import Layout, fetch_layout

__all__ = ["TopologyFollower"]

logger = logging.getLogger(__name__)

TOPOLOGY_TIMEOUT_S = 5.0
"""Longest wait for one Topology answer."""
REFRESH_SOON_MAX_S = 1.0
"""Longest wait between topology reads while a wanted partition has no serving proxy."""
REFRESH_MIN_GAP_S = 0.1
"""Shortest gap between two topology reads, however many streams ask."""


class TopologyFollower:
    """Reads the topology for one Consumer and applies it to its streams (the Consumer's
    map, read here; new streams are added through `add_streams`)."""

    def __init__(
        self,
        *,
        consumer_id: str,
        target: str,
        partitions: tuple[int, ...] | None,
        metadata: tuple[tuple[str, str], ...],
        channels: Channels,
        streams: Mapping[int | None, PartitionStream],
        add_streams: Callable[[dict[int | None, str | None]], None],
        stopping: asyncio.Event,
        max_backoff: float,
        interval: float,
    ) -> None:
        self._consumer_id = consumer_id
        self._target = target
        self._partitions = partitions
        self._metadata = metadata
        self._channels = channels
        self._streams = streams
        self._add_streams = add_streams
        self._stopping = stopping
        self._max_backoff = max_backoff
        self._interval = interval
        self._wanted = asyncio.Event()  # a stream asked, or stop(): read (or end) now

    def wake(self) -> None:
        """Read the topology again now (a stream failed), or end `run` after stop()."""
        self._wanted.set()

    async def discover(self) -> Layout | None:
        """The first topology, from the target; None for a proxy without Topology (an older
        one: consume its only partition) or when stop() came first. Transient failures (the
        proxy not up yet) are retried; a target that is not a Triage proxy raises."""
        failures = 0
        target = self._target
        while not self._stopping.is_set():
            try:
                layout = await self._until_stopped(self._fetch(target))
                if layout is None:
                    break
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details()
                if not speaks_grpc(details):
                    raise EndpointError(
                        target, code, details, "it does not speak gRPC (a wrong port?)"
                    ) from exc
                if code is grpc.StatusCode.UNIMPLEMENTED:
                    # An older proxy, or a gRPC server that is no proxy: Consume tells which.
                    logger.info(
                        "consumer %s: %s does not answer Topology: consuming its only "
                        "partition, as with an older proxy",
                        self._consumer_id,
                        target,
                    )
                    return None
                error = error_for_status(code, details, target)
                if error is not None:
                    raise error from exc
                problem = f"{code.name}: {details}"
            else:
                if layout.partition_count > 0:
                    self._check_partitions(layout)
                    return layout
                problem = f"its topology lists no partitions ({layout.problem or 'no reason'})"
            delay = backoff_delay(failures, cap=self._max_backoff)
            failures += 1
            logger.warning(
                "consumer %s: no topology from %s (%s); retrying in %.2f s",
                self._consumer_id,
                target,
                problem,
                delay,
            )
            with suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
        return None

    def _check_partitions(self, layout: Layout) -> None:
        count = layout.partition_count
        missing = [p for p in self._partitions or () if p >= count]
        if missing:
            raise PartitionError(
                missing,
                f"partitions {missing} are not in topic {layout.topic!r}, which has {count} "
                f"partition{'s' if count != 1 else ''} (0 to {count - 1})",
            )

    def apply(self, layout: Layout) -> None:
        """Open streams for wanted partitions new to the Consumer; point the others at the
        endpoints serving them now."""
        count = layout.partition_count
        wanted = range(count) if self._partitions is None else self._partitions
        new: dict[int | None, str | None] = {}
        for p in wanted:
            if p >= count:
                continue
            endpoint = layout.endpoints.get(p)
            stream = self._streams.get(p)
            if stream is None:
                new[p] = endpoint
            elif endpoint is not None:
                stream.move(endpoint)
        if new and self._streams:
            logger.info(
                "consumer %s: partitions %s of %r are new: consuming them too",
                self._consumer_id,
                sorted(p for p in new if p is not None),
                layout.topic,
            )
        self._add_streams(new)

    def trouble(self, layout: Layout) -> str:
        """What in a topology answer calls for asking again soon ("" for nothing)."""
        if not layout.complete:
            return f"the topology of {layout.topic!r} is incomplete ({layout.problem})"
        unserved = sorted(p for p in self._streams if p is not None and p not in layout.endpoints)
        if unserved:
            return f"nobody serves partitions {unserved} of {layout.topic!r} now"
        return ""

    async def run(self, trouble: str) -> None:
        """Reads the topology every `interval`, at once when a stream asks, and every
        second or so while a wanted partition has no serving proxy, no proxy answered, or a
        stream is reconnecting, until stop(). Trouble is logged when it starts or changes,
        not per read; `trouble` is the first answer's."""
        loop = asyncio.get_running_loop()
        last = loop.time()
        failures = 1 if trouble else 0
        if trouble:
            logger.warning("consumer %s: %s; asking again soon", self._consumer_id, trouble)
        while not self._stopping.is_set():
            if failures:
                wait = backoff_delay(failures - 1, initial=0.1, cap=REFRESH_SOON_MAX_S)
            else:
                wait = self._interval
            with suppress(TimeoutError):
                await asyncio.wait_for(self._wanted.wait(), wait)
            gap = REFRESH_MIN_GAP_S - (loop.time() - last)
            if gap > 0 and not self._stopping.is_set():
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), gap)
            if self._stopping.is_set():
                return
            self._wanted.clear()
            last = loop.time()
            layout, problem = await self._fetch_any()
            if self._stopping.is_set():
                return
            if layout is not None:
                self.apply(layout)
                problem = self.trouble(layout)
            if problem and problem != trouble:
                logger.warning("consumer %s: %s; asking again soon", self._consumer_id, problem)
            elif trouble and not problem:
                logger.info("consumer %s: every partition is served again", self._consumer_id)
            trouble = problem
            # A stream that is reconnecting (its proxy died, say) may wait out a long
            # backoff; asking again soon lets a standby's endpoint wake it at once.
            reconnecting = any(
                s.endpoint is not None and not s.established for s in self._streams.values()
            )
            failures = failures + 1 if problem or reconnecting else 0

    def _fetch(self, endpoint: str) -> Coroutine[Any, Any, Layout]:
        return fetch_layout(self._channels.channel(endpoint), self._metadata, TOPOLOGY_TIMEOUT_S)

    async def _until_stopped(self, fetch: Coroutine[Any, Any, Layout]) -> Layout | None:
        """`fetch`'s answer, or None when stop() comes first (an endpoint that never answers
        must not hold up a stop)."""
        task = asyncio.ensure_future(fetch)
        stopped = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not task.done():
                task.cancel()
                with suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await task
        return task.result() if not task.cancelled() else None

    async def _fetch_any(self) -> tuple[Layout | None, str]:
        """The topology from the target, else from any endpoint a stream uses (any proxy
        answers); (None, what went wrong) when none did."""
        candidates = [self._target]
        for stream in list(self._streams.values()):
            if stream.endpoint is not None and stream.endpoint not in candidates:
                candidates.append(stream.endpoint)
        problems = []
        for endpoint in candidates:
            if self._stopping.is_set():
                break
            try:
                layout = await self._until_stopped(self._fetch(endpoint))
            except grpc.aio.AioRpcError as exc:
                problems.append(f"{endpoint}: {exc.code().name}")
                continue
            if layout is not None and layout.partition_count > 0:
                return layout, ""
            problems.append(f"{endpoint}: no partitions")
        return None, f"no proxy answered Topology ({', '.join(problems)})"
