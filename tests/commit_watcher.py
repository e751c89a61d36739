"""Polling a consumer group's committed offsets, shared by the benchmarks and the fault suite.

Both wait for the proxy's commits to reach the end of the partition; one long-lived
client keeps each poll cheap.
"""

from __future__ import annotations

import time

from confluent_kafka import Consumer, TopicPartition

from triage_proxy.kafka.logs import KafkaLog


class CommitWatcher:
    """Polls a group's committed offsets (one long-lived client, cheap to poll)."""

    def __init__(self, bootstrap: str, group: str, topic: str, partitions: int) -> None:
        self._consumer = Consumer(
            {"bootstrap.servers": bootstrap, "group.id": group, **KafkaLog().config()}
        )
        self._tps = [TopicPartition(topic, p) for p in range(partitions)]
        self.reached: dict[int, float] = {}
        """Partition -> time.time() of the poll that first saw its expected offset
        (`wait_for`): which partition's commit finished last, and when."""

    def offsets(self) -> list[int]:
        return [tp.offset for tp in self._consumer.committed(self._tps, 10)]

    def wait_for(self, expected: list[int], timeout_s: float, poll_s: float = 0.01) -> float:
        """Block until the committed offsets equal `expected`; return time.time() then."""
        deadline = time.monotonic() + timeout_s
        while True:
            offsets = self.offsets()
            now = time.time()
            for p, (offset, end) in enumerate(zip(offsets, expected, strict=True)):
                if offset == end:
                    self.reached.setdefault(p, now)
            if offsets == expected:
                return now
            if time.monotonic() > deadline:
                raise TimeoutError(f"committed {self.offsets()}, expected {expected}")
            time.sleep(poll_s)

    def close(self) -> None:
        self._consumer.close()
