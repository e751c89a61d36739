"""One `Consumer` for a whole topic against real parts: proxies on several partitions of a
Tansu topic, their leases in moto's DynamoDB. Every partition handled and committed; a
holder killed with kill -9 and the Consumer following its standby; a partition with a
backlog of slow messages not starving another; a partition joining the deployment while
running."""

from __future__ import annotations

import asyncio
import dataclasses
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
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port, wait_for_port
from triage_client import Consumer, Message
from triage_proxy.app import Proxy
from triage_proxy.config.settings import Settings

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
    """Partition 0 holds a backlog of 1 s messages on every slot when partition 1 gets quick
    work. A pool that hands a free slot to whatever waits first (FIFO over all partitions)
    runs quick messages only in the moments a slow one has just finished: at most the quick
    partition's credits (4 of concurrency + prefetch = 8) per slow completion, 4 slow ones a
    second, so 60 quick messages need at least 60 / 16 = 3.75 s from the first start. Here
    the two backlogs are hungry together, the slow one may run only half of the slots, and
    the quick partition runs on the other half: done in well under half that bound."""
    create_topic(broker.bootstrap, unique_name, partitions=2)
    settings = settings_for(broker, aws, unique_name)
    slow_s, quick_s, backlog, quick = 1.0, 0.005, 80, 60
    concurrency = 4
    fifo_bound = quick / (concurrency * concurrency / slow_s)
    produce(broker.bootstrap, unique_name, [(None, b"slow", None)] * backlog, partition=0)
    started: dict[int, list[float]] = defaultdict(list)
    finished: dict[int, list[float]] = defaultdict(list)
    slots_full = asyncio.Event()
    quick_done = asyncio.Event()

    async def handle(message: Message) -> None:
        p = message.partition
        started[p].append(time.monotonic())
        if p == 0 and len(started[0]) >= concurrency:
            slots_full.set()
        await asyncio.sleep(slow_s if message.value == b"slow" else quick_s)
        finished[p].append(time.monotonic())
        if p == 1 and len(finished[1]) == quick:
            quick_done.set()

    async def scenario() -> float:
        async with Proxy(settings, 0) as p0, Proxy(settings, 1):
            consumer = Consumer(target(p0), TOKEN, handle, concurrency=concurrency)
            task = asyncio.create_task(consumer.run_async())
            try:
                # The slow partition has every slot before the other has work.
                await asyncio.wait_for(slots_full.wait(), 60)
                await asyncio.to_thread(
                    produce,
                    broker.bootstrap,
                    unique_name,
                    [(None, b"quick", None)] * quick,
                    1,
                )
                produced = time.monotonic()
                # Generous: the whole backlog through every slot would take 20 s.
                await asyncio.wait_for(quick_done.wait(), backlog * slow_s / concurrency + 30)
                return produced
            finally:
                await stop(consumer, task)

    produced = asyncio.run(scenario())
    first, took = started[1][0] - produced, max(finished[1]) - started[1][0]
    slow_meanwhile = sum(1 for t in finished[0] if started[1][0] <= t <= max(finished[1]))
    assert first < 2 * slow_s + 5, f"the first quick message waited {first:.2f}s"
    assert took < fifo_bound / 2, (
        f"60 quick messages took {took:.2f}s from the first start beside the backlog "
        f"(a FIFO pool: >= {fifo_bound:.2f}s); {slow_meanwhile} slow ones finished meanwhile"
    )
    assert len(finished[0]) < backlog / 2, "the backlog was mostly gone before the quick work"


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


def test_a_partition_added_to_the_topic_and_the_deployment_is_picked_up_while_running(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> None:
    """The deployment grows from 2 partitions to 3 while one Consumer runs, the way an
    operator grows it: `kafka.partitions` (the deployment's partition count, which is what
    Topology answers) goes from 2 to 3; the new partition's proxy starts with the new config
    and the two others are restarted with it, one after the other. Tansu 0.6 has no
    CreatePartitions (librdkafka: "CreatePartitions (KIP-195) not supported by broker"), so
    the topic has its third partition from the start, with records waiting in it; what the
    Consumer sees is the partition count growing. It picks partition 2 up without a restart,
    follows the restarted proxies (each back on its own port, as a deployment's endpoints
    stay put), and loses nothing."""
    create_topic(broker.bootstrap, unique_name, partitions=3)
    base = settings_for(broker, aws, unique_name)
    group = base.kafka.group_id
    ports = [free_port() for _ in range(3)]

    def config(partition: int, count: int) -> Settings:
        """Partition `partition`'s proxy on its own port, in a deployment of `count`."""
        server = dataclasses.replace(base.server, port=ports[partition] - partition)
        kafka = dataclasses.replace(base.kafka, partitions=count)
        return dataclasses.replace(base, server=server, kafka=kafka)

    n = 20
    for p in range(3):
        produce(broker.bootstrap, unique_name, [(None, b"a%d" % i, None) for i in range(n)], p)
    seen = Handled()

    async def handle(message: Message) -> None:
        seen.at[(message.partition, message.offset)] = time.monotonic()

    async def restart(proxy: Proxy, settings: Settings) -> Proxy:
        proxy.stop()
        await proxy.wait_stopped()
        new = Proxy(settings, proxy.partition)
        await new.start()
        return new

    async def scenario() -> Consumer:
        proxies = {p: Proxy(config(p, 2), p) for p in range(2)}
        for proxy in proxies.values():
            await proxy.start()
        consumer = Consumer(target(proxies[0]), TOKEN, handle, concurrency=4, topology_interval=0.5)
        task = asyncio.create_task(consumer.run_async())
        try:
            assert await await_until(lambda: seen.count(0) == seen.count(1) == n, 30)
            assert seen.count(2) == 0, "partition 2 is not in the deployment yet"
            proxies[2] = Proxy(config(2, 3), 2)
            await proxies[2].start()
            for p in range(2):  # the redeploy: one proxy after the other
                proxies[p] = await restart(proxies[p], config(p, 3))
            assert await await_until(lambda: seen.count(2) == n, 60), seen.count(2)
            for p in range(3):
                more = [(None, b"b%d" % i, None) for i in range(n)]
                await asyncio.to_thread(produce, broker.bootstrap, unique_name, more, p)
            assert await await_until(lambda: all(seen.count(p) == 2 * n for p in range(3)), 60)
            expected = dict.fromkeys(range(3), 2 * n)
            assert await asyncio.to_thread(
                wait_until,
                lambda: all_committed(broker.bootstrap, group, unique_name, expected),
                30,
            )
        finally:
            await stop(consumer, task)
            for proxy in proxies.values():
                proxy.stop()
            for proxy in proxies.values():
                await proxy.wait_stopped()
        return consumer

    consumer = asyncio.run(scenario())
    for p in range(3):
        assert seen.offsets(p) == set(range(2 * n)), p  # lost = 0
    stats = consumer.stats
    assert sorted(stats.partitions) == [0, 1, 2]
    assert stats.partitions[2].reconnects == 0, "partition 2's one stream, opened once"
    assert all(stats.partitions[p].reconnects >= 1 for p in range(2)), "followed the restarts"


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
