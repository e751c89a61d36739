"""One Spark task's work: scan one DynamoDB segment, select, then replay or export it.

Why a module of its own: everything here runs on the executors. A task gets a
`SegmentJob` of frozen, picklable values (the run's `ReplayOptions`, which hold the
proxy's own `DeadLetterSettings`; no clients, no Spark types) and builds its boto3
client (one per Python worker, reused across tasks) and Kafka producer there, with
the proxy's client builders, so the same code runs in local mode and on any cluster
where the `triage` package is installed. Selection, claims, marks, S3 payloads,
provenance headers and the replay routine itself are `triage_proxy.store`'s (`query.py`,
`replay.py`), shared with `triage dlq`, so the two tools never disagree about what a
filter selects, whether an item was replayed, or what a failed delivery means. `job.py`
is the driver side; this module runs the segment:

    for each selected item of the segment:
      not pending, or claimed (seen in the scan)  -> counted skipped / in doubt
      (a stale claim is taken over only with retry_in_doubt)
      else                                        -> into the current chunk
    for each chunk of `chunk_size` replayable items:
      table.replay.Replayer.replay_chunk: claim -> produce -> confirm -> mark, with the
      conditional writes on a pool of `write_concurrency` threads

The routine settles a chunk (marks what was delivered, releases what was certainly not
sent, keeps the claims of what may have been) before it re-raises an exception from
anywhere in the chunk (a broker error, a throttled table, the injected `Fault`). A
segment that fails reports its error in its `SegmentCounts` instead of failing the Spark
task: a failed task makes Spark abort the job and kill the sibling tasks with SIGKILL,
which would leave their current chunks in doubt for nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol, cast

from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.kafka.producer import never_written, replay_producer_config
from triage_proxy.store.aws import dynamodb_client
from triage_proxy.store.query import TABLE_ATTEMPTS, DeadLetterTable
from triage_proxy.store.replay import Outcome, Producer, Replayer, ReplayResult
from triage_proxy.structs import DeadLetter
from triage_replay.options import Fault, ReplayOptions

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.client import DynamoDBClient

logger = logging.getLogger(__name__)

CRASH_EXIT_CODE = 70
"""Exit status of a worker killed by an injected crash (`Fault(crash=True)`)."""
SCAN_PAGE = 500
"""Items evaluated per Scan page (DynamoDB's own limit is 1 MB): a slow endpoint answers
each page well inside READ_TIMEOUT_S, and a task starts producing sooner."""
READ_TIMEOUT_S = 30.0
"""botocore read timeout on the executors: a Scan page of 1 MB from a loaded endpoint
takes longer than the tools' interactive default."""


class _ScanCounter:
    """A DynamoDB client that adds up ScannedCount: what Scan/Query evaluated (`read`)."""

    def __init__(self, client: DynamoDBClient) -> None:
        self._client = client
        self.scanned = 0

    def scan(self, **kwargs: Any) -> Any:
        page = self._client.scan(**kwargs)
        self.scanned += page.get("ScannedCount", 0)
        return page

    def query(self, **kwargs: Any) -> Any:
        page = self._client.query(**kwargs)
        self.scanned += page.get("ScannedCount", 0)
        return page

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@functools.cache
def _shared_client(settings: DeadLetterSettings) -> DynamoDBClient:
    """One DynamoDB client per table per Python worker, kept for the worker's life.

    Spark reuses its Python workers across tasks and runs; building a boto3 client loads
    the service model (a few hundred ms of CPU), which would otherwise be paid per task.
    boto3 clients are thread-safe, so the task's write pool shares it too.
    """
    return dynamodb_client(settings, read_timeout_s=READ_TIMEOUT_S, max_attempts=TABLE_ATTEMPTS)


class TaskTable:
    """The dead-letter table as one task uses it: table.query's DeadLetterTable (the shared
    selection, claim, mark and S3 payload logic) on the worker's DynamoDB client,
    counting what this task's scans read. Close it when done."""

    def __init__(self, settings: DeadLetterSettings, group: str) -> None:
        self._dynamodb = _ScanCounter(_shared_client(settings))
        self.table = DeadLetterTable(
            settings, group=group, dynamodb=cast("DynamoDBClient", self._dynamodb)
        )

    @property
    def scanned(self) -> int:
        """Items DynamoDB evaluated for this table's scans and queries so far."""
        return self._dynamodb.scanned

    def close(self) -> None:
        self.table.close()  # its S3 client, if a payload needed one; not the shared one


class InjectedFault(RuntimeError):
    """Raised by `Fault(crash=False)`."""


@dataclass(frozen=True)
class SegmentJob:
    """What every task of one run needs, shipped to the executors as plain values."""

    options: ReplayOptions
    """The run's options (table settings, filters, target, tuning)."""
    total_segments: int
    """DynamoDB parallel scan's TotalSegments (= Spark partitions)."""
    replay_id: str
    """This run's id: claim owner and `triage-replay-id` header."""


@dataclass
class Counts:
    """What happened to the items a run read: per segment, and summed for the run."""

    read: int = 0
    """Items DynamoDB evaluated (ScannedCount): all of the table (or segment) for a Scan,
    one source partition for a topic+partition Query; checkpoint items included."""
    selected: int = 0
    """Dead letters the filters matched."""
    replayed: int = 0
    """Produced, acknowledged by the broker and (unless a warning says otherwise) marked."""
    skipped: int = 0
    """Selected but replayed or discarded already (or claimed by another run in the
    moment between our scan and our claim)."""
    failed: int = 0
    """Selected and not replayed this run, left pending for a rerun (delivery refused,
    payload unreadable, or the segment stopped before producing it)."""
    in_doubt: int = 0
    """Claimed and maybe produced: by another run (live, or stopped midway), or by this
    one when a delivery report or the mark did not come back. Never replayed again
    automatically (see ReplayOptions.retry_in_doubt)."""

    def add(self, other: Counts) -> None:
        """Add `other`'s counts to these."""
        for name in _COUNT_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def totals(self) -> dict[str, int]:
        """The counts alone, by name (for building a Summary)."""
        return {name: getattr(self, name) for name in _COUNT_FIELDS}


_COUNT_FIELDS = tuple(f.name for f in dataclasses.fields(Counts))


@dataclass(kw_only=True)
class SegmentCounts(Counts):
    """What one task did; the driver sums them into the run's Summary."""

    segment: int
    """The scan segment."""
    error: str | None = None
    """Why the segment stopped early; None when it ran to the end."""


# --- replay -----------------------------------------------------------------------------


class _FaultyProducer:
    """Tests only: the producer of a segment with a `Fault` injected (see `Fault`)."""

    def __init__(self, producer: Producer, fault: Fault) -> None:
        self._producer = producer
        self._fault = fault
        self.sent = 0
        """Messages handed to the producer so far in this segment."""

    def produce(self, topic: str, **kwargs: Any) -> None:
        if not self._fault.crash and self.sent >= self._fault.after:
            raise InjectedFault(f"injected fault after {self.sent} messages")
        self._producer.produce(topic, **kwargs)
        self.sent += 1

    def poll(self, timeout: float) -> int:
        return self._producer.poll(timeout)

    def flush(self, timeout: float) -> int:
        left = self._producer.flush(timeout)
        if self._fault.crash and self.sent >= self._fault.after:
            os._exit(CRASH_EXIT_CODE)  # delivered, not yet marked: the worst moment
        return left

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        self._producer.purge(in_queue=in_queue, in_flight=in_flight, blocking=blocking)


class SegmentReplayer:
    """Replays the selected items of one scan segment (see the module docstring).

    `make_producer` builds the Kafka producer from its config (default: confluent-kafka's
    Producer); tests pass a wrapper to inject faults.
    """

    def __init__(
        self,
        job: SegmentJob,
        segment: int,
        *,
        now_ms: Callable[[], int] | None = None,
        make_producer: Callable[[dict[str, Any]], Producer] | None = None,
    ) -> None:
        if job.options.bootstrap is None:
            raise ValueError("replay needs bootstrap servers")
        self._job = job
        self._segment = segment
        self._now_ms = now_ms or _wall_ms
        self._make_producer = make_producer
        self.counts = SegmentCounts(segment=segment)

    def run(self) -> SegmentCounts:
        """Replay the whole segment; never raises (a failure ends up in `counts.error`)."""
        job = self._job
        tasktable: TaskTable | None = None
        pool: ThreadPoolExecutor | None = None
        try:
            tasktable = TaskTable(job.options.dead_letters, job.options.group)
            pool = ThreadPoolExecutor(job.options.write_concurrency, "triage-replay-write")
            replayer = Replayer(
                tasktable.table,
                self._producer(),
                job.replay_id,
                never_written=never_written,
                to_topic=job.options.to_topic,
                lease_s=job.options.claim_lease_s,
                flush_timeout_s=job.options.delivery_timeout_s + 5,
                take_over_stale=job.options.retry_in_doubt,
                pool=pool,
                now_ms=self._now_ms,
            )
            chunk: list[Mapping[str, Any]] = []
            selected = tasktable.table.scan(
                job.options.filters,
                segment=self._segment,
                total_segments=job.total_segments,
                page_size=SCAN_PAGE,
            )
            for item in selected:
                self.counts.selected += 1
                refused = replayer.check(item)
                if refused is not None:
                    self._count(refused[0])
                    continue
                chunk.append(item)
                if len(chunk) >= job.options.chunk_size:
                    self._replay_chunk(replayer, chunk)
                    chunk = []
            if chunk:
                self._replay_chunk(replayer, chunk)
        except Exception as exc:  # the task's top level: report, do not fail the Spark task
            logger.exception("replay of segment %d stopped early", self._segment)
            self.counts.error = f"segment {self._segment}: {type(exc).__name__}: {exc}"
        finally:
            if pool is not None:
                pool.shutdown()
            if tasktable is not None:
                self.counts.read = tasktable.scanned
                tasktable.close()
        return self.counts

    def _producer(self) -> Producer:
        if self._make_producer is not None:
            producer = self._make_producer(producer_config(self._job.options))
        else:
            from confluent_kafka import Producer as KafkaProducer

            producer = KafkaProducer(producer_config(self._job.options))
        fault = self._job.options.fault
        return producer if fault is None else _FaultyProducer(producer, fault)

    def _replay_chunk(self, replayer: Replayer, chunk: Sequence[Mapping[str, Any]]) -> None:
        """The shared routine on one chunk; its outcomes are counted even when it raises."""
        result = ReplayResult()
        try:
            replayer.replay_chunk(chunk, result)
        finally:
            self.counts.replayed += len(result.replayed)
            self.counts.skipped += len(result.skipped)
            self.counts.failed += len(result.failed)
            self.counts.in_doubt += len(result.in_doubt)

    def _count(self, outcome: Outcome) -> None:
        if outcome is Outcome.SKIPPED:
            self.counts.skipped += 1
        else:
            self.counts.in_doubt += 1


def producer_config(options: ReplayOptions) -> dict[str, Any]:
    """The librdkafka properties of a task's producer: every replay's (`kafka.producer`) on
    the run's broker, reporting through `KafkaLog`, so a broker that goes away is one
    logged line per cause in the executor's log, not librdkafka's own line at every
    refused connect. Imports confluent-kafka (through `kafka.logs`): call it where the
    producer is built."""
    from triage_proxy.kafka.logs import KafkaLog

    assert options.bootstrap is not None
    connection = {**options.kafka_config, "bootstrap.servers": options.bootstrap}
    return {
        **replay_producer_config(connection, delivery_timeout_s=options.delivery_timeout_s),
        **KafkaLog().config(),
    }


def replay_partition(job: SegmentJob, segments: Iterable[int]) -> Iterator[SegmentCounts]:
    """mapPartitions body for replay: one SegmentCounts per scan segment."""
    for segment in segments:
        yield SegmentReplayer(job, segment).run()


# --- export -----------------------------------------------------------------------------


class _Counter(Protocol):
    """What export_partition needs of a Spark accumulator."""

    def add(self, term: int) -> None: ...


def export_partition(
    job: SegmentJob, read: _Counter, selected: _Counter, segments: Iterable[int]
) -> Iterator[tuple[Any, ...]]:
    """mapPartitions body for export: one row (EXPORT_COLUMNS order) per selected item."""
    for segment in segments:
        opened = TaskTable(job.options.dead_letters, job.options.group)
        table = opened.table
        count = 0
        try:
            for item in table.scan(
                job.options.filters,
                segment=segment,
                total_segments=job.total_segments,
                page_size=SCAN_PAGE,
            ):
                count += 1
                yield export_row(item, table.load(item))
        finally:
            read.add(opened.scanned)
            selected.add(count)
            opened.close()


EXPORT_COLUMNS = (
    "topic",
    "partition",
    "offset",
    "key",
    "value",
    "headers",
    "timestamp",
    "reason",
    "attempts",
    "consumer_id",
    "dead_lettered_at",
    "status",
    "replay_id",
    "replayed_at",
    "replayed_to",
    "replay_count",
    "payload_s3",
)
"""Columns of the Parquet export, in row order (types in job.export_schema)."""


def export_row(item: Mapping[str, Any], dl: DeadLetter) -> tuple[Any, ...]:
    """One export row; key/value/headers byte-exact (loaded from S3 when they are there)."""
    record = dl.record

    def text(name: str) -> str | None:
        return item[name]["S"] if name in item else None

    return (
        record.topic,
        record.partition,
        record.offset,
        record.key,
        record.value,
        [(name, value) for name, value in record.headers],
        _instant(record.timestamp_ms),
        dl.reason,
        dl.attempts,
        dl.consumer_id,
        _instant(dl.dead_lettered_at_ms),
        item["status"]["S"],
        text("replay_id"),
        text("replayed_at"),
        text("replayed_to"),
        int(item["replay_count"]["N"]) if "replay_count" in item else None,
        text("payload_s3"),
    )


def _wall_ms() -> int:
    return int(time.time() * 1000)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _instant(ms: int) -> datetime:
    return _EPOCH + timedelta(milliseconds=ms)  # exact, unlike fromtimestamp(ms / 1000)
