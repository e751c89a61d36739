"""Moving one Consumer's credits and handler slots between its partition streams.

Every REBALANCE_INTERVAL_S (sooner when a handler slot ran dry beside a backlog while the
default prefetch can still grow) the rebalancer asks each stream what it held (`load`),
runs the pure policies of credits.py over the loads (`grown` for the default prefetch,
`split` for the credits and slots), sets the slots in the pool's ledger and sends Grants
where a stream's credits changed. It starts moving credits once a stream's proxy says it
honours Grant frames; until then each stream keeps its Hello's share (`credits_for`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from contextlib import suppress

from triage_client.credits import (
    REBALANCE_INTERVAL_S,
    STREAM_CAPS_MAX,
    credit_share,
    grown,
    grown_cap,
    split,
)
from triage_client.pool import HandlerPool
from triage_client.stream import PartitionStream
from triage_protocol.constants import MAX_CREDITS

__all__ = ["AUTO_PREFETCH_MAX", "Rebalancer"]

logger = logging.getLogger(__name__)

AUTO_PREFETCH_MAX = 4
"""The default prefetch grows to this many times `concurrency` when the round trip outlasts
the local queue (see credits.grown)."""


class Rebalancer:
    """Owns the Consumer's credit budget and splits it, with the handler slots, over the
    streams (the Consumer's map, read here, changed only by the Consumer)."""

    def __init__(
        self,
        consumer_id: str,
        concurrency: int,
        prefetch: int | None,
        pool: HandlerPool,
        streams: Mapping[int | None, PartitionStream],
        stopping: asyncio.Event,
    ) -> None:
        self._consumer_id = consumer_id
        self._concurrency = concurrency
        self._auto_prefetch = prefetch is None
        self.credits = concurrency + (concurrency if prefetch is None else prefetch)
        """The budget: most unsettled deliveries over all streams (the default prefetch may
        grow it)."""
        self._max_credits = max(
            self.credits, min(MAX_CREDITS, concurrency * (1 + AUTO_PREFETCH_MAX))
        )
        """Most credits one stream is given; the default prefetch grows to this once per
        stream with a backlog, up to STREAM_CAPS_MAX of them (credits.grown_cap)."""
        self._granting = False  # a stream's proxy has honoured Grant frames: credits move
        self._pool = pool
        self._streams = streams
        self._stopping = stopping
        self._now = asyncio.Event()
        """Ends a rebalance period early: stop(), or a slot ran dry beside a backlog while
        the default prefetch can still grow (`on_idle`)."""

    def wake(self) -> None:
        """End the current period now (stop() calls it, so `run` returns)."""
        self._now.set()

    def credits_for(self, stream: PartitionStream) -> int:
        """The Hello credits of a stream about to connect: its share of the even split; once
        credits move, no more than what the other streams leave free."""
        order = sorted(self._streams, key=by_partition)
        share = credit_share(
            self.credits, len(order), order.index(stream.partition if stream.named else None)
        )
        if not self._granting:
            return share
        others = sum(s.committed() for s in self._streams.values() if s is not stream)
        return max(1, min(share, self.credits - others))

    async def run(self) -> None:
        """Every REBALANCE_INTERVAL_S, until stop(): split credits and handler slots over
        the streams from what each showed (see credits.py); send Grants where they changed."""
        streams = self._streams
        while not self._stopping.is_set():
            with suppress(TimeoutError):
                await asyncio.wait_for(self._now.wait(), REBALANCE_INTERVAL_S)
            self._now.clear()
            idled = self._pool.ledger.take_idled()
            if self._stopping.is_set() or (
                len(streams) < 2 and not self._granting and not self._auto_prefetch
            ):
                continue
            current = list(streams.values())
            loads = [stream.load() for stream in current]
            if any(load.adjustable for load in loads):
                self._granting = True
            if self._auto_prefetch and self._granting:
                cap = grown_cap(self._max_credits, MAX_CREDITS, loads)
                budget = grown(self.credits, cap, loads, idled)
                if budget != self.credits:
                    logger.info(
                        "consumer %s: handler slots ran out of queued work while the proxy "
                        "had more: prefetch %d -> %d",
                        self._consumer_id,
                        self.credits - self._concurrency,
                        budget - self._concurrency,
                    )
                    self.credits = budget
            decision = split(self._concurrency, self.credits, loads, self._max_credits)
            raised = self._pool.ledger.set_slots(
                [stream.account for stream in current], decision.slots
            )
            for stream, load, credits in zip(current, loads, decision.credits, strict=True):
                if load.adjustable:
                    stream.set_credits(credits)
            if raised:
                self._pool.kick()

    def on_idle(self) -> None:
        """A handler slot found nothing queued (on the loop): while the default prefetch can
        still grow and a stream shows a backlog, rebalance now rather than at the end of the
        period (a tenth of a second of slots waiting for refills, each time). Also before
        the first rebalance has seen a stream that takes Grants: a run's first tenth of a
        second is when the local queue runs dry first (measured, bench_efficiency 1x4x8:
        21-25 of 32 slots busy in it, all 32 afterwards)."""
        streams = self._streams.values()
        if (
            self._auto_prefetch
            and self.credits
            < min(MAX_CREDITS, self._max_credits * min(STREAM_CAPS_MAX, len(streams)))
            and not self._now.is_set()
            and (self._granting or any(s.grants and s.call is not None for s in streams))
            and any(s.backlogged() for s in streams)
        ):
            self._now.set()


def by_partition(partition: int | None) -> int:
    """Sort key of a partition, with None (an older proxy's only partition) first."""
    return -1 if partition is None else partition
