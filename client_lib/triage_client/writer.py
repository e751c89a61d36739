"""What one partition stream sends: the Hello, then Started, Grant, Extend, Release and
Settle frames, one writer task per connection so frames never interleave.

Settlements go out when the batch is large, after a short delay, or when the stream's local
queue drains while the proxy may send fewer than half the credits (the moment its next batch
is needed): `after_settle`, which the pool calls as handlers finish. When the Welcome says
the proxy understands them (`ack_ranges`), runs of consecutive acks go as offset ranges
(`settle_frame`); against an older proxy, as plain acks.

Leases: every third of the Welcome's ack deadline the ticker (`extend_loop`) asks for an
Extend, which the writer builds when it sends it, listing the offsets the stream holds right
then: an offset is never extended after its settlement was sent.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, TypeAlias

import grpc

from triage_client.pool import SETTLE_DELAY_S
from triage_protocol import triage_pb2
from triage_protocol.constants import CLIENT_MAX_FRAME_BYTES

if TYPE_CHECKING:
    from triage_client.stream import PartitionStream, StreamContext

__all__ = ["ACK_BATCH", "CLOSE_TIMEOUT_S", "SETTLE_TICKS", "StreamWriter", "settle_frame"]

logger = logging.getLogger(__name__)

# grpc.aio's classes are generic only in the type stubs, hence the string.
Call: TypeAlias = "grpc.aio.StreamStreamCall[triage_pb2.ConsumerFrame, triage_pb2.ProxyFrame]"

ACK_BATCH = 1024
"""Settlements that are sent at once without waiting for the queue to drain (or the
stream's credits, when fewer). Measured: one Settle per drained batch beats sending
half-batches early, which costs CPU for no gain; and 1,024 rather than 256 halves the
Settle and Deliveries frames of a backlog (the proxy refills what a Settle frees in one
frame), each a gRPC write and read with fixed costs on both sides (bench_throughput: about
0.5 us per message less in the proxy and in the instances)."""
SETTLE_TICKS = 3
"""Most pool ticks (SETTLE_DELAY_S each) results wait for company before they are sent,
unless a quarter of the credits is tied up in them or the proxy runs short of credits
(`after_settle`). Measured (bench_efficiency, 1 process x 4 Consumers x 8 sync handlers):
a Settle on every 2 ms tick carried ~2 results, and each gRPC write holds the GIL ~70 us
(grpc.aio sends inline: sendmsg and an eventfd write), so the writes of 4 streams kept the
loop thread on the GIL while handler threads waited to wake."""
CLOSE_TIMEOUT_S = 5.0
"""How long stop() waits for the proxy to end the stream after the half-close."""


def settle_frame(acks: list[int], nacks: list[triage_pb2.Nack]) -> triage_pb2.Settle:
    """A Settle for a proxy that understands ack ranges: runs of consecutive offsets (most
    acks are: handlers finish in about delivery order) become `ack_ranges`, the rest stay
    plain acks. A duplicate ack stays a separate plain ack, so the proxy rejects it
    as it rejects any duplicate ack."""
    if not acks:
        return triage_pb2.Settle(nacks=nacks)
    ordered = sorted(acks)
    singles: list[int] = []
    ranges: list[triage_pb2.OffsetRange] = []
    first = prev = ordered[0]
    for offset in ordered[1:]:
        if offset == prev + 1:
            prev = offset
            continue
        if prev > first:
            ranges.append(triage_pb2.OffsetRange(first=first, last=prev))
        else:
            singles.append(first)
        first = prev = offset
    if prev > first:
        ranges.append(triage_pb2.OffsetRange(first=first, last=prev))
    else:
        singles.append(first)
    return triage_pb2.Settle(acks=singles, nacks=nacks, ack_ranges=ranges)


class StreamWriter:
    """The sending side of one PartitionStream, kept across its connections."""

    def __init__(self, stream: PartitionStream, context: StreamContext) -> None:
        self._stream = stream
        self._ctx = context
        self._ledger = context.pool.ledger
        self.wanted = asyncio.Event()
        """Something is due: the writer task wakes and flushes."""
        self._timer: asyncio.TimerHandle | None = None
        self.ticks_waited = 0  # pool ticks the unsent results have waited (SETTLE_TICKS)
        self.batch_limit = 1
        self.extend_due = False  # the ticker asked for an Extend
        self._grant_due = False  # a Grant with the stream's credits is due
        self._release_due = False
        """stop() began on an established stream: the next flush sends a Release, even empty."""
        self._started_due: list[int] = []  # isolated offsets whose Started is to be sent
        self.settled = 0
        """Offsets settled or released on this connection (the stream's `held` subtracts them)."""
        self.acked = 0
        self.nacked = 0
        self.extended = 0
        self.dropped = 0
        """Settlements lost with a write that failed."""

    def connecting(self, credits: int) -> None:
        """A new connection with `credits` is about to say Hello: nothing is due yet."""
        self.wanted.clear()
        self._grant_due = False
        self.settled = 0
        self.batch_limit = min(ACK_BATCH, credits)

    def ended(self) -> None:
        """The connection ended: what was due on it is void (the proxy redelivers)."""
        self._release_due = False
        self.extend_due = False
        self._started_due = []
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def release_all(self, established: bool) -> None:
        """stop() began: send a Release, even an empty one, on an established connection
        (it ends the stream's credits, else the proxy refills what the last Settle frees
        and holds that at the half-close, an attempt each)."""
        self._release_due = established
        self.wanted.set()

    def grant(self, credits: int) -> None:
        """Send a Grant of the stream's new `credits`."""
        self.batch_limit = min(ACK_BATCH, credits)
        self._grant_due = True
        self.wanted.set()

    def started(self, offset: int) -> None:
        """Send a Started for the isolated delivery at `offset` (its turn came)."""
        self._started_due.append(offset)
        self.wanted.set()

    async def run(self, call: Call) -> None:
        """The connection's writer task: Hello, then whatever is due, until the half-close."""
        ctx = self._ctx
        stream = self._stream
        hello = triage_pb2.Hello(
            consumer_id=ctx.consumer_id,
            credits=stream.credits,
            max_frame_bytes=CLIENT_MAX_FRAME_BYTES,
            packed_deliveries=True,
            isolation=True,
        )
        if stream.named and stream.partition is not None:
            hello.partition = stream.partition
        try:
            await call.write(triage_pb2.ConsumerFrame(hello=hello))
            while True:
                await self.wanted.wait()
                self.wanted.clear()
                await self._flush(call)
                account = stream.account
                if ctx.stopping.is_set() and not account.outstanding:
                    while account.acks or account.nacks or account.releases:
                        await self._flush(call)
                    await call.done_writing()
                    logger.debug(
                        "consumer %s: %s: final settlements sent, half-closed",
                        ctx.consumer_id,
                        stream.label,
                    )
                    await asyncio.sleep(CLOSE_TIMEOUT_S)
                    logger.warning(
                        "consumer %s: proxy did not end the stream for %s %.0f s after half-close",
                        ctx.consumer_id,
                        stream.label,
                        CLOSE_TIMEOUT_S,
                    )
                    call.cancel()
                    return
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            raise  # the call is over and its status is known: the reader reports it
        except BaseException:
            call.cancel()  # wake the reader, which reports how the stream ended
            raise

    async def extend_loop(self, deadline_ms: asyncio.Future[int]) -> None:
        """The connection's ticker: every third of the ack deadline, while handlers run, ask
        for an Extend (a deadline of 0 means leases never lapse: nothing to do)."""
        interval = (await deadline_ms) / 3000
        if not interval:
            return
        account = self._stream.account
        while True:
            await asyncio.sleep(interval)
            if account.running:
                self.extend_due = True
                self.wanted.set()

    async def _flush(self, call: Call) -> None:
        stream = self._stream
        if self._started_due:
            offsets, self._started_due = self._started_due, []
            await call.write(triage_pb2.ConsumerFrame(started=triage_pb2.Started(offsets=offsets)))
        if self._grant_due:
            self._grant_due = False
            grant = triage_pb2.Grant(credits=stream.credits)
            await call.write(triage_pb2.ConsumerFrame(grant=grant))
        account = stream.account
        if self.extend_due:
            # Listed at send time, before any settlement that follows it: a handler that has
            # finished is out of the set before its result can be settled, so the proxy never
            # sees an offset extended after it was settled.
            self.extend_due = False
            offsets = self._ledger.leases(account)
            if offsets:
                extend = triage_pb2.Extend(offsets=offsets)
                await call.write(triage_pb2.ConsumerFrame(extend=extend))
                self.extended += len(offsets)
        if account.releases or self._release_due:
            self._release_due = False
            releases = self._ledger.take_releases(account)
            self.settled += len(releases)
            await call.write(triage_pb2.ConsumerFrame(release=triage_pb2.Release(offsets=releases)))
        if not account.acks and not account.nacks:
            return
        acks, nacks = self._ledger.take_settlements(account)
        self.ticks_waited = 0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.settled += len(acks) + len(nacks)
        if stream.ack_ranges and len(acks) > 1:
            settle = settle_frame(acks, nacks)
        else:
            settle = triage_pb2.Settle(acks=acks, nacks=nacks)
        try:
            await call.write(triage_pb2.ConsumerFrame(settle=settle))
        except BaseException:
            self.dropped += len(acks) + len(nacks)
            raise
        self.acked += len(acks)
        self.nacked += len(nacks)
        stream.settlements_sent(acks, nacks)

    def _on_timer(self) -> None:
        self._timer = None
        self.wanted.set()

    def after_settle(self, queue_drained: bool, *, due: bool = False, timer: bool = True) -> bool:
        """Send now if the batch is full, or if nobody is queued behind it while the proxy
        may send fewer than half the credits (the freed ones are needed); else within
        SETTLE_DELAY_S (by a timer of its own, unless the pool's tick will ask: `timer`
        False). On a pool tick (`due`) results are sent once they tie up a quarter of the
        credits or have waited SETTLE_TICKS ticks; True: they wait for a later tick (the
        pool keeps ticking for this stream).

        While the proxy may still send half the credits, its next deliveries are on their
        way or it has none: a drained queue then waits for company instead of costing a
        Settle frame per few results (each a gRPC write, a proxy wake-up and a loop turn on
        both sides)."""
        stream = self._stream
        account = stream.account
        pending = len(account.acks) + len(account.nacks)
        if not pending:
            if self._ctx.stopping.is_set() and not account.outstanding:
                self.wanted.set()  # let the writer half-close
            return False
        credits = stream.credits
        if pending >= self.batch_limit or (
            queue_drained and 2 * (credits - stream.received + self.settled) < credits
        ):
            self.wanted.set()
        elif due:
            self.ticks_waited += 1
            if (
                self.ticks_waited < SETTLE_TICKS
                and 4 * pending < credits
                and not self._ctx.stopping.is_set()
            ):
                return True
            self.wanted.set()
        elif timer and self._timer is None and (loop := stream.loop) is not None:
            self._timer = loop.call_later(SETTLE_DELAY_S, self._on_timer)
        return False
