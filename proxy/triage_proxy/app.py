"""The proxy application: one process, one (topic, partition).

`Proxy.serve()` is the one place that owns the long-lived tasks (a single
TaskGroup: fetcher and committer; the gRPC server owns its per-stream handlers
and the service its reader tasks). `stop()` only signals; `serve()` then shuts
down in this order (the steps through the final commit run one after the other in
`_serve_partition`; the rest is its AsyncExitStack unwinding, which also undoes a
start that failed half-way):

    (with ownership.enabled, before Kafka is opened: wait as a standby until this process
    holds the partition's lease, see ownership.py; it is renewed by a task in the TaskGroup.
    The lease item advertises this proxy's endpoint, `server.advertised_*`: at once when
    the port is configured, else by a renewal once the free port is bound)
    stop fetching (and polling the log end)
    -> deliver nothing new; let in-flight work settle, up to shutdown.drain_timeout_s
    -> flush dead letters still being written (bounded by what is left of the deadline;
       neither step waits for a dead letter that can never be written, see deadletter.py)
    -> end the streams and stop the gRPC server (accepting nothing new)
    -> final commit of the committable offset (with the settled-above encoding), only while
       the lease is still ours
    -> release the lease (a standby takes over at once)
    -> close the Kafka client
    -> stop the HTTP endpoint (http_endpoint.py; it starts first, before Kafka is opened, so
       a starting or standby proxy can be watched)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from triage_proxy.committer import Committer
from triage_proxy.deadletter import DeadLetterWriter, overflow_warning
from triage_proxy.dispatcher import Dispatcher
from triage_proxy.errors import StateError, TableUnavailable, TriageError
from triage_proxy.fetcher import Fetcher
from triage_proxy.http_endpoint import HttpEndpoint
from triage_proxy.kafka import ConfluentPartition, KafkaThread, PartitionLog
from triage_proxy.logend import LogEndWatcher
from triage_proxy.notifier import notifier_from_settings
from triage_proxy.ownership import Ownership, new_owner_id
from triage_proxy.service import TriageService, create_server, server_credentials
from triage_proxy.settings import AuthSettings, Settings
from triage_proxy.settled import CheckpointError, decode_attempts, decode_settled
from triage_proxy.snapshot import UNWRITABLE_SHOWN, Instance, ProxySnapshot
from triage_proxy.structs import DeadLetter
from triage_proxy.table.checkpoints import CheckpointStore, DynamoDBCheckpoints
from triage_proxy.table.deadletters import DeadLetterStore, DynamoDBStore
from triage_proxy.table.leases import (
    DynamoDBLeaseReader,
    DynamoDBLeases,
    LeaseReader,
    LeaseStore,
    MemoryLeaseReader,
)
from triage_proxy.topology import Topology
from triage_proxy.tracker import CommitTracker
from triage_proxy.waiting import wait_any

logger = logging.getLogger(__name__)

SERVER_GRACE_S = 2.0


class ProxyState(enum.Enum):
    NEW = "new"
    STANDBY = "standby"
    """Waiting for another proxy's lease on the partition to lapse (ownership.py)."""
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Proxy:
    """Fetches one partition, fans it out over gRPC, commits what is settled."""

    def __init__(
        self,
        settings: Settings,
        partition: int,
        *,
        log: PartitionLog | None = None,
        store: DeadLetterStore | None = None,
        checkpoints: CheckpointStore | None = None,
        leases: LeaseStore | None = None,
        lease_reader: LeaseReader | None = None,
        auth_source: Callable[[], AuthSettings] | None = None,
    ) -> None:
        self.settings = settings
        self.partition = partition
        self._log = log
        """The partition (a twin in tests); by default a ConfluentPartition."""
        self._store = store
        self._checkpoints = checkpoints
        self._leases = leases
        """Injected stores are the caller's to close; the ones made here are closed here."""
        self._lease_reader = lease_reader
        """Every partition's lease, for Topology; with `leases` injected and this not,
        only that store is read (a twin's world)."""
        self.owner = new_owner_id()
        """This process's id: its lease owner id, and the owner Topology names."""
        self.endpoint = ""
        """host:port consumers are given for this partition (known once it listens)."""
        self.topology: Topology | None = None
        self.state = ProxyState.NEW
        self.port = 0
        """The gRPC port actually bound (known once ready)."""
        self.ready = asyncio.Event()
        self._auth_source = auth_source
        """Re-reads the [auth] section (the config file) when `reload_auth()` is called."""
        self._reload_wanted = asyncio.Event()
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.dispatcher: Dispatcher | None = None
        self.committer: Committer | None = None
        self.fetcher: Fetcher | None = None
        self.writer: DeadLetterWriter | None = None
        self.watermarks: LogEndWatcher | None = None
        self.ownership: Ownership | None = None
        self.http_port: int | None = None
        """The HTTP (metrics/health/status) port bound; None when off or not started."""

    # --- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Run `serve()` in a task owned by this object; return once it accepts streams."""
        if self.state is not ProxyState.NEW or self._task is not None:
            raise StateError(f"proxy already {self.state.value}")
        self._task = asyncio.create_task(self._run(), name=f"proxy-{self.partition}")
        ready = asyncio.ensure_future(self.ready.wait())
        await asyncio.wait([ready, self._task], return_when=asyncio.FIRST_COMPLETED)
        if not self.ready.is_set():
            ready.cancel()
            await self._task  # raises what made serve() fail

    def reload_auth(self) -> None:
        """Ask for the tokens to be re-read (SIGHUP; safe from a signal handler)."""
        self._reload_wanted.set()

    def stop(self) -> None:
        """Signal shutdown (safe from a signal handler, safe twice)."""
        self._closing.set()

    async def wait_stopped(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    async def __aenter__(self) -> Proxy:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        await self.wait_stopped()

    @property
    def is_alive(self) -> bool:
        """Liveness: started and not yet stopped."""
        return self.state not in (ProxyState.NEW, ProxyState.STOPPED)

    @property
    def is_ready(self) -> bool:
        """Readiness: delivering the partition (not starting, standing by or stopping)."""
        return self.state is ProxyState.RUNNING

    def snapshot(self, *, now: float | None = None) -> ProxySnapshot:
        """Read the components as they are now (they appear once Kafka is open); metrics
        and the HTTP endpoint see the proxy only through this."""
        now = time.monotonic() if now is None else now
        settings = self.settings
        base: dict[str, Any] = {
            "topic": settings.kafka.topic,
            "partition": self.partition,
            "state": self.state.value,
            "ready": self.is_ready,
            "alive": self.is_alive,
            "grpc_port": self.port,
            "advertised_endpoint": self.endpoint,
            "window_max_messages": settings.window.max_messages,
            "window_max_bytes": settings.window.max_bytes,
        }
        dispatcher, committer = self.dispatcher, self.committer
        if dispatcher is None or committer is None:
            return ProxySnapshot(**base)
        degraded: list[str] = []
        fetcher, writer, watermarks = self.fetcher, self.writer, self.watermarks
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
            unwritable_dead_letters=(
                writer.unwritable(UNWRITABLE_SHOWN) if writer is not None else ()
            ),
            fetch_paused=fetcher.paused if fetcher is not None else False,
            degraded=tuple(degraded),
            counters=counters,
            settle_latency=dispatcher.settle_latency,
        )

    # --- the run ----------------------------------------------------------------------

    async def serve(self) -> None:
        """Run in the caller's task until stop(); see the module docstring for the order."""
        if self.state is not ProxyState.NEW or self._task is not None:
            raise StateError(f"proxy already {self.state.value}")
        await self._run()

    async def _run(self) -> None:
        self.state = ProxyState.STARTING
        endpoint = HttpEndpoint(self.snapshot, self.settings.server.http_address(self.partition))
        try:
            await endpoint.start()
            self.http_port = endpoint.port
            await self._serve_partition()
        finally:
            await endpoint.stop()  # last, see the module docstring
            self.state = ProxyState.STOPPED

    async def _serve_partition(self) -> None:
        settings = self.settings
        credentials = server_credentials(settings.tls)  # bad TLS files: fail before opening
        if (warning := overflow_warning(settings.dead_letters)) is not None:
            logger.warning("%s", warning)
        log = self._log or ConfluentPartition(settings.kafka, self.partition)
        # Teardown is this stack unwinding: what is pushed last is undone first, so read
        # the pushes from the bottom up for the module docstring's order.
        async with contextlib.AsyncExitStack() as stack:

            @stack.callback
            def stopped() -> None:  # once everything below is undone
                self.state = ProxyState.STOPPED

            ownership = None
            reader = None
            if settings.ownership.enabled:
                leases = self._leases
                if leases is None:
                    leases = DynamoDBLeases(
                        settings.dead_letters, settings.kafka.topic, self.partition
                    )
                    stack.callback(leases.close)
                reader = self._lease_reader
                if reader is None and self._leases is not None:
                    reader = MemoryLeaseReader({self.partition: self._leases})
                elif reader is None:
                    reader = DynamoDBLeaseReader(settings.dead_letters, settings.kafka.topic)
                    stack.callback(reader.close)
                # The endpoint is known now unless the port is picked when bound.
                endpoint = settings.server.advertised_endpoint(self.partition) or ""
                self.ownership = ownership = Ownership(
                    leases, settings.ownership, owner=self.owner, endpoint=endpoint
                )
            checkpoints = self._checkpoints
            if checkpoints is None and settings.commit.encode_settled:
                checkpoints = DynamoDBCheckpoints(
                    settings.dead_letters,
                    settings.kafka.topic,
                    self.partition,
                    settings.kafka.group_id,
                )
                stack.callback(checkpoints.close)
            store = self._store
            if store is None:
                store = DynamoDBStore(settings.dead_letters)
                stack.callback(store.close)
            thread = KafkaThread()
            stack.callback(thread.shutdown)
            lease_lost = ownership.lost if ownership is not None else asyncio.Event()

            if ownership is not None:
                self.state = ProxyState.STANDBY
                if not await ownership.acquire(self._closing):
                    return
                stack.push_async_callback(ownership.release)  # should Kafka not open
                self.state = ProxyState.STARTING
            start_offset, metadata = await thread.run(log.open)
            stack.push_async_callback(thread.run, log.close)
            if ownership is not None:
                # Released before Kafka closes, so a standby takes over at once (release
                # is safe twice: the one pushed above then does nothing).
                stack.push_async_callback(ownership.release)
            settled, failures = await self._restore(start_offset, metadata, checkpoints)
            if ownership is not None:
                await ownership.renew()  # the start may have been slow: still ours?

            tracker = CommitTracker(start_offset)
            notifier = notifier_from_settings(
                settings.dead_letters, source=f"{settings.kafka.topic}[{self.partition}]"
            )

            # The dispatcher hands nacked records to the writer, which reports each one
            # back once it is durable (only then does its offset settle). The writer only
            # calls back once started, by when `dispatcher` below exists.
            def dead_letter_written(dl: DeadLetter) -> None:
                dispatcher.dead_letter_written(dl)

            def dead_letter_unwritable(dl: DeadLetter) -> None:
                dispatcher.dead_letter_unwritable(dl)

            writer = DeadLetterWriter(
                store,
                settings.dead_letters,
                dead_letter_written,
                notifier=notifier,
                on_unwritable=dead_letter_unwritable,
            )
            dispatcher = Dispatcher(
                settings,
                self.partition,
                tracker,
                writer.submit,
                already_settled=settled,
                prior_failures=failures,
            )
            topology = Topology(
                settings,
                self.owner,
                leases=reader,
                partition_count=lambda: thread.run(log.partition_count),
            )
            service = TriageService(settings, {self.partition: dispatcher}, topology)
            server, self.port = create_server(settings, self.partition, service, credentials)
            stack.push_async_callback(server.stop, None)
            endpoint = settings.server.advertised_endpoint(self.partition, self.port) or ""
            if ownership is not None and ownership.endpoint != endpoint:
                ownership.endpoint = endpoint  # the port was picked when bound: advertise it
                await ownership.renew()
            self.endpoint, self.topology = endpoint, topology
            topology.serve(self.partition, endpoint)
            fetch_closing = asyncio.Event()
            fetcher = Fetcher(log, thread, dispatcher, settings.kafka.fetch_batch, fetch_closing)
            commit_closing = asyncio.Event()
            committer = Committer(
                log,
                thread,
                tracker,
                start_offset,
                settings.commit.interval_s,
                commit_closing,
                checkpoints=checkpoints if settings.commit.encode_settled else None,
                attempts=dispatcher,
                ahead=dispatcher,
            )
            watermarks = LogEndWatcher(log, thread, tracker, fetch_closing)
            self.dispatcher, self.committer, self.fetcher = dispatcher, committer, fetcher
            self.writer, self.watermarks = writer, watermarks

            def on_lease_lost() -> None:
                # Synchronously, before any other task runs: nothing more is delivered, and
                # no commit starts (a new holder may be ahead of us), then the shutdown below.
                topology.withdraw(self.partition)
                dispatcher.stop_delivering()
                fetch_closing.set()
                commit_closing.set()
                self._closing.set()

            # The notifier stops after the writer, so the last dead letters are summarized.
            async with notifier or contextlib.nullcontext(), writer, asyncio.TaskGroup() as tasks:
                fetch_task = tasks.create_task(fetcher.run(), name="fetcher")
                tasks.create_task(committer.run(), name="committer")
                tasks.create_task(dispatcher.run_timers(commit_closing), name="timers")
                if self._auth_source is not None:
                    tasks.create_task(self._reload_tokens(service, self._auth_source))
                tasks.create_task(watermarks.run(), name="log-end")
                if ownership is not None:
                    # Renews until the streams have ended (commit_closing), drain included.
                    tasks.create_task(ownership.keep(commit_closing, on_lease_lost), name="lease")
                await server.start()
                self.state = ProxyState.RUNNING
                self.ready.set()
                logger.info(
                    "proxy for %s[%d] serving on port %d from offset %d "
                    "(%d offsets above it already settled, %d with failed deliveries)",
                    settings.kafka.topic,
                    self.partition,
                    self.port,
                    start_offset,
                    len(settled),
                    len(failures),
                )
                await self._closing.wait()
                self.state = ProxyState.STOPPING
                topology.withdraw(self.partition)
                deadline = time.monotonic() + settings.shutdown.drain_timeout_s
                logger.info("stopping: fetching stops, draining in-flight work")
                fetch_closing.set()
                dispatcher.stop_delivering()
                await fetch_task
                await wait_any(dispatcher.quiet, lease_lost, timeout=_left(deadline))
                logger.debug("drained; %d records still in flight", dispatcher.in_flight)
                # Lost lease: no commit follows, so waiting for dead letters is pointless.
                await writer.flush(timeout=0 if lease_lost.is_set() else _left(deadline))
                logger.debug("dead letters flushed; %d not durable", writer.pending)
                service.stop_accepting()
                dispatcher.end_sessions()
                await server.stop(SERVER_GRACE_S)
                await service.stop()
                logger.debug("streams ended; gRPC server stopped")
                commit_closing.set()
            if ownership is not None and not ownership.holding:
                # Settled-but-uncommitted offsets are redelivered by the new holder.
                raise ownership.lost_error()
            await committer.commit()
            logger.info(
                "stopped; committed offset %d, %d records left for redelivery",
                committer.committed,
                dispatcher.in_window,
            )

    async def _reload_tokens(
        self, service: TriageService, source: Callable[[], AuthSettings]
    ) -> None:
        """On each reload_auth() until stop(): read [auth] again (in a thread: it may ask
        Secrets Manager) and apply it; a bad file keeps the current tokens."""
        while await wait_any(self._reload_wanted, self._closing):
            if self._closing.is_set():
                return
            self._reload_wanted.clear()
            try:
                auth = await asyncio.to_thread(source)
            except (TriageError, OSError) as exc:
                logger.error("token reload failed, keeping the current tokens: %s", exc)  # noqa: TRY400 - the message is the whole story
                continue
            service.update_tokens(auth.active())

    async def _restore(
        self, committed: int, metadata: str | None, checkpoints: CheckpointStore | None
    ) -> tuple[list[int], dict[int, int]]:
        """What a previous run left: the offsets it settled above `committed` (from the
        commit's metadata, else from the checkpoint item) and the failed-delivery counts
        of its unsettled messages (from the item), both unless the item is newer than
        Kafka's commit. Trouble here only costs redeliveries (or attempts counted again),
        so it is logged and ignored."""
        if not self.settings.commit.encode_settled:
            return [], {}
        found = None
        if checkpoints is not None:
            try:
                found = await asyncio.to_thread(checkpoints.get)
            except TableUnavailable as exc:
                logger.warning("ignoring the checkpoint item: %s", exc)
        if found is not None and found.committed > committed:
            found = None  # newer than Kafka's commit (the group was rewound): unusable
        # The item may trail Kafka by a commit (it is written just after it). Offsets
        # settled then are still settled now; the ones below Kafka's commit drop out, and
        # so do their counts.
        settled: list[int] = []
        try:
            if metadata:
                settled = decode_settled(committed, metadata)
            elif found is not None:
                settled = [
                    o for o in decode_settled(found.committed, found.settled) if o >= committed
                ]
        except CheckpointError as exc:
            logger.warning("ignoring the settled-above checkpoint: %s", exc)
        failures: dict[int, int] = {}
        try:
            if found is not None:
                counts = decode_attempts(found.committed, found.attempts)
                failures = {o: n for o, n in counts.items() if o >= committed}
        except CheckpointError as exc:
            logger.warning("ignoring the failed-delivery counts of the checkpoint: %s", exc)
        return settled, failures


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
