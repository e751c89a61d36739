"""Every push target of one proxy process: built from `[[push]]`, told which partitions the
process serves, and asked for their snapshots.

The proxy calls `serve(partition, dispatcher)` when a pipeline starts delivering and
`withdraw(partition)` when it stops; each target then opens (or ends) its lane in that
partition's dispatcher. Targets from `[[push]]` with mode "http" exist from `start()`; a
mode "grpc" table adds one target per consumer that registers (`GET /consumers`), and
drops it when the consumer is gone (UNAVAILABLE), until it registers again; while none
is registered, the table shows in status and metrics as one target that waits
(`UNREGISTERED`).

Lifecycle (`lifecycle.Lifecycle`, as each target's): `start()` once, `stop()` safe twice
or before start, `async with`. A target that fails to start stops the ones started before
it, and the table ends STOPPED. The table's task owns the stopping of the gRPC consumers
that are gone (each stopped gracefully: its calls in flight end with their own answers).
Order at stop: the pipelines drain first (their dispatchers stop handing out records and
wait for what is in flight), then `stop()` ends every target's lanes, cancels the
requests still in flight (the drain's deadline has passed: `stop(abandon=True)`) and
closes the connections. A consumer that registers once the table is stopping is refused
(ShuttingDown: `GET /consumers` answers 503); a partition offered then is ignored.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Iterable

import grpc
from aiohttp import web

from triage_proxy.config.push import PushTargetSettings
from triage_proxy.config.settings import Settings
from triage_proxy.errors import ShuttingDown, StateError
from triage_proxy.lifecycle import Lifecycle, State
from triage_proxy.observe.snapshot import PUSH_BUCKETS_S, LatencyHistogram, PushTargetSnapshot
from triage_proxy.pipeline.dispatch import Dispatcher
from triage_proxy.push.cloudevents import EventShape
from triage_proxy.push.grpc import GrpcTarget, Registration
from triage_proxy.push.http import HttpEndpoint, HttpTarget
from triage_proxy.push.limit import LimitSettings
from triage_proxy.push.target import PushTarget, TargetShape
from triage_proxy.waiting import wait_any

__all__ = ["PushTargets", "default_source"]

logger = logging.getLogger(__name__)


def default_source(settings: Settings) -> str:
    """CloudEvents `source` unless a target names one: the deployment and its topic."""
    return f"triage://{settings.kafka.group_id}/{settings.kafka.topic}"


def shape_of(target: PushTargetSettings, name: str | None = None) -> TargetShape:
    return TargetShape(
        name=name or target.name,
        limit=LimitSettings(
            min_limit=target.min_concurrency,
            max_limit=target.max_concurrency,
            initial=target.initial_limit,
        ),
        batch=target.batch,
        max_batch_bytes=target.max_batch_bytes,
        timeout_s=target.timeout_s,
    )


def _ssl_context(target: PushTargetSettings) -> ssl.SSLContext | None:
    if target.ca_file is None and target.cert_file is None:
        return None
    context = ssl.create_default_context(cafile=target.ca_file)
    if target.cert_file is not None:
        context.load_cert_chain(target.cert_file, target.key_file)
    return context


def http_target(settings: Settings, target: PushTargetSettings) -> HttpTarget:
    """The HttpTarget a `[[push]]` table describes (its secrets read now)."""
    token = target.resolved("token")
    signing = target.resolved("signing_secret")
    endpoint = HttpEndpoint(
        url=target.url or "",
        event=EventShape(
            source=target.source or default_source(settings),
            type=target.type,
            content_type=target.content_type,
        ),
        nack_statuses=frozenset(target.nack_statuses),
        max_response_bytes=target.max_response_bytes,
        authorization=None if token is None else f"Bearer {token}",
        signing_secret=None if signing is None else signing.encode(),
        ssl_context=_ssl_context(target),
    )
    return HttpTarget(shape_of(target), endpoint)


def _grpc_credentials(target: PushTargetSettings) -> grpc.ChannelCredentials | None:
    if target.ca_file is None and target.cert_file is None:
        return None

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(
        read(target.ca_file), read(target.key_file), read(target.cert_file)
    )


UNREGISTERED = (
    "unregistered: no consumer has registered yet; it delivers once one does (GET /consumers)"
)
"""The state of a mode "grpc" target no consumer has registered with. Its first word is
short: `triage status` shows the state's first word in an 80-column table, the rest under
it."""


STOP_TIMEOUT_S = 30.0
"""How long the table's task may take at stop: each target's requests are cancelled at
once then, so this bounds only a target stuck closing its connections."""


class PushTargets(Lifecycle):
    """The process's push targets; see the module docstring."""

    name = "push targets"

    def __init__(self, settings: Settings, tokens: Callable[[], Iterable[str]]) -> None:
        super().__init__(stop_timeout_s=STOP_TIMEOUT_S)
        self._settings = settings
        self._tokens = tokens
        self._targets: list[PushTarget] = []
        self._registered: dict[str, GrpcTarget] = {}
        self._grpc = next((t for t in settings.push if t.mode == "grpc"), None)
        self._serving: dict[int, Dispatcher] = {}
        self._gone: list[GrpcTarget] = []
        """Consumers gone, for the table's task to stop."""
        self._wake = asyncio.Event()
        """Set when `_gone` has a target."""

    def __bool__(self) -> bool:
        return bool(self._settings.push)

    async def start(self) -> None:
        """Open the HTTP targets' connection pools. A target that fails to start stops
        the table (and the targets started before it), then its error is raised."""
        await super().start()
        try:
            for table in self._settings.push:
                if table.mode == "http":
                    target = http_target(self._settings, table)
                    await self._add(target)
                    logger.info("push target %s: %s", table.name, table.url)
        except BaseException:
            await self.stop()
            raise

    async def _add(self, target: PushTarget) -> None:
        """Start `target` and hand it every partition served; ShuttingDown when the table
        stopped meanwhile (the target is stopped again)."""
        await target.start()
        if self._state is not State.RUNNING:
            await target.stop(abandon=True)
            raise ShuttingDown(f"{self.name} {self._state.value}: {target.name} not added")
        self._targets.append(target)
        for partition, dispatcher in self._serving.items():
            target.attach(partition, dispatcher)

    def registration(self) -> Registration | None:
        """The `GET /consumers` handler, when a mode "grpc" target takes registrations."""
        if self._grpc is None:
            return None
        return Registration(
            self._tokens,
            self.register,
            allow=self._grpc.allow,
            trust_forwarded_for=self._grpc.trust_forwarded_for,
        )

    def routes(self) -> list[web.RouteDef]:
        """The HTTP routes push adds to the proxy's HTTP endpoint."""
        registration = self.registration()
        return [] if registration is None else [web.get("/consumers", registration.handle)]

    async def register(self, address: str) -> None:
        """A consumer at `address` serves triage.MessageHandler: deliver to it too.
        ShuttingDown once the table is stopping (StateError before it started)."""
        if self._state is State.NEW:
            raise StateError(f"{self.name} not started: no registration yet")
        if self._state is not State.RUNNING:
            raise ShuttingDown(f"{self.name} {self._state.value}: no new consumer")
        if self._grpc is None or address in self._registered:
            return
        target = GrpcTarget(
            shape_of(self._grpc, f"{self._grpc.name}@{address}"),
            address,
            credentials=_grpc_credentials(self._grpc),
            on_gone=self._on_gone,
        )
        await self._add(target)
        self._registered[address] = target
        logger.info("push consumer registered at %s", address)

    def _on_gone(self, target: GrpcTarget) -> None:
        """The consumer is gone (UNAVAILABLE): forget it; the table's task stops it."""
        if self._registered.get(target.address) is not target:
            return
        del self._registered[target.address]
        self._targets.remove(target)
        logger.warning("push consumer at %s is gone (UNAVAILABLE)", target.address)
        self._gone.append(target)
        self._wake.set()

    def serve(self, partition: int, dispatcher: Dispatcher) -> None:
        """`partition` delivers now: every target takes from it. Ignored once the table
        is stopping (nothing would take from it); StateError before it started."""
        if self._state is State.NEW:
            raise StateError(f"{self.name} not started: cannot serve partition {partition}")
        if self._state is not State.RUNNING:
            logger.debug("%s %s: not serving partition %d", self.name, self._state.value, partition)
            return
        self._serving[partition] = dispatcher
        for target in self._targets:
            target.attach(partition, dispatcher)

    def withdraw(self, partition: int) -> None:
        """`partition` stops delivering here."""
        self._serving.pop(partition, None)
        for target in self._targets:
            target.detach(partition)

    # --- lifecycle (see lifecycle.Lifecycle) -----------------------------------------

    async def _run(self) -> None:
        """Stop each consumer that is gone, gracefully, until stop(); then every target,
        abandoning its requests in flight (the pipelines drained before)."""
        stopping: dict[asyncio.Task[None], PushTarget] = {}

        def stopped(task: asyncio.Task[None]) -> None:
            target = stopping.pop(task, None)
            if target is not None and not task.cancelled() and task.exception() is not None:
                logger.error("%s failed to stop", target.name, exc_info=task.exception())

        try:
            while not self._closing.is_set():
                self._wake.clear()
                for target in self._gone:
                    task = asyncio.create_task(target.stop(), name=f"stop {target.name}")
                    stopping[task] = target
                    task.add_done_callback(stopped)
                self._gone.clear()
                await wait_any(self._wake, self._closing)
        finally:
            targets = [*self._targets, *self._gone, *stopping.values()]
            self._targets.clear()
            self._registered.clear()
            self._gone.clear()
            self._serving.clear()
            ends = [asyncio.create_task(t.stop(abandon=True)) for t in targets]
            # A gone consumer's stop already under way ends too (abandoned): wait for it.
            pending = [*ends, *stopping]
            if pending:
                await asyncio.wait(pending)
        for task in ends:
            if not task.cancelled() and (exc := task.exception()) is not None:
                raise exc

    def _on_stopping(self) -> None:
        logger.debug("%s stopping: %d targets", self.name, len(self._targets))

    def snapshot(self) -> tuple[PushTargetSnapshot, ...]:
        """Every target now; a mode "grpc" target no consumer has registered with shows as
        one row that waits (`UNREGISTERED`), so status says why it delivers nothing."""
        shown = tuple(target.snapshot() for target in self._targets)
        if self._grpc is None or self._registered:
            return shown
        waiting = PushTargetSnapshot(
            name=self._grpc.name,
            limit=0,
            in_flight=0,
            partitions=tuple(sorted(self._serving)),
            state=UNREGISTERED,
            latency=LatencyHistogram(PUSH_BUCKETS_S),
            responses={},
            records={},
            errors=0,
        )
        return (*shown, waiting)
