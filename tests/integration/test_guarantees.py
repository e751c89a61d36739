"""Delivery guarantees under failure, against the real broker and DynamoDB endpoint."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.harness import (
    TOKEN,
    RawConsumer,
    await_until,
    committed,
    create_topic,
    dead_letters,
    produce,
    settings_for,
    target,
    wait_until,
)
from triage_cli.devstack import write_config
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port, wait_for_port
from triage_proxy.app import Proxy
from triage_proxy.pipeline.settled import decode_settled
from triage_proxy.store.checkpoints import DynamoDBCheckpoints

pytestmark = pytest.mark.integration


def plain(n: int, key: bytes | None = None) -> list[tuple[bytes | None, bytes, None]]:
    return [(key, b"v%d" % i, None) for i in range(n)]


def test_expired_lease_is_redelivered_with_the_next_attempt(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    # (Rejection of a late ack from an instance that lost the lease: unit-tested.)
    settings = settings_for(broker, aws, topic, delivery={"ack_deadline_s": 0.5})
    produce(broker.bootstrap, topic, plain(1))

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy, RawConsumer(target(proxy), credits=1) as c:
            (first,) = await c.receive(1)
            assert first.attempt == 1
            (again,) = await c.receive(1, timeout=15)  # no ack, no extend: it expires
            assert (again.offset, again.attempt) == (0, 2)
            c.settle(acks=[0])
            assert await await_until(lambda: proxy.snapshot().committed_offset == 1)
            assert proxy.snapshot().counters["expired"] == 1

    asyncio.run(scenario())


def test_extend_keeps_a_slow_delivery(broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str) -> None:
    # Extends every 0.25 s against a 1.5 s deadline: a loop descheduled for a second
    # between two of them (a loaded machine) still extends in time. (0.5 s left 0.25 s.)
    settings = settings_for(broker, aws, topic, delivery={"ack_deadline_s": 1.5})
    produce(broker.bootstrap, topic, plain(1))

    async def scenario() -> None:
        from triage_protocol import triage_pb2 as pb

        async with Proxy(settings, 0) as proxy, RawConsumer(target(proxy), credits=1) as c:
            await c.receive(1)
            for _ in range(18):  # 4.5 s of work, three deadlines' worth
                await asyncio.sleep(0.25)
                c._outgoing.put_nowait(pb.ConsumerFrame(extend=pb.Extend(offsets=[0])))
            c.settle(acks=[0])
            assert await await_until(lambda: proxy.snapshot().committed_offset == 1)
            counters = proxy.snapshot().counters
            assert counters["expired"] == 0
            assert counters["redelivered"] == 0

    asyncio.run(scenario())


def test_retry_waits_out_backoff_then_dead_letters_at_the_limit(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    settings = settings_for(
        broker,
        aws,
        topic,
        delivery={"max_attempts": 3},
        retry={"initial_backoff_s": 0.3, "multiplier": 2, "max_backoff_s": 1},
    )
    produce(broker.bootstrap, topic, plain(2))

    async def scenario() -> None:
        from triage_protocol import triage_pb2 as pb

        async with Proxy(settings, 0) as proxy, RawConsumer(target(proxy)) as c:
            await c.receive(2)
            c.settle(acks=[1])
            # (attempt, seconds from just before its nack went out to the redelivery read):
            # the backoff starts when the proxy has the nack, after that moment, so a
            # reading loop that falls behind on a loaded machine only lengthens each gap.
            seen: list[tuple[int, float]] = []
            for attempt in (1, 2, 3):
                frame = pb.ConsumerFrame(
                    settle=pb.Settle(nacks=[pb.Nack(offset=0, reason="busy", retry=True)])
                )
                nacked = time.monotonic()
                c._outgoing.put_nowait(frame)
                if attempt < 3:
                    (d,) = await c.receive(1, timeout=15)
                    seen.append((d.attempt, time.monotonic() - nacked))
            assert [a for a, _ in seen] == [2, 3]
            assert seen[0][1] >= 0.25  # first backoff 0.3 s
            assert seen[1][1] >= 0.5  # second backoff 0.6 s
            assert await await_until(lambda: proxy.snapshot().committed_offset == 2)
        (dl,) = dead_letters(settings)
        assert (dl.record.offset, dl.attempts) == (0, 3)
        assert dl.reason == "delivery attempts exhausted (3): busy"

    asyncio.run(scenario())


def test_crash_type_poison_pill_is_dead_lettered_with_attempts_at_the_limit(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    # Gaps of 0 and 1 s between the crashes (the default span would make it 60 s).
    settings = settings_for(
        broker, aws, topic, delivery={"max_attempts": 3, "redelivery_span_s": 1.0}
    )
    produce(broker.bootstrap, topic, [(None, b"crash", None)])

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy:
            for attempt in (1, 2, 3):
                consumer = RawConsumer(target(proxy), credits=1)
                async with consumer:
                    (d,) = await consumer.receive(1)
                    assert d.attempt == attempt
                # The instance "crashed": it vanished without settling.
            assert await await_until(lambda: proxy.snapshot().committed_offset == 1)
        (dl,) = dead_letters(settings)
        assert dl.attempts == 3
        # One reason for every crash pill (grouping by reason groups them); which instance
        # is the dead letter's consumer_id.
        assert (
            dl.reason
            == "delivery attempts exhausted (3): its instance disconnected while handling it"
        )
        assert dl.consumer_id.startswith("raw-")

    asyncio.run(scenario())


def test_ordering_by_key_in_flight_one_at_a_time_in_offset_order(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    settings = settings_for(broker, aws, topic, delivery={"ordering": "key"})
    keys = [b"a", b"b", b"a", b"a", None, b"b"]
    produce(broker.bootstrap, topic, [(k, b"v%d" % i, None) for i, k in enumerate(keys)])

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy, RawConsumer(target(proxy)) as c:
            first = await c.receive(3)
            assert [d.offset for d in first] == [0, 1, 4]
            c.settle(acks=[0])
            assert [d.offset for d in await c.receive(1)] == [2]
            c.settle(acks=[1, 2])
            got = await c.receive(2)
            assert sorted(d.offset for d in got) == [3, 5]
            c.settle(acks=[3, 4, 5])
            assert await await_until(lambda: proxy.snapshot().committed_offset == 6)

    asyncio.run(scenario())


def _proxy_process(config: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "triage_cli.main", "proxy", "--config", str(config), "-p", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("encode", [True, False])
def test_kill_9_loses_nothing_and_settled_offsets_are_not_redelivered(
    tmp_path: Path, broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str, encode: bool
) -> None:
    settings = settings_for(broker, aws, topic)  # creates the table
    port = free_port()
    config = tmp_path / "triage.toml"
    write_config(
        config,
        {
            "kafka": {
                "bootstrap_servers": broker.bootstrap,
                "topic": topic,
                "group_id": settings.kafka.group_id,
            },
            # Never a default port: the tests must pass beside a deployment on them.
            "server": {"host": "127.0.0.1", "port": port, "http_port": 0},
            "auth": {"token": TOKEN},
            "dead_letters": {
                "table": settings.dead_letters.table,
                "endpoint_url": aws.endpoint_url,
            },
            "commit": {"interval_s": 0.1, "encode_settled": encode},
            "ownership": {"lease_s": 2.0},  # the restart waits for the killed one's lease
        },
    )
    produce(broker.bootstrap, topic, plain(20))

    async def first_run() -> None:
        async with RawConsumer(f"127.0.0.1:{port}") as c:
            await c.receive(20)
            c.settle(acks=list(range(1, 20)))  # 0 stays unsettled
            await asyncio.sleep(1.5)  # several commits, and a checkpoint write (1/s)

    async def second_run() -> list[int]:
        async with RawConsumer(f"127.0.0.1:{port}") as c:
            # Offset 20, produced while the proxy was down, marks the end of any redelivery.
            while not c.deliveries or c.deliveries[-1].offset != 20:
                await c.receive(1)
            c.settle(acks=[d.offset for d in c.deliveries])
            await c.sync()  # the proxy has read the settlement before we vanish
            return [d.offset for d in c.deliveries]

    proc = _proxy_process(config)
    try:
        wait_for_port("127.0.0.1", port, 30, proc)
        asyncio.run(first_run())
        if encode:
            # What keeps 1..19 from redelivery: the checkpoint item, written at most once
            # a second. Waited for, as a loaded machine may take longer than the 1.5 s.
            checkpoints = DynamoDBCheckpoints(
                settings.dead_letters, topic, 0, settings.kafka.group_id
            )
            try:

                def settled() -> list[int]:
                    found = checkpoints.get()
                    return [] if found is None else decode_settled(found.committed, found.settled)

                assert wait_until(lambda: settled() == list(range(1, 20)), timeout=30), settled()
            finally:
                checkpoints.close()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert committed(broker.bootstrap, settings.kafka.group_id, topic) <= 0
        produce(broker.bootstrap, topic, [(None, b"sentinel", None)])
        proc = _proxy_process(config)
        wait_for_port("127.0.0.1", port, 30, proc)
        again = asyncio.run(second_run())
        if encode:
            assert again == [0, 20]  # 1..19 were settled: not redelivered
        else:
            assert again == list(range(21))  # plain at-least-once
        group = settings.kafka.group_id
        wait_until(lambda: committed(broker.bootstrap, group, topic) == 21)
        assert committed(broker.bootstrap, group, topic) == 21
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_broker_and_dynamodb_outages_do_not_crash_the_proxy_or_lose_data(
    unique_name: str,
) -> None:
    with EmbeddedBroker() as broker, EmbeddedAWS() as aws:
        create_topic(broker.bootstrap, unique_name)
        # A lease that outlives the 3 s DynamoDB freeze (a shorter one would stop the proxy).
        settings = settings_for(broker, aws, unique_name, ownership={"lease_s": 10.0})
        produce(broker.bootstrap, unique_name, plain(30))

        async def scenario() -> None:
            async with Proxy(settings, 0) as proxy, RawConsumer(target(proxy)) as c:
                got = await c.receive(30)
                broker.signal(signal.SIGSTOP)
                aws.signal(signal.SIGSTOP)
                try:
                    c.settle(acks=[d.offset for d in got[1:]], nacks=[(0, "bad")])
                    await asyncio.sleep(3)
                    assert proxy.state.value == "running"
                    assert proxy.snapshot().committed_offset == 0
                finally:
                    broker.signal(signal.SIGCONT)
                    aws.signal(signal.SIGCONT)
                assert await await_until(
                    lambda: proxy.snapshot().committed_offset == 30, timeout=60
                )
            assert [d.record.offset for d in dead_letters(settings)] == [0]
            assert committed(broker.bootstrap, settings.kafka.group_id, unique_name) == 30

        asyncio.run(scenario())
