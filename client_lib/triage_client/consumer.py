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
by design; the default prefetch grows with the number of backlogged partitions, up to 4
single-stream caps, none of them given more than one: credits.py). The same rebalance caps
how many handler slots each backlogged partition may run
(an even share of `concurrency`), and the shared pool gives a free slot to the stream with
the fewest running handlers under its cap (see pool.py), so a partition with a backlog of
slow messages never starves another, and a partition alone with work gets every slot.
Against a proxy without Grant (no `Welcome.grants`) a stream keeps its Hello's share: when
only one partition has work, it then uses at most its share of the credits.

Stream mechanics (reconnects, epochs, batching, leases) are in stream.py; the handler pool
and the fairness rule in pool.py.
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

from triage_client.credits import (
    REBALANCE_INTERVAL_S,
    STREAM_CAPS_MAX,
    credit_share,
    grown,
    grown_cap,
    split,
)
from triage_client.errors import (
    EndpointError,
    PartitionError,
    Retry,
    StateError,
    error_for_status,
    speaks_grpc,
)
from triage_client.loop import SHARED
from triage_client.message import ConsumerStats
from triage_client.pool import Handler, HandlerPool
from triage_client.stream import (
    DEFAULT_MAX_BACKOFF_S,
    INITIAL_BACKOFF_S,
    SETTLE_BATCH,
    Consume,
    PartitionStream,
    StreamContext,
    backoff_delay,
)
from triage_client.topology import Layout, fetch_layout
from triage_protocol import triage_pb2
from triage_protocol.constants import (
    AUTHORIZATION_METADATA,
    BEARER_PREFIX,
    CLIENT_MAX_FRAME_BYTES,
    MAX_CREDITS,
    MAX_REASON_CHARS,
    UINT32_MAX,
)

__all__ = ["AUTO_PREFETCH_MAX", "MAX_REASON_CHARS", "Consumer", "Handler", "backoff_delay"]

logger = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 16
AUTO_PREFETCH_MAX = 4
"""The default prefetch grows to this many times `concurrency` when the round trip outlasts
the local queue (see credits.grown)."""
DEFAULT_TOPOLOGY_INTERVAL_S = 30.0
"""How often a running Consumer reads the topology again when nothing asks for it sooner."""
TOPOLOGY_TIMEOUT_S = 5.0
"""Longest wait for one Topology answer."""
REFRESH_SOON_MAX_S = 1.0
"""Longest wait between topology reads while a wanted partition has no serving proxy."""
REFRESH_MIN_GAP_S = 0.1
"""Shortest gap between two topology reads, however many streams ask."""

_SERVICE = triage_pb2.DESCRIPTOR.services_by_name["Triage"]
_CONSUME = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['Consume'].name}"


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
    automatically every third of the proxy's ack deadline (see stream.py).
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
            much more for each, up to 4, while no partition's stream gets more than one
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
        self._auto_prefetch = prefetch is None
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
        self._credits = concurrency + prefetch
        self._max_credits = max(
            self._credits, min(MAX_CREDITS, concurrency * (1 + AUTO_PREFETCH_MAX))
        )
        """Most credits one stream is given; the default prefetch grows to this once per
        stream with a backlog, up to STREAM_CAPS_MAX of them (credits.grown_cap)."""
        self._granting = False  # a stream's proxy has honoured Grant frames: credits move
        self._consumer_id = consumer_id or f"{socket.gethostname()}-{os.getpid()}"
        self._credentials: grpc.ChannelCredentials | None = None
        if secure or root_certificates or certificate_chain:
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates, private_key, certificate_chain
            )
        self._max_backoff = max_backoff
        self._topology_interval = topology_interval

        self._state = _State.IDLE
        # stop() may run on any thread or in a signal handler: it only sets flags and
        # schedules _begin_stop on the loop (no locks, which a signal handler could deadlock on).
        self._stop_requested = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = asyncio.Event()
        self._refresh_wanted = asyncio.Event()  # also set by stop(), to end the topology loop
        # Ends a rebalance period early: stop(), or a slot ran dry beside a backlog while
        # the default prefetch can still grow (_on_idle).
        self._rebalance_now = asyncio.Event()
        self._pool = HandlerPool(
            handler, concurrency, (Retry, *retry_on), min(SETTLE_BATCH, self._credits)
        )
        self._pool.on_idle = self._on_idle
        self._context = StreamContext(
            consumer_id=self._consumer_id,
            metadata=self._metadata,
            pool=self._pool,
            stopping=self._stopping,
            max_backoff=max_backoff,
            allowed=None if wanted is None else frozenset(wanted),
            consume=self._consume,
            credits=self._credits_for,
            refresh=self._refresh_wanted.set,
        )
        # Touched only on the loop thread (stats reads a snapshot of the values).
        self._streams: dict[int | None, PartitionStream] = {}
        """Partition -> its stream; the key None is an older proxy's only partition."""
        self._tasks: list[asyncio.Task[None]] = []
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._consumes: dict[str, Consume] = {}
        self._failure: BaseException | None = None

    @property
    def consumer_id(self) -> str:
        """The name this instance gives the proxies."""
        return self._consumer_id

    @property
    def credits(self) -> int:
        """Most unsettled deliveries the proxies may send this instance, over all partitions
        (each stream's Hello announces its share; the default prefetch may grow it)."""
        return self._credits

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
            self._credits,
            "async" if self._pool.is_async else "sync",
        )
        self._pool.start(loop)
        background: list[asyncio.Task[None]] = []  # the topology reader and the rebalancer
        clean = False
        try:
            layout = await self._discover()
            if not self._stopping.is_set():
                if layout is None:
                    self._add_streams({None: self._target})
                else:
                    self._apply(layout)
                    background.append(
                        loop.create_task(
                            self._guarded(self._topology_loop(self._trouble(layout))),
                            name="triage-topology",
                        )
                    )
                    background.append(
                        loop.create_task(
                            self._guarded(self._rebalance_loop()), name="triage-credits"
                        )
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
            for channel in self._channels.values():
                await channel.close()
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
        self._refresh_wanted.set()
        self._rebalance_now.set()
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

    # -- channels --------------------------------------------------------------------------

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        """The one channel to `endpoint`, shared by its streams and topology reads."""
        channel = self._channels.get(endpoint)
        if channel is None:
            options = [
                ("grpc.max_receive_message_length", CLIENT_MAX_FRAME_BYTES),
                ("grpc.max_send_message_length", CLIENT_MAX_FRAME_BYTES),
                # gRPC's own reconnect backoff defaults to 1 s growing to 120 s; keep it in
                # step with ours so a restarted proxy is found again within max_backoff.
                ("grpc.initial_reconnect_backoff_ms", int(INITIAL_BACKOFF_S * 1000)),
                ("grpc.max_reconnect_backoff_ms", int(self._max_backoff * 1000)),
            ]
            if self._credentials is not None:
                channel = grpc.aio.secure_channel(endpoint, self._credentials, options)
            else:
                channel = grpc.aio.insecure_channel(endpoint, options)
            self._channels[endpoint] = channel
        return channel

    def _consume(self, endpoint: str) -> Consume:
        consume = self._consumes.get(endpoint)
        if consume is None:
            consume = self._consumes[endpoint] = self._channel(endpoint).stream_stream(
                _CONSUME,
                request_serializer=triage_pb2.ConsumerFrame.SerializeToString,
                response_deserializer=triage_pb2.ProxyFrame.FromString,
            )
        return consume

    # -- topology --------------------------------------------------------------------------

    async def _discover(self) -> Layout | None:
        """The first topology, from the target; None for a proxy without Topology (an older
        one: consume its only partition) or when stop() came first. Transient failures (the
        proxy not up yet) are retried; a target that is not a Triage proxy raises."""
        failures = 0
        target = self._target
        while not self._stopping.is_set():
            try:
                layout = await self._until_stopped(
                    fetch_layout(self._channel(target), self._metadata, TOPOLOGY_TIMEOUT_S)
                )
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

    def _apply(self, layout: Layout) -> None:
        """Open streams for wanted partitions new to this Consumer; point the others at the
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

    def _credits_for(self, stream: PartitionStream) -> int:
        """The Hello credits of a stream about to connect: its share of the even split; once
        credits move (`_granting`), no more than what the other streams leave free."""
        order = sorted(self._streams, key=_by_partition_key)
        share = credit_share(
            self._credits, len(order), order.index(stream.partition if stream.named else None)
        )
        if not self._granting:
            return share
        others = sum(s.committed() for s in self._streams.values() if s is not stream)
        return max(1, min(share, self._credits - others))

    async def _rebalance_loop(self) -> None:
        """Every REBALANCE_INTERVAL_S, until stop(): split credits and handler slots over
        the streams from what each showed (see credits.py); send Grants where they changed."""
        streams = self._streams
        while not self._stopping.is_set():
            with suppress(TimeoutError):
                await asyncio.wait_for(self._rebalance_now.wait(), REBALANCE_INTERVAL_S)
            self._rebalance_now.clear()
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
                budget = grown(self._credits, cap, loads, idled)
                if budget != self._credits:
                    logger.info(
                        "consumer %s: handler slots ran out of queued work while the proxy "
                        "had more: prefetch %d -> %d",
                        self._consumer_id,
                        self._credits - self._concurrency,
                        budget - self._concurrency,
                    )
                    self._credits = budget
            decision = split(self._concurrency, self._credits, loads, self._max_credits)
            raised = self._pool.ledger.set_slots(
                [stream.account for stream in current], decision.slots
            )
            for stream, load, credits in zip(current, loads, decision.credits, strict=True):
                if load.adjustable:
                    stream.set_credits(credits)
            if raised:
                self._pool.kick()

    def _on_idle(self) -> None:
        """A handler slot found nothing queued (on the loop): while the default prefetch can
        still grow and a stream shows a backlog, rebalance now rather than at the end of the
        period (a tenth of a second of slots waiting for refills, each time). Also before
        the first rebalance has seen a stream that takes Grants: a run's first tenth of a
        second is when the local queue runs dry first (measured, bench_efficiency 1x4x8:
        21-25 of 32 slots busy in it, all 32 afterwards)."""
        streams = self._streams.values()
        if (
            self._auto_prefetch
            and self._credits
            < min(MAX_CREDITS, self._max_credits * min(STREAM_CAPS_MAX, len(streams)))
            and not self._rebalance_now.is_set()
            and (self._granting or any(s.grants and s.call is not None for s in streams))
            and any(s.backlogged() for s in streams)
        ):
            self._rebalance_now.set()

    async def _guarded(self, work: Coroutine[Any, Any, None]) -> None:
        """A stream's or the topology reader's task: a stream refused for good (or a bug)
        stops the whole Consumer, whose run() raises it once the other streams drained."""
        try:
            await work
        except Exception as exc:  # noqa: BLE001 - whatever ends a stream, run() raises it
            if self._failure is None:
                self._failure = exc
            self._begin_stop()

    def _trouble(self, layout: Layout) -> str:
        """What in a topology answer calls for asking again soon ("" for nothing)."""
        if not layout.complete:
            return f"the topology of {layout.topic!r} is incomplete ({layout.problem})"
        unserved = sorted(p for p in self._streams if p is not None and p not in layout.endpoints)
        if unserved:
            return f"nobody serves partitions {unserved} of {layout.topic!r} now"
        return ""

    async def _topology_loop(self, trouble: str) -> None:
        """Reads the topology every `topology_interval`, at once when a stream asks, and
        every second or so while a wanted partition has no serving proxy, no proxy
        answered, or a stream is reconnecting, until stop(). Trouble is logged when it
        starts or changes, not per read; `trouble` is the first answer's."""
        loop = asyncio.get_running_loop()
        last = loop.time()
        failures = 1 if trouble else 0
        if trouble:
            logger.warning("consumer %s: %s; asking again soon", self._consumer_id, trouble)
        while not self._stopping.is_set():
            if failures:
                wait = backoff_delay(failures - 1, initial=0.1, cap=REFRESH_SOON_MAX_S)
            else:
                wait = self._topology_interval
            with suppress(TimeoutError):
                await asyncio.wait_for(self._refresh_wanted.wait(), wait)
            gap = REFRESH_MIN_GAP_S - (loop.time() - last)
            if gap > 0 and not self._stopping.is_set():
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), gap)
            if self._stopping.is_set():
                return
            self._refresh_wanted.clear()
            last = loop.time()
            layout, problem = await self._fetch_any()
            if self._stopping.is_set():
                return
            if layout is not None:
                self._apply(layout)
                problem = self._trouble(layout)
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
                layout = await self._until_stopped(
                    fetch_layout(self._channel(endpoint), self._metadata, TOPOLOGY_TIMEOUT_S)
                )
            except grpc.aio.AioRpcError as exc:
                problems.append(f"{endpoint}: {exc.code().name}")
                continue
            if layout is not None and layout.partition_count > 0:
                return layout, ""
            problems.append(f"{endpoint}: no partitions")
        return None, f"no proxy answered Topology ({', '.join(problems)})"


def _by_partition_key(partition: int | None) -> int:
    return -1 if partition is None else partition


def _by_partition(item: tuple[int | None, ConsumerStats]) -> int:
    return _by_partition_key(item[0])
