"""Every push target of one proxy process: built from `[[push]]`, told which partitions the
process serves, and asked for their snapshots.

The proxy calls `serve(partition, dispatcher)` when a pipeline starts delivering and
`withdraw(partition)` when it stops; each target then opens (or ends) its lane in that
partition's dispatcher. Targets from `[[push]]` with mode "http" exist from `start()`; a
mode "grpc" table adds one target per consumer that registers (`GET /consumers`), and
drops it when the consumer is gone (UNAVAILABLE), until it registers again; while none
is registered, the table shows in status and metrics as one target that waits
(`UNREGISTERED`).

Order at stop: the pipelines drain first (their dispatchers stop handing out records and
wait for what is in flight), then `aclose()` ends every lane and closes the connections.
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
from triage_proxy.observe.snapshot import PUSH_BUCKETS_S, LatencyHistogram, PushTargetSnapshot
from triage_proxy.pipeline.dispatch import Dispatcher
from triage_proxy.push.cloudevents import EventShape
from triage_proxy.push.grpc import GrpcTarget, Registration
from triage_proxy.push.http import HttpEndpoint, HttpTarget
from triage_proxy.push.limit import LimitSettings
from triage_proxy.push.target import PushTarget, TargetShape

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


class PushTargets:
    """The process's push targets; see the module docstring."""

    def __init__(self, settings: Settings, tokens: Callable[[], Iterable[str]]) -> None:
        self._settings = settings
        self._tokens = tokens
        self._targets: list[PushTarget] = []
        self._registered: dict[str, GrpcTarget] = {}
        self._grpc = next((t for t in settings.push if t.mode == "grpc"), None)
        self._serving: dict[int, Dispatcher] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def __bool__(self) -> bool:
        return bool(self._settings.push)

    async def start(self) -> None:
        """Open the HTTP targets' connection pools."""
        for table in self._settings.push:
            if table.mode == "http":
                target = http_target(self._settings, table)
                await target.start()
                self._targets.append(target)
                logger.info("push target %s: %s", table.name, table.url)

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
        """A consumer at `address` serves triage.MessageHandler: deliver to it too."""
        if self._grpc is None or address in self._registered:
            return
        target = GrpcTarget(
            shape_of(self._grpc, f"{self._grpc.name}@{address}"),
            address,
            credentials=_grpc_credentials(self._grpc),
            on_gone=self._gone,
        )
        await target.start()
        self._registered[address] = target
        self._targets.append(target)
        for partition, dispatcher in self._serving.items():
            target.attach(partition, dispatcher)
        logger.info("push consumer registered at %s", address)

    def _gone(self, target: GrpcTarget) -> None:
        if self._registered.get(target.address) is not target:
            return
        del self._registered[target.address]
        self._targets.remove(target)
        logger.warning("push consumer at %s is gone (UNAVAILABLE)", target.address)
        task = asyncio.get_running_loop().create_task(target.finish())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def serve(self, partition: int, dispatcher: Dispatcher) -> None:
        """`partition` delivers now: every target takes from it."""
        self._serving[partition] = dispatcher
        for target in self._targets:
            target.attach(partition, dispatcher)

    def withdraw(self, partition: int) -> None:
        """`partition` stops delivering here."""
        self._serving.pop(partition, None)
        for target in self._targets:
            target.detach(partition)

    async def aclose(self) -> None:
        """End every lane and close every connection (after the pipelines drained)."""
        for target in list(self._targets):
            await target.aclose()
        self._targets.clear()
        self._registered.clear()
        if self._closing:
            await asyncio.wait(set(self._closing))

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
