"""End to end through a real proxy, the real broker (Tansu) and real DynamoDB (moto server)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from tests.integration.harness import (
    Message,
    RawConsumer,
    await_until,
    committed,
    dead_letters,
    produce,
    settings_for,
    target,
)
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker
from triage_proxy.app import Proxy

pytestmark = pytest.mark.integration


def plain(n: int) -> list[tuple[bytes, bytes, None]]:
    return [(b"k%d" % i, b"v%d" % i, None) for i in range(n)]


def test_out_of_order_acks_commit_only_the_contiguous_prefix(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    settings = settings_for(broker, aws, topic)
    produce(broker.bootstrap, topic, plain(5))

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy, RawConsumer(target(proxy)) as consumer:
            got = await consumer.receive(5)
            assert [d.offset for d in got] == [0, 1, 2, 3, 4]
            commits = proxy.snapshot().counters["commits"]
            consumer.settle(acks=[1, 2, 4])
            # The settled-above encoding changes, so the committer commits offset 0 with it:
            # a commit that has seen these acks, and must not pass the unsettled 0.
            assert await await_until(lambda: proxy.snapshot().counters["commits"] > commits)
            assert committed(broker.bootstrap, settings.kafka.group_id, topic) == 0
            consumer.settle(acks=[0])
            assert await await_until(
                lambda: committed(broker.bootstrap, settings.kafka.group_id, topic) == 3
            )
            consumer.settle(acks=[3])
            assert await await_until(
                lambda: committed(broker.bootstrap, settings.kafka.group_id, topic) == 5
            )

    asyncio.run(scenario())


def test_a_receive_that_times_out_leaves_the_stream_open(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """The test client's own contract (tests/integration/harness.py): giving up on a read
    must not cancel the call, or a test polling with a short timeout loses its stream the
    first time nothing comes in time (a push test failed so on a slow machine)."""
    settings = settings_for(broker, aws, topic)

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy, RawConsumer(target(proxy)) as consumer:
            for _ in range(3):  # nothing produced yet: each read is given up
                with pytest.raises(TimeoutError):
                    await consumer.receive(1, timeout=0.05)
            produce(broker.bootstrap, topic, plain(2))
            got = await consumer.receive(2)
            assert [d.offset for d in got] == [0, 1]
            consumer.settle(acks=[0, 1])
            assert await await_until(
                lambda: committed(broker.bootstrap, settings.kafka.group_id, topic) == 2
            )

    asyncio.run(scenario())


def test_wrong_or_missing_token_gets_unauthenticated_and_no_data(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    settings = settings_for(broker, aws, topic)
    produce(broker.bootstrap, topic, plain(3))

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy:
            for token in ("wrong", None, ""):
                async with RawConsumer(target(proxy), token=token, hello=False) as consumer:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await consumer.read()
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert consumer.deliveries == []
            assert proxy.snapshot().counters["delivered"] == 0

    asyncio.run(scenario())


def test_instance_that_disconnects_mid_batch_has_its_messages_redelivered(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    settings = settings_for(broker, aws, topic)
    produce(broker.bootstrap, topic, plain(10))

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy:
            first = RawConsumer(target(proxy))
            async with first:
                await first.receive(10)
                first.settle(acks=[0, 1, 2])
                await first.sync()  # the proxy has read the acks before `first` vanishes
            # `first` vanished holding 3..9: seven at once prove nothing about any one of
            # them, so they come back as suspects without using an attempt.
            async with RawConsumer(target(proxy)) as second:
                again = []
                for _ in range(7):  # suspects come one at a time per instance
                    (d,) = await second.receive(1)
                    again.append(d)
                    second.settle(acks=[d.offset])
                assert [(d.offset, d.attempt) for d in again] == [(o, 1) for o in range(3, 10)]
                assert [d.value for d in again] == [b"v%d" % o for o in range(3, 10)]
                assert await await_until(
                    lambda: committed(broker.bootstrap, settings.kafka.group_id, topic) == 10
                )

    asyncio.run(scenario())


def test_a_lone_delivery_is_blamed_for_an_older_client_and_only_once_started_for_a_new_one(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """An older client (no Hello.isolation) that vanishes holding one delivery loses it an
    attempt, as any vanished holder does. An isolating one does not (the crash may have
    come from another of its process's partitions): the record comes back flagged
    isolated, and only once its holder reported it Started, and the proxy answered, does
    vanishing cost an attempt."""
    settings = settings_for(broker, aws, topic, delivery={"redelivery_span_s": 0.7})
    produce(broker.bootstrap, topic, plain(2))

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy:

            async def left() -> None:
                """The proxy saw the instance go, so what it held is back before the next
                one asks (on a busy machine the next Hello came first and got offset 1)."""
                assert await await_until(lambda: not proxy.snapshot().instances)

            async with RawConsumer(target(proxy), credits=1) as old:
                (d,) = await old.receive(1)
                assert (d.offset, d.attempt) == (0, 1)
                assert old.isolated == []
            await left()
            async with RawConsumer(target(proxy), credits=1, isolation=True) as new:
                (d,) = await new.receive(1)
                assert (d.offset, d.attempt) == (0, 2)  # the older client's lone one: blamed
                assert new.isolated == [0]
            await left()
            async with RawConsumer(target(proxy), credits=1, isolation=True) as new:
                (d,) = await new.receive(1)
                assert (d.offset, d.attempt) == (0, 2)  # held, never started: not blamed
                assert new.isolated == [0]
                new.start(0)
                async with asyncio.timeout(15):
                    while new.started != [0]:
                        await new.read()
            await left()
            async with RawConsumer(target(proxy), credits=2, isolation=True) as new:
                got = await new.receive(2)
                assert sorted((d.offset, d.attempt) for d in got) == [(0, 3), (1, 1)]
                assert new.isolated == [0]  # the suspect alone in its frame, flagged
                new.settle(acks=[0, 1])
                assert await await_until(
                    lambda: committed(broker.bootstrap, settings.kafka.group_id, topic) == 2
                )

    asyncio.run(scenario())


def test_forged_and_duplicate_settlements_are_rejected_and_counted(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    settings = settings_for(broker, aws, topic)
    produce(broker.bootstrap, topic, plain(2))

    async def scenario() -> None:
        async with (
            Proxy(settings, 0) as proxy,
            RawConsumer(target(proxy), credits=1) as a,
            RawConsumer(target(proxy), credits=1) as b,
        ):
            (mine,) = await a.receive(1)
            (theirs,) = await b.receive(1)
            a.settle(acks=[theirs.offset, 12345])
            a.settle(acks=[mine.offset])
            a.settle(acks=[mine.offset])
            async with asyncio.timeout(10):
                while len(a.rejected) < 3:
                    await a.read()
            assert sorted(a.rejected) == sorted([theirs.offset, 12345, mine.offset])
            assert proxy.snapshot().counters["rejected"] == 3
            b.settle(acks=[theirs.offset])
            assert await await_until(
                lambda: committed(broker.bootstrap, settings.kafka.group_id, topic) == 2
            )

    asyncio.run(scenario())


def test_ack_ranges_settle_and_forged_or_duplicate_offsets_in_a_range_are_rejected(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    settings = settings_for(broker, aws, topic)
    produce(broker.bootstrap, topic, plain(10))

    async def scenario() -> None:
        async with (
            Proxy(settings, 0) as proxy,
            RawConsumer(target(proxy), credits=6) as a,
            RawConsumer(target(proxy), credits=4) as b,
        ):
            mine = await a.receive(6)
            theirs = await b.receive(4)
            assert a.welcome is not None
            assert a.welcome.ack_ranges
            held = sorted(d.offset for d in mine)
            others = sorted(d.offset for d in theirs)
            # One range over all of this stream's offsets, another's, and one never fetched;
            # then the same range again (duplicates): only what it holds settles.
            a.settle(ranges=[(0, 9), (9990, 9991)])
            a.settle(ranges=[(held[0], held[-1])])
            expected = [*others, 9990, 9991, *list(range(held[0], held[-1] + 1))]
            async with asyncio.timeout(10):
                while len(a.rejected) < len(expected):
                    await a.read()
            assert sorted(a.rejected) == sorted(expected)
            counters = proxy.snapshot().counters
            assert counters["rejected"] == len(expected)
            assert counters["acked"] == 6
            b.settle(acks=others)  # plain acks, beside the ranges
            assert await await_until(
                lambda: committed(broker.bootstrap, settings.kafka.group_id, topic) == 10
            )

    asyncio.run(scenario())


def test_packed_and_repeated_deliveries_side_by_side_are_byte_exact(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """A client that asks for packed deliveries and one that does not (an older client)
    share one proxy: each gets its records byte-exact, the first mostly packed (records with
    headers stay repeated), the second never packed; together they settle everything."""
    records: list[Message] = [
        (b"k%d" % i if i % 3 else None, None if i % 7 == 0 else b"v" * (i % 5), None)
        for i in range(40)
    ]
    records += [(b"h%d" % i, b"with header", [("h", b"x")]) for i in range(4)]
    produce(broker.bootstrap, topic, records)
    settings = settings_for(broker, aws, topic)

    async def scenario() -> None:
        async with (
            Proxy(settings, 0) as proxy,
            RawConsumer(target(proxy), credits=22, packed=True) as new,
            RawConsumer(target(proxy), credits=22) as old,
        ):
            got = [*await new.receive(22), *await old.receive(22)]
            assert new.packed_received > 0
            assert old.packed_received == 0
            assert sorted(d.offset for d in got) == list(range(44))
            for d in got:
                key, value, headers = records[d.offset]
                assert (d.key if d.HasField("key") else None) == key
                assert (d.value if d.HasField("value") else None) == value
                assert [(h.key, h.value) for h in d.headers] == (headers or [])
                assert d.attempt == 1
            new.settle(acks=[d.offset for d in new.deliveries])
            old.settle(acks=[d.offset for d in old.deliveries])
            assert await await_until(
                lambda: committed(broker.bootstrap, settings.kafka.group_id, topic) == 44
            )

    asyncio.run(scenario())


def test_a_settle_with_a_malformed_range_ends_the_stream_invalid_argument(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    settings = settings_for(broker, aws, topic)
    produce(broker.bootstrap, topic, plain(1))

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy, RawConsumer(target(proxy)) as consumer:
            await consumer.receive(1)
            consumer.settle(ranges=[(0, 200_000)])

            async def read_to_the_end() -> None:
                async with asyncio.timeout(10):
                    while True:
                        await consumer.read()

            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await read_to_the_end()
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 100000 offsets" in (caught.value.details() or "")

    asyncio.run(scenario())


def test_restarted_proxy_resumes_from_the_committed_offset(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    # The instance holds 12..19 through the stop; the drain gives up on them after 1 s.
    settings = settings_for(broker, aws, topic, shutdown={"drain_timeout_s": 1})
    produce(broker.bootstrap, topic, plain(20))

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy, RawConsumer(target(proxy)) as consumer:
            got = await consumer.receive(20)
            consumer.settle(acks=[d.offset for d in got if d.offset < 12])
            assert await await_until(lambda: proxy.snapshot().committed_offset == 12)
            # The proxy stops while the instance is connected: it ends the stream, which
            # uses no attempt (an instance vanishing would: that count outlives a restart).
            proxy.stop()
            await proxy.wait_stopped()
        # Graceful stop: the final commit says 12; offsets 12.. come back.
        assert committed(broker.bootstrap, settings.kafka.group_id, topic) == 12
        async with Proxy(settings, 0) as proxy, RawConsumer(target(proxy)) as consumer:
            got = await consumer.receive(8)
            assert [d.offset for d in got] == list(range(12, 20))
            assert all(d.attempt == 1 for d in got)

    asyncio.run(scenario())


def test_full_window_pauses_fetching_and_stays_bounded(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    settings = settings_for(broker, aws, topic, window={"max_messages": 50})
    produce(broker.bootstrap, topic, plain(500))

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy, RawConsumer(target(proxy), credits=20) as c:
            await c.receive(20)
            # Paused, the fetcher waits for room in the window: only settlements make it.
            assert await await_until(lambda: proxy.snapshot().fetch_paused)
            # Any delivery the proxy could send now comes before the answer to this probe:
            # none may (20 credits, 20 held).
            await c.sync()
            assert proxy.snapshot().in_window == 50
            assert proxy.snapshot().counters["fetched"] == 50
            assert len(c.deliveries) == 20  # credits respected while the window is full
            c.settle(acks=[d.offset for d in c.deliveries])
            await c.receive(20)
            assert await await_until(lambda: proxy.snapshot().counters["fetched"] == 70)
            assert proxy.snapshot().in_window <= 50

    asyncio.run(scenario())


def test_nack_is_in_dynamodb_before_the_commit_passes_it(
    broker: EmbeddedBroker, topic: str
) -> None:
    # A private moto server, so it can be frozen without disturbing other tests.
    with EmbeddedAWS() as aws:
        settings = settings_for(broker, aws, topic)
        produce(broker.bootstrap, topic, [(None, b"\x00poison\xff", [("h", b"1")]), *plain(3)])
        group = settings.kafka.group_id

        async def scenario() -> None:
            async with Proxy(settings, 0) as proxy, RawConsumer(target(proxy)) as consumer:
                await consumer.receive(4)
                os.kill(aws.pid, signal.SIGSTOP)  # DynamoDB stops answering
                try:
                    commits = proxy.snapshot().counters["commits"]
                    consumer.settle(acks=[1, 2, 3], nacks=[(0, "ValueError: bad")])
                    # A commit that has seen the settlements (offset 0 with the encoding of
                    # 1..3 settled above it) while the dead letter of 0 cannot be written:
                    assert await await_until(lambda: proxy.snapshot().counters["commits"] > commits)
                    assert committed(broker.bootstrap, group, topic) == 0
                    assert proxy.snapshot().in_window == 1
                finally:
                    os.kill(aws.pid, signal.SIGCONT)
                assert await await_until(
                    lambda: committed(broker.bootstrap, group, topic) == 4, timeout=30
                )
            (dl,) = dead_letters(settings)
            assert (dl.record.offset, dl.record.key, dl.record.value) == (
                0,
                None,
                b"\x00poison\xff",
            )
            assert dl.record.headers == (("h", b"1"),)
            assert dl.reason == "ValueError: bad"
            assert dl.attempts == 1

        asyncio.run(scenario())


def test_a_taken_port_fails_the_start_and_releases_everything(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """A start that fails after Kafka is opened (the gRPC port is taken) must still close
    the Kafka thread and give the lease back, so a second proxy can own the partition."""
    import dataclasses
    import socket
    import threading

    # A long lease: a lease not given back makes the second start wait it out (30 s), far
    # past the bound below, which leaves a whole proxy start on a loaded machine room.
    settings = settings_for(broker, aws, topic, ownership={"lease_s": 30.0})
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        taken = dataclasses.replace(
            settings, server=dataclasses.replace(settings.server, port=port)
        )
        threads_before = {t.name for t in threading.enumerate()}

        async def failing() -> None:
            await Proxy(taken, 0).serve()

        with pytest.raises(Exception, match=str(port)):
            asyncio.run(failing())
        leaked = {t.name for t in threading.enumerate()} - threads_before
        assert not [name for name in leaked if "kafka" in name.lower()], leaked

    async def owner() -> None:
        # The lease was released: this start does not wait out lease_s as a standby.
        async with Proxy(settings, 0) as proxy:
            assert proxy.state.value == "running"

    began = time.monotonic()
    asyncio.run(asyncio.wait_for(owner(), settings.ownership.lease_s * 0.8))
    assert time.monotonic() - began < settings.ownership.lease_s * 0.8
