"""The proxy's one partition of Kafka, behind a small Protocol.

`ConfluentPartition` is the real adapter (librdkafka via confluent-kafka, `assign`,
auto-commit off); `MemoryPartition` is its in-memory twin for unit tests. Both are
synchronous and are called from dedicated threads (`KafkaThread`), so the event loop
never blocks on the broker: one thread fetches (only it ever consumes), and the commit
and the broker queries (log end, partition count) run each on a thread of their own
(partition.py), on a second handle: a commit or a query on the fetch's thread held up
every fetch behind it (2-3% of records delayed up to 100 ms), and on the fetch's handle
from another thread it waited for confluent-kafka's one-call-at-a-time gate, which an
idle fetch holds back to back (see `SideHandle`). (The seed
once saw a synchronous commit beside a blocking consume hang, together with
pause()/resume(), which this adapter does not use; the fault suite and the integration
tests run the commit beside the consume.) confluent-kafka exceptions become
`BrokerUnavailable` through `kafka/errors.py`. A process that may serve several
partitions reads them through one Consumer instead (reader.py: it pauses full
partitions, and calls its Consumer from its one thread only; it shares this module's
settings).

Pausing: when the window is full the fetcher simply stops taking records. librdkafka's
own prefetch queue is capped (`queued.min.messages`, `queued.max.messages.kbytes`), so
the broker fetches stop too and memory stays bounded. librdkafka's pause()/resume()
is not used: against Tansu the first record after a resume took ~450 ms, which turned
every full window into a stall.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from confluent_kafka import OFFSET_INVALID, Consumer, TopicPartition

from triage_proxy.config.sections import KafkaSettings
from triage_proxy.errors import BrokerUnavailable
from triage_proxy.kafka.errors import kafka_errors, opening_errors
from triage_proxy.kafka.logs import KafkaLog
from triage_proxy.structs import Record

logger = logging.getLogger(__name__)
T = TypeVar("T")

FETCH_WAIT_S = 0.05
"""How long one fetch waits for the first message when the partition is idle (a drain
or a close queued behind it waits at most this long)."""
PREFETCH_MESSAGES = 10_000
PREFETCH_KBYTES = 16_384
FETCH_QUEUE_BACKOFF_MS = 20
"""How long librdkafka postpones the next fetch once its queue is over the caps above
(its default, 1 s, stalls a partition read faster than the caps refill)."""
BROKER_TIMEOUT_S = 10.0
WATERMARK_TIMEOUT_S = 1.0
"""Longest a log-end or metadata query may hold the query thread (the next query queues
behind it; fetches and commits do not)."""


class PartitionLog(Protocol):
    """What the proxy needs from Kafka for the one partition it owns."""

    def open(self) -> tuple[int, str | None]:
        """Connect, assign the partition at its committed position.

        Returns that offset and the metadata committed with it (None if none was kept).
        """
        ...

    def fetch(self, max_records: int) -> list[Record]:
        """Return the next records in offset order (possibly none after a short wait)."""
        ...

    def commit(self, offset: int, metadata: str | None = None) -> None:
        """Synchronously commit `offset` (the next offset to process) with `metadata`."""
        ...

    def log_end(self) -> int:
        """The partition's high watermark as the broker reports it now (for lag)."""
        ...

    def partition_count(self) -> int:
        """How many partitions the topic has now, from the broker's metadata (Topology)."""
        ...

    def close(self) -> None: ...


class SideHandle:
    """A Consumer handle that commits and answers the broker queries, beside the one that
    fetches. Why: confluent-kafka (2.16) lets one call at a time into a handle, and a
    waiting call retries every millisecond; an idle fetch holds its handle for its whole
    wait, back to back, so a commit on the fetching handle waited out idle fetches (50-330
    ms measured at the end of bench_throughput, against 1-20 ms on a handle of its own).
    It never assigns or consumes; calls from several threads take turns at its gate, each
    short (one broker round trip)."""

    def __init__(self, settings: KafkaSettings) -> None:
        self._topic = settings.topic
        self.consumer: Any = Consumer(consumer_config(settings))
        """For the reads that open a partition (committed offset, low watermark)."""
        self._lock = threading.Lock()
        self._closed = False

    def _handle(self) -> Any:
        if self._closed:
            raise BrokerUnavailable("the Kafka client is closed")
        return self.consumer

    def commit(self, partition: int, offset: int, metadata: str | None) -> None:
        consumer = self._handle()
        try:
            commit_offset(consumer, self._topic, partition, offset, metadata)
        finally:
            consumer.poll(0)  # its error and log callbacks: nothing else serves them

    def log_end(self, partition: int) -> int:
        consumer = self._handle()
        try:
            with kafka_errors("reading the log end offset"):
                _low, high = consumer.get_watermark_offsets(
                    TopicPartition(self._topic, partition),
                    timeout=WATERMARK_TIMEOUT_S,
                    cached=False,
                )
        finally:
            consumer.poll(0)
        return int(high)

    def partition_count(self) -> int:
        return count_partitions(self._handle(), self._topic)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.consumer.close()


class ConfluentPartition:
    """One assigned partition of a confluent-kafka Consumer."""

    def __init__(self, settings: KafkaSettings, partition: int) -> None:
        self._settings = settings
        self._tp = TopicPartition(settings.topic, partition)
        self._consumer: Any = None
        """Fetches, and nothing else (only the fetch's thread calls it)."""
        self._side: SideHandle | None = None
        """Commits and answers the broker queries (see SideHandle)."""
        self._lock = threading.Lock()  # this keeps close() clean

    def _config(self) -> dict[str, Any]:
        return consumer_config(self._settings)

    def open(self) -> tuple[int, str | None]:
        consumer: Any = None
        partition = self._tp.partition
        # The side handle first: reading the committed offset looks up the group
        # coordinator, which its commits need (the first commit does not pay for it).
        with opening_errors(self._settings, partition):
            side = SideHandle(self._settings)
        try:
            start, metadata = self._position(side)
            with opening_errors(self._settings, partition, side.consumer):
                consumer = Consumer(self._config())
                consumer.assign([TopicPartition(self._tp.topic, partition, start)])
        except BaseException:
            if consumer is not None:
                consumer.close()
            side.close()
            raise
        self._consumer, self._side = consumer, side
        logger.info("assigned %s[%d] at offset %d", self._tp.topic, partition, start)
        return start, metadata

    def _position(self, side: SideHandle) -> tuple[int, str | None]:
        """Where to start: the committed offset and its metadata, else the log start."""
        with opening_errors(self._settings, self._tp.partition, side.consumer):
            committed = side.consumer.committed([self._tp], timeout=BROKER_TIMEOUT_S)[0]
            if committed.error:
                raise BrokerUnavailable(f"reading committed offset: {committed.error}")
            if committed.offset != OFFSET_INVALID and committed.offset >= 0:
                return committed.offset, committed.metadata
            low, _high = side.consumer.get_watermark_offsets(self._tp, timeout=BROKER_TIMEOUT_S)
            return max(low, 0), None

    def fetch(self, max_records: int) -> list[Record]:
        consumer = self._consumer
        with kafka_errors("fetch failed"):
            # Wait for one message (at once when one is queued), then take whatever else is
            # queued. Not a non-blocking consume first: below the partition's full rate it
            # finds nothing right after the last batch was taken, and each consume() call
            # takes the GIL back twice, just when the event loop hands that batch out.
            messages = consumer.consume(1, FETCH_WAIT_S)
            if messages and max_records > 1:
                messages.extend(consumer.consume(max_records - 1, 0))
        records = records_of(self._tp.topic, messages)
        if len(records) != len(messages):
            for m in messages:
                err = m.error()
                if err is not None:
                    if err.fatal():
                        raise BrokerUnavailable(f"fatal fetch error: {err.str()}")
                    logger.warning("fetch: %s", err.str())
        return records

    def _side_handle(self) -> SideHandle:
        side = self._side
        if side is None:
            raise BrokerUnavailable("the partition is not open")
        return side

    def commit(self, offset: int, metadata: str | None = None) -> None:
        self._side_handle().commit(self._tp.partition, offset, metadata)

    def log_end(self) -> int:
        return self._side_handle().log_end(self._tp.partition)

    def partition_count(self) -> int:
        return self._side_handle().partition_count()

    def close(self) -> None:
        with self._lock:
            consumer, side = self._consumer, self._side
            self._consumer = self._side = None
        if consumer is not None:
            consumer.close()
        if side is not None:
            side.close()


def prefetch_config() -> dict[str, Any]:
    """librdkafka's prefetch as a fetching consumer of the proxy sets it (also what a
    benchmark's plain consumer must set to read a partition the way the proxy does)."""
    return {
        # Bound librdkafka's own prefetch so a full window really stops fetching.
        "queued.min.messages": PREFETCH_MESSAGES,
        "queued.max.messages.kbytes": PREFETCH_KBYTES,
        # Short, so the queue refills as soon as we drain it.
        "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
    }


def consumer_config(settings: KafkaSettings) -> dict[str, Any]:
    """The librdkafka properties of a fetching consumer (ConfluentPartition, reader.py)."""
    # What the guarantees rest on: every key here is in settings.RESERVED_CLIENT_PROPERTIES,
    # so [kafka.client] cannot set it (a unit test checks the two agree).
    own: dict[str, Any] = {
        "group.id": settings.group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": False,
        "isolation.level": "read_committed",  # librdkafka's default, stated
        **prefetch_config(),
        "fetch.wait.max.ms": settings.fetch_wait_ms,
        # error_cb and logger: reported once per cause, never raw on stderr.
        **KafkaLog(settings.topic).config(),
    }
    # Connection and secrets (resolved only now), then our own properties, which win.
    return {**settings.librdkafka_config(), **own}


def records_of(topic: str, messages: list[Any]) -> list[Record]:
    """`messages` as Records, leaving out those that carry an error (the caller looks at
    them only when the counts differ). One comprehension per batch, no per-message append
    or branch beyond the error test: the fetch path of the pinned adapter and the reader."""
    new = tuple.__new__
    return [
        new(
            Record,
            (
                topic,
                m.partition(),
                m.offset(),
                m.key(),
                m.value(),
                tuple(headers) if (headers := m.headers()) else (),
                m.timestamp()[1],
            ),
        )
        for m in messages
        if m.error() is None
    ]


def commit_offset(
    consumer: Any, topic: str, partition: int, offset: int, metadata: str | None
) -> None:
    """Commit `offset` (and its metadata) synchronously with `consumer`; a refused or failed
    commit is BrokerUnavailable (the pinned adapter and the reader both commit this way)."""
    tp = TopicPartition(topic, partition, offset)
    if metadata is not None:  # confluent-kafka refuses metadata=None
        tp = TopicPartition(topic, partition, offset, metadata=metadata)
    with kafka_errors(f"commit of offset {offset} failed"):
        result = consumer.commit(offsets=[tp], asynchronous=False)
    if result and result[0].error:
        raise BrokerUnavailable(f"commit of offset {offset} failed: {result[0].error}")


def count_partitions(consumer: Any, topic: str, timeout: float = WATERMARK_TIMEOUT_S) -> int:
    """How many partitions `topic` has, from the broker's metadata as `consumer` reads it
    (the pinned adapter, the reader, the group member and `triage status` all ask this way)."""
    with kafka_errors(f"reading the metadata of {topic}"):
        meta = consumer.list_topics(topic, timeout=timeout)
    found = meta.topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        raise BrokerUnavailable(f"the broker reported no partitions of {topic}")
    return len(found.partitions)


class KafkaThread:
    """One thread that talks to the Kafka client; its calls queue up in order."""

    def __init__(self, name: str = "kafka") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


class MemoryPartition:
    """In-memory twin of `ConfluentPartition` for unit tests: a list is the log."""

    def __init__(self, topic: str = "t", partition: int = 0, committed: int = 0) -> None:
        self.topic = topic
        self.partition = partition
        self.log: list[Record] = []
        self.committed = committed
        self.metadata: str | None = None
        self.commits: list[tuple[int, str | None]] = []
        self.closed = False
        self.partitions = partition + 1
        """What `partition_count()` answers (the topic's partitions)."""
        self._position = committed

    def append(
        self, value: bytes | None, key: bytes | None = None, offset: int | None = None
    ) -> None:
        """Add a record (offset defaults to the next one; pass a larger one for a gap)."""
        if offset is None:
            offset = self.log[-1].offset + 1 if self.log else 0
        self.log.append(Record(self.topic, self.partition, offset, key, value, (), 0))

    def open(self) -> tuple[int, str | None]:
        self._position = self.committed
        return self.committed, self.metadata

    def fetch(self, max_records: int) -> list[Record]:
        out = [r for r in self.log if r.offset >= self._position][:max_records]
        if not out:
            time.sleep(0.01)  # like a real idle fetch, so callers do not spin
        if out:
            self._position = out[-1].offset + 1
        return out

    def commit(self, offset: int, metadata: str | None = None) -> None:
        self.committed = offset
        self.metadata = metadata
        self.commits.append((offset, metadata))

    def log_end(self) -> int:
        return self.log[-1].offset + 1 if self.log else self.committed

    def partition_count(self) -> int:
        return self.partitions

    def close(self) -> None:
        self.closed = True
