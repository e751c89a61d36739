"""One partition's stream: Hello, deliveries into the shared pool, batched settlements, leases.

How a delivery flows:

    reader  --Deliveries-->  this stream's local queue  -->  the Consumer's shared handler pool
    handler returns / raises  -->  this stream's ack / nack batch  --Settle-->  proxy (writer)

The Hello asks for packed deliveries (`packed_deliveries`): a proxy that knows them sends
most records as columns, decoded without a protobuf object per delivery
(`message.messages_of`); a proxy without them sends repeated Delivery messages, which
are read as well. What the stream sends (Hello, batched settlements, Extend, Grant, Started,
Release) is writer.py's: this module reads frames and keeps the connection.

A broken stream is reopened with capped, jittered backoff, at the endpoint the topology names
for its partition then: a proxy that refuses the Hello with FAILED_PRECONDITION and names the
partition's owner (`triage-owner-endpoint`) is followed at once, and every failure asks the
Consumer to refresh the topology. Each stream is an epoch: results of handlers that started on
an earlier stream are dropped and counted, never settled on the new stream, because the proxy
redelivers whatever the broken stream held.

Leases: the proxy redelivers a delivery left unsettled for the Welcome's `ack_deadline_ms`.
Every third of that deadline one Extend frame lists the offsets this stream holds right then
(running or queued for a handler slot, not yet settled), so long work keeps its lease and so do
the deliveries queued behind it (as Pub/Sub's client does): writer.py. A delivery whose
instance dies or hangs its event loop stops being extended and is redelivered after the
deadline.

Isolated deliveries: the Hello sets `isolation`; a delivery the proxy flags isolated (a
suspect: its earlier holder vanished) waits for the process's turn (isolation.py), then the
writer sends Started and, once the proxy answers it, it takes the next handler slot; the
turn passes on when its Settle is written (or the connection ends).

Credits: the Hello announces the Consumer's split for this stream. When the Welcome says the
proxy honours Grant frames (`grants`), the Consumer changes them while the stream runs
(`set_credits`, rebalancer.py): the writer sends a Grant, and the stream reports what it
held (`load`) to the next rebalance. Against an older proxy the Hello's credits hold.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import TypeAlias

import grpc

from triage_client.credits import StreamLoad
from triage_client.errors import PartitionError, error_for_status
from triage_client.isolation import StreamTurn
from triage_client.message import ConsumerStats, messages_of
from triage_client.pool import HandlerPool
from triage_client.topology import owner_endpoint
from triage_client.writer import Call, StreamWriter
from triage_protocol import triage_pb2

__all__ = ["PartitionStream", "StreamContext", "backoff_delay"]

logger = logging.getLogger(__name__)

Consume: TypeAlias = (
    "grpc.aio.StreamStreamMultiCallable[triage_pb2.ConsumerFrame, triage_pb2.ProxyFrame]"
)

DEFAULT_MAX_BACKOFF_S = 5.0
INITIAL_BACKOFF_S = 0.05
SETTLE_BATCH = 256
"""Results a handler slot runs (async) or a handler thread hands back (sync) before the loop
gets a turn: the pool's batch (consumer.py)."""
MAX_REDIRECTS = 3
"""Owner endpoints followed at once in a row; past that, redirects wait out the backoff too,
so two proxies that each name the other cannot spin a stream."""
LOWERED_GRACE_S = 1.0
"""How long after a lowering Grant the stream still allows its old credits before it warns
that the proxy sent more: a Grant is not acknowledged, and Deliveries decided under the
old credits arrive a round trip after it, which a busy machine stretches past a rebalance
period (with one period, the warning named proxies that had done nothing wrong). Only the
warning waits this long; the budget counts the old credits for one period (credits.py)."""


def backoff_delay(
    failures: int,
    *,
    initial: float = INITIAL_BACKOFF_S,
    cap: float = DEFAULT_MAX_BACKOFF_S,
    rand: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait before reconnect number `failures` (0-based): exponential, capped,
    with jitter over the upper half so many instances do not reconnect in lockstep."""
    ceiling = min(cap, initial * 2.0 ** min(failures, 32))
    return ceiling / 2 + ceiling / 2 * rand()


@dataclass(frozen=True, slots=True, eq=False)
class StreamContext:
    """What every stream of one Consumer shares."""

    consumer_id: str
    """The instance name sent in each Hello."""
    metadata: tuple[tuple[str, str], ...]
    """Call metadata (the bearer token)."""
    pool: HandlerPool
    """The handler slots all streams feed."""
    stopping: asyncio.Event
    """Set once stop() began: streams drain and end."""
    max_backoff: float
    """Longest wait between reconnects."""
    allowed: frozenset[int] | None
    """`partitions=[...]`: checked against the Welcome of a stream that names none."""
    consume: Callable[[str], Consume]
    """The Consume method on the shared channel to an endpoint."""
    credits: Callable[[PartitionStream], int]
    """Hello credits for a stream about to connect (the Consumer's split)."""
    refresh: Callable[[], None]
    """Ask the Consumer to read the topology again now."""


class PartitionStream:
    """The stream for one partition (or, against a proxy without Topology, for that proxy's
    only partition): reconnects until stop(), following the partition's owner."""

    def __init__(self, context: StreamContext, partition: int | None, endpoint: str | None) -> None:
        self._ctx = context
        self.named = partition is not None
        """The Hello names the partition (False: an older proxy's only partition)."""
        self.partition = partition
        """The partition, or None until the Welcome of an unnamed stream says which."""
        self.endpoint = endpoint
        """Where the next connection goes; None while nobody serves the partition."""
        self._wake = asyncio.Event()  # a new endpoint, or stop(): cut a backoff short
        self.loop: asyncio.AbstractEventLoop | None = None
        """The event loop the stream runs on (once it runs)."""

        self.account = context.pool.ledger.open(self)
        """This stream's deliveries in hand: queued, running, results to send (ledger.py)."""
        self._ledger = context.pool.ledger

        # Touched only on the loop thread.
        self.credits = 0
        """Most unsettled deliveries the proxy may send now (the Hello's or the last Grant's)."""
        self.grants = False
        """This stream's proxy honours Grant frames (its Welcome said so)."""
        self.ack_ranges = False
        """This stream's proxy understands Settle.ack_ranges (its Welcome said so)."""
        self._lowered_from = 0  # credits before a lowering in this rebalance period
        self._lowered_at = -float("inf")  # the loop's time() at the last lowering
        self._allowed = 0  # most the stream may hold: credits, or higher ones just lowered
        self._peak = 0  # most held at once since the last rebalance
        self.call: Call | None = None
        self.established = False
        self.received = 0
        """Deliveries received on this connection (`held` subtracts what the writer sent)."""
        self._over_warned = False
        self._writer = StreamWriter(self, context)
        """What this stream sends (writer.py)."""
        self._turn = StreamTurn(self, context, self._writer)
        """Its isolated deliveries and the process's turn (isolation.py)."""
        self.after_settle = self._writer.after_settle
        """Handlers' results arrived (the pool calls it): send them now or soon."""

        self.delivered = 0
        self.rejected = 0
        self.dropped = 0
        self.opened = 0

    @property
    def label(self) -> str:
        """How logs name this stream's partition."""
        if self.partition is None:
            return "the proxy's only partition"
        return f"partition {self.partition}"

    @property
    def held(self) -> int:
        """Delivered on this connection and not yet settled or released."""
        return self.received - self._writer.settled

    def stats(self) -> ConsumerStats:
        writer = self._writer
        return ConsumerStats(
            delivered=self.delivered,
            acked=writer.acked,
            nacked=writer.nacked,
            rejected=self.rejected,
            dropped=self.dropped + writer.dropped + self.account.dropped,
            reconnects=max(0, self.opened - 1),
            extended=writer.extended,
        )

    def move(self, endpoint: str) -> None:
        """The topology names a new endpoint for this partition: the next connection goes
        there, and a reconnect waiting out its backoff goes now. A working stream stays: the
        proxy that lost the partition ends it."""
        if endpoint != self.endpoint:
            logger.info(
                "consumer %s: %s is served at %s now",
                self._ctx.consumer_id,
                self.label,
                endpoint,
            )
            self.endpoint = endpoint
            self._wake.set()

    def begin_stop(self) -> tuple[int, int]:
        """Release the queued deliveries and let the writer drain; (in flight, released)."""
        taken = self._ctx.pool.take_back(self.account)
        self._turn.give_back()
        if taken:
            self._ledger.release(self.account, (message.offset for message in taken))
            self.dropped += len(taken)
        self._writer.release_all(self.call is not None and self.established)
        if self.call is not None and not self.established:
            self.call.cancel()  # nothing to settle yet: do not wait for a slow connect
        self._wake.set()
        return self.account.outstanding, len(taken)

    # -- connections -----------------------------------------------------------------------

    async def run(self) -> None:
        """Consume until stop(); raises a StreamError the proxy means for good."""
        ctx = self._ctx
        self.loop = asyncio.get_running_loop()
        failures = 0
        redirects = 0
        while not ctx.stopping.is_set():
            self._wake.clear()
            endpoint = self.endpoint
            if endpoint is None:
                await self._wake.wait()  # nobody serves the partition: wait for the topology
                continue
            owner = None
            try:
                await self._stream(ctx.consume(endpoint))
            except grpc.aio.AioRpcError as exc:
                if ctx.stopping.is_set():
                    break
                error = error_for_status(exc.code(), exc.details(), endpoint)
                if error is not None:
                    raise error from exc
                if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
                    owner = owner_endpoint(exc.trailing_metadata())
                problem = f"{exc.code().name}: {exc.details()}"
            else:
                if ctx.stopping.is_set():
                    break
                problem = "the proxy ended the stream"
            finally:
                self._end_stream()
            if self.established:
                failures = redirects = 0
            else:
                failures += 1
            if self.named:
                ctx.refresh()  # the topology may know a better endpoint by now
            if owner is not None and owner != endpoint:
                self.endpoint = owner
                if redirects < MAX_REDIRECTS:
                    redirects += 1
                    logger.info(
                        "consumer %s: %s does not serve %s (%s); following it to %s",
                        ctx.consumer_id,
                        endpoint,
                        self.label,
                        problem,
                        owner,
                    )
                    continue
            delay = backoff_delay(failures, cap=ctx.max_backoff)
            logger.warning(
                "consumer %s: stream for %s at %s lost (%s); reconnecting in %.2f s",
                ctx.consumer_id,
                self.label,
                endpoint,
                problem,
                delay,
            )
            with suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    async def _stream(self, consume: Consume) -> None:
        """One stream, from Hello to its end; the reader owns the outcome."""
        self.opened += 1
        self.established = False
        self._over_warned = False
        self.credits = self._allowed = self._ctx.credits(self)
        self.grants = self.ack_ranges = False
        self._lowered_from = self._peak = self.received = 0
        self._writer.connecting(self.credits)
        call = consume(metadata=self._ctx.metadata)
        self.call = call
        loop = asyncio.get_running_loop()
        deadline_ms: asyncio.Future[int] = loop.create_future()  # the Welcome's ack deadline
        writer = loop.create_task(self._writer.run(call), name="triage-writer")
        ticker = loop.create_task(self._writer.extend_loop(deadline_ms), name="triage-extender")
        try:
            await self._read_loop(call, deadline_ms)
        finally:
            writer.cancel()
            ticker.cancel()
            await asyncio.wait([writer, ticker])
            call.cancel()
            if not ticker.cancelled() and (bug := ticker.exception()) is not None:
                raise bug
            if not writer.cancelled():
                exc = writer.exception()
                # A failed write also fails the read, which reports it; anything else is a bug.
                if exc is not None and not isinstance(
                    exc, grpc.aio.AioRpcError | asyncio.InvalidStateError
                ):
                    raise exc

    def _end_stream(self) -> None:
        """Forget what the dead stream held: the proxy redelivers all of it."""
        self.call = None
        leases = self.account.running  # the ended connection's: a handler leaves it when done
        taken = self._ctx.pool.take_back(self.account, next_epoch=True)
        released = len(taken)
        unsent = self._ledger.forget(self.account)
        self._writer.ended()
        self._turn.connection_ended(leases, taken)  # the proxy redelivers what waited
        self.dropped += released + unsent
        self.received = self._writer.settled
        if released or unsent:
            logger.debug(
                "consumer %s: %s: dropped %d queued deliveries and %d unsent settlements",
                self._ctx.consumer_id,
                self.label,
                released,
                unsent,
            )

    async def _read_loop(self, call: Call, deadline_ms: asyncio.Future[int]) -> None:
        task = asyncio.current_task()
        while True:
            try:
                frame = await call.read()
            except asyncio.CancelledError:
                # grpc.aio raises CancelledError when *we* cancelled the call (stop() before
                # Welcome, a failed writer, the close timeout); that ends this stream normally.
                if task is None or task.cancelling():
                    raise
                return
            if not isinstance(frame, triage_pb2.ProxyFrame):  # EOF: the proxy ended the stream
                return
            kind = frame.WhichOneof("frame")
            if kind == "deliveries":
                self._on_deliveries(frame.deliveries)
            elif kind == "rejected":
                self.rejected += len(frame.rejected.offsets)
                logger.warning(
                    "consumer %s: proxy rejected %d settlements: %s",
                    self._ctx.consumer_id,
                    len(frame.rejected.offsets),
                    frame.rejected.reason,
                )
            elif kind == "welcome":
                self._on_welcome(frame.welcome, deadline_ms)
            elif kind == "started":
                self._turn.on_started(frame.started.offsets)

    def _on_welcome(self, welcome: triage_pb2.Welcome, deadline_ms: asyncio.Future[int]) -> None:
        ctx = self._ctx
        if not self.named:
            allowed = ctx.allowed
            if allowed is not None and welcome.partition not in allowed:
                raise PartitionError(
                    set(allowed),
                    f"partitions {sorted(allowed)} asked for, but the proxy at {self.endpoint} "
                    f"(an older proxy, without Topology) serves only partition "
                    f"{welcome.partition} of {welcome.topic!r}",
                )
            self.partition = welcome.partition
        self.established = True
        self.grants = welcome.grants
        self.ack_ranges = welcome.ack_ranges
        if not deadline_ms.done():
            deadline_ms.set_result(welcome.ack_deadline_ms)
        logger.info(
            "consumer %s connected to %s: %s[%d], credits %d%s, ack deadline %d ms, "
            "max attempts %d",
            ctx.consumer_id,
            self.endpoint,
            welcome.topic,
            welcome.partition,
            self.credits,
            " (granted as needed)" if welcome.grants else "",
            welcome.ack_deadline_ms,
            welcome.max_attempts,
        )

    def settlements_sent(self, acks: list[int], nacks: list[triage_pb2.Nack]) -> None:
        """The writer sent these results (an isolated delivery's passes the turn on)."""
        self._turn.settled(acks, nacks)

    # -- deliveries and settlements ----------------------------------------------------------

    def _on_deliveries(self, batch: triage_pb2.Deliveries) -> None:
        messages = messages_of(batch)
        count = len(messages)
        self.established = True
        self.delivered += count
        self.received += count
        held = self.received - self._writer.settled
        if held > self._peak:
            self._peak = held
        if held > self._allowed and not self._over_warned:
            self._over_warned = True
            logger.warning(
                "consumer %s: proxy sent %d unsettled deliveries, more than the %d credits",
                self._ctx.consumer_id,
                held,
                self._allowed,
            )
        if self._ctx.stopping.is_set():
            self.dropped += count  # released: the proxy redelivers them
            self._ledger.release(self.account, (message.offset for message in messages))
            self._writer.wanted.set()
            return
        if batch.isolated:
            self._turn.isolate(messages, batch.isolated)
            return
        self._ctx.pool.submit(self.account, messages)

    def load(self) -> StreamLoad:
        """What this stream showed since the last call (one rebalance period), for the
        Consumer's split; starts the next period."""
        connected = self.call is not None and self.established
        held = self.held
        load = StreamLoad(
            credits=self.credits if connected else 0,
            peak=max(self._peak, held),
            committed=self.committed(),
            adjustable=connected and self.grants and not self._ctx.stopping.is_set(),
        )
        self._peak = held
        if self._now() - self._lowered_at >= LOWERED_GRACE_S:
            # No lowering for LOWERED_GRACE_S: what was on its way under the old credits has
            # arrived, so from now on the proxy sends only while the stream holds fewer.
            self._allowed = self.credits
        self._lowered_from = 0
        return load

    def backlogged(self) -> bool:
        """This period the stream held more than half its credits at once (credits.grown's
        sign of a backlog at its proxy)."""
        return self.established and 2 * max(self._peak, self.held) > self.credits

    def committed(self) -> int:
        """Most unsettled deliveries this stream may come to hold without a new Grant: its
        credits, what it holds, and what a lowering in this period may still bring."""
        if self.call is None:
            return 0  # its next Hello asks the Consumer for credits again
        return max(self.credits, self.held, self._lowered_from)

    def _now(self) -> float:
        """The event loop's clock: the one every timer of the client reads (so a test's
        loop with a virtual clock drives it all). Called on the loop thread."""
        loop = self.loop or asyncio.get_running_loop()
        return loop.time()

    def set_credits(self, credits: int) -> None:
        """The Consumer's new split gives this stream `credits`: the writer sends a Grant.
        Only for a stream whose proxy honours Grant (`grants`)."""
        if credits == self.credits or not self.grants or self.call is None:
            return
        if credits < self.credits:
            self._lowered_from = max(self._lowered_from, self.credits)
            self._lowered_at = self._now()
        else:
            self._allowed = max(self._allowed, credits)
        self.credits = credits
        self._writer.grant(credits)
