"""The process's one Kafka reader: a single librdkafka Consumer that fetches every
partition a multi-partition process serves.

Why one: a Consumer per partition pipeline brings librdkafka's own threads, its own
fetch requests to the broker and its own idle wake-ups for each; serving 4 partitions
that way costs more CPU per message than one partition per process
(bench_fleet_throughput). One Consumer sends one fetch request per broker for all of
them, and one thread serves it.

`Reader` owns the Consumer (assign()-based: `incremental_assign` when a pipeline opens
its partition at the committed offset, `incremental_unassign` when it closes; the group
membership is assignment.py's, never this client's) and the one thread that uses it: a
confluent-kafka Consumer is used from one thread only (kafka/client.py). That thread alternates
consume() with the calls queued for it (open, close), so a call waits at most one idle
consume (FETCH_WAIT_S). Commits and the broker queries (log end, metadata) go to a
second handle on the pipelines' own threads instead (kafka.SideHandle): they wait for
no consume and hold up no fetch. consume() fills one buffer per
partition; each pipeline takes from its own buffer only, on its event loop
(`ReaderPartition.take_buffered`, no thread hop: with 16 partitions a consume() brings
each about a 16th of its records, and a hop to the pipeline's thread and back for every
such run cost more than the run). When its buffer is empty the pipeline waits on its
loop too (`ReaderPartition.arm`: the reader thread wakes it when records or an error come
in), so an idle partition costs no wake-ups; `ReaderPartition.fetch` (a `PartitionLog`,
waiting up to FETCH_WAIT_S on a thread) serves a caller without a loop.

Bounds: a partition's buffer holds at most PREFETCH_KBYTES (kafka/client.py's per-partition
prefetch cap) of records, counted as their keys and values plus RECORD_OVERHEAD bytes
each for the Python objects that carry them: once over, that partition alone is paused
in librdkafka, and resumed once its pipeline took the buffer below half (librdkafka
refetches from the last record handed over, so nothing is lost or repeated; the half
left hides the slow first fetch after a resume, see kafka/client.py). Not a count of records
as librdkafka's own cap (`queued.min.messages`): a pause throws away what librdkafka
had fetched ahead for the partition and costs a refetch (measured with a 10,000-record
cap: ~10 pauses per bench_fleet_throughput run, proxy 5.9-6.5 vs 4.6-4.8 and broker
0.6-0.7 vs 0.4 ms CPU per 1,000 messages without), and 10,000 small records are only
~3 MB. So a
full window stops fetching for its partition only, and memory stays bounded per
partition. A partition that closes drops what its buffer held (it was never
delivered; the next owner fetches it again from the committed offset) and is unassigned
before another pipeline may open it.

Errors: a consume that fails, or a fatal error, is raised as BrokerUnavailable by the
next fetch of every partition (each fetcher reports degraded and backs off on its own);
per-partition log-end queries fail per partition.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from itertools import groupby
from operator import itemgetter
from typing import Any, TypeVar

from confluent_kafka import OFFSET_INVALID, Consumer, TopicPartition

from triage_proxy.config.sections import KafkaSettings
from triage_proxy.errors import BrokerUnavailable, StateError
from triage_proxy.kafka.client import (
    BROKER_TIMEOUT_S,
    FETCH_WAIT_S,
    PREFETCH_KBYTES,
    SideHandle,
    consumer_config,
    records_of,
)
from triage_proxy.kafka.errors import kafka_errors, kafka_warnings, opening_errors
from triage_proxy.kafka.jobs import ThreadJobs
from triage_proxy.structs import Record

logger = logging.getLogger(__name__)
T = TypeVar("T")

CONSUME_BATCH = 2_000
"""Most records one consume() takes, over all partitions."""
CALL_TIMEOUT_S = BROKER_TIMEOUT_S + 5.0
"""Longest a caller waits for its call on the reader thread (the call bounds itself)."""
RECORD_OVERHEAD = 200
"""Bytes of one buffered Record beside its key and value: the 7-tuple, the bytes and int
objects, the list slot (measured ~200 with sys.getsizeof)."""
_PARTITION = itemgetter(1)
"""A Record's partition."""
FAILED_CONSUME_WAIT_S = 0.1
"""Pause of the reader thread after a consume() that raised (so it does not spin)."""


class _Buffer:
    """What the reader fetched for one partition and its pipeline has not taken yet."""

    __slots__ = (
        "batches",
        "cond",
        "count",
        "error",
        "nbytes",
        "paused",
        "resume_asked",
        "waker",
    )

    def __init__(self) -> None:
        self.batches: deque[tuple[list[Record], int]] = deque()
        """Runs of records as the reader sorted them, each with its `_size` (counted once,
        when it came in)."""
        self.count = 0
        self.nbytes = 0
        self.cond = threading.Condition(threading.Lock())
        self.error: BrokerUnavailable | None = None
        """Raised by the next take (then cleared)."""
        self.paused = False
        """Paused in librdkafka because the buffer is over a cap."""
        self.resume_asked = False
        self.waker: Callable[[], None] | None = None
        """Its pipeline waits on its event loop for records (`Reader.arm`): called once,
        from the reader thread, when records or an error come in."""

    def fire(self) -> Callable[[], None] | None:
        """The waker to call (after the lock is released), cleared (its lock held)."""
        waker, self.waker = self.waker, None
        return waker


class Reader:
    """One Consumer and its thread for every partition of a process (module docstring)."""

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        max_bytes: int = PREFETCH_KBYTES * 1024,
    ) -> None:
        self._settings = settings
        self._topic = settings.topic
        self._max_bytes = max_bytes
        self._consumer: Any = None
        self._side: SideHandle | None = None
        """Commits and answers the broker queries, on the pipelines' threads (SideHandle):
        queued for the reader thread, a commit waited for an idle consume and held up
        every partition's fetch for its round trip."""
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._jobs = ThreadJobs()
        self._buffers: dict[int, _Buffer] = {}
        """The open partitions (written on the reader thread only)."""
        self._resume: queue.SimpleQueue[int] = queue.SimpleQueue()
        """Partitions whose pipeline took their buffer below half: resume them."""
        self.pauses = 0
        """Times a partition was paused because its buffer was full (tests, profiling)."""

    def partition(self, partition: int) -> ReaderPartition:
        """The `PartitionLog` of `partition` through this reader."""
        return ReaderPartition(self, partition)

    # --- lifecycle ------------------------------------------------------------------------

    def _start(self) -> None:
        """Make the Consumer and start the thread (at the first open; on a caller's thread)."""
        with self._start_lock:
            if self._stopping.is_set():
                raise BrokerUnavailable("the Kafka reader has stopped")
            if self._thread is not None:
                return
            with opening_errors(self._settings, 0):
                side = SideHandle(self._settings)
            try:
                with opening_errors(self._settings, 0):
                    self._consumer = Consumer(consumer_config(self._settings))
            except BaseException:
                side.close()
                raise
            self._side = side
            self._thread = threading.Thread(target=self._run, name="kafka-reader", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the thread and close the Consumer (blocking; once every partition closed)."""
        with self._start_lock:
            self._stopping.set()
            thread = self._thread
        self._wake.set()
        if thread is not None:
            thread.join()
        if self._side is not None:
            self._side.close()

    # --- calls, from the pipelines' threads -----------------------------------------------

    def call(self, job: Callable[[], T]) -> T:
        """Run `job` on the reader thread (the Consumer's only thread) and wait for it."""
        self._start()
        future = self._jobs.submit(job)
        self._wake.set()
        try:
            return future.result(CALL_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise BrokerUnavailable("the Kafka reader did not answer in time") from None

    def take(self, partition: int, max_records: int) -> list[Record]:
        """Up to `max_records` of `partition`'s buffer, in offset order (none after
        FETCH_WAIT_S if it stays empty)."""
        buffer = self._buffers.get(partition)
        if buffer is None:
            raise BrokerUnavailable(f"partition {partition} is not open")
        with buffer.cond:
            if not buffer.count and buffer.error is None:
                buffer.cond.wait(FETCH_WAIT_S)
            return self._take(partition, buffer, max_records)

    def take_buffered(self, partition: int, max_records: int) -> list[Record]:
        """Up to `max_records` of what `partition`'s buffer holds now, without waiting
        (none when it is empty): the pipeline calls this on its event loop first, so a
        partition whose records are already here costs no hop to a thread and back."""
        buffer = self._buffers.get(partition)
        if buffer is None:
            raise BrokerUnavailable(f"partition {partition} is not open")
        if not buffer.count and buffer.error is None:
            return []  # unlocked: a batch appended meanwhile is the next call's
        with buffer.cond:
            return self._take(partition, buffer, max_records)

    def arm(self, partition: int, wake: Callable[[], None]) -> bool:
        """Have `wake` called once, from the reader thread, when `partition`'s buffer gets
        records or an error; False (and no call) if it holds either already. So a pipeline
        whose buffer is empty waits on its own event loop, with no thread to wake it every
        FETCH_WAIT_S (any thread)."""
        buffer = self._buffers.get(partition)
        if buffer is None:
            raise BrokerUnavailable(f"partition {partition} is not open")
        with buffer.cond:
            if buffer.count or buffer.error is not None:
                return False
            buffer.waker = wake
            return True

    def _take(self, partition: int, buffer: _Buffer, max_records: int) -> list[Record]:
        """`take` of what `buffer` holds (its lock held)."""
        if buffer.error is not None:
            error, buffer.error = buffer.error, None
            raise error
        batches = buffer.batches
        out: list[Record] = []
        nbytes = 0
        while batches and len(out) < max_records:
            batch, size = batches[0]
            want = max_records - len(out)
            if len(batch) <= want:
                batches.popleft()
                if out:
                    out.extend(batch)
                else:
                    out = batch
                nbytes += size
            else:
                part = batch[:want]
                taken = _size(part)
                out.extend(part)
                batches[0] = (batch[want:], size - taken)
                nbytes += taken
        if out:
            buffer.count -= len(out)
            buffer.nbytes -= nbytes
            if buffer.paused and not buffer.resume_asked and buffer.nbytes <= self._max_bytes // 2:
                buffer.resume_asked = True
                self._resume.put(partition)
        return out

    # --- the reader thread -----------------------------------------------------------------

    def _run(self) -> None:
        consumer = self._consumer
        while not self._stopping.is_set():
            self._jobs.run()
            self._resume_asked()
            if not self._buffers:
                self._wake.wait(FETCH_WAIT_S)
                self._wake.clear()
                continue
            try:
                with kafka_errors("fetch failed"):
                    messages = consumer.consume(CONSUME_BATCH, 0)
                    if not messages:
                        messages = consumer.consume(1, FETCH_WAIT_S)
                        if messages:
                            messages.extend(consumer.consume(CONSUME_BATCH - 1, 0))
            except BrokerUnavailable as exc:
                self._fail_all(exc)
                self._stopping.wait(FAILED_CONSUME_WAIT_S)
                continue
            if messages:
                self._deliver(messages)
        self._jobs.run()
        with kafka_warnings("closing the Kafka reader", log=logger):
            consumer.close()
        self._fail_all(BrokerUnavailable("the Kafka reader has stopped"))
        self._buffers.clear()
        self._jobs.refuse("the Kafka reader has stopped")  # what came after the close

    def _resume_asked(self) -> None:
        while True:
            try:
                partition = self._resume.get_nowait()
            except queue.Empty:
                return
            buffer = self._buffers.get(partition)
            if buffer is None:
                continue
            with buffer.cond:
                buffer.paused = buffer.resume_asked = False
            with kafka_warnings("resuming partition %d", partition, log=logger):
                self._consumer.resume([TopicPartition(self._topic, partition)])

    def _deliver(self, messages: list[Any]) -> None:
        """Sort `messages` into the buffers; pause the partitions now over a cap."""
        topic = self._topic
        # Records of the batch (kafka.records_of), then runs of one partition cut by
        # groupby in C: a batch is a few long runs, one per fetch response.
        records = records_of(self._topic, messages)
        failed = (
            [m for m in messages if m.error() is not None] if len(records) != len(messages) else []
        )
        groups: dict[int, list[Record]] = {}
        for partition, run in groupby(records, _PARTITION):
            found = groups.get(partition)
            if found is None:
                groups[partition] = list(run)
            else:
                found.extend(run)
        for partition, records in groups.items():
            buffer = self._buffers.get(partition)
            if buffer is None:
                continue  # closed meanwhile: never delivered, fetched again by its next owner
            size = _size(records)
            with buffer.cond:
                buffer.batches.append((records, size))
                buffer.count += len(records)
                buffer.nbytes += size
                pause = not buffer.paused and buffer.nbytes >= self._max_bytes
                if pause:
                    buffer.paused = True
                buffer.cond.notify()
                waker = buffer.fire()
            if waker is not None:
                waker()
            if pause:
                self.pauses += 1
                with kafka_warnings("pausing partition %d", partition, log=logger):
                    self._consumer.pause([TopicPartition(topic, partition)])
        for m in failed:
            err = m.error()
            if err.fatal():
                self._fail_all(BrokerUnavailable(f"fatal fetch error: {err.str()}"))
            else:
                logger.warning("fetch: %s", err.str())

    def _fail_all(self, error: BrokerUnavailable) -> None:
        """Every buffer answers `error` from now on; whoever waits on one is woken."""
        for buffer in self._buffers.values():
            with buffer.cond:
                buffer.error = error
                buffer.cond.notify_all()
                waker = buffer.fire()
            if waker is not None:
                waker()

    # --- the calls (on the reader thread) ----------------------------------------------

    def open_partition(self, partition: int) -> tuple[int, str | None]:
        if partition in self._buffers:
            raise StateError(f"partition {partition} is already open")
        consumer = self._consumer
        tp = TopicPartition(self._topic, partition)
        metadata: str | None = None
        with opening_errors(self._settings, partition, consumer):
            committed = consumer.committed([tp], timeout=BROKER_TIMEOUT_S)[0]
            if committed.error:
                raise BrokerUnavailable(f"reading committed offset: {committed.error}")
            if committed.offset == OFFSET_INVALID or committed.offset < 0:
                low, _high = consumer.get_watermark_offsets(tp, timeout=BROKER_TIMEOUT_S)
                start = max(low, 0)
            else:
                start = committed.offset
                metadata = committed.metadata
            consumer.incremental_assign([TopicPartition(self._topic, partition, start)])
        self._buffers[partition] = _Buffer()
        logger.info("assigned %s[%d] at offset %d", self._topic, partition, start)
        return start, metadata

    def close_partition(self, partition: int) -> None:
        buffer = self._buffers.pop(partition, None)
        if buffer is None:
            return
        with buffer.cond:
            dropped = buffer.count
            buffer.batches.clear()
            buffer.count = buffer.nbytes = 0
            buffer.error = BrokerUnavailable(f"partition {partition} is closed")
            buffer.cond.notify_all()
            waker = buffer.fire()
        if waker is not None:
            waker()
        with kafka_warnings("unassigning partition %d", partition, log=logger):
            self._consumer.incremental_unassign([TopicPartition(self._topic, partition)])
        logger.info(
            "unassigned %s[%d] (%d fetched records dropped)", self._topic, partition, dropped
        )

    def side(self) -> SideHandle:
        """The handle for commits and queries (any thread; once started)."""
        side = self._side
        if side is None:
            raise BrokerUnavailable("the Kafka reader has not started")
        return side

    def log_end(self, partition: int) -> int:
        if partition not in self._buffers:
            raise BrokerUnavailable(f"partition {partition} is not open")
        return self.side().log_end(partition)


class ReaderPartition:
    """One partition through the process's `Reader` (a `PartitionLog`)."""

    def __init__(self, reader: Reader, partition: int) -> None:
        self._reader = reader
        self._partition = partition
        self._open = False

    def open(self) -> tuple[int, str | None]:
        reader, partition = self._reader, self._partition
        opened = reader.call(lambda: reader.open_partition(partition))
        self._open = True
        return opened

    def fetch(self, max_records: int) -> list[Record]:
        return self._reader.take(self._partition, max_records)

    def take_buffered(self, max_records: int) -> list[Record]:
        """What the reader already holds for this partition, without waiting (any thread;
        the pipeline's event loop calls it before it sends a `fetch` to its thread)."""
        return self._reader.take_buffered(self._partition, max_records)

    def arm(self, wake: Callable[[], None]) -> bool:
        """`Reader.arm` for this partition: False if records (or an error) wait already."""
        return self._reader.arm(self._partition, wake)

    def commit(self, offset: int, metadata: str | None = None) -> None:
        self._reader.side().commit(self._partition, offset, metadata)

    def log_end(self) -> int:
        return self._reader.log_end(self._partition)

    def partition_count(self) -> int:
        return self._reader.side().partition_count()

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        reader, partition = self._reader, self._partition
        try:
            reader.call(lambda: reader.close_partition(partition))
        except BrokerUnavailable as exc:  # the reader stopped: nothing is assigned any more
            logger.debug("closing partition %d: %s", partition, exc)


def _size(records: list[Record]) -> int:
    """What `records` hold in memory, about (what the buffer caps): keys, values and
    RECORD_OVERHEAD each."""
    return RECORD_OVERHEAD * len(records) + sum(
        [len(r[3] or b"") + len(r[4] or b"") for r in records]
    )
