"""In-memory twins of the fetcher's and committer's collaborators, for a virtual clock.

Run them on `virtual_time.VirtualClockLoop`: a Kafka call then costs KAFKA_CALL_S of
virtual time instead of a real thread hop, so an idle fetch loop lets the clock move
(as a real idle fetch waits up to kafka.FETCH_WAIT_S) and nothing sleeps for real.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from triage_proxy.errors import BrokerUnavailable, TableUnavailable
from triage_proxy.kafka.client import KafkaThread, MemoryPartition
from triage_proxy.store.checkpoints import MemoryCheckpoints
from triage_proxy.structs import Record

T = TypeVar("T")

KAFKA_CALL_S = 0.01
"""Virtual time one call through InlineKafkaThread takes (a broker round trip)."""


class InlineKafkaThread(KafkaThread):
    """`KafkaThread` twin: each call runs on the loop after KAFKA_CALL_S of virtual time.

    Calls still complete in the order they were made, as on the one real Kafka thread.
    """

    def __init__(self) -> None:
        self.calls = 0

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        self.calls += 1
        await asyncio.sleep(KAFKA_CALL_S)
        return fn(*args)

    def shutdown(self) -> None:
        pass


class FlakyPartition(MemoryPartition):
    """`MemoryPartition` that fails the next N fetches or commits as the real adapter does
    (`BrokerUnavailable`) and notes when each call came, on the clock it is given.

    An idle fetch returns at once: the thread twin's KAFKA_CALL_S stands for the wait.
    """

    def __init__(self, clock: Callable[[], float], committed: int = 0) -> None:
        super().__init__(committed=committed)
        self._clock = clock
        self.failing_fetches = 0
        """How many of the next fetches raise."""
        self.failing_commits = 0
        """How many of the next commits raise."""
        self.fetch_times: list[float] = []
        """When each fetch was called, failed ones included."""
        self.commit_times: list[float] = []
        """When each commit was called, failed ones included."""
        self.fetch_sizes: list[int] = []
        """`max_records` of each fetch that returned records."""

    def fill(self, count: int) -> None:
        """Append `count` records at the next offsets."""
        for _ in range(count):
            self.append(b"v")

    @property
    def position(self) -> int:
        """The next offset a fetch returns (how far the fetcher has taken the log)."""
        return self._position

    def fetch(self, max_records: int) -> list[Record]:
        self.fetch_times.append(self._clock())
        if self.failing_fetches:
            self.failing_fetches -= 1
            raise BrokerUnavailable("fetch failed (twin)")
        out = [r for r in self.log if r.offset >= self._position][:max_records]
        if out:
            self._position = out[-1].offset + 1
            self.fetch_sizes.append(max_records)
        return out

    def commit(self, offset: int, metadata: str | None = None) -> None:
        self.commit_times.append(self._clock())
        if self.failing_commits:
            self.failing_commits -= 1
            raise BrokerUnavailable(f"commit of offset {offset} failed (twin)")
        super().commit(offset, metadata)


class TimedCheckpoints(MemoryCheckpoints):
    """`MemoryCheckpoints` that notes when each write came, on the clock it is given, and
    refuses the next N writes as the real table does (`TableUnavailable`)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__()
        self._clock = clock
        self.put_times: list[float] = []
        """When each write came, refused ones included."""
        self.refusing = 0
        """How many of the next writes raise."""

    def put(self, committed: int, settled: str, attempts: str = "") -> None:
        self.put_times.append(self._clock())
        if self.refusing:
            self.refusing -= 1
            raise TableUnavailable("checkpoint write refused (twin)")
        super().put(committed, settled, attempts)
