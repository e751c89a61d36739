"""The Grant frame on the real proxy service over in-memory twins: the Welcome says the
proxy honours it, a raise lets more through, a lowering stops new deliveries without taking
back what is held, and a Grant out of bounds ends the stream with INVALID_ARGUMENT. A
client that never sends one (an older client) keeps its Hello's credits."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from tests.unit.wire import consume_call, serving
from triage_protocol import triage_pb2 as pb
from triage_proxy.app import Proxy
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.config.settings import Settings
from triage_proxy.kafka.client import MemoryPartition
from triage_proxy.store.checkpoints import MemoryCheckpoints
from triage_proxy.store.deadletter_store import MemoryStore
from triage_proxy.store.leases import MemoryLeases

TOKEN = "grant-unit-token-0123456"
PROBE = 10**9
"""An offset no stream holds: a Settle of it comes back Rejected (see `Stream.quiet`)."""


def make_settings() -> Settings:
    return settings_from_dict(
        {
            "kafka": {"bootstrap_servers": "127.0.0.1:1", "topic": "orders", "group_id": "g"},
            "auth": {"token": TOKEN},
            "dead_letters": {"table": "dlq", "flush_interval_ms": 1},
            "server": {"host": "127.0.0.1", "port": 0, "http_port": 0},
        },
        {},
    )


def proxy_with(records: int) -> Proxy:
    log = MemoryPartition("orders", 0)
    for i in range(records):
        log.append(b"v%d" % i)
    return Proxy(
        make_settings(),
        0,
        log=log,
        store=MemoryStore(),
        checkpoints=MemoryCheckpoints(),
        leases=MemoryLeases(),
    )


class Stream:
    """One Consume call driven by hand; a reader task queues what the proxy sends (a read
    cancelled by a timeout would cancel the call)."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.held: list[int] = []
        self.frames: asyncio.Queue[pb.ProxyFrame | None] = asyncio.Queue()
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            while (frame := await self.call.read()) is not grpc.aio.EOF:
                self.frames.put_nowait(frame)
        except grpc.aio.AioRpcError:
            pass
        self.frames.put_nowait(None)

    async def write(self, **frame: Any) -> None:
        await self.call.write(pb.ConsumerFrame(**frame))

    async def next(self) -> pb.ProxyFrame | None:
        async with asyncio.timeout(10):
            return await self.frames.get()

    async def receive(self, count: int) -> None:
        while len(self.held) < count:
            frame = await self.next()
            assert frame is not None, "the stream ended"
            self.held.extend(d.offset for d in frame.deliveries.deliveries)

    async def quiet(self) -> bool:
        """The proxy sent nothing since the last frame read, and sends nothing now.

        Not a wait of some fixed time: a Settle of an offset the stream never held is
        answered Rejected on the same stream, and the proxy hands out deliveries inside the
        call that changed credits or settlements (the dispatcher pumps before it returns;
        the Rejected is queued after that). So every delivery that the frames written so
        far (this probe included) let it send is queued before the answer: the answer
        coming first proves there is none."""
        await self.write(settle=pb.Settle(acks=[PROBE]))
        frame = await self.next()
        assert frame is not None, "the stream ended"
        if frame.WhichOneof("frame") != "rejected":
            return False
        assert list(frame.rejected.offsets) == [PROBE]
        return True


def scenario(body: Any, records: int = 50) -> None:
    async def run() -> None:
        async with serving(proxy_with(records)) as proxy, consume_call(proxy, TOKEN) as call:
            stream = Stream(call)
            try:
                await body(stream)
            finally:
                call.cancel()
                await asyncio.gather(stream.reader, return_exceptions=True)

    asyncio.run(run())


def test_grants_raise_and_lower_a_streams_credits() -> None:
    async def body(stream: Stream) -> None:
        await stream.write(hello=pb.Hello(consumer_id="g", credits=2))
        frame = await stream.next()
        assert frame is not None, "the stream ended"
        assert frame.welcome.grants, "this proxy honours Grant"
        await stream.receive(2)
        assert await stream.quiet()
        await stream.write(grant=pb.Grant(credits=6))
        await stream.receive(6)
        assert await stream.quiet()
        assert stream.held == list(range(6))
        await stream.write(grant=pb.Grant(credits=3))  # lowered below the 6 held
        assert await stream.quiet(), "nothing is sent while it holds more than its grant"
        await stream.write(settle=pb.Settle(acks=[0, 1, 2]))  # holds 3: still not under 3
        assert await stream.quiet()
        await stream.write(settle=pb.Settle(acks=[3]))
        await stream.receive(7)
        assert stream.held[6:] == [6]
        assert await stream.quiet()

    scenario(body)


def test_an_older_client_keeps_its_hello_credits() -> None:
    async def body(stream: Stream) -> None:
        await stream.write(hello=pb.Hello(consumer_id="old", credits=4))  # no partition
        frame = await stream.next()
        assert frame is not None, "the stream ended"
        assert frame.welcome.partition == 0
        await stream.receive(4)
        assert await stream.quiet()
        await stream.write(settle=pb.Settle(acks=[0, 1]))
        await stream.receive(6)
        assert await stream.quiet()

    scenario(body)


def test_a_grant_out_of_bounds_ends_the_stream_with_invalid_argument() -> None:
    for credits in (0, 100_001):

        async def body(stream: Stream, credits: int = credits) -> None:
            await stream.write(hello=pb.Hello(consumer_id="bad", credits=2))
            await stream.receive(2)
            await stream.write(grant=pb.Grant(credits=credits))
            while await stream.next() is not None:
                pass
            assert await stream.call.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "Grant.credits must be 1..100000" in (await stream.call.details())

        scenario(body)
