"""The head-of-line blocking demo and the workload the benchmarks share.

A workload is a list of message kinds: ordinary (2 ms of work), slow (500 ms: a
slow downstream call) and poison (the handler raises). It is consumed twice:
by a plain serial confluent-kafka consumer, and through Triage by consumer
instances with many concurrent handlers. The figures show the partition kept
moving past slow messages and poison pills, and nothing was lost.
"""

from __future__ import annotations

import enum
import itertools
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from triage_cli.devstack import DevStack
    from triage_client import Message

ORDINARY_S = 0.002
SLOW_S = 0.5
SLOW_SHARE = 0.01
POISON_SHARE = 0.005


class Kind(enum.Enum):
    ORDINARY = b"ordinary"
    SLOW = b"slow"
    POISON = b"poison"


@dataclass(frozen=True)
class Workload:
    """Message kinds in produce order; the kind is the value's prefix."""

    kinds: tuple[Kind, ...]
    ordinary_s: float = ORDINARY_S
    slow_s: float = SLOW_S

    @classmethod
    def generate(
        cls,
        count: int,
        *,
        slow_share: float = SLOW_SHARE,
        poison_share: float = POISON_SHARE,
        seed: int = 7,
        ordinary_s: float = ORDINARY_S,
        slow_s: float = SLOW_S,
    ) -> Workload:
        """Exactly round(count*share) slow and poison messages, at random places."""
        rng = random.Random(seed)
        n_slow, n_poison = round(count * slow_share), round(count * poison_share)
        kinds = [Kind.SLOW] * n_slow + [Kind.POISON] * n_poison
        kinds += [Kind.ORDINARY] * (count - len(kinds))
        rng.shuffle(kinds)
        return cls(tuple(kinds), ordinary_s, slow_s)

    def value(self, index: int) -> bytes:
        return self.kinds[index].value + b":" + str(index).encode()

    def count(self, kind: Kind) -> int:
        return self.kinds.count(kind)

    def work_s(self, value: bytes) -> float:
        return self.slow_s if value.startswith(Kind.SLOW.value) else self.ordinary_s

    @property
    def serial_ideal_s(self) -> float:
        return self.count(Kind.ORDINARY) * self.ordinary_s + self.count(Kind.SLOW) * self.slow_s


def produce(bootstrap: str, topic: str, workload: Workload, partitions: int = 1) -> None:
    """Produce the workload, spread round-robin over the partitions, and wait for acks."""
    from confluent_kafka import Producer

    from triage_proxy.kafka.logs import KafkaLog

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, **KafkaLog().config()})
    for i in range(len(workload.kinds)):
        producer.produce(
            topic, value=workload.value(i), key=str(i).encode(), partition=i % partitions
        )
        if i % 1000 == 0:
            producer.poll(0)
    if producer.flush(30) != 0:
        raise RuntimeError("produce did not complete")


def run_serial_baseline(
    bootstrap: str, topic: str, workload: Workload, partitions: int = 1
) -> float:
    """Seconds for a plain serial consumer to get through the workload.

    It is the best case for a serial consumer: it catches the poison pill and moves
    on. (Without that, one poison pill stops the partition for good.)
    """
    from confluent_kafka import Consumer, TopicPartition

    from triage_proxy.kafka.logs import KafkaLog

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"serial-baseline-{time.time_ns()}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            **KafkaLog().config(),
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    seen = 0
    start = time.perf_counter()
    try:
        while seen < len(workload.kinds):
            for message in consumer.consume(500, 1.0):
                if message.error():
                    continue
                seen += 1
                value = message.value() or b""
                if not value.startswith(Kind.POISON.value):
                    time.sleep(workload.work_s(value))
                consumer.commit(message=message, asynchronous=True)
        return time.perf_counter() - start
    finally:
        consumer.close()


@dataclass
class TriageRun:
    """What the instrumented handlers saw while consuming through Triage."""

    workload: Workload
    acked: int = 0
    poisoned: int = 0
    finishes: list[tuple[float, bool]] = field(default_factory=list)
    """(when a handler finished, whether the message was ordinary)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)
    started_at: float = 0.0
    finished_at: float = 0.0
    by_partition: dict[int, tuple[int, float]] = field(default_factory=dict)
    """partition -> (messages handled, when its last one finished)."""

    @property
    def handled(self) -> int:
        return self.acked + self.poisoned

    def handler(self) -> Callable[[Message], Any]:
        total = len(self.workload.kinds)

        def handle(message: Message) -> None:
            value = message.value or b""
            if value.startswith(Kind.POISON.value):
                self._count(message.partition, poisoned=1, total=total, ordinary=False)
                raise ValueError("poison pill: cannot parse " + value.decode())
            time.sleep(self.workload.work_s(value))
            ordinary = value.startswith(Kind.ORDINARY.value)
            self._count(message.partition, acked=1, total=total, ordinary=ordinary)

        return handle

    def _count(
        self, partition: int, *, total: int, ordinary: bool, acked: int = 0, poisoned: int = 0
    ) -> None:
        now = time.perf_counter()
        with self.lock:
            self.finishes.append((now, ordinary))
            handled, _ = self.by_partition.get(partition, (0, 0.0))
            self.by_partition[partition] = (handled + 1, now)
            self.acked += acked
            self.poisoned += poisoned
            if self.acked + self.poisoned >= total and not self.done.is_set():
                self.finished_at = time.perf_counter()
                self.done.set()

    @property
    def elapsed_s(self) -> float:
        return self.finished_at - self.started_at

    @property
    def longest_stall_s(self) -> float:
        """Longest time no message finished while ordinary messages were still waiting.

        Behind a slow message a serial consumer stalls for the whole slow call; a
        partition free of head-of-line blocking keeps finishing ordinary messages.
        """
        with self.lock:
            finishes = sorted(self.finishes)
        last_ordinary = max((t for t, ordinary in finishes if ordinary), default=0.0)
        times = [self.started_at] + [t for t, _ in finishes if t <= last_ordinary]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def run_through_triage(
    endpoint: str,
    token: str,
    workload: Workload,
    *,
    instances: int = 2,
    concurrency: int = 16,
    timeout_s: float = 300.0,
    on_progress: Callable[[int], None] | None = None,
) -> TriageRun:
    """Consume the workload with `instances` client instances, each ONE Consumer given the
    deployment's `endpoint` (it consumes every partition with one pool of handlers)."""
    from triage_client import Consumer

    run = TriageRun(workload)
    consumers = [
        Consumer(endpoint, token, run.handler(), concurrency=concurrency, consumer_id=f"demo-{i}")
        for i in range(instances)
    ]
    threads = [threading.Thread(target=c.run, daemon=True) for c in consumers]
    run.started_at = time.perf_counter()
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not run.done.wait(0.1):
            if on_progress:
                on_progress(run.handled)
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {run.handled} of {len(workload.kinds)} handled")
        if on_progress:
            on_progress(run.handled)
    finally:
        for consumer in consumers:
            consumer.stop()
        for thread in threads:
            thread.join(30)
    return run


def committed_offsets(bootstrap: str, group_id: str, topic: str, partitions: int) -> list[int]:
    from confluent_kafka import Consumer, TopicPartition

    from triage_proxy.kafka.logs import KafkaLog

    config = {"bootstrap.servers": bootstrap, "group.id": group_id, **KafkaLog().config()}
    consumer = Consumer(config)
    try:
        found = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], 10)
        return [tp.offset for tp in found]
    finally:
        consumer.close()


def wait_for_commits(
    bootstrap: str, group_id: str, topic: str, expected: list[int], timeout_s: float = 30.0
) -> list[int]:
    """Poll the group's committed offsets until they reach `expected` (or time out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        offsets = committed_offsets(bootstrap, group_id, topic, len(expected))
        if offsets == expected or time.monotonic() > deadline:
            return offsets
        time.sleep(0.2)


def count_dead_letters(endpoint_url: str, table: str) -> int:
    from triage_proxy.config.sections import DeadLetterSettings
    from triage_proxy.store.aws import dynamodb_client

    client = dynamodb_client(DeadLetterSettings(table=table, endpoint_url=endpoint_url))
    total = 0
    paginator = client.get_paginator("scan")
    pages = paginator.paginate(
        TableName=table,
        Select="COUNT",
        # Checkpoint items share the table under a negative offset: not dead letters.
        FilterExpression="#o >= :zero",
        ExpressionAttributeNames={"#o": "offset"},
        ExpressionAttributeValues={":zero": {"N": "0"}},
    )
    for page in pages:
        total += page["Count"]
    client.close()
    return total


def partition_table(run: TriageRun, expected: list[int], committed: list[int]) -> Any:
    """Per partition: messages handled, when its last one finished, its committed offset;
    the spread of finish times says whether the one Consumer per instance was fair."""
    from rich.table import Table

    table = Table(title="Per partition (one Consumer per instance)")
    for name in ("partition", "handled", "last finished", "committed offset"):
        table.add_column(name, justify="right")
    for p, want in enumerate(expected):
        handled, last = run.by_partition.get(p, (0, run.started_at))
        table.add_row(
            str(p), f"{handled} / {want}", f"{last - run.started_at:.2f} s", str(committed[p])
        )
    return table


def run_demo(stack: DevStack, *, messages: int = 2000) -> None:
    """Produce a workload, consume it serially and through Triage, print the figures."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    from rich.table import Table

    console = Console()
    workload = Workload.generate(messages)
    bootstrap, topic = stack.broker.bootstrap, stack.topic
    console.print(
        f"[bold]Workload[/]: {messages} messages on {topic}: "
        f"{workload.count(Kind.ORDINARY)} ordinary ({ORDINARY_S * 1000:.0f} ms), "
        f"{workload.count(Kind.SLOW)} slow ({SLOW_S * 1000:.0f} ms), "
        f"{workload.count(Kind.POISON)} poison pills"
    )
    produce(bootstrap, topic, workload, stack.partitions)
    with console.status("Plain serial confluent-kafka consumer (one message at a time)..."):
        serial_s = run_serial_baseline(bootstrap, topic, workload, stack.partitions)
    console.print(f"serial consumer: {serial_s:.2f} s")
    endpoint = stack.describe()["endpoint"]
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("Through Triage (2 instances x 16 handlers)", total=messages)
        run = run_through_triage(
            endpoint,
            stack.token,
            workload,
            on_progress=lambda n: progress.update(task, completed=n),
        )
    expected = [len(range(p, messages, stack.partitions)) for p in range(stack.partitions)]
    committed = wait_for_commits(bootstrap, stack.group_id, topic, expected)
    dead = count_dead_letters(stack.aws.endpoint_url, stack.table)

    table = Table(title="Head-of-line blocking, removed")
    table.add_column("")
    table.add_column("figure", justify="right")
    table.add_row("serial consumer", f"{serial_s:.2f} s")
    table.add_row("through Triage", f"{run.elapsed_s:.2f} s")
    table.add_row("speed-up", f"{serial_s / run.elapsed_s:.1f}x")
    table.add_row("messages acked", f"{run.acked}")
    table.add_row("dead letters written", f"{dead} (poison pills: {workload.count(Kind.POISON)})")
    table.add_row("committed offset", ", ".join(str(o) for o in committed))
    table.add_row(
        "longest stall while ordinary work waited",
        f"{run.longest_stall_s * 1000:.0f} ms (a slow message takes {SLOW_S * 1000:.0f} ms)",
    )
    console.print(table)
    if stack.partitions > 1:
        console.print(partition_table(run, expected, committed))
    lost = messages - run.acked - dead
    if committed != expected or lost:
        console.print(f"[red]Something is missing: lost={lost}, committed={committed}[/]")
