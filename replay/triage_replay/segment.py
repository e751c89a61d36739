"""One Spark task's work: scan one DynamoDB segment, select, then replay or export it.

Why a module of its own: everything here runs on the executors. A task gets a
`SegmentJob` of frozen, picklable values (the run's `ReplayOptions`, which hold the
proxy's own `DeadLetterSettings`; no clients, no Spark types) and builds its boto3
client (one per Python worker, reused across tasks) and Kafka producer there, with
the proxy's client builders, so the same code runs in local mode and on any cluster
where the `triage` package is installed. Selection,
claims, marks, S3 payloads and provenance headers are `triage_proxy.table`'s, shared
with `triage dlq`, so the two tools never disagree about what a filter selects or
whether an item was replayed. `job.py` is the driver side and explains the replay
protocol (claim -> produce -> mark) and its one failure window; this module runs it:

    for each chunk of `chunk_size` selected, replayable items:
      claim    conditional UpdateItem per item (`write_concurrency` at once), then
               load the payload (from S3 when it is there)
      produce  every claimed item, then flush and read the delivery reports
      settle   delivered -> `replayed` (if the claim is still ours);
               certainly not sent -> claim released (pending again, counted failed);
               anything else -> left claimed, counted in doubt

`settle` runs in a `finally`, so an exception anywhere in a chunk (a broker error, a
throttled table, the injected `Fault`) still marks what was delivered and releases
what was not. A segment that fails reports its error in its `SegmentCounts` instead of
failing the Spark task: a failed task makes Spark abort the job and kill the sibling
tasks with SIGKILL, which would leave their current chunks in doubt for nothing.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from triage_proxy.settings import DeadLetterSettings
from triage_proxy.structs import DeadLetter
from triage_proxy.table.aws import dynamodb_client
from triage_proxy.table.items import CLAIM_ATTR, CLAIM_UNTIL_ATTR, STATUS_PENDING, item_key
from triage_proxy.table.query import TABLE_ATTEMPTS, DeadLetterTable
from triage_proxy.table.replay import replay_headers
from triage_replay.options import ReplayOptions

if TYPE_CHECKING:
    from confluent_kafka import KafkaError, Message, Producer
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

T = TypeVar("T")


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

    def __init__(self, settings: DeadLetterSettings) -> None:
        self._dynamodb = _ScanCounter(_shared_client(settings))
        self.table = DeadLetterTable(settings, dynamodb=cast("DynamoDBClient", self._dynamodb))

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


class _State(enum.Enum):
    CANDIDATE = "candidate"
    CLAIMED = "claimed"
    """Claimed (or maybe claimed: the call failed) and not handed to the producer."""
    SENT = "sent"
    """Handed to the producer, no delivery report yet."""
    DELIVERED = "delivered"
    NOT_SENT = "not-sent"
    """The delivery report says it certainly never reached the broker."""
    UNKNOWN = "unknown"
    """The delivery failed in a way that may still have written it."""


class _Claim(enum.Enum):
    TAKEN = "taken"
    LOST = "lost"
    """Not pending any more, or another replay holds it."""
    UNREADABLE = "unreadable"
    """Claimed, but its payload cannot be read (e.g. the S3 object is gone): released."""


@functools.cache
def _not_sent_codes() -> frozenset[int]:
    """librdkafka errors that guarantee the message was never written (all others: maybe)."""
    from confluent_kafka import KafkaError

    return frozenset(
        {
            KafkaError._PURGE_QUEUE,
            KafkaError._UNKNOWN_TOPIC,
            KafkaError._UNKNOWN_PARTITION,
            KafkaError._INVALID_ARG,
            KafkaError.UNKNOWN_TOPIC_OR_PART,
            KafkaError.MSG_SIZE_TOO_LARGE,
            KafkaError.TOPIC_AUTHORIZATION_FAILED,
        }
    )


@dataclass(slots=True)
class _Candidate:
    item: Mapping[str, Any]
    dl: DeadLetter | None = None
    """Loaded once claimed (from S3 when the payload is there)."""
    state: _State = _State.CANDIDATE
    replayed_to: str = ""

    @property
    def key(self) -> tuple[str, int, int]:
        return item_key(self.item)

    def on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is None:
            self.state = _State.DELIVERED
            self.replayed_to = f"{msg.topic()}/{msg.partition()}/{msg.offset()}"
        elif err.code() in _not_sent_codes():
            self.state = _State.NOT_SENT
        else:
            self.state = _State.UNKNOWN


class SegmentReplayer:
    """Replays the selected items of one scan segment (see the module docstring)."""

    def __init__(
        self, job: SegmentJob, segment: int, *, now_ms: Callable[[], int] | None = None
    ) -> None:
        if job.options.bootstrap is None:
            raise ValueError("replay needs bootstrap servers")
        self._job = job
        self._segment = segment
        self._now_ms = now_ms or _wall_ms
        self.counts = SegmentCounts(segment=segment)
        self._sent = 0
        self._tasktable: TaskTable | None = None
        self._table: DeadLetterTable | None = None
        self._producer: Producer | None = None
        self._pool: ThreadPoolExecutor | None = None

    def run(self) -> SegmentCounts:
        """Replay the whole segment; never raises (a failure ends up in `counts.error`)."""
        from confluent_kafka import Producer

        job = self._job
        try:
            self._tasktable = TaskTable(job.options.dead_letters)
            table = self._table = self._tasktable.table
            self._pool = ThreadPoolExecutor(job.options.write_concurrency, "triage-replay-write")
            self._producer = Producer(self._producer_config())
            chunk: list[_Candidate] = []
            selected = table.scan(
                job.options.filters,
                segment=self._segment,
                total_segments=job.total_segments,
                page_size=SCAN_PAGE,
            )
            for item in selected:
                self.counts.selected += 1
                if self._replayable(item):
                    chunk.append(_Candidate(item))
                if len(chunk) >= job.options.chunk_size:
                    self._replay_chunk(chunk)
                    chunk = []
            if chunk:
                self._replay_chunk(chunk)
        except Exception as exc:  # the task's top level: report, do not fail the Spark task
            logger.exception("replay of segment %d stopped early", self._segment)
            self.counts.error = f"segment {self._segment}: {type(exc).__name__}: {exc}"
        finally:
            if self._pool is not None:
                self._pool.shutdown()
            if self._tasktable is not None:
                self.counts.read = self._tasktable.scanned
                self._tasktable.close()
        return self.counts

    def _producer_config(self) -> dict[str, str | int | bool | float]:
        job = self._job
        assert job.options.bootstrap is not None
        return {
            "bootstrap.servers": job.options.bootstrap,
            "enable.idempotence": True,  # librdkafka's own retries never duplicate
            "linger.ms": 5,
            "message.timeout.ms": int(job.options.delivery_timeout_s * 1000),
            "partitioner": "murmur2_random",  # the Java client's choice, for --to-topic
            **dict(job.options.kafka_config),
        }

    def _replayable(self, item: Mapping[str, Any]) -> bool:
        """Whether to try to claim `item`; if not, it is counted as skipped or in doubt."""
        if item["status"]["S"] != STATUS_PENDING:
            self.counts.skipped += 1
            return False
        claimant = item.get(CLAIM_ATTR, {}).get("S")
        if claimant is None:
            return True
        # Claimed by another run (or an earlier attempt of this one): it is producing the
        # item right now, or it stopped midway and the item may be in Kafka already.
        # DeadLetterTable.claim would take a stale claim over; this job only does when asked.
        until = int(item.get(CLAIM_UNTIL_ATTR, {}).get("N", "0"))
        stale = claimant != self._job.replay_id and until < self._now_ms()
        if stale and self._job.options.retry_in_doubt:
            return True
        self.counts.in_doubt += 1
        return False

    def _replay_chunk(self, chunk: list[_Candidate]) -> None:
        outcomes = self._each(self._claim, chunk)
        claimed: list[_Candidate] = []
        error: BaseException | None = None
        for candidate, outcome in zip(chunk, outcomes, strict=True):
            if outcome is _Claim.LOST:
                self.counts.skipped += 1  # changed since the scan: someone else has it
            elif outcome is _Claim.UNREADABLE:
                self.counts.failed += 1
            else:
                if isinstance(outcome, BaseException):
                    error = error or outcome  # the claim may or may not have landed
                candidate.state = _State.CLAIMED
                claimed.append(candidate)
        try:
            if error is not None:
                raise error
            self._produce(claimed)
        finally:
            self._settle(claimed)

    def _claim(self, candidate: _Candidate) -> _Claim:
        table = self._table
        assert table is not None
        if not table.claim(
            candidate.key, self._job.replay_id, lease_s=self._job.options.claim_lease_s
        ):
            return _Claim.LOST
        try:
            candidate.dl = table.load(candidate.item)
        except ValueError:
            logger.warning(
                "segment %d: the payload of %s/%d/%d is unreadable; released",
                self._segment,
                *candidate.key,
            )
            table.release(candidate.key, self._job.replay_id)
            return _Claim.UNREADABLE
        return _Claim.TAKEN

    def _produce(self, claimed: Sequence[_Candidate]) -> None:
        job = self._job
        producer = self._producer
        assert producer is not None
        for candidate in claimed:
            dl = candidate.dl
            assert dl is not None
            record = dl.record
            topic = job.options.to_topic or record.topic
            kwargs: dict[str, Any] = {
                "key": record.key,
                "value": record.value,
                "headers": replay_headers(dl, job.replay_id),
                "on_delivery": candidate.on_delivery,
            }
            if topic == record.topic:  # back where it came from: same partition
                kwargs["partition"] = record.partition
            while True:
                try:
                    producer.produce(topic, **kwargs)
                    break
                except BufferError:  # the local queue is full: serve reports, try again
                    producer.poll(0.05)
            candidate.state = _State.SENT
            self._sent += 1
            fault = job.options.fault
            if fault is not None and not fault.crash and self._sent == fault.after:
                raise InjectedFault(f"injected fault after {self._sent} messages")
        producer.poll(0)

    def _settle(self, claimed: Sequence[_Candidate]) -> None:
        """Mark what was delivered, release what was certainly not sent, count the rest."""
        job = self._job
        producer = self._producer
        sent = producer is not None and any(c.state is _State.SENT for c in claimed)
        if sent and producer is not None and producer.flush(job.options.delivery_timeout_s + 5) > 0:
            producer.purge(in_queue=True, in_flight=False)  # queued ones: never sent
            producer.flush(5)
        fault = job.options.fault
        if fault is not None and fault.crash and self._sent >= fault.after:
            os._exit(CRASH_EXIT_CODE)  # delivered, not yet marked: the worst moment
        delivered = [c for c in claimed if c.state is _State.DELIVERED]
        unsent = [c for c in claimed if c.state in (_State.CLAIMED, _State.NOT_SENT)]
        counts = self.counts
        counts.in_doubt += len(claimed) - len(delivered) - len(unsent)
        for candidate, outcome in zip(delivered, self._each(self._mark, delivered), strict=True):
            if outcome is True:
                counts.replayed += 1
            elif outcome is False:
                counts.replayed += 1
                logger.warning(
                    "segment %d: %s/%d/%d was replayed but its claim was taken over; not marked",
                    self._segment,
                    *candidate.key,
                )
            else:
                counts.in_doubt += 1  # in Kafka, still claimed: never produced again
        for outcome in self._each(self._release, unsent):
            if outcome is True:
                counts.failed += 1
            elif outcome is False:
                counts.skipped += 1  # the claim never landed or was taken over
            else:
                counts.in_doubt += 1  # maybe still claimed until the lease runs out

    def _mark(self, candidate: _Candidate) -> bool:
        assert self._table is not None
        return self._table.mark_replayed(
            candidate.key, self._job.replay_id, candidate.replayed_to, candidate.item
        )

    def _release(self, candidate: _Candidate) -> bool:
        assert self._table is not None
        return self._table.release(candidate.key, self._job.replay_id)

    def _each(self, fn: Callable[[T], Any], items: Sequence[T]) -> list[Any]:
        """fn over items on the write pool; each outcome is its result or its exception."""
        assert self._pool is not None
        futures = [self._pool.submit(fn, item) for item in items]
        outcomes: list[Any] = []
        for future in futures:
            exc = future.exception()
            outcomes.append(exc if exc is not None else future.result())
        return outcomes


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
        opened = TaskTable(job.options.dead_letters)
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
