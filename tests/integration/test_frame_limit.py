"""Hello.max_frame_bytes end to end: no frame over the consumer's limit, with a client whose
gRPC receive limit is exactly that (as grpc-js's 4 MiB default), and a record over it
dead-lettered while the rest flows."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.integration.harness import (
    RawConsumer,
    await_until,
    committed,
    dead_letters,
    produce,
    settings_for,
    target,
)
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker
from triage_protocol import triage_pb2 as pb
from triage_protocol.constants import DEFAULT_FRAME_BYTES, MIN_FRAME_BYTES
from triage_proxy.app import Proxy

pytestmark = pytest.mark.integration

CREDITS = 2048
SIZE = 4000


async def receive_frames(consumer: RawConsumer, count: int) -> list[pb.ProxyFrame]:
    """Read until `count` more deliveries arrived; return the Deliveries frames."""
    frames = []
    before = len(consumer.deliveries)
    async with asyncio.timeout(30):
        while len(consumer.deliveries) < before + count:
            frame = await consumer.read()
            if frame.WhichOneof("frame") == "deliveries":
                frames.append(frame)
    return frames


async def fetched(proxy: Proxy, count: int) -> None:
    """Wait until the proxy holds `count` records, so one pump fills whole frames."""
    assert await await_until(lambda: proxy.snapshot().in_window >= count, 30)


@pytest.mark.parametrize("max_frame_bytes", [DEFAULT_FRAME_BYTES, 0], ids=["4MiB", "old-hello"])
def test_4000_byte_messages_at_2048_credits_fit_a_4_mib_client(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str, max_frame_bytes: int
) -> None:
    """The grpc-js trap: grpc-js refuses a frame over its 4 MiB receive limit, and 2,048
    credits of 4,000-byte records fill 4,213,082 bytes unless the proxy cuts frames by
    their encoded size; also for a Hello without the field, which gets 4 MiB frames."""
    settings = settings_for(broker, aws, topic)
    total = 2 * CREDITS
    produce(broker.bootstrap, topic, ((b"k%d" % i, b"x" * SIZE, None) for i in range(total)))

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy:
            await fetched(proxy, total)
            async with RawConsumer(
                target(proxy), credits=CREDITS, max_frame_bytes=max_frame_bytes
            ) as consumer:
                frames = await receive_frames(consumer, CREDITS)
                assert consumer.welcome is not None
                assert consumer.welcome.max_frame_bytes == DEFAULT_FRAME_BYTES
                consumer.settle(acks=[d.offset for d in consumer.deliveries])
                frames += await receive_frames(consumer, CREDITS)
                consumer.settle(acks=[d.offset for d in consumer.deliveries[CREDITS:]])
                sizes = [f.ByteSize() for f in frames]
                assert max(sizes) <= DEFAULT_FRAME_BYTES
                assert max(sizes) > DEFAULT_FRAME_BYTES - SIZE - 64  # filled to the limit
                assert sorted(d.offset for d in consumer.deliveries) == list(range(total))
                assert await await_until(
                    lambda: committed(broker.bootstrap, settings.kafka.group_id, topic) == total
                )

    asyncio.run(scenario())


def test_a_record_over_the_limit_is_dead_lettered_and_the_next_ones_flow(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    settings = settings_for(broker, aws, topic)
    big = b"B" * (2 * MIN_FRAME_BYTES)
    produce(
        broker.bootstrap,
        topic,
        [(b"a", b"small", None), (b"b", big, [("h", b"\x00\xff")]), (b"c", b"s2", None)],
    )

    async def scenario() -> None:
        async with (
            Proxy(settings, 0) as proxy,
            RawConsumer(target(proxy), credits=10, max_frame_bytes=MIN_FRAME_BYTES) as consumer,
        ):
            got = await consumer.receive(2)
            assert [d.offset for d in got] == [0, 2]
            consumer.settle(acks=[0, 2])
            assert await await_until(
                lambda: committed(broker.bootstrap, settings.kafka.group_id, topic) == 3
            )
            assert consumer.welcome is not None
            assert consumer.welcome.max_frame_bytes == MIN_FRAME_BYTES

    asyncio.run(scenario())
    [dl] = dead_letters(settings)
    assert dl.record.offset == 1
    assert dl.record.value == big  # byte-exact: nothing lost
    assert dl.record.headers == (("h", b"\x00\xff"),)
    assert dl.reason.startswith(f"record of {len(big) + 4} bytes needs a frame of ")
    assert f"over the consumer's frame limit of {MIN_FRAME_BYTES} bytes" in dl.reason


def test_a_frame_limit_below_the_minimum_is_invalid_argument(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    settings = settings_for(broker, aws, topic)

    async def scenario() -> None:
        async with (
            Proxy(settings, 0) as proxy,
            RawConsumer(target(proxy), max_frame_bytes=MIN_FRAME_BYTES - 1) as consumer,
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await consumer.read()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "Hello.max_frame_bytes" in (info.value.details() or "")

    asyncio.run(scenario())


def test_rejected_frames_are_split_to_the_limit_too(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """20,000 forged settlements at a 64 KiB limit: the Rejected answer comes in frames
    within the limit, every offset named once."""
    settings = settings_for(broker, aws, topic)
    forged = list(range(10**6, 10**6 + 20_000))

    async def scenario() -> None:
        async with (
            Proxy(settings, 0) as proxy,
            RawConsumer(target(proxy), max_frame_bytes=MIN_FRAME_BYTES) as consumer,
        ):
            await consumer.read()  # Welcome
            consumer.settle(acks=forged)
            sizes = []
            async with asyncio.timeout(30):
                while len(consumer.rejected) < len(forged):
                    sizes.append((await consumer.read()).ByteSize())
            assert sorted(consumer.rejected) == forged
            assert len(sizes) > 1
            assert max(sizes) <= MIN_FRAME_BYTES

    asyncio.run(scenario())
