"""One partition's pipeline: fetcher -> dispatcher -> tracker -> committer, with its
lease, its dead-letter writer and its Kafka client, from lease to final commit.

Why a module of its own: a proxy process (app.py) runs one pipeline per partition it
serves, all behind one gRPC server and one HTTP endpoint, and starts or drains them as
partitions are pinned, assigned or revoked (assignment.py). Each pipeline keeps the
guarantees of the one-partition proxy it grew out of; the process only routes streams
to it (`Routes`) and owns its task (the proxy's TaskGroup runs `serve()`).

`serve()` runs the whole life; `stop()` only signals. The order (the steps through
`drained` run one after the other; the rest is an AsyncExitStack unwinding, which also
undoes a start that failed half-way):

    (with ownership.enabled, before Kafka is opened: wait as a standby until this process
    holds the partition's lease, see ownership.py; a task renews it. The lease item
    advertises the process's endpoint)
    open Kafka at the committed offset, restore what the previous run settled above it
    -> serve: the process routes Hellos for the partition here (`Routes.serve`)
    ... stop() ...
    -> no new streams (`Routes.withdraw`); stop fetching (and polling the log end)
    -> deliver nothing new; let in-flight work settle, up to shutdown.drain_timeout_s
    -> flush dead letters still being written (bounded by what is left of the deadline)
    -> end the partition's streams; `drained` is set
    -> (wait for `finish()`: a stopping process first stops its gRPC server; a revoked
       partition goes on at once)
    -> final commit of the committable offset (with the settled-above encoding), only
       while the lease is still ours
    -> release the lease (a standby or the partition's new assignee takes over at once)
    -> close the Kafka client (or, through the process's shared reader, unassign the
       partition and drop what it had buffered: reader.py)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from triage_proxy.config.settings import Settings
from triage_proxy.deadletters.notifier import notifier_from_settings
from triage_proxy.deadletters.writer import DeadLetterWriter
from triage_proxy.errors import BrokerUnavailable, StateError, TableUnavailable
from triage_proxy.kafka.client import KafkaThread, PartitionLog
from triage_proxy.observe.snapshot import UNWRITABLE_SHOWN, Instance, ProxySnapshot
from triage_proxy.pipeline.committer import Committer
from triage_proxy.pipeline.dispatch import Dispatcher
from triage_proxy.pipeline.fetcher import Fetcher
from triage_proxy.pipeline.logend import LogEndWatcher
from triage_proxy.pipeline.ownership import Ownership
from triage_proxy.pipeline.settled import CheckpointError, decode_attempts, decode_settled
from triage_proxy.pipeline.tracker import CommitTracker
from triage_proxy.store.checkpoints import CheckpointStore
from triage_proxy.store.deadletter_store import DeadLetterStore
from triage_proxy.store.leases import LeaseStore
from triage_proxy.structs import DeadLetter, Record
from triage_proxy.waiting import wait_any

logger = logging.getLogger(__name__)


class PipelineState(enum.Enum):
    NEW = "new"
    STANDBY = "standby"
    """Waiting for another process's lease on the partition to lapse (ownership.py)."""
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(frozen=True)
class PartitionParts:
    """What one pipeline talks to: the real adapters, or twins in unit tests."""

    log: PartitionLog
    """The partition in Kafka."""
    checkpoints: CheckpointStore | None = None
    """The settled-above checkpoint item (None: commit.encode_settled is off)."""
    leases: LeaseStore | None = None
    """The partition's lease item (None: ownership is off)."""
    close: Callable[[], None] = lambda: None
    """Closes what was made for this pipeline (not what a test injected)."""
    fence: Callable[[], str | None] | None = None
    """The group fence (`Ownership`'s; a pinned process's `GroupFence.busy`): why it must
    not deliver now; None: no fence (a fleet member, or ownership off)."""
    buffered: Callable[[int], list[Record]] | None = None
    """Takes up to n records the process's reader already fetched for the partition,
    without waiting (kafka/reader.py; None: every fetch waits on the fetch thread)."""
    arm: Callable[[Callable[[], None]], bool] | None = None
    """With `buffered`: has the reader call a function once records come in, so an empty
    buffer is waited for on the event loop (`ReaderPartition.arm`)."""


class Routes(Protocol):
    """How a pipeline tells its process which partitions it may route streams to."""

    def coming(self, partition: int) -> None:
        """`partition` holds its lease and starts: a Hello for it waits a moment rather
        than being refused."""
        ...

    def serve(self, partition: int, dispatcher: Dispatcher) -> None:
        """Hellos for `partition` go to `dispatcher` from now on."""
        ...

    def withdraw(self, partition: int) -> None:
        """No new stream for `partition` (draining, or the lease was lost)."""
        ...


class PartitionPipeline:
    """Serves one partition from lease to final commit (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        partition: int,
        parts: PartitionParts,
        store: DeadLetterStore,
        routes: Routes,
        *,
        owner: str,
        endpoint: str,
        listening: bool = True,
    ) -> None:
        self.settings = settings
        self.partition = partition
        self.parts = parts
        self._store = store
        """The process's dead-letter store (shared: one client per process)."""
        self._routes = routes
        self.owner = owner
        self.endpoint = endpoint
        """host:port of the process, advertised in the lease item ("" until known)."""
        self._advertised = asyncio.Event()
        """Set once `endpoint` is final (a pinned process binds its port only once it
        holds its leases, see app.py): the pipeline serves only then."""
        if listening:
            self._advertised.set()
        self.leased = asyncio.Event()
        """Set once it holds its lease (at once with ownership off), or it ended."""
        self.state = PipelineState.NEW
        self.serving = asyncio.Event()
        """Set once it delivers (RUNNING)."""
        self.drained = asyncio.Event()
        """Set once its streams have ended after stop(), or it ended without serving."""
        self._closing = asyncio.Event()
        self._finish = asyncio.Event()
        self.dispatcher: Dispatcher | None = None
        self.committer: Committer | None = None
        self.fetcher: Fetcher | None = None
        self.writer: DeadLetterWriter | None = None
        self.watermarks: LogEndWatcher | None = None
        self.ownership: Ownership | None = None
        self._queries: KafkaThread | None = None
        """The thread of the broker queries beside the fetch (log end, partition count)."""
        self._open = False

    # --- signals ------------------------------------------------------------------------

    def stop(self, *, finish: bool = True) -> None:
        """Drain (safe twice, and before serve()). With `finish` False, stop at `drained`
        until `finish()`: the process ends every stream and stops its server first."""
        self._closing.set()
        if finish:
            self._finish.set()

    def advertise(self, endpoint: str) -> None:
        """The process listens at `endpoint` now: write it with the next lease renewal
        (which comes before serving) and go on serving."""
        self.endpoint = endpoint
        if self.ownership is not None:
            self.ownership.endpoint = endpoint
        self._advertised.set()

    def finish(self) -> None:
        """Go on from `drained` to the final commit, the release and the close."""
        self._finish.set()

    @property
    def stopping(self) -> bool:
        return self._closing.is_set()

    async def partition_count(self) -> int:
        """The topic's partition count from the broker, on this pipeline's query thread
        (Topology asks any open pipeline); BrokerUnavailable when not open."""
        thread = self._queries
        if thread is None or not self._open:
            raise BrokerUnavailable(f"partition {self.partition} is not open")
        return await thread.run(self.parts.log.partition_count)

    # --- the run ------------------------------------------------------------------------

    async def serve(self) -> None:
        """The pipeline's whole life, until stop() (or its lease is lost: OwnershipLost)."""
        if self.state is not PipelineState.NEW:
            raise StateError(f"pipeline of partition {self.partition} already {self.state.value}")
        self.state = PipelineState.STARTING
        try:
            await self._serve()
        finally:
            self._routes.withdraw(self.partition)
            self.leased.set()
            self.drained.set()
            self.state = PipelineState.STOPPED

    async def _serve(self) -> None:
        settings = self.settings
        partition = self.partition
        log = self.parts.log
        # Teardown is this stack unwinding: what is pushed last is undone first, so read
        # the pushes from the bottom up for the module docstring's order.
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(self.parts.close)
            ownership = None
            if self.parts.leases is not None:
                self.ownership = ownership = Ownership(
                    self.parts.leases,
                    settings.ownership,
                    owner=self.owner,
                    endpoint=self.endpoint,
                    fence=self.parts.fence,
                )
            checkpoints = self.parts.checkpoints if settings.commit.encode_settled else None
            # The fetch has a thread of its own; the commit and the broker queries (log
            # end, partition count) each have theirs, so neither holds up a fetch: on the
            # fetch's thread a synchronous commit (p90 20-106 ms on Tansu) and a log-end
            # query (up to 200 ms) delayed 2-3% of records by up to 100 ms; a fleet
            # member's commit (through the group's client: up to two of its polls plus
            # the broker's answer) waits on the commit thread too. librdkafka's handle is
            # thread-safe; only one thread ever consumes.
            thread = KafkaThread("kafka-fetch")
            stack.callback(thread.shutdown)
            lease_lost = ownership.lost if ownership is not None else asyncio.Event()

            if ownership is not None:
                self.state = PipelineState.STANDBY
                if not await ownership.acquire(self._closing):
                    return
                stack.push_async_callback(ownership.release)  # should Kafka not open
                self.state = PipelineState.STARTING
            self._routes.coming(partition)
            self.leased.set()
            start_offset, metadata = await thread.run(log.open)
            self._open = True
            stack.push_async_callback(thread.run, log.close)
            # Pushed after the close: their calls end before the client closes.
            self._queries = queries = KafkaThread("kafka-query")
            stack.callback(queries.shutdown)
            commit_thread = KafkaThread("kafka-commit")
            stack.callback(commit_thread.shutdown)
            if ownership is not None:
                # Released before Kafka closes, so a standby takes over at once (release
                # is safe twice: the one pushed above then does nothing).
                stack.push_async_callback(ownership.release)
            settled, failures = await restore(settings, start_offset, metadata, checkpoints)
            await wait_any(self._advertised, self._closing)
            if ownership is not None:
                ownership.endpoint = self.endpoint
                # The start may have been slow: still ours? (and advertise the endpoint)
                await ownership.renew()

            tracker = CommitTracker(start_offset)
            notifier = notifier_from_settings(
                settings.dead_letters, source=f"{settings.kafka.topic}[{partition}]"
            )

            # The dispatcher hands nacked records to the writer, which reports each one
            # back once it is durable (only then does its offset settle). The writer only
            # calls back once started, by when `dispatcher` below exists.
            def dead_letter_written(dl: DeadLetter) -> None:
                dispatcher.dead_letter_written(dl)

            def dead_letter_unwritable(dl: DeadLetter) -> None:
                dispatcher.dead_letter_unwritable(dl)

            writer = DeadLetterWriter(
                self._store,
                settings.dead_letters,
                dead_letter_written,
                notifier=notifier,
                on_unwritable=dead_letter_unwritable,
            )
            dispatcher = Dispatcher(
                settings,
                partition,
                tracker,
                writer.submit,
                already_settled=settled,
                prior_failures=failures,
                bounded=checkpoints is not None,
            )
            fetch_closing = asyncio.Event()
            fetcher = Fetcher(
                log,
                thread,
                dispatcher,
                settings.kafka.fetch_batch,
                fetch_closing,
                buffered=self.parts.buffered,
                arm=self.parts.arm,
            )
            commit_closing = asyncio.Event()
            committer = Committer(
                log,
                commit_thread,
                tracker,
                start_offset,
                settings.commit.interval_s,
                commit_closing,
                checkpoints=checkpoints,
                attempts=dispatcher,
                ahead=dispatcher,
                caught_up=dispatcher.caught_up,
                durability=dispatcher.durability,
                on_durable=dispatcher.durable_moved,
            )
            watermarks = LogEndWatcher(log, queries, tracker, fetch_closing)
            self.dispatcher, self.committer, self.fetcher = dispatcher, committer, fetcher
            self.writer, self.watermarks = writer, watermarks

            def on_lease_lost() -> None:
                # Synchronously, before any other task runs: nothing more is delivered, and
                # no commit starts (a new holder may be ahead of us), then the shutdown below.
                self._routes.withdraw(partition)
                dispatcher.stop_delivering()
                fetch_closing.set()
                commit_closing.set()
                self._closing.set()
                self._finish.set()

            # The notifier stops after the writer, so the last dead letters are summarized.
            async with notifier or contextlib.nullcontext(), writer, asyncio.TaskGroup() as tasks:
                fetch_task = tasks.create_task(fetcher.run(), name=f"fetcher-{partition}")
                tasks.create_task(committer.run(), name=f"committer-{partition}")
                tasks.create_task(dispatcher.run_timers(commit_closing), name=f"timers-{partition}")
                tasks.create_task(watermarks.run(), name=f"log-end-{partition}")
                if ownership is not None:
                    # Renews until the streams have ended (commit_closing), drain included.
                    tasks.create_task(
                        ownership.keep(commit_closing, on_lease_lost), name=f"lease-{partition}"
                    )
                if not self._closing.is_set():
                    self._routes.serve(partition, dispatcher)
                    self.state = PipelineState.RUNNING
                    self.serving.set()
                    logger.info(
                        "partition %s[%d] serving from offset %d "
                        "(%d offsets above it already settled, %d with failed deliveries)",
                        settings.kafka.topic,
                        partition,
                        start_offset,
                        len(settled),
                        len(failures),
                    )
                await self._closing.wait()
                self.state = PipelineState.STOPPING
                self._routes.withdraw(partition)
                deadline = time.monotonic() + settings.shutdown.drain_timeout_s
                logger.info(
                    "partition %d stopping: fetching stops, draining in-flight work", partition
                )
                fetch_closing.set()
                dispatcher.stop_delivering()
                await fetch_task
                await wait_any(dispatcher.quiet, lease_lost, timeout=_left(deadline))
                logger.debug("drained; %d records still in flight", dispatcher.in_flight)
                # Lost lease: no commit follows, so waiting for dead letters is pointless.
                await writer.flush(timeout=0 if lease_lost.is_set() else _left(deadline))
                logger.debug("dead letters flushed; %d not durable", writer.pending)
                dispatcher.end_sessions()
                self.drained.set()
                await wait_any(self._finish, lease_lost)
                commit_closing.set()
            if ownership is not None and not ownership.holding:
                # Settled-but-uncommitted offsets are redelivered by the new holder.
                raise ownership.lost_error()
            await committer.commit()
            logger.info(
                "partition %d stopped; committed offset %d, %d records left for redelivery",
                partition,
                committer.committed,
                dispatcher.in_window,
            )

    # --- what it reports ----------------------------------------------------------------

    def snapshot(self, now: float, **process: Any) -> ProxySnapshot:
        """Read the components as they are now (they appear once Kafka is open).
        `process` carries what the process knows (grpc_port, advertised_endpoint, alive)."""
        settings = self.settings
        base: dict[str, Any] = {
            "topic": settings.kafka.topic,
            "partition": self.partition,
            "state": self.state.value,
            "ready": self.state is PipelineState.RUNNING,
            "window_max_messages": settings.window.max_messages,
            "window_max_bytes": settings.window.max_bytes,
            **process,
        }
        return snapshot_of(base, self, now)


def snapshot_of(
    base: dict[str, Any], pipeline: PartitionPipeline | None, now: float
) -> ProxySnapshot:
    """A ProxySnapshot of `base` plus what `pipeline`'s components say (none: `base` only)."""
    if pipeline is None:
        return ProxySnapshot(**base)
    dispatcher, committer = pipeline.dispatcher, pipeline.committer
    if dispatcher is None or committer is None:
        return ProxySnapshot(**base)
    degraded: list[str] = []
    fetcher, writer, watermarks = pipeline.fetcher, pipeline.writer, pipeline.watermarks
    if fetcher is not None and fetcher.degraded:
        degraded.append("fetch")
    if committer.degraded:
        degraded.append("commit")
    if writer is not None and writer.degraded:
        degraded.append("dead_letters")
    if writer is not None and writer.too_large:
        degraded.append("dead_letters_unwritable")
    log_end: int | None = None
    log_end_age: float | None = None
    if watermarks is not None:
        if watermarks.degraded:
            degraded.append("log_end")
        log_end = watermarks.log_end
        if watermarks.checked_at is not None:
            log_end_age = now - watermarks.checked_at
    oldest = dispatcher.oldest_fetched_at
    counters = dataclasses.asdict(dispatcher.counters)
    counters["commits"] = committer.commits
    return ProxySnapshot(
        **base,
        committed_offset=committer.committed,
        log_end_offset=log_end,
        log_end_age_s=log_end_age,
        in_flight=dispatcher.in_flight,
        in_window=dispatcher.in_window,
        window_bytes=dispatcher.window_bytes,
        queued=dispatcher.queued,
        instances=tuple(
            Instance(s.consumer_id, s.credits, len(s.held)) for s in dispatcher.sessions
        ),
        oldest_unsettled_age_s=None if oldest is None else max(0.0, now - oldest),
        dead_letters_pending=writer.pending if writer is not None else 0,
        dead_letters_unwritable=writer.too_large if writer is not None else 0,
        unwritable_dead_letters=(writer.unwritable(UNWRITABLE_SHOWN) if writer is not None else ()),
        fetch_paused=fetcher.paused if fetcher is not None else False,
        degraded=tuple(degraded),
        counters=counters,
        settle_latency=dispatcher.settle_latency,
        blocking=dispatcher.blocking,
        taken_at=now,
    )


async def restore(
    settings: Settings, committed: int, metadata: str | None, checkpoints: CheckpointStore | None
) -> tuple[list[int], dict[int, int]]:
    """What a previous run left: the offsets it settled above `committed` (from the
    commit's metadata and from the checkpoint item, joined) and the failed-delivery counts of
    its unsettled messages (from the item), both unless the item is newer than Kafka's
    commit. Trouble here only costs redeliveries (or attempts counted again), so it is
    logged and ignored."""
    if not settings.commit.encode_settled:
        return [], {}
    found = None
    if checkpoints is not None:
        try:
            found = await asyncio.to_thread(checkpoints.get)
        except TableUnavailable as exc:
            logger.warning("ignoring the checkpoint item: %s", exc)
    if found is not None and found.committed > committed:
        found = None  # newer than Kafka's commit (the group was rewound): unusable
    # The item may trail Kafka by a commit (it is written just after it). Offsets settled
    # then are still settled now; the ones below Kafka's commit drop out, and so do their
    # counts. Both records count, joined: the item may also be ahead of Kafka's metadata
    # (written while the offset was held, between commits), and the committer counts on
    # it alone (committer.py: what the bounded window takes as recorded).
    settled: set[int] = set()
    try:
        if metadata:
            settled.update(decode_settled(committed, metadata))
    except CheckpointError as exc:
        logger.warning("ignoring the settled-above encoding of the commit: %s", exc)
    try:
        if found is not None:
            settled.update(
                o for o in decode_settled(found.committed, found.settled) if o >= committed
            )
    except CheckpointError as exc:
        logger.warning("ignoring the settled-above checkpoint: %s", exc)
    failures: dict[int, int] = {}
    try:
        if found is not None:
            counts = decode_attempts(found.committed, found.attempts)
            failures = {o: n for o, n in counts.items() if o >= committed}
    except CheckpointError as exc:
        logger.warning("ignoring the failed-delivery counts of the checkpoint: %s", exc)
    return sorted(settled), failures


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
