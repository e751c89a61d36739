"""The proxy application: one process serving one or more partitions of a topic.

A process runs one pipeline per partition it serves (partition.py: fetcher ->
dispatcher -> tracker -> committer, with the partition's lease) behind one gRPC server
and one HTTP endpoint. Which partitions: the ones pinned (`--partition N`, repeatable),
or, with none pinned, the ones Kafka's group coordinator assigns this process as a
member of the deployment's consumer group (fleet mode, assignment.py). Either way a
pipeline delivers only while it holds its partition's DynamoDB lease (ownership.py):
the lease, not the group, is the fence.

`Proxy.serve()` is the one place that owns the long-lived tasks: a single TaskGroup runs
every pipeline, the group membership's follower and the token reloader (the gRPC server
owns its per-stream handlers and the service its reader tasks). `stop()` only signals;
`serve()` then shuts down in this order:

    (at start: the HTTP endpoint, then the gRPC server, so a starting or standby process
    can be watched, and a Hello for a partition it does not serve yet is told where it is
    served; then the pipelines)
    refuse new streams
    -> every pipeline drains at once (partition.py: stop fetching, deliver nothing new,
       let in-flight work settle up to shutdown.drain_timeout_s, flush dead letters, end
       its streams)
    -> stop the gRPC server
    -> every pipeline: final commit (with the settled-above encoding, only while its lease
       is ours), release the lease, close its Kafka client
    -> leave the consumer group (fleet mode; the other members take the partitions over,
       their leases are free by then)
    -> stop the HTTP endpoint

A process that may serve several partitions reads them all through one Kafka Consumer
(reader.py, closed once every pipeline has closed); a one-partition process's pipeline
opens its own.

What differs between the two modes lives beside this module: pinned.py (check the pins,
start every pipeline, listen once every lease is held; a lost lease stops the process)
and fleet.py (listen at once, join the group, follow its assignment; a lost lease ends
only that pipeline). A pipeline that fails otherwise (Kafka unreachable at start) stops
the process in either mode, which then exits with its error.

The ports: the process listens on `server.port + slot` (gRPC) and `server.http_port +
slot` (HTTP); the slot is the pinned partition for one pin (the layout of one process
per partition), else given by the supervisor (`--slot`, one per fleet process).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING

import grpc

from triage_proxy.adapters import Adapters, PartsFactory
from triage_proxy.config.sections import AuthSettings
from triage_proxy.config.settings import Settings
from triage_proxy.deadletters.writer import overflow_warning
from triage_proxy.errors import (
    BrokerUnavailable,
    ConfigError,
    OwnershipLost,
    StateError,
    TriageError,
)
from triage_proxy.fleet import FleetMembership
from triage_proxy.kafka.client import PartitionLog
from triage_proxy.kafka.reader import Reader
from triage_proxy.observe.endpoint import HttpEndpoint
from triage_proxy.observe.snapshot import ProcessSnapshot, ProxySnapshot
from triage_proxy.pinned import PinnedPartitions
from triage_proxy.pipeline.dispatch import Dispatcher
from triage_proxy.pipeline.ownership import new_owner_id
from triage_proxy.pipeline.partition import (
    PartitionPipeline,
    PipelineState,
    snapshot_of,
)
from triage_proxy.push.targets import PushTargets
from triage_proxy.server.service import TriageService, create_server, server_credentials
from triage_proxy.server.tokens import Tokens
from triage_proxy.server.topology import Topology
from triage_proxy.store.checkpoints import CheckpointStore
from triage_proxy.store.deadletter_store import DeadLetterStore
from triage_proxy.store.leases import (
    LeaseReader,
    LeaseStore,
)
from triage_proxy.store.migrate import LegacyCheck
from triage_proxy.waiting import wait_any

if TYPE_CHECKING:
    from triage_proxy.kafka.assignment import Membership

logger = logging.getLogger(__name__)

SERVER_GRACE_S = 2.0


class ProxyState(enum.Enum):
    NEW = "new"
    STANDBY = "standby"
    """Waiting for another proxy's lease on a pinned partition to lapse (ownership.py)."""
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Proxy:
    """Serves the pinned partitions, or those the consumer group assigns (see above)."""

    def __init__(
        self,
        settings: Settings,
        partitions: int | Sequence[int] | None,
        *,
        slot: int | None = None,
        log: PartitionLog | None = None,
        store: DeadLetterStore | None = None,
        checkpoints: CheckpointStore | None = None,
        leases: LeaseStore | None = None,
        lease_reader: LeaseReader | None = None,
        parts: PartsFactory | None = None,
        membership: Membership | None = None,
        auth_source: Callable[[], AuthSettings] | None = None,
    ) -> None:
        self.settings = settings
        self.owner = new_owner_id()
        """This process's id: its lease owner id, and the owner Topology names."""
        self._pinned = None if partitions is None else PinnedPartitions(settings, partitions)
        self._fleet = None
        if self._pinned is None:
            self._fleet = FleetMembership(settings, self.owner, membership)
        self.pins = None if self._pinned is None else self._pinned.pins
        """The pinned partitions; None: fleet mode (the group assigns them)."""
        self.slot = slot if slot is not None else (self.pins[0] if self.pins else 0)
        """Offset of this process's ports from server.port and server.http_port."""
        self.endpoint = ""
        """host:port consumers are given for every partition served here (once it listens)."""
        self.topology: Topology | None = None
        self._state = ProxyState.NEW
        self.port = 0
        """The gRPC port actually bound (known once it listens)."""
        self.ready = asyncio.Event()
        """Set once every partition it should serve at start delivers."""
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.pipelines: dict[int, PartitionPipeline] = {}
        """The pipelines running now (standby to stopping), by partition."""
        self._errors: list[BaseException] = []
        self._service: TriageService | None = None
        self.http_port: int | None = None
        """The HTTP (metrics/health/status) port bound; None when off or not started."""
        self._legacy: LegacyCheck | None = None
        """Looks for legacy dead letters (None with injected twins)."""
        self._tokens = Tokens(settings.auth, auth_source)
        """The tokens accepted now: the service's, and push registration's; re-read from
        the config file when `reload_auth()` is called (server/tokens.py)."""
        self.push = PushTargets(settings, self._tokens.values)
        """The `[[push]]` targets: each takes from every partition served here."""
        self._adapters = Adapters(
            settings,
            self._fleet,
            log=log,
            leases=leases,
            checkpoints=checkpoints,
            parts=parts,
            store=store,
            lease_reader=lease_reader,
        )
        """What each pipeline talks to: Kafka, its lease and checkpoint items."""

    @property
    def partition(self) -> int:
        """The (first) pinned partition."""
        if not self.pins:
            raise StateError("a fleet proxy has no single partition")
        return self.pins[0]

    # --- lifecycle --------------------------------------------------------------------

    @property
    def state(self) -> ProxyState:
        if self._state is ProxyState.STARTING and any(
            p.state is PipelineState.STANDBY for p in self.pipelines.values()
        ):
            return ProxyState.STANDBY
        return self._state

    async def start(self) -> None:
        """Run `serve()` in a task owned by this object; return once it accepts streams."""
        if self._state is not ProxyState.NEW or self._task is not None:
            raise StateError(f"proxy already {self._state.value}")
        self._task = asyncio.create_task(self._run(), name=f"proxy-{self.slot}")
        ready = asyncio.ensure_future(self.ready.wait())
        await asyncio.wait([ready, self._task], return_when=asyncio.FIRST_COMPLETED)
        if not self.ready.is_set():
            ready.cancel()
            await self._task  # raises what made serve() fail

    def reload_auth(self) -> None:
        """Ask for the tokens to be re-read (SIGHUP; safe from a signal handler)."""
        self._tokens.reload()

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
        return self._state not in (ProxyState.NEW, ProxyState.STOPPED)

    @property
    def is_ready(self) -> bool:
        """Readiness: running, a member of the group (fleet), and delivering every
        partition it should serve now."""
        if self._state is not ProxyState.RUNNING:
            return False
        if self._fleet is not None and not self._fleet.member:
            return False  # a lost session: it serves nothing, and may own nothing
        wanted = self._wanted()
        return all(
            (p := self.pipelines.get(n)) is not None and p.state is PipelineState.RUNNING
            for n in wanted
        )

    def _wanted(self) -> frozenset[int]:
        """The partitions this process should serve now."""
        if self._pinned is not None:
            return self._pinned.wanted()
        assert self._fleet is not None
        return self._fleet.wanted()

    def snapshot(self, partition: int | None = None, *, now: float | None = None) -> ProxySnapshot:
        """One partition's view (default: the first pin), as a one-partition proxy showed
        itself; `status()` is the whole process."""
        now = time.monotonic() if now is None else now
        if partition is None:
            partition = self.partition
        pipeline = self.pipelines.get(partition)
        state = self.state.value
        if pipeline is not None and self._state in (ProxyState.STARTING, ProxyState.RUNNING):
            state = pipeline.state.value
        base = {
            "topic": self.settings.kafka.topic,
            "partition": partition,
            "state": state,
            "ready": self.is_ready
            if self.pins == (partition,)
            else pipeline is not None and pipeline.state is PipelineState.RUNNING,
            "alive": self.is_alive,
            "grpc_port": self.port,
            "advertised_endpoint": self.endpoint,
            "window_max_messages": self.settings.window.max_messages,
            "window_max_bytes": self.settings.window.max_bytes,
        }
        return snapshot_of(base, pipeline, now)

    def status(self, *, now: float | None = None) -> ProcessSnapshot:
        """The process and every partition it runs a pipeline for (the HTTP endpoint's
        /status and /metrics read only this)."""
        now = time.monotonic() if now is None else now
        shown = sorted({*self.pipelines, *(self.pins or ())})
        return ProcessSnapshot(
            topic=self.settings.kafka.topic,
            group_id=self.settings.kafka.group_id,
            dead_letter_table=self.settings.dead_letters.table,
            state=self.state.value,
            ready=self.is_ready,
            alive=self.is_alive,
            grpc_port=self.port,
            advertised_endpoint=self.endpoint,
            owner=self.owner,
            pid=os.getpid(),
            mode="pinned" if self.pins is not None else "fleet",
            member=self._fleet is None or self._fleet.member,
            assigned=tuple(sorted(self._wanted())),
            partitions=tuple(self.snapshot(p, now=now) for p in shown),
            push=self.push.snapshot(),
        )

    # --- the run ----------------------------------------------------------------------

    async def serve(self) -> None:
        """Run in the caller's task until stop(); see the module docstring for the order."""
        if self._state is not ProxyState.NEW or self._task is not None:
            raise StateError(f"proxy already {self._state.value}")
        await self._run()

    async def _run(self) -> None:
        self._state = ProxyState.STARTING
        endpoint = HttpEndpoint(
            self.status, self.settings.server.http_address(self.slot), routes=self.push.routes()
        )
        try:
            await endpoint.start()
            self.http_port = endpoint.port
            await self._serve()
        finally:
            await endpoint.stop()  # last, see the module docstring
            self._state = ProxyState.STOPPED
        if self._errors:
            raise self._errors[0]

    async def _serve(self) -> None:
        settings = self.settings
        credentials = server_credentials(settings.tls)  # bad TLS files: fail before opening
        if (warning := overflow_warning(settings.dead_letters)) is not None:
            logger.warning("%s", warning)
        async with contextlib.AsyncExitStack() as stack:
            store, self._legacy = self._adapters.open_store(stack)
            reader = self._adapters.open_lease_reader(stack, self.pins)
            topology = Topology(
                settings, self.owner, leases=reader, partition_count=self._partition_count
            )
            several = self.pins is None or len(self.pins) > 1
            if several and self._adapters.real:
                kafka_reader = self._adapters.reader = Reader(settings.kafka)
                # Closed last: once every pipeline has closed its partition.
                stack.push_async_callback(asyncio.to_thread, kafka_reader.close)
            self._service = service = TriageService(settings, {}, topology)
            self.topology = topology
            stack.push_async_callback(self.push.stop)  # safe before start, and twice
            await self.push.start()
            servers: list[grpc.aio.Server] = []
            if self._fleet is not None:
                servers.append(await self._listen(stack, service, credentials))
                await self._fleet.join(stack)
            elif self._adapters.real:
                assert self._pinned is not None
                await self._pinned.check()
            async with asyncio.TaskGroup() as tasks:
                if self._tokens.source is not None:
                    tasks.create_task(self._tokens.follow(service.update_tokens, self._closing))

                def launch(partition: int) -> PartitionPipeline:
                    return self._launch(tasks, partition, store)

                if self._pinned is not None:

                    async def listen() -> str | None:
                        try:
                            servers.append(await self._listen(stack, service, credentials))
                        except (OSError, RuntimeError, ConfigError) as exc:  # port taken
                            # (create_server says so with a ConfigError): undo the start
                            self._fail(exc)
                            return None
                        return self.endpoint

                    await self._pinned.start(launch, listen, self._closing)
                else:
                    assert self._fleet is not None
                    follow = self._fleet.follow(self.pipelines, launch, self._closing)
                    tasks.create_task(follow, name="membership")
                tasks.create_task(self._watch_ready(), name="ready")
                await self._closing.wait()
                self._state = ProxyState.STOPPING
                logger.info("stopping: every partition drains")
                service.stop_accepting()
                pipelines = list(self.pipelines.values())
                for pipeline in pipelines:
                    pipeline.stop(finish=False)
                await asyncio.gather(*(p.drained.wait() for p in pipelines))
                await self.push.stop()
                for server in servers:
                    await server.stop(SERVER_GRACE_S)
                await service.stop()
                logger.debug("streams ended; gRPC server stopped")
                for pipeline in pipelines:
                    pipeline.finish()
            # (the membership leaves the group as the stack unwinds)

    async def _listen(
        self,
        stack: contextlib.AsyncExitStack,
        service: TriageService,
        credentials: grpc.ServerCredentials | None,
    ) -> grpc.aio.Server:
        """Bind the gRPC port, start serving; the endpoint is known from now on."""
        server, self.port = create_server(self.settings, self.slot, service, credentials)
        stack.push_async_callback(server.stop, None)
        self.endpoint = self.settings.server.advertised_endpoint(self.slot, self.port) or ""
        await server.start()
        return server

    def _launch(
        self, tasks: asyncio.TaskGroup, partition: int, store: DeadLetterStore
    ) -> PartitionPipeline:
        pipeline = PartitionPipeline(
            self.settings,
            partition,
            self._adapters.for_partition(partition),
            store,
            self._routes(),
            owner=self.owner,
            # Pinned: not listening yet; the endpoint is known before the port is bound
            # only when the port is configured.
            endpoint=self.endpoint or self.settings.server.advertised_endpoint(self.slot) or "",
            listening=self._pinned is None,
        )
        self.pipelines[partition] = pipeline
        tasks.create_task(self._run_pipeline(pipeline), name=f"partition-{partition}")
        if self._legacy is not None and self._legacy.due(partition):
            tasks.create_task(self._legacy.warn(partition), name=f"legacy-{partition}")
        return pipeline

    async def _run_pipeline(self, pipeline: PartitionPipeline) -> None:
        """One pipeline's task: its failure stops a pinned process (and is what serve()
        raises); in fleet mode a lost lease only ends the pipeline."""
        try:
            await pipeline.serve()
        except OwnershipLost as exc:
            mode = self._pinned or self._fleet
            assert mode is not None
            if mode.lost(pipeline, exc):
                self._fail(exc)
        except TriageError as exc:
            self._fail(exc)
        except Exception as exc:
            logger.exception("partition %d failed", pipeline.partition)
            self._fail(exc)
        finally:
            if self.pipelines.get(pipeline.partition) is pipeline:
                del self.pipelines[pipeline.partition]
            if self._fleet is not None:
                self._fleet.pipeline_ended()

    def _fail(self, exc: BaseException) -> None:
        self._errors.append(exc)
        self._closing.set()

    def _routes(self) -> _Routes:
        assert self._service is not None
        assert self.topology is not None
        return _Routes(self._service, self.topology, self.push, lambda: self.endpoint)

    async def _partition_count(self) -> int:
        """The topic's partition count for Topology: from the group membership, else from
        any open pipeline."""
        if self._fleet is not None:
            return await self._fleet.partition_count()
        for pipeline in list(self.pipelines.values()):
            with contextlib.suppress(BrokerUnavailable):
                return await pipeline.partition_count()
        raise BrokerUnavailable("no partition is open yet")

    async def _watch_ready(self) -> None:
        """RUNNING (and `ready` set) once every partition it should serve at start
        delivers; RUNNING stays (readiness then follows the pipelines, see is_ready)."""
        while not self._closing.is_set():
            if self._started():
                self._state = ProxyState.RUNNING
                self.ready.set()
                logger.info(
                    "proxy serving %s partitions %s on port %d",
                    self.settings.kafka.topic,
                    sorted(self.pipelines),
                    self.port,
                )
                return
            await wait_any(self._closing, timeout=0.02)

    def _started(self) -> bool:
        if self._fleet is not None and not self._fleet.joined:
            return False
        wanted = self._wanted()
        return all(
            (p := self.pipelines.get(n)) is not None and p.state is PipelineState.RUNNING
            for n in wanted
        )


class _Routes:
    """Where a pipeline registers its partition: the service routes Hellos to it and
    Topology names this process's endpoint for it."""

    def __init__(
        self,
        service: TriageService,
        topology: Topology,
        push: PushTargets,
        endpoint: Callable[[], str],
    ) -> None:
        self._service = service
        self._topology = topology
        self._push = push
        self._endpoint = endpoint

    def coming(self, partition: int) -> None:
        self._service.expect_partition(partition)

    def serve(self, partition: int, dispatcher: Dispatcher) -> None:
        self._service.serve_partition(partition, dispatcher)
        self._topology.serve(partition, self._endpoint())
        self._push.serve(partition, dispatcher)

    def withdraw(self, partition: int) -> None:
        self._push.withdraw(partition)
        self._service.withdraw_partition(partition)
        self._topology.withdraw(partition)
