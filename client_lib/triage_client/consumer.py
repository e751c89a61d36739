"""The consumer: every partition of a deployment, one pool of handler slots, batched settlements.

How it finds its partitions: `Consumer(target, ...)` asks the proxy at `target` for the
Topology (any proxy of a deployment answers: which endpoint serves which partition now), then
opens one stream per partition at that partition's endpoint, channels shared per endpoint,
each Hello naming its partition (`partitions=[...]` restricts the set). The topology is read
again every `topology_interval` seconds, at once when a stream fails, and every second or so
while a wanted partition has no serving proxy, so a partition that fails over to a standby or
one added to the topic is followed without a restart. A proxy that predates Topology
(UNIMPLEMENTED) is consumed with one stream whose Hello names no partition, meaning that
proxy's only partition; a gRPC server that answers neither is not a Triage proxy, and one that
does not speak gRPC at all is reported as such at once.

    Topology --> PartitionStream per partition --deliveries--> HandlerPool (concurrency slots)
                         ^                                            |
                         +------------- acks / nacks (per stream) ----+

Credits (the split): the proxy lets a stream hold at most the credits its Hello announced,
`concurrency + prefetch` split evenly over the partition streams (`credit_share`). When a
proxy's Welcome says it honours Grant frames, the Consumer moves credits between its streams
as they need them: every REBALANCE_INTERVAL_S a pure policy (`credits.split`) gives a
partition that filled its credits (a backlog) an even share of the budget beside the other
backlogs plus what the others leave, and shrinks an idle one to a small prefetch; raises come
only out of credits no stream may hold, so total unsettled deliveries stay within
`concurrency + prefetch` (a stream keeps at least 1, so more partitions than that exceed it
by design; the default prefetch grows with the number of backlogged partitions, up to 16
single-stream caps, none of them given more than one: credits.py). The same rebalance caps
how many handler slots each backlogged partition may run
(an even share of `concurrency`), and the shared pool gives a free slot to the stream with
the fewest running handlers under its cap (see pool.py), so a partition with a backlog of
slow messages never starves another, and a partition alone with work gets every slot.
Against a proxy without Grant (no `Welcome.grants`) a stream keeps its Hello's share: when
only one partition has work, it then uses at most its share of the credits.

The Consumer owns the lifecycle (run, stop, the order of shutdown) and its parts: following
the topology is in follower.py, moving credits and slots in rebalancer.py, the channels per
endpoint in channels.py, stream mechanics (reconnects, epochs, batching, leases) in
stream.py, the handler pool and the fairness rule in pool.py.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import socket
import threading
from collections.abc import Coroutine, Iterable
from contextlib import suppress
from typing import Any

import grpc

from triage_client.channels import Channels
from triage_client.errors import Retry, StateError
from triage_client.follower import TopologyFollower
from triage_client.loop import SHARED
from triage_client.message import ConsumerStats
from triage_client.pool import Handler, HandlerPool
from triage_client.rebalancer import AUTO_PREFETCH_MAX, Rebalancer, by_partition
from triage_client.stream import (
    DEFAULT_MAX_BACKOFF_S,
    SETTLE_BATCH,
    PartitionStream,
    StreamContext,
    backoff_delay,
)
from triage_protocol.constants import (
    AUTHORIZATION_METADATA,
    BEARER_PREFIX,
    MAX_REASON_CHARS,
    UINT32_MAX,
)

__all__ = ["AUTO_PREFETCH_MAX", "MAX_REASON_CHARS", "Consumer", "Handler", "backoff_delay"]

logger = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 16
DEFAULT_TOPOLOGY_INTERVAL_S = 30.0
"""How often a running Consumer reads the topology again when nothing asks for it sooner."""


class _State(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    STOPPED = "stopped"


class Consumer:
    """Consumes a deployment's partitions with a handler: return to ack, raise to nack.

    `run()` blocks until `stop()`; `run_async()` does the same in the caller's event loop.
    A Consumer runs once. Shutdown order on stop(), for every stream at once: stop taking
    deliveries (queued ones are released for the proxy to redeliver) -> wait for running
    handlers -> send their settlements -> half-close the stream -> wait for the proxy to end
    it -> return once every stream has ended.

    A handler that raises `Retry`, or an instance of a class in `retry_on`, nacks with
    retry=True: the proxy redelivers the message after its backoff (until its attempt limit).
    Any other exception nacks with retry=False: the proxy dead-letters the message now.
    While a delivery is in this instance's hands (running or queued), its lease is extended
    automatically every third of the proxy's ack deadline (see writer.py).
    """

    def __init__(
        self,
        target: str,
        token: str,
        handler: Handler,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        prefetch: int | None = None,
        partitions: Iterable[int] | None = None,
        consumer_id: str | None = None,
        secure: bool = False,
        max_backoff: float = DEFAULT_MAX_BACKOFF_S,
        retry_on: tuple[type[BaseException], ...] = (),
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
        topology_interval: float = DEFAULT_TOPOLOGY_INTERVAL_S,
    ) -> None:
        """Configure, without connecting.

        target: any proxy of the deployment, `host:port` (one proxy of an older deployment
            without Topology: then that proxy's only partition is consumed).
        concurrency: most handlers running at once, over all partitions (threads for a sync
            handler).
        prefetch: deliveries queued locally beyond the running ones, so handlers never wait
            for a round trip (default: concurrency, raised to AUTO_PREFETCH_MAX x concurrency
            once handler slots run out of queued work while the proxy has a backlog, against
            a proxy that honours Grant; with several partitions backlogged at once, that
            much more for each, up to 16, while no partition's stream gets more than one
            stream's share: see credits.py); credits = concurrency + prefetch, split
            over the partitions' streams.
        partitions: consume only these partitions (default: every partition of the topic,
            including ones added later); one the topic lacks raises PartitionError at start.
        consumer_id: stable instance name recorded on dead letters (default: host-pid).
        secure: TLS with the system's root certificates (default: plaintext).
        max_backoff: longest wait, in seconds, between reconnect attempts.
        retry_on: exception classes (subclasses included) that nack with retry=True, as
            `Retry` always does, e.g. `(TimeoutError, ConnectionError)` for a flaky downstream.
        root_certificates: PEM bytes of the CA that signed the proxy's certificate, for a
            private CA (implies TLS).
        certificate_chain, private_key: PEM bytes of this app's client certificate and its
            key, for a proxy that requires client certificates (mTLS; implies TLS).
        topology_interval: seconds between topology reads when nothing asks sooner (a
            stream failing asks at once).
        """
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        auto_prefetch = prefetch is None
        prefetch = concurrency if prefetch is None else prefetch
        if prefetch < 0:
            raise ValueError(f"prefetch must not be negative, got {prefetch}")
        if concurrency + prefetch > UINT32_MAX:
            raise ValueError("concurrency + prefetch does not fit the protocol's uint32 credits")
        if max_backoff <= 0:
            raise ValueError(f"max_backoff must be positive, got {max_backoff}")
        if topology_interval <= 0:
            raise ValueError(f"topology_interval must be positive, got {topology_interval}")
        for cls in retry_on:
            if not (isinstance(cls, type) and issubclass(cls, BaseException)):
                raise TypeError(f"retry_on takes exception classes, got {cls!r}")
        if (certificate_chain is None) != (private_key is None):
            raise ValueError("give certificate_chain and private_key together")
        wanted: tuple[int, ...] | None = None
        if partitions is not None:
            wanted = tuple(sorted(set(partitions)))
            if not wanted:
                raise ValueError("partitions is empty: leave it out to consume every partition")
            for p in wanted:
                if isinstance(p, bool) or not isinstance(p, int) or p < 0:
                    raise ValueError(f"partitions are numbers from 0, got {p!r}")
        self._target = target
        self._partitions = wanted
        self._metadata = ((AUTHORIZATION_METADATA, BEARER_PREFIX + token),)
        self._concurrency = concurrency
        self._consumer_id = consumer_id or f"{socket.gethostname()}-{os.getpid()}"
        credentials: grpc.ChannelCredentials | None = None
        if secure or root_certificates or certificate_chain:
            credentials = grpc.ssl_channel_credentials(
                root_certificates, private_key, certificate_chain
            )
        self._channels = Channels(credentials, max_backoff)

        self._state = _State.IDLE
        # stop() may run on any thread or in a signal handler: it only sets flags and
        # schedules _begin_stop on the loop (no locks, which a signal handler could deadlock on).
        self._stop_requested = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = asyncio.Event()
        self._pool = HandlerPool(
            handler, concurrency, (Retry, *retry_on), min(SETTLE_BATCH, concurrency + prefetch)
        )
        # Touched only on the loop thread (stats reads a snapshot of the values).
        self._streams: dict[int | None, PartitionStream] = {}
        """Partition -> its stream; the key None is an older proxy's only partition."""
        self._credits = Rebalancer(
            self._consumer_id,
            concurrency,
            None if auto_prefetch else prefetch,
            self._pool,
            self._streams,
            self._stopping,
        )
        """The credit budget and its split over the streams (rebalancer.py)."""
        self._pool.on_idle = self._credits.on_idle
        self._topology = TopologyFollower(
            consumer_id=self._consumer_id,
            target=target,
            partitions=wanted,
            metadata=self._metadata,
            channels=self._channels,
            streams=self._streams,
            add_streams=self._add_streams,
            stopping=self._stopping,
            max_backoff=max_backoff,
            interval=topology_interval,
        )
        """Which partitions to consume and where each is served (follower.py)."""
        self._context = StreamContext(
            consumer_id=self._consumer_id,
            metadata=self._metadata,
            pool=self._pool,
            stopping=self._stopping,
            max_backoff=max_backoff,
            allowed=None if wanted is None else frozenset(wanted),
            consume=self._channels.consume,
            credits=self._credits.credits_for,
            refresh=self._topology.wake,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._failure: BaseException | None = None

    @property
    def consumer_id(self) -> str:
        """The name this instance gives the proxies."""
        return self._consumer_id

    @property
    def credits(self) -> int:
        """Most unsettled deliveries the proxies may send this instance, over all partitions
        (each stream's Hello announces its share; the default prefetch may grow it)."""
        return self._credits.credits

    @property
    def stats(self) -> ConsumerStats:
        """Counters since creation, in total and per partition (a snapshot; safe to read from
        any thread)."""
        per = [(stream.partition, stream.stats()) for stream in list(self._streams.values())]
        return ConsumerStats(
            delivered=sum(s.delivered for _, s in per),
            acked=sum(s.acked for _, s in per),
            nacked=sum(s.nacked for _, s in per),
            rejected=sum(s.rejected for _, s in per),
            dropped=sum(s.dropped for _, s in per),
            reconnects=sum(s.reconnects for _, s in per),
            extended=sum(s.extended for _, s in per),
            partitions={p: s for p, s in sorted(per, key=_by_partition) if p is not None},
        )

    # -- lifecycle -------------------------------------------------------------------------

    def run(self) -> None:
        """Consume until stop(); blocks this thread, which must not be running an event loop.

        With a sync handler the streams run in the process's shared loop thread (loop.py:
        several Consumers of one process then share one loop instead of contending for the
        GIL with a loop each); with an async handler, in a loop of its own on this thread.
        An exception in this thread while waiting (Ctrl-C) cancels the run and waits for it
        to end, as `asyncio.run` does, then propagates."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise StateError("run() blocks; inside an event loop use `await run_async()`")
        if self._pool.is_async:
            asyncio.run(self.run_async())
            return
        loop = SHARED.acquire()
        try:
            ended = threading.Event()
            tasks: list[asyncio.Task[None]] = []

            def start() -> None:
                task = loop.create_task(self.run_async(), name=f"triage-{self._consumer_id}")
                task.add_done_callback(lambda _: ended.set())
                tasks.append(task)

            loop.call_soon_threadsafe(start)
            try:
                ended.wait()
            except BaseException:
                # Interrupted in this thread (Ctrl-C): callbacks run in order, so the task
                # exists by the time this one runs.
                loop.call_soon_threadsafe(lambda: tasks[0].cancel())
                ended.wait()
                raise
            tasks[0].result()
        finally:
            SHARED.release()

    async def run_async(self) -> None:
        """Consume until stop(), in the running event loop.

        Raises, before consuming anything: EndpointError when the target is not a Triage
        proxy, PartitionError when `partitions` names one the topic lacks. Raises
        AuthenticationError (or another StreamError) when a proxy refuses a stream for good,
        after draining the other streams; transient failures are retried, never raised.
        """
        if self._state is not _State.IDLE:
            raise StateError("a Consumer runs once; create a new one")
        self._state = _State.RUNNING
        loop = asyncio.get_running_loop()
        self._loop = loop
        if self._stop_requested:  # stop() ran before run(): it could not reach the loop
            self._begin_stop()
        logger.info(
            "consumer %s starting: target %s, partitions %s, concurrency %d, credits %d, "
            "%s handler",
            self._consumer_id,
            self._target,
            "all" if self._partitions is None else list(self._partitions),
            self._concurrency,
            self._credits.credits,
            "async" if self._pool.is_async else "sync",
        )
        self._pool.start(loop)
        background: list[asyncio.Task[None]] = []  # the topology reader and the rebalancer
        clean = False
        try:
            layout = await self._topology.discover()
            if not self._stopping.is_set():
                if layout is None:
                    self._add_streams({None: self._target})
                else:
                    self._topology.apply(layout)
                    background.append(
                        loop.create_task(
                            self._guarded(self._topology.run(self._topology.trouble(layout))),
                            name="triage-topology",
                        )
                    )
                    background.append(
                        loop.create_task(self._guarded(self._credits.run()), name="triage-credits")
                    )
            await self._stopping.wait()
            # No stream is added once stopping is set: these are all of them.
            await asyncio.gather(*self._tasks)
            # Handlers that outlived a broken stream: run() never returns under running user code.
            while self._pool.outstanding:
                self._pool.drained.clear()
                await self._pool.drained.wait()
            clean = True
        finally:
            for task in (*background, *self._tasks):
                task.cancel()
            await asyncio.gather(*background, *self._tasks, return_exceptions=True)
            self._loop = None
            self._state = _State.STOPPED
            await self._pool.close(clean)
            logger.debug("consumer %s: handler slots closed", self._consumer_id)
            await self._channels.close()
            logger.info("consumer %s stopped", self._consumer_id)
        if self._failure is not None:
            raise self._failure

    def stop(self) -> None:
        """Ask run() to finish: safe from any thread, a signal handler or a handler; idempotent.

        Returns at once; run() returns once running handlers have finished and their
        settlements were sent, on every stream.
        """
        self._stop_requested = True
        self._pool.stop_requested = True
        loop = self._loop
        if loop is None:
            return
        with suppress(RuntimeError):  # the loop already closed: run() has returned
            loop.call_soon_threadsafe(self._begin_stop)

    def _begin_stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._topology.wake()
        self._credits.wake()
        in_flight = released = 0
        for stream in list(self._streams.values()):
            running, given_back = stream.begin_stop()
            in_flight += running
            released += given_back
        logger.info(
            "consumer %s stopping: %d deliveries in flight, %d queued ones released",
            self._consumer_id,
            in_flight,
            released,
        )
        if not self._pool.outstanding:
            self._pool.drained.set()

    # -- streams ---------------------------------------------------------------------------

    def _add_streams(self, endpoints: dict[int | None, str | None]) -> None:
        # All created before any connects, so each Hello sees the full split.
        added = [
            self._streams.setdefault(p, PartitionStream(self._context, p, endpoint))
            for p, endpoint in endpoints.items()
        ]
        loop = asyncio.get_running_loop()
        for stream in added:
            self._tasks.append(
                loop.create_task(self._guarded(stream.run()), name=f"triage-{stream.label}")
            )

    async def _guarded(self, work: Coroutine[Any, Any, None]) -> None:
        """A stream's or the topology reader's task: a stream refused for good (or a bug)
        stops the whole Consumer, whose run() raises it once the other streams drained."""
        try:
            await work
        except Exception as exc:  # noqa: BLE001 - whatever ends a stream, run() raises it
            if self._failure is None:
                self._failure = exc
            self._begin_stop()


def _by_partition(item: tuple[int | None, ConsumerStats]) -> int:
    return by_partition(item[0])
