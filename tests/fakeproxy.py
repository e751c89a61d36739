"""One fake Triage proxy for both clients' tests.

A real grpc.aio server on 127.0.0.1 that speaks the wire protocol. It runs on its own thread
and event loop, so a test thread can block in `Consumer.run()` exactly as an app does. It
answers a stream in one of two ways:

* served (the default): it sends the Welcome itself and delivers what the test `feed()`s,
  honest about credits and, given an ack deadline, about leases, as the real proxy is;
* scripted (`scripted = True`): it sends nothing of its own accord; the test answers each
  stream frame by frame with `write()`, `end()` and `fail()`.

Either way it records every stream (its metadata, each frame with its arrival time, the
half-close, a cancel) and every Topology call. The real proxy is covered by the
integration tests.

`python -m tests.fakeproxy --control` serves the same fake to the tests of a client in
another language (the TypeScript client's `test/fake.ts`) over JSON lines on stdin and
stdout; `control()` below describes the protocol. One fake, so the two clients' tests
cannot drift apart in what they take a proxy to do.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message as ProtoMessage

from triage_protocol import triage_pb2, triage_pb2_grpc
from triage_protocol.constants import OWNER_ENDPOINT_METADATA

TOKEN = "s3cret-token"
WAIT_S = 5.0
CANCEL_NOTICE_S = 0.02
"""How long after the client's frames end a cancel may still be reported (see Consume)."""

Metadata = tuple[tuple[str, str | bytes], ...]
Listener = Callable[[dict[str, Any]], None]
"""Called on the server's thread with each event, a JSON-ready dict (see `control()`)."""


def delivery(
    offset: int,
    key: bytes | None = b"key",
    value: bytes | None = b"value",
    headers: Iterable[tuple[str, bytes | None]] = (),
    timestamp_ms: int = 1_700_000_000_000,
    attempt: int = 1,
) -> triage_pb2.Delivery:
    d = triage_pb2.Delivery(offset=offset, timestamp_ms=timestamp_ms, attempt=attempt)
    if key is not None:
        d.key = key
    if value is not None:
        d.value = value
    for name, hvalue in headers:
        h = d.headers.add(key=name)
        if hvalue is not None:
            h.value = hvalue
    return d


def now_ms() -> float:
    """Wall-clock milliseconds: what Date.now() reads in a test driving the fake from Node."""
    return time.time() * 1000


@dataclass(frozen=True)
class Status:
    """A final status the fake ends a call with."""

    code: grpc.StatusCode
    """The gRPC status code."""
    details: str
    """The status message."""
    trailers: Metadata = ()
    """Trailing metadata, e.g. `triage-owner-endpoint`."""


class _End:
    """End the stream with OK."""


END = _End()


@dataclass(eq=False)
class FakeStream:
    """One Consume call, as the fake saw it."""

    number: int
    """1, 2, ... in the order the calls reached this proxy."""
    metadata: Metadata
    """The call's invocation metadata."""
    received: list[tuple[float, triage_pb2.ConsumerFrame]] = field(default_factory=list)
    """Every frame the client sent, the Hello first, with its arrival (wall-clock ms)."""
    half_closed_at: float | None = None
    """When the client half-closed (wall-clock ms)."""
    cancelled: bool = False
    """The client cancelled the call."""
    refused: bool = False
    """Refused with FAILED_PRECONDITION: its partition is not served here."""
    finished: bool = False
    """The call is over: ended by the fake or the client, or the server stopped."""
    outbox: deque[triage_pb2.ProxyFrame | Status | _End] = field(default_factory=deque)
    """What the test asked to send, in order (scripted streams; served ones too)."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when there is something for the stream's handler to do."""
    announced: bool = False
    """Its "stream" event was emitted (control interface)."""

    @property
    def hello(self) -> triage_pb2.Hello | None:
        return self.received[0][1].hello if self.received else None


class Deployment:
    """What the fake proxies of one deployment share: a queue per partition (the Kafka
    partition, with its redeliveries), which proxy serves each partition now, what Topology
    says, and how many deliveries the consumer holds unsettled over all streams."""

    def __init__(self, partitions: int) -> None:
        self.cond = threading.Condition()
        self.queues: dict[int, deque[triage_pb2.Delivery]] = {p: deque() for p in range(partitions)}
        self.owners: dict[int, FakeProxy | None] = dict.fromkeys(range(partitions))
        self.announced: dict[int, FakeProxy | None] = dict.fromkeys(range(partitions))
        """What Topology says: normally `owners`; a test may leave it stale."""
        self.proxies: list[FakeProxy] = []
        self.unsettled = 0
        self.max_unsettled = 0
        self.topology_calls = 0

    @property
    def count(self) -> int:
        return len(self.queues)

    def proxy(self) -> FakeProxy:
        fake = FakeProxy(deployment=self).start()
        self.proxies.append(fake)
        return fake

    def serve(self, partition: int, proxy: FakeProxy | None, *, announce: bool = True) -> None:
        """`proxy` serves `partition` from now on; its old owner ends that partition's
        streams with FAILED_PRECONDITION naming the new owner."""
        with self.cond:
            self.queues.setdefault(partition, deque())
            self.owners[partition] = proxy
            if announce:
                self.announced[partition] = proxy
            self.cond.notify_all()
        for fake in self.proxies:
            fake.wake()

    def feed(self, partition: int, deliveries: Iterable[triage_pb2.Delivery]) -> None:
        with self.cond:
            self.queues[partition].extend(deliveries)
        for fake in self.proxies:
            fake.wake()

    def reply(self) -> triage_pb2.TopologyReply:
        with self.cond:
            self.topology_calls += 1
            reply = triage_pb2.TopologyReply(
                topic="orders", partition_count=self.count, complete=True
            )
            for p in range(self.count):
                owner = self.announced.get(p)
                if owner is None:
                    reply.partitions.add(partition=p, state=triage_pb2.PartitionRoute.STANDBY_ONLY)
                else:
                    reply.partitions.add(
                        partition=p,
                        endpoint=owner.target,
                        state=triage_pb2.PartitionRoute.SERVING,
                        owner_id=f"proxy-{owner.port}",
                    )
            return reply

    def wait_for(self, predicate: Callable[[], object], what: str, within: float = WAIT_S) -> None:
        """As FakeProxy.wait_for, over every proxy of the deployment."""
        deadline = time.monotonic() + within
        with self.cond:
            while not predicate():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                self.cond.wait(0.01)

    def acked(self, partition: int) -> list[int]:
        """Offsets of `partition` acked on any proxy."""
        return [o for fake in self.proxies for p, o in fake.acked_in() if p == partition]

    def held(self, delta: int) -> None:
        """Under cond: the consumer holds `delta` more (or fewer) unsettled deliveries."""
        self.unsettled += delta
        self.max_unsettled = max(self.max_unsettled, self.unsettled)

    def close(self) -> None:
        for fake in self.proxies:
            fake.close()


class FakeProxy(triage_pb2_grpc.TriageServicer):
    """A Triage proxy in miniature: checks the token, honours credits, records settlements.

    With `ack_deadline_ms` set, a delivery left unsettled and unextended that long is taken
    back and queued again with its attempt raised, as the real proxy does. Alone, it is an
    older proxy: no Topology, one partition (3) for a Hello that names none. In a Deployment
    it answers Topology and serves the partitions the deployment gives it, refusing a Hello
    for any other with FAILED_PRECONDITION and the owner in `triage-owner-endpoint`. With
    `grants` set its Welcome says so and it applies Grant frames, as a current proxy does;
    without, it ignores them (an older proxy). `topology_answer`, when set, is what Topology
    answers instead.
    """

    def __init__(
        self,
        *,
        batch: int = 64,
        deployment: Deployment | None = None,
        token: str = TOKEN,
        scripted: bool = False,
    ) -> None:
        self.batch = batch
        self.deployment = deployment
        self.token = token
        self.port = 0
        self.scripted = scripted  # for each new stream: no Welcome, no deliveries of its own
        self.end_on_half_close = True  # as the proxy: a half-close is answered with OK
        self.topology_answer: triage_pb2.TopologyReply | Status | None = None
        self.ack_deadline_ms = 0  # sent in the Welcome of each new stream; 0: leases never lapse
        self.grants = False  # Welcome.grants: Grant frames change a stream's credits
        self.ack_ranges = False  # Welcome.ack_ranges: Settle.ack_ranges are understood
        self.delay_s = 0.0  # before each Deliveries frame: a round trip longer than the work
        self.streams: list[FakeStream] = []
        self.topology_calls: list[Metadata] = []
        self.listeners: list[Listener] = []
        self.ranges: list[tuple[int, int]] = []  # every Settle.ack_ranges entry received
        self.granted: list[tuple[int | None, int]] = []  # (partition, credits) of each Grant
        self.reject: set[int] = set()  # offsets whose settlement is answered with Rejected
        self.refused: list[int] = []  # partitions of Hellos refused with FAILED_PRECONDITION
        self.acks: list[tuple[int, int]] = []  # (stream number, offset)
        self.nacks: list[tuple[int, triage_pb2.Nack]] = []
        self.releases: list[tuple[int, int]] = []  # (stream number, offset)
        self.extends: list[tuple[int, list[int]]] = []  # (stream number, offsets of one frame)
        self.stale_extends: list[tuple[int, int]] = []  # extended, but not held by that stream
        self.expired: list[tuple[int, int]] = []  # (stream number, offset whose lease lapsed)
        # (stream number, "settle" | "release" | "extend" | "grant" | "half-close")
        self.events: list[tuple[int, str]] = []
        self.max_unsettled = 0
        self._queue: deque[triage_pb2.Delivery] = deque()
        self._generation = 0  # bumped by restart(): a dead server's streams requeue nothing
        self._cond = threading.Condition() if deployment is None else deployment.cond
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-proxy")
        self._server: grpc.aio.Server | None = None

    # -- test thread ----------------------------------------------------------------------

    def start(self) -> FakeProxy:
        self._thread.start()
        self._call(self._start_server())
        return self

    def close(self) -> None:
        self.stop_server()
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(WAIT_S)
            self._loop.close()

    def stop_server(self) -> None:
        """Kill the server and every stream on it, as a proxy restart does."""
        if self._server is not None:
            self._call(self._server.stop(grace=None))
            self._server = None

    def restart(self, deliveries: Iterable[triage_pb2.Delivery]) -> None:
        """Start again on the same port with a fresh queue (nothing redelivered)."""
        with self._cond:
            self._generation += 1
            self._queue = deque(deliveries)
        self._call(self._start_server())

    def feed(self, deliveries: Iterable[triage_pb2.Delivery]) -> None:
        with self._cond:
            self._queue.extend(deliveries)
        self.wake()

    def write(self, stream: int, frame: triage_pb2.ProxyFrame) -> None:
        """Send `frame` on stream number `stream`, after what was asked before."""
        self._send(stream, frame)

    def end(self, stream: int) -> None:
        """End stream number `stream` with OK (once what was asked before is sent)."""
        self._send(stream, END)

    def fail(self, stream: int, status: Status) -> None:
        """End stream number `stream` with `status` (once what was asked before is sent)."""
        self._send(stream, status)

    def wake(self) -> None:
        """Have every stream look again at what changed (a feed, an owner, a setting)."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._wake_all)

    def wait_for(self, predicate: Callable[[], object], what: str) -> None:
        """Wait until `predicate()` holds; it is re-checked on every server event and every
        10 ms, since it may also look at state the handlers change."""
        deadline = time.monotonic() + WAIT_S
        with self._cond:
            while not predicate():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                self._cond.wait(0.01)

    @property
    def hellos(self) -> list[triage_pb2.Hello]:
        """The Hellos of the streams served here (not refused), in order."""
        with self._cond:
            return [s.hello for s in self.streams if s.hello is not None and not s.refused]

    def acked(self, stream: int | None = None) -> list[int]:
        with self._cond:
            return [o for s, o in self.acks if stream is None or s == stream]

    def partition_of(self, stream: int) -> int | None:
        hello = self.streams[stream - 1].hello
        return hello.partition if hello is not None and hello.HasField("partition") else None

    def acked_in(self) -> list[tuple[int | None, int]]:
        """(partition named by the stream's Hello, offset) of every ack."""
        with self._cond:
            return [(self.partition_of(s), o) for s, o in self.acks]

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(WAIT_S)

    def _send(self, number: int, item: triage_pb2.ProxyFrame | Status | _End) -> None:
        with self._cond:
            if not 1 <= number <= len(self.streams):
                raise LookupError(f"no stream {number} (there are {len(self.streams)})")
            stream = self.streams[number - 1]
        self._loop.call_soon_threadsafe(self._push, stream, item)

    # -- server loop ----------------------------------------------------------------------

    async def _start_server(self) -> None:
        server = grpc.aio.server()
        triage_pb2_grpc.add_TriageServicer_to_server(self, server)
        self.port = server.add_insecure_port(f"127.0.0.1:{self.port}")
        await server.start()
        self._server = server

    def _push(self, stream: FakeStream, item: triage_pb2.ProxyFrame | Status | _End) -> None:
        if not stream.finished:  # what a test sends after the call ended goes nowhere
            stream.outbox.append(item)
            stream.wake.set()

    def _wake_all(self) -> None:
        for stream in self.streams:
            stream.wake.set()

    def _emit(self, event: dict[str, Any]) -> None:
        for listener in self.listeners:
            listener(event)

    def _authorized(self, metadata: Metadata) -> bool:
        return dict(metadata).get("authorization") == f"Bearer {self.token}"

    async def Topology(
        self,
        request: triage_pb2.TopologyRequest,
        context: grpc.aio.ServicerContext[triage_pb2.TopologyRequest, triage_pb2.TopologyReply],
    ) -> triage_pb2.TopologyReply:
        metadata: Metadata = tuple(context.invocation_metadata() or ())
        with self._cond:
            self.topology_calls.append(metadata)
            self._cond.notify_all()
        if self.listeners:
            self._emit({"event": "topology", "metadata": metadata_json(metadata)})
        if not self._authorized(metadata):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong or missing token")
        answer = self.topology_answer
        if isinstance(answer, Status):
            await context.abort(answer.code, answer.details, trailing_metadata=answer.trailers)
        if answer is not None:
            return answer
        if self.deployment is None:  # an older proxy: the method does not exist
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        assert self.deployment is not None
        return self.deployment.reply()

    async def _refuse(
        self,
        stream: FakeStream,
        partition: int,
        context: grpc.aio.ServicerContext[triage_pb2.ConsumerFrame, triage_pb2.ProxyFrame],
    ) -> None:
        assert self.deployment is not None
        with self._cond:
            stream.refused = True
            self.refused.append(partition)
            owner = self.deployment.owners.get(partition)
            self._cond.notify_all()
        trailing = ((OWNER_ENDPOINT_METADATA, owner.target),) if owner is not None else ()
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"partition {partition} is not served here",
            trailing_metadata=trailing,
        )

    def _cancelled(self, stream: FakeStream) -> None:
        with self._cond:
            if stream.cancelled:
                return
            stream.cancelled = True
            self._cond.notify_all()
        if self.listeners:
            self._announce(stream)
            self._emit({"event": "cancelled", "stream": stream.number})

    def _announce(self, stream: FakeStream, first: dict[str, Any] | None = None) -> None:
        """Emit the stream's event, once: with its first frame when it has one, so a test
        never sees a stream that already sent its Hello without it."""
        if not stream.announced:
            stream.announced = True
            event = {"event": "stream", "stream": stream.number}
            self._emit({**event, "metadata": metadata_json(stream.metadata), **(first or {})})

    def _record(self, stream: FakeStream, frame: triage_pb2.ConsumerFrame) -> None:
        at = now_ms()
        with self._cond:
            stream.received.append((at, frame))
            self._cond.notify_all()
        if self.listeners:
            received = {"at": at, "frame": frame_json(frame)}
            if stream.announced:
                self._emit({"event": "frame", "stream": stream.number, **received})
            else:
                self._announce(stream, received)

    # grpc.aio also serves a stream as a coroutine that writes through context.write, as
    # this one does; the generated stubs know only the iterator form.
    async def Consume(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[triage_pb2.ConsumerFrame],
        context: grpc.aio.ServicerContext[triage_pb2.ConsumerFrame, triage_pb2.ProxyFrame],
    ) -> None:
        metadata: Metadata = tuple(context.invocation_metadata() or ())
        if not self._authorized(metadata):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong or missing token")
        with self._cond:
            stream = FakeStream(number=len(self.streams) + 1, metadata=metadata)
            self.streams.append(stream)
            generation = self._generation
            self._cond.notify_all()
        try:
            await self._consume(stream, generation, request_iterator, context)
        except asyncio.CancelledError:
            # The client cancelled the call (or the server is stopping): record it, then let
            # grpc finish the cancellation.
            self._cancelled(stream)
            raise
        finally:
            stream.finished = True
            if self.listeners:
                self._announce(stream)  # a call that ended before its first frame

    async def _consume(
        self,
        stream: FakeStream,
        generation: int,
        request_iterator: AsyncIterator[triage_pb2.ConsumerFrame],
        context: grpc.aio.ServicerContext[triage_pb2.ConsumerFrame, triage_pb2.ProxyFrame],
    ) -> None:
        frames = aiter(request_iterator)
        first = await anext(frames, None)
        if first is None:
            return
        self._record(stream, first)
        hello = first.hello
        deployment = self.deployment
        partition = 3
        queue_of: Callable[[], deque[triage_pb2.Delivery]] = lambda: self._queue  # noqa: E731
        if hello.HasField("partition") and deployment is not None:
            partition = hello.partition
            if deployment.owners.get(partition) is not self:
                await self._refuse(stream, partition, context)
            queue_of = lambda: deployment.queues[partition]  # noqa: E731
        scripted = self.scripted
        deadline_ms = self.ack_deadline_ms
        grants = self.grants
        credits = hello.credits
        if not scripted:
            welcome = triage_pb2.Welcome(
                topic="orders",
                partition=partition,
                ack_deadline_ms=deadline_ms,
                grants=grants,
                ack_ranges=self.ack_ranges,
            )
            await context.write(triage_pb2.ProxyFrame(welcome=welcome))
        loop = asyncio.get_running_loop()
        unsettled: dict[int, triage_pb2.Delivery] = {}
        leases: dict[int, float] = {}  # offset -> loop time its lease lapses
        rejected: list[int] = []
        number = stream.number
        wake = stream.wake
        half_closed = False

        def settled(offset: int) -> None:  # under cond
            if unsettled.pop(offset, None) is not None and deployment is not None:
                deployment.held(-1)

        async def read() -> None:
            nonlocal half_closed, credits
            async for frame in frames:
                self._record(stream, frame)
                with self._cond:
                    if frame.HasField("grant"):
                        self.granted.append((partition, frame.grant.credits))
                        if grants:
                            credits = frame.grant.credits
                    ranged = [
                        o for r in frame.settle.ack_ranges for o in range(r.first, r.last + 1)
                    ]
                    self.ranges.extend((r.first, r.last) for r in frame.settle.ack_ranges)
                    for offset in [*frame.settle.acks, *ranged]:
                        self.acks.append((number, offset))
                        settled(offset)
                    for nack in frame.settle.nacks:
                        self.nacks.append((number, nack))
                        settled(nack.offset)
                    if frame.HasField("release"):
                        credits = 0  # as the proxy: a Release ends the stream's credits
                    for offset in frame.release.offsets:
                        self.releases.append((number, offset))
                        settled(offset)
                    if frame.HasField("extend"):
                        self.extends.append((number, list(frame.extend.offsets)))
                        for offset in frame.extend.offsets:
                            if offset in leases:
                                leases[offset] = loop.time() + deadline_ms / 1000
                            else:
                                self.stale_extends.append((number, offset))
                    for offset in (*frame.settle.acks, *frame.release.offsets):
                        leases.pop(offset, None)
                    for nack in frame.settle.nacks:
                        leases.pop(nack.offset, None)
                    rejected.extend(o for o in frame.settle.acks if o in self.reject)
                    self.events.append((number, frame.WhichOneof("frame") or "empty"))
                    self._cond.notify_all()
                wake.set()
            at = now_ms()
            # A cancel ends the frames too, and grpc cancels this handler only a moment later:
            # wait that moment, so that a cancel is not taken for a half-close.
            await asyncio.sleep(CANCEL_NOTICE_S)
            if context.cancelled():
                self._cancelled(stream)
                wake.set()
                return
            with self._cond:
                stream.half_closed_at = at
                self.events.append((number, "half-close"))
                self._cond.notify_all()
            if self.listeners:
                self._emit({"event": "half-close", "stream": number, "at": at})
            half_closed = True
            wake.set()

        reader = asyncio.create_task(read())
        try:
            while True:
                while stream.outbox:
                    item = stream.outbox.popleft()
                    if isinstance(item, triage_pb2.ProxyFrame):
                        await context.write(item)
                    elif isinstance(item, Status):
                        stream.finished = True
                        await context.abort(
                            item.code, item.details, trailing_metadata=item.trailers
                        )
                    else:
                        stream.finished = True
                        return
                if half_closed and self.end_on_half_close:
                    return
                moved = deployment is not None and deployment.owners.get(partition) is not self
                if moved and hello.HasField("partition"):
                    await self._refuse(stream, partition, context)
                if rejected:
                    refusal = triage_pb2.Rejected(offsets=rejected, reason="not held")
                    rejected = []
                    await context.write(triage_pb2.ProxyFrame(rejected=refusal))
                if not scripted and not half_closed:
                    with self._cond:
                        queue = queue_of()
                        room = min(self.batch, credits - len(unsettled))
                        batch = [queue.popleft() for _ in range(min(room, len(queue)))]
                        for d in batch:
                            unsettled[d.offset] = d
                            if deadline_ms:
                                leases[d.offset] = loop.time() + deadline_ms / 1000
                        self.max_unsettled = max(self.max_unsettled, len(unsettled))
                        if deployment is not None:
                            deployment.held(len(batch))
                    if batch:
                        if self.delay_s:
                            await asyncio.sleep(self.delay_s)
                        frame = triage_pb2.Deliveries(
                            topic="orders", partition=partition, deliveries=batch
                        )
                        await context.write(triage_pb2.ProxyFrame(deliveries=frame))
                        continue
                timeout = max(0.0, min(leases.values()) - loop.time()) if leases else None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), timeout)
                wake.clear()
                now = loop.time()
                with self._cond:  # lapsed leases: taken back and redelivered, attempt raised
                    for offset in [o for o, lapse in leases.items() if lapse <= now]:
                        del leases[offset]
                        lapsed = unsettled.pop(offset)
                        lapsed.attempt += 1
                        self.expired.append((number, offset))
                        queue_of().appendleft(lapsed)
                        if deployment is not None:
                            deployment.held(-1)
                    self._cond.notify_all()
        finally:
            reader.cancel()
            with self._cond:  # what this stream still held goes back for redelivery
                named = hello.HasField("partition")
                held = unsettled.values() if named or generation == self._generation else ()
                for d in sorted(held, key=lambda d: -d.offset):
                    d.attempt += 1
                    queue_of().appendleft(d)
                if deployment is not None:
                    deployment.held(-len(unsettled))
                self._cond.notify_all()


# -- JSON forms, for the control interface ------------------------------------------------


def frame_json(message: ProtoMessage) -> dict[str, Any]:
    """`message` as @grpc/proto-loader reads it with the TypeScript client's options
    (keepCase, longs: Number, defaults: false, oneofs: true): field names as in the proto,
    64-bit integers as numbers, bytes as base64, absent fields and empty repeated ones left
    out, and a oneof's chosen member named under the oneof's own name."""
    out: dict[str, Any] = {}
    for descriptor, value in message.ListFields():
        if descriptor.is_repeated:
            out[descriptor.name] = [_field_json(descriptor, v) for v in value]
        else:
            out[descriptor.name] = _field_json(descriptor, value)
        oneof = descriptor.containing_oneof
        if oneof is not None and not oneof.name.startswith("_"):  # "_x": proto3 `optional`
            out[oneof.name] = descriptor.name
    return out


def _field_json(descriptor: FieldDescriptor, value: Any) -> Any:
    if descriptor.type == FieldDescriptor.TYPE_MESSAGE:
        return frame_json(value)
    if descriptor.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(value).decode()
    return value


def metadata_json(metadata: Metadata) -> dict[str, list[str]]:
    """key -> its values; the values of `-bin` keys in base64."""
    out: dict[str, list[str]] = {}
    for key, value in metadata:
        text = base64.b64encode(value).decode() if isinstance(value, bytes) else value
        out.setdefault(key, []).append(text)
    return out


def status_of(command: dict[str, Any]) -> Status:
    """The Status a control command names: numeric code, details, trailers."""
    code = next(c for c in grpc.StatusCode if c.value[0] == int(command["code"]))
    trailers = tuple((str(k), str(v)) for k, v in (command.get("trailers") or {}).items())
    return Status(code, str(command.get("details", "")), trailers)


# -- control interface --------------------------------------------------------------------

CONTROL_HELP = """\
JSON lines. On start, one line: {"ready": true, "endpoints": ["127.0.0.1:PORT", ...],
"token": TOKEN, "pid": PID}. Proxies are numbered from 0 in that order; they start scripted.

Commands on stdin, one JSON object a line; "id" (any) is echoed in the reply, "proxy"
(default 0) picks the proxy, "stream" numbers a proxy's Consume calls from 1:
  {"cmd": "configure", "scripted": bool, "end_on_half_close": bool, "ack_deadline_ms": int,
   "grants": bool, "ack_ranges": bool, "batch": int, "reject": [offset, ...]}
      any subset; "end_on_half_close": true also ends the streams already half-closed
  {"cmd": "topology", "reply": TopologyReply}   what Topology answers from now on
  {"cmd": "topology", "code": int, "details": str}   ...or fail it with that status
  {"cmd": "topology"}   ...or answer UNIMPLEMENTED, as a proxy older than Topology
  {"cmd": "feed", "deliveries": [Delivery, ...]}   queue records for served streams
  {"cmd": "write", "stream": n, "frame": ProxyFrame}   e.g. a Welcome, Deliveries, Rejected
  {"cmd": "end", "stream": n}   end the stream with OK
  {"cmd": "fail", "stream": n, "code": int, "details": str, "trailers": {key: value}}
  {"cmd": "report"}   what the proxy received: acks, nacks, releases, extends, grants
  {"cmd": "sync"}   nothing: its reply follows every event emitted before it
Messages are proto3 JSON with the proto's field names; bytes in base64.
Replies: {"reply": id, "ok": true, ...} or {"reply": id, "error": "..."}.

Events on stdout as they happen (times are wall-clock ms):
  {"event": "topology", "proxy": i, "metadata": {key: [value, ...]}}
  {"event": "stream", "proxy": i, "stream": n, "metadata": {...}, "at": ms,
   "frame": ConsumerFrame}   a Consume call with its first frame (the Hello), or without
                             "at" and "frame" if it ended before sending one
  {"event": "frame", "proxy": i, "stream": n, "at": ms, "frame": ConsumerFrame}   the others
  {"event": "half-close", "proxy": i, "stream": n, "at": ms}
  {"event": "cancelled", "proxy": i, "stream": n}
ConsumerFrames are as @grpc/proto-loader gives them (see frame_json). Stdin's end, SIGTERM
or SIGKILL stops it.
"""


def run_command(proxies: Sequence[FakeProxy], command: dict[str, Any]) -> dict[str, Any]:
    """Apply one control command; what the reply adds to `ok`."""
    proxy = proxies[int(command.get("proxy", 0))]
    kind = command["cmd"]
    if kind == "configure":
        for name in ("scripted", "end_on_half_close", "grants", "ack_ranges"):
            if name in command:
                setattr(proxy, name, bool(command[name]))
        for name in ("ack_deadline_ms", "batch"):
            if name in command:
                setattr(proxy, name, int(command[name]))
        if "reject" in command:
            proxy.reject = {int(o) for o in command["reject"]}
        proxy.wake()
    elif kind == "topology":
        if "reply" in command:
            reply = json_format.ParseDict(command["reply"], triage_pb2.TopologyReply())
            proxy.topology_answer = reply
        elif "code" in command:
            proxy.topology_answer = status_of(command)
        else:
            proxy.topology_answer = None
    elif kind == "feed":
        proxy.feed(json_format.ParseDict(d, triage_pb2.Delivery()) for d in command["deliveries"])
    elif kind == "write":
        frame = json_format.ParseDict(command["frame"], triage_pb2.ProxyFrame())
        proxy.write(int(command["stream"]), frame)
    elif kind == "end":
        proxy.end(int(command["stream"]))
    elif kind == "fail":
        proxy.fail(int(command["stream"]), status_of(command))
    elif kind == "report":
        return report(proxy)
    elif kind != "sync":
        raise ValueError(f"unknown command {kind!r}")
    return {}


def report(proxy: FakeProxy) -> dict[str, Any]:
    with proxy._cond:
        return {
            "streams": len(proxy.streams),
            "topology_calls": len(proxy.topology_calls),
            "acks": [[s, o] for s, o in proxy.acks],
            "nacks": [[s, n.offset, n.reason, n.retry] for s, n in proxy.nacks],
            "releases": [[s, o] for s, o in proxy.releases],
            "extends": [[s, offsets] for s, offsets in proxy.extends],
            "granted": [[p, c] for p, c in proxy.granted],
        }


def control(count: int, token: str) -> None:
    """Serve `count` scripted fake proxies, driven over stdin and stdout (CONTROL_HELP)."""
    lock = threading.Lock()

    def send(message: dict[str, Any]) -> None:
        with lock:
            sys.stdout.write(json.dumps(message) + "\n")
            sys.stdout.flush()

    def forward(index: int) -> Listener:
        return lambda event: send({**event, "proxy": index})

    proxies: list[FakeProxy] = []
    try:
        for index in range(count):
            fake = FakeProxy(token=token, scripted=True)
            fake.listeners.append(forward(index))
            proxies.append(fake.start())
        send(
            {
                "ready": True,
                "endpoints": [p.target for p in proxies],
                "token": token,
                "pid": os.getpid(),
            }
        )
        while line := sys.stdin.readline():
            if not line.strip():
                continue
            command: dict[str, Any] = {}
            try:
                command = json.loads(line)
                answer = run_command(proxies, command)
            except Exception as exc:  # noqa: BLE001 - reported to the driving test, which fails
                send({"reply": command.get("id"), "error": f"{type(exc).__name__}: {exc}"})
            else:
                send({"reply": command.get("id"), "ok": True, **answer})
    finally:
        for fake in proxies:
            fake.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fakeproxy",
        description="Fake Triage proxies driven over JSON lines, for another language's tests.",
        epilog=CONTROL_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--control", action="store_true", required=True)
    parser.add_argument("--proxies", type=int, default=1, help="how many (default 1)")
    parser.add_argument("--token", default=TOKEN, help="the bearer token the proxies accept")
    args = parser.parse_args(argv)
    with contextlib.suppress(BrokenPipeError, KeyboardInterrupt):
        control(args.proxies, args.token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
