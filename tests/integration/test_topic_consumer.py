"""One `Consumer` for a whole topic against real parts: proxies on several partitions of a
Tansu topic, their leases in moto's DynamoDB. Every partition handled and committed; a
holder killed with kill -9 and the Consumer following its standby; a partition with a
backlog of slow messages not starving another; a partition joining the deployment while
running."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import (
    TOKEN,
    await_until,
    committed,
    create_topic,
    dead_letters,
    kill_processes,
    produce,
    settings_for,
    start_proxy_process,
    target,
    wait_until,
)
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, wait_for_port
from triage_client import Consumer, Message
from triage_proxy.app import Proxy

pytestmark = pytest.mark.integration


class Handled:
    """What the handler saw: (partition, offset) -> finish time, in arrival order too."""

    def __init__(self) -> None:
        self.at: dict[tuple[int, int], float] = {}
        self.started: dict[int, int] = defaultdict(int)

    def offsets(self, partition: int) -> set[int]:
        return {o for p, o in self.at if p == partition}

    def count(self, partition: int) -> int:
        return sum(1 for p, _ in self.at if p == partition)


def all_committed(bootstrap: str, group: str, topic: str, expected: dict[int, int]) -> bool:
    return all(committed(bootstrap, group, topic, p) == n for p, n in expected.items())


async def stop(consumer: Consumer, task: asyncio.Task[None]) -> None:
    consumer.stop()
    await asyncio.wait_for(task, 30)


# --- every partition through one Consumer ------------------------------------------------


def test_one_consumer_handles_and_commits_every_partition_of_the_topic(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> None:
    create_topic(broker.bootstrap, unique_name, partitions=3)
    settings = settings_for(broker, aws, unique_name)
    per_partition = 60
    for p in range(3):
        sent = [
            (b"k-%d-%d" % (p, i), (b"poison" if i % 20 == 7 else b"ok") + b"-%d" % i, None)
            for i in range(per_partition)
        ]
        produce(broker.bootstrap, unique_name, sent, partition=p)
    expected = dict.fromkeys(range(3), per_partition)
    seen = Handled()
    wrong: list[Message] = []

    async def handle(message: Message) -> None:
        await asyncio.sleep(0.001)
        if message.topic != unique_name or message.key != b"k-%d-%d" % (
            message.partition,
            message.offset,
        ):
            wrong.append(message)
        seen.at[(message.partition, message.offset)] = time.monotonic()
        if (message.value or b"").startswith(b"poison"):
            raise ValueError("poison")

    async def scenario() -> Consumer:
        async with Proxy(settings, 0) as p0, Proxy(settings, 1), Proxy(settings, 2):
            # One endpoint (any proxy), one pool of 8 handler slots for all three.
            consumer = Consumer(target(p0), TOKEN, handle, concurrency=8, consumer_id="topic")
            task = asyncio.create_task(consumer.run_async())
            try:
                done = await await_until(
                    lambda: all(seen.count(p) == per_partition for p in range(3)), timeout=60
                )
                assert done, {p: seen.count(p) for p in range(3)}
                assert await asyncio.to_thread(
                    wait_until,
                    lambda: all_committed(
                        broker.bootstrap, settings.kafka.group_id, unique_name, expected
                    ),
                    60,
                )
            finally:
                await stop(consumer, task)
            return consumer

    consumer = asyncio.run(scenario())
    assert not wrong, wrong[:3]
    for p in range(3):
        assert seen.offsets(p) == set(range(per_partition)), p
    poison_per_partition = sum(1 for i in range(per_partition) if i % 20 == 7)
    stats = consumer.stats
    assert sorted(stats.partitions) == [0, 1, 2]
    for p in range(3):
        part = stats.partitions[p]
        assert part.delivered >= per_partition
        assert part.acked >= per_partition - poison_per_partition
        assert part.nacked >= poison_per_partition
        assert part.partitions == {}
    assert stats.delivered == sum(s.delivered for s in stats.partitions.values())
    assert stats.acked == sum(s.acked for s in stats.partitions.values())
    letters = dead_letters(settings)
    assert len(letters) == 3 * poison_per_partition
    assert {(d.record.partition, d.consumer_id) for d in letters} == {
        (p, "topic") for p in range(3)
    }


# --- fairness: a backlog of slow messages in one partition --------------------------------


def test_a_backlog_of_slow_messages_in_one_partition_does_not_starve_another(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> None:
    create_topic(broker.bootstrap, unique_name, partitions=2)
    settings = settings_for(broker, aws, unique_name)
    slow_s, backlog, quick = 1.0, 80, 30
    concurrency = 4
    produce(broker.bootstrap, unique_name, [(None, b"slow", None)] * backlog, partition=0)
    seen = Handled()

    async def handle(message: Message) -> None:
        seen.started[message.partition] += 1
        await asyncio.sleep(slow_s if message.value == b"slow" else 0.005)
        seen.at[(message.partition, message.offset)] = time.monotonic()

    async def scenario() -> tuple[float, float, int]:
        async with Proxy(settings, 0) as p0, Proxy(settings, 1):
            consumer = Consumer(target(p0), TOKEN, handle, concurrency=concurrency)
            task = asyncio.create_task(consumer.run_async())
            try:
                # The slow partition has every slot it can get before the other has work.
                assert await await_until(lambda: seen.started[0] >= concurrency // 2, 30)
                await asyncio.to_thread(
                    produce,
                    broker.bootstrap,
                    unique_name,
                    [(None, b"quick", None)] * quick,
                    1,
                )
                produced = time.monotonic()
                assert await await_until(lambda: seen.count(1) == quick, 10 * slow_s + 20), (
                    seen.count(1),
                    seen.count(0),
                )
                quick_at = sorted(t for (p, _), t in seen.at.items() if p == 1)
                return quick_at[0] - produced, quick_at[-1] - produced, seen.count(0)
            finally:
                await stop(consumer, task)

    first, took, slow_done = asyncio.run(scenario())
    # Serially behind the backlog the quick messages would wait backlog / concurrency slow
    # calls (20 s); sharing the pool, the first waits for the next slot to come free, and
    # all are done long before the backlog.
    behind_backlog = backlog * slow_s / concurrency
    assert first < 2 * slow_s, f"the first quick message waited {first:.2f}s"
    assert took < behind_backlog / 2, f"the quick partition took {took:.2f}s behind the backlog"
    assert slow_done < backlog / 2, "the backlog was mostly gone before the quick work"


# --- a partition added to the deployment -------------------------------------------------


def test_a_partition_that_gets_a_proxy_while_running_is_picked_up(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> None:
    """Tansu cannot add partitions to a topic (no CreatePartitions), so the third
    partition exists from the start and joins the deployment later: until its proxy starts
    the topology shows it unserved, then the running Consumer picks it up."""
    create_topic(broker.bootstrap, unique_name, partitions=3)
    settings = settings_for(broker, aws, unique_name)
    n = 20
    for p in range(3):
        produce(broker.bootstrap, unique_name, [(None, b"a%d" % i, None) for i in range(n)], p)
    seen = Handled()

    async def handle(message: Message) -> None:
        seen.at[(message.partition, message.offset)] = time.monotonic()

    async def scenario() -> Consumer:
        async with Proxy(settings, 0) as p0, Proxy(settings, 1):
            consumer = Consumer(target(p0), TOKEN, handle, concurrency=4, topology_interval=0.5)
            task = asyncio.create_task(consumer.run_async())
            try:
                assert await await_until(lambda: seen.count(0) == seen.count(1) == n, 30)
                assert seen.count(2) == 0
                async with Proxy(settings, 2):
                    assert await await_until(lambda: seen.count(2) == n, 60), seen.count(2)
                    assert await asyncio.to_thread(
                        wait_until,
                        lambda: (
                            committed(broker.bootstrap, settings.kafka.group_id, unique_name, 2)
                            == n
                        ),
                        30,
                    )
                    await stop(consumer, task)
            finally:
                if not task.done():
                    await stop(consumer, task)
            return consumer

    consumer = asyncio.run(scenario())
    assert seen.offsets(2) == set(range(n))
    assert sorted(consumer.stats.partitions) == [0, 1, 2]


# --- failover: the holder killed with kill -9 ---------------------------------------------

LEASE_S = 3.0


def test_the_consumer_follows_a_partition_to_its_standby_after_the_holders_kill_9(
    tmp_path: Path, broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> None:
    create_topic(broker.bootstrap, unique_name, partitions=2)
    settings = settings_for(broker, aws, unique_name)  # creates the table
    group = settings.kafka.group_id
    base: dict[str, dict[str, Any]] = {
        "kafka": {"bootstrap_servers": broker.bootstrap, "topic": unique_name, "group_id": group},
        "auth": {"token": TOKEN},
        "dead_letters": {"table": settings.dead_letters.table, "endpoint_url": aws.endpoint_url},
        "commit": {"interval_s": 0.1},
        "ownership": {"lease_s": LEASE_S},
    }
    before, after = 30, 30
    for p in range(2):
        produce(broker.bootstrap, unique_name, [(None, b"a%d" % i, None) for i in range(before)], p)
    seen = Handled()

    async def handle(message: Message) -> None:
        await asyncio.sleep(0.002)
        seen.at[(message.partition, message.offset)] = time.monotonic()

    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["a"], holder = start_proxy_process(tmp_path, "a", base, 0)
        wait_for_port("127.0.0.1", int(holder.rsplit(":", 1)[1]), 30, procs["a"])
        procs["b"], _standby = start_proxy_process(tmp_path, "b", base, 0)
        procs["c"], other = start_proxy_process(tmp_path, "c", base, 1)
        wait_for_port("127.0.0.1", int(other.rsplit(":", 1)[1]), 30, procs["c"])

        async def scenario() -> tuple[float, Consumer]:
            # Given the holder's endpoint: the one that dies, so the Consumer must find
            # the deployment through the endpoints its streams use.
            consumer = Consumer(holder, TOKEN, handle, concurrency=4)
            task = asyncio.create_task(consumer.run_async())
            try:
                first = dict.fromkeys(range(2), before)
                assert await await_until(lambda: all(seen.count(p) == before for p in range(2)), 30)
                assert await asyncio.to_thread(
                    wait_until,
                    lambda: all_committed(broker.bootstrap, group, unique_name, first),
                    30,
                )
                os.kill(procs["a"].pid, signal.SIGKILL)
                killed = time.monotonic()
                await asyncio.to_thread(
                    produce,
                    broker.bootstrap,
                    unique_name,
                    [(None, b"b%d" % i, None) for i in range(after)],
                    0,
                )
                new = set(range(before, before + after))
                assert await await_until(lambda: seen.offsets(0) & new, 4 * LEASE_S + 10), (
                    "partition 0 was not followed to its standby"
                )
                followed = min(t for (p, o), t in seen.at.items() if p == 0 and o in new) - killed
                assert await await_until(lambda: seen.count(0) == before + after, 30)
                total = {0: before + after, 1: before}
                assert await asyncio.to_thread(
                    wait_until,
                    lambda: all_committed(broker.bootstrap, group, unique_name, total),
                    30,
                )
            finally:
                await stop(consumer, task)
            return followed, consumer

        followed, consumer = asyncio.run(scenario())
        assert procs["a"].wait(10) == -signal.SIGKILL
    finally:
        kill_processes(procs.values())
    # lost = 0: every offset of both partitions handled.
    assert seen.offsets(0) == set(range(before + after))
    assert seen.offsets(1) == set(range(before))
    assert consumer.stats.partitions[0].reconnects >= 1
    assert followed < 2 * LEASE_S, f"the Consumer followed the standby after {followed:.2f}s"
