"""The deployment a conformance run drives: `triage dev`'s DevStack with short deadlines
(and, to check a push receiver, one `[[push]]` target), plus what the scenarios need from
it (produce, committed offsets, dead letters).

Why short settings: each scenario must show a lease extended past the ack deadline, a
retry backoff and a redelivery after a killed client within seconds, not minutes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triage_cli.devstack import DevStack
from triage_cli.embedded import HOST, free_port
from triage_conformance import ACTION_HEADER
from triage_proxy.structs import DeadLetter

TOPIC = "conformance"
ACK_DEADLINE_S = 2.0
"""The proxy's delivery.ack_deadline_s: a `sleep` past it needs Extend to keep its lease."""
MAX_ATTEMPTS = 5
OVERRIDES: dict[str, dict[str, Any]] = {
    "delivery": {
        "ack_deadline_s": ACK_DEADLINE_S,
        "max_attempts": MAX_ATTEMPTS,
        "redelivery_span_s": 1.0,
    },
    "retry": {"initial_backoff_s": 0.1, "max_backoff_s": 0.5},
    "commit": {"interval_s": 0.2},
    "shutdown": {"drain_timeout_s": 5.0},
    "ownership": {"lease_s": 3.0},
}

PUSH_TARGET = "conformance"
"""The `[[push]]` target's name, when the stack delivers to a receiver."""
PUSH_TIMEOUT_S = 5.0
"""The push target's request timeout (its records' ack deadline): well past the
receivers' `sleep` actions, short enough that a lost answer is retried soon."""

GIVE_UP_S = 5.0
"""How long the commit is still waited for once no client runs."""


@dataclass(frozen=True)
class Produced:
    """One message as the kit produced it; what every check compares against."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]

    @property
    def action(self) -> str:
        for name, value in self.headers:
            if name == ACTION_HEADER and value is not None:
                return value.decode()
        return "ack"


@dataclass(frozen=True)
class Message:
    """What a scenario asks to produce."""

    value: bytes | None
    action: str | None = None
    """The ACTION_HEADER value (None: no header, which means ack)."""
    key: bytes | None = b"k"
    headers: tuple[tuple[str, bytes | None], ...] = ()
    """Headers besides the action header (which goes first when set)."""


class Stack:
    """A DevStack for TOPIC with OVERRIDES, and the kit's views of it; stop() stops every
    process it started, by PID."""

    def __init__(self, work_dir: Path, partitions: int = 1, push_batch: int | None = None) -> None:
        """`push_batch` (records per request; 1 is CloudEvents binary mode) makes every
        proxy deliver to a push receiver on `push_port`, a free loopback port chosen now."""
        self.partitions = partitions
        self.push_batch = push_batch
        self.push_port = 0
        overrides: dict[str, Any] = dict(OVERRIDES)
        if push_batch is not None:
            self.push_port = free_port()
            target = {
                "name": PUSH_TARGET,
                "url": f"http://{HOST}:{self.push_port}/",
                "batch": push_batch,
                "timeout_s": PUSH_TIMEOUT_S,
            }
            overrides["push"] = [target]
        self._dev = DevStack(
            topic=TOPIC, partitions=partitions, state_dir=work_dir, proxy_overrides=overrides
        )
        self._watcher: Any = None
        self._table: Any = None
        self._next_partition = 0

    def start(self) -> None:
        from confluent_kafka import Consumer

        from triage_proxy.config.loader import load_settings
        from triage_proxy.kafka.logs import KafkaLog
        from triage_proxy.store.aws import read_secret
        from triage_proxy.store.query import DeadLetterTable

        self._dev.start()
        self._watcher = Consumer(
            {
                "bootstrap.servers": self._dev.broker.bootstrap,
                "group.id": self._dev.group_id,
                **KafkaLog(TOPIC).config(),
            }
        )
        settings = load_settings(self._dev.config_path, fetch_secret=read_secret)
        self._table = DeadLetterTable(settings.dead_letters, group=settings.kafka.group_id)

    def stop(self) -> None:
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                self._watcher.close()
            self._watcher = None
        if self._table is not None:
            self._table.close()
            self._table = None
        self._dev.stop()

    @property
    def endpoint(self) -> str:
        endpoint = self._dev.describe()["endpoint"]
        assert isinstance(endpoint, str)
        return endpoint

    @property
    def token(self) -> str:
        return self._dev.token

    @property
    def log_dir(self) -> Path:
        return self._dev.state_dir

    def proxies_alive(self) -> bool:
        return all(self._dev.proxy_process(p).poll() is None for p in range(self.partitions))

    def produce(self, messages: list[Message]) -> list[Produced]:
        """Produce `messages` round-robin over the partitions; return them with offsets."""
        from confluent_kafka import Producer

        from triage_proxy.kafka.logs import KafkaLog

        producer = Producer(
            {
                "bootstrap.servers": self._dev.broker.bootstrap,
                "linger.ms": 2,
                "message.max.bytes": 8 * 1024 * 1024,
                **KafkaLog(TOPIC).config(),
            }
        )
        produced: list[Produced | None] = [None] * len(messages)
        errors: list[str] = []

        def report(index: int, message: Message, partition: int) -> Any:
            def on_delivery(err: Any, msg: Any) -> None:
                if err is not None:
                    errors.append(str(err))
                    return
                produced[index] = Produced(
                    partition, msg.offset(), message.key, message.value, headers_of(message)
                )

            return on_delivery

        for index, message in enumerate(messages):
            partition = self._next_partition
            self._next_partition = (partition + 1) % self.partitions
            producer.produce(
                TOPIC,
                value=message.value,
                key=message.key,
                headers=list(headers_of(message)),
                partition=partition,
                on_delivery=report(index, message, partition),
            )
            producer.poll(0)
        if producer.flush(30) or errors:
            raise RuntimeError(f"producing failed: {errors[:3]}")
        return [p for p in produced if p is not None]

    def committed(self) -> dict[int, int]:
        """partition -> the group's committed offset (-1001 when none)."""
        from confluent_kafka import TopicPartition

        tps = [TopicPartition(TOPIC, p) for p in range(self.partitions)]
        return {tp.partition: tp.offset for tp in self._watcher.committed(tps, 10)}

    def wait_committed(
        self,
        produced: list[Produced],
        timeout_s: float,
        working: Callable[[], bool] = lambda: True,
    ) -> bool:
        """Wait until the commit of every partition is past what was produced to it; give
        up after `timeout_s`, or GIVE_UP_S after `working()` turned False (no client runs:
        nothing more can settle but what the proxy already has)."""
        ends: dict[int, int] = {}
        for p in produced:
            ends[p.partition] = max(ends.get(p.partition, 0), p.offset + 1)
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(Exception):
                done = self.committed()
                if all(done.get(p, -1) >= end for p, end in ends.items()):
                    return True
            now = time.monotonic()
            if not working():
                deadline = min(deadline, now + GIVE_UP_S)
            if now > deadline:
                return False
            time.sleep(0.1)

    def dead_letters(self) -> dict[tuple[int, int], DeadLetter]:
        """Every dead letter of TOPIC, byte-exact (S3 payloads loaded), by (partition, offset)."""
        from triage_proxy.store.query import Filters

        out = {}
        for item in self._table.scan(Filters(topic=TOPIC)):
            dl = self._table.load(item)
            out[dl.record.partition, dl.record.offset] = dl
        return out


def headers_of(message: Message) -> tuple[tuple[str, bytes | None], ...]:
    action = () if message.action is None else ((ACTION_HEADER, message.action.encode()),)
    return (*action, *message.headers)
