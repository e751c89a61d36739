"""The dead-letter writer: a nacked message is durable in DynamoDB before its offset settles.

Why: a dead letter takes the place of its message in Kafka, so the commit tracker may
move past the offset only once the table holds the message byte-exact. The writer
reports an item (``on_written``) strictly after DynamoDB accepted it. While DynamoDB is
down or throttling it keeps every item and retries forever with capped exponential
backoff; the offsets then simply do not commit and the in-flight window eventually
pauses fetching. Nothing is dropped, nothing is reported written that was not.

Writes go through `DeadLetterStore`, a small sync Protocol with the real
`DynamoDBStore` (BatchWriteItem, up to 25 items a call) and the in-memory
`MemoryStore` for unit tests. `DeadLetterWriter` batches submissions, runs
`put_batch` in worker threads (up to `DEFAULT_MAX_IN_FLIGHT` batches at once) and
retries what was not written.

Item schema (one item per dead message; writing the same message again overwrites it):

| attribute          | type | content                                                       |
|--------------------|------|---------------------------------------------------------------|
| `source`           | S    | partition key: `<topic>#<partition>` (no `#` in topic names)  |
| `offset`           | N    | sort key: the message's offset                                |
| `topic`            | S    | source topic                                                  |
| `partition`        | N    | source partition                                              |
| `key`              | B    | message key; absent when null                                 |
| `value`            | B    | message value; absent when null (tombstone)                   |
| `headers`          | L    | of M {`k`: S, `v`: B, no `v` if null}, in order; absent if () |
| `timestamp_ms`     | N    | Kafka timestamp, ms since the epoch                           |
| `reason`           | S    | the consumer's nack reason or the proxy's own cause           |
| `attempts`         | N    | deliveries before it was dead-lettered                        |
| `consumer_id`      | S    | instance that settled it last (empty if none)                 |
| `dead_lettered_at` | S    | ISO-8601 UTC with ms and Z, e.g. `2024-05-01T12:00:00.123Z`   |
| `status`           | S    | `pending` when written (replay: `replayed`, `discarded`)      |

Byte strings may be empty (then present, unlike null); headers keep duplicates and order.
`dead_letter_from_item` inverts `item_from_dead_letter` exactly (an empty `headers` list
reads as no headers).

Items over DynamoDB's 400 KB limit (`MAX_ITEM_BYTES`, counted the way DynamoDB
counts, rounded up): until large payloads move to S3, such a dead letter can never be
written, and writing it truncated or without its value would lose data. So the writer
never sends it (one oversized item would fail its whole batch forever); it logs ERROR
once, counts it in `too_large`, and holds it as pending for good. Its offset never
commits, the window stalls behind it after `window.max_messages`, and a restart
redelivers it: no loss, loudly visible. `item_from_dead_letter` raises
`DeadLetterTooLarge` for such a record so no other caller can send it either.

Shutdown of the writer (`stop()`): stop taking batches -> let the `put_batch` calls in
flight finish and report what they wrote (no further retries) -> cancel only what
outlives `stop_timeout_s`. Whatever is still unwritten stays pending: its offsets do
not commit and Kafka redelivers it after a restart. Call `flush(timeout)` first to
write what can be written.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import ipaddress
import logging
import random
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from triage_proxy.errors import (
    ConfigError,
    DeadLetterTooLarge,
    DeadLetterUnavailable,
    StateError,
)
from triage_proxy.settings import DEFAULT_DLQ_BATCH, DeadLetterSettings
from triage_proxy.structs import DeadLetter, Record

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.client import DynamoDBClient

logger = logging.getLogger(__name__)

MAX_BATCH = DEFAULT_DLQ_BATCH
"""Most items one BatchWriteItem call takes."""
MAX_ITEM_BYTES = 400_000
"""DynamoDB's item limit ("400 KB"), taken at its smallest reading; moto allows 405,000."""
DEFAULT_MAX_IN_FLIGHT = 4
"""Batches being written at once."""
DEFAULT_STOP_TIMEOUT_S = 10.0
"""How long stop() lets in-flight writes finish before cancelling them."""
RETRY_BASE_S = 0.05
"""First backoff after a failed write; doubles per consecutive failure up to retry_max_s."""
DEFAULT_CONNECT_TIMEOUT_S = 2.0
DEFAULT_READ_TIMEOUT_S = 5.0
DEFAULT_BOTO_ATTEMPTS = 2
"""botocore's own attempts per call (ours retry forever above it)."""
STATUS_PENDING = "pending"
LOCAL_CREDENTIALS = ("triage-local", "triage-local")
"""Placeholder key pair for a loopback endpoint (moto accepts any credentials)."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ISO_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"

Sleep = Callable[[float], Awaitable[None]]
DeadLetterKey = tuple[str, int, int]
"""(topic, partition, offset): what identifies a dead letter (and its item)."""


# --- the item format ------------------------------------------------------------------


def dead_letter_key(dl: DeadLetter) -> DeadLetterKey:
    """(topic, partition, offset) of a dead letter."""
    return (dl.record.topic, dl.record.partition, dl.record.offset)


def item_from_dead_letter(dl: DeadLetter) -> dict[str, Any]:
    """The DynamoDB item (low-level attribute values); DeadLetterTooLarge if over the limit."""
    item = _build_item(dl)
    size = _item_size(item)
    if size > MAX_ITEM_BYTES:
        raise DeadLetterTooLarge(dead_letter_key(dl), size, MAX_ITEM_BYTES)
    return item


def item_size(dl: DeadLetter) -> int:
    """Bytes the item takes by DynamoDB's accounting (an upper bound; numbers rounded up)."""
    return _item_size(_build_item(dl))


def dead_letter_from_item(item: Mapping[str, Any]) -> DeadLetter:
    """Inverse of item_from_dead_letter: the same bytes, headers and times back."""
    headers: list[tuple[str, bytes | None]] = []
    for entry in item.get("headers", {}).get("L", []):
        header = entry["M"]
        headers.append((header["k"]["S"], _binary(header["v"]) if "v" in header else None))
    record = Record(
        topic=item["topic"]["S"],
        partition=int(item["partition"]["N"]),
        offset=int(item["offset"]["N"]),
        key=_binary(item["key"]) if "key" in item else None,
        value=_binary(item["value"]) if "value" in item else None,
        headers=tuple(headers),
        timestamp_ms=int(item["timestamp_ms"]["N"]),
    )
    return DeadLetter(
        record=record,
        reason=item["reason"]["S"],
        attempts=int(item["attempts"]["N"]),
        consumer_id=item["consumer_id"]["S"],
        dead_lettered_at_ms=_parse_iso_ms(item["dead_lettered_at"]["S"]),
    )


def format_iso_ms(ms: int) -> str:
    """ms since the epoch as ISO-8601 UTC with milliseconds and 'Z'."""
    stamp = (_EPOCH + timedelta(milliseconds=ms)).isoformat(timespec="milliseconds")
    return stamp.removesuffix("+00:00") + "Z"


def _parse_iso_ms(text: str) -> int:
    moment = datetime.strptime(text, _ISO_FORMAT).replace(tzinfo=UTC)
    return (moment - _EPOCH) // timedelta(milliseconds=1)


def _binary(attr: Mapping[str, Any]) -> bytes:
    return bytes(attr["B"])


def _build_item(dl: DeadLetter) -> dict[str, Any]:
    record = dl.record
    item: dict[str, Any] = {
        "source": {"S": f"{record.topic}#{record.partition}"},
        "offset": {"N": str(record.offset)},
        "topic": {"S": record.topic},
        "partition": {"N": str(record.partition)},
        "timestamp_ms": {"N": str(record.timestamp_ms)},
        "reason": {"S": dl.reason},
        "attempts": {"N": str(dl.attempts)},
        "consumer_id": {"S": dl.consumer_id},
        "dead_lettered_at": {"S": format_iso_ms(dl.dead_lettered_at_ms)},
        "status": {"S": STATUS_PENDING},
    }
    if record.key is not None:
        item["key"] = {"B": record.key}
    if record.value is not None:
        item["value"] = {"B": record.value}
    if record.headers:
        headers: list[dict[str, Any]] = []
        for name, value in record.headers:
            header: dict[str, Any] = {"k": {"S": name}}
            if value is not None:
                header["v"] = {"B": value}
            headers.append({"M": header})
        item["headers"] = {"L": headers}
    return item


def _item_size(item: Mapping[str, Any]) -> int:
    return sum(len(name.encode()) + _value_size(value) for name, value in item.items())


def _value_size(attr: Mapping[str, Any]) -> int:
    """DynamoDB's size rules: S as UTF-8, B raw, N at most its digits + 1, L/M 3 + 1 each."""
    ((kind, value),) = attr.items()
    if kind == "S":
        return len(value.encode())
    if kind == "B":
        return len(value)
    if kind == "N":
        return len(value) + 1
    if kind == "L":
        return 3 + sum(1 + _value_size(v) for v in value)
    if kind == "M":
        return 3 + sum(1 + len(k.encode()) + _value_size(v) for k, v in value.items())
    raise ValueError(f"attribute type {kind!r} is not used in dead-letter items")


# --- stores ---------------------------------------------------------------------------


class DeadLetterStore(Protocol):
    """Where dead letters go; sync, called from a worker thread."""

    def put_batch(self, items: Sequence[DeadLetter]) -> list[DeadLetter]:
        """Write up to 25 items with distinct keys; return those NOT written.

        Raises DeadLetterUnavailable when the store is unreachable, throttles or errors.
        """
        ...


class DynamoDBStore:
    """The real store: BatchWriteItem against the table in DeadLetterSettings.

    Timeouts are short and botocore retries little, since the writer retries forever
    above it. A loopback endpoint_url (moto, for `triage dev` and tests) gets
    placeholder credentials; anything else uses boto3's usual credential chain.
    Close it (or use it as a context manager) to release its connections.
    """

    def __init__(
        self,
        settings: DeadLetterSettings,
        *,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        max_attempts: int = DEFAULT_BOTO_ATTEMPTS,
    ) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        self.table = settings.table
        self._errors = (BotoCoreError, ClientError)
        self._client = dynamodb_client(
            settings,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            max_attempts=max_attempts,
        )

    def put_batch(self, items: Sequence[DeadLetter]) -> list[DeadLetter]:
        """One BatchWriteItem call; returns the UnprocessedItems as DeadLetters."""
        _check_batch(items)
        if not items:
            return []
        by_key: dict[tuple[str, str], DeadLetter] = {}
        requests: list[Any] = []
        for dl in items:
            item = item_from_dead_letter(dl)
            by_key[(item["source"]["S"], item["offset"]["N"])] = dl
            requests.append({"PutRequest": {"Item": item}})
        try:
            response = self._client.batch_write_item(RequestItems={self.table: requests})
        except self._errors as exc:
            raise DeadLetterUnavailable(
                f"BatchWriteItem on table {self.table!r} failed: {_describe(exc)}"
            ) from exc
        unprocessed = response.get("UnprocessedItems", {}).get(self.table, [])
        unwritten: list[DeadLetter] = []
        for request in unprocessed:
            item = request.get("PutRequest", {}).get("Item", {})
            found = by_key.get((item["source"]["S"], item["offset"]["N"]))
            if found is not None:
                unwritten.append(found)
        return unwritten

    def close(self) -> None:
        """Close the HTTP connections; safe twice."""
        self._client.close()

    def __enter__(self) -> DynamoDBStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class MemoryStore:
    """In-memory twin of DynamoDBStore for unit tests; thread-safe.

    `items` maps (source, offset) to the item as DynamoDB would hold it. Tests can make
    the next calls fail (`fail_next`), leave items unprocessed (`leave_unprocessed`),
    or hold calls in flight by clearing `gate`.
    """

    def __init__(self) -> None:
        self.items: dict[tuple[str, int], dict[str, Any]] = {}
        """Written items by (source, offset)."""
        self.calls: list[int] = []
        """Size of every put_batch call, failed ones included, in call order."""
        self.gate = threading.Event()
        """put_batch waits for this before doing anything; set unless a test clears it."""
        self.max_concurrent = 0
        """Most put_batch calls seen running at once."""
        self.gate.set()
        self._lock = threading.Lock()
        self._active = 0
        self._fail = 0
        self._unprocessed: collections.deque[int] = collections.deque()

    def fail_next(self, calls: int) -> None:
        """The next `calls` put_batch calls raise DeadLetterUnavailable (0 heals the store)."""
        with self._lock:
            self._fail = calls

    def leave_unprocessed(self, count: int, calls: int = 1) -> None:
        """Each of the next `calls` successful calls leaves its last `count` items unwritten."""
        with self._lock:
            self._unprocessed.extend([count] * calls)

    def dead_letters(self) -> list[DeadLetter]:
        """Every written item decoded, by (source, offset)."""
        with self._lock:
            return [dead_letter_from_item(self.items[k]) for k in sorted(self.items)]

    def put_batch(self, items: Sequence[DeadLetter]) -> list[DeadLetter]:
        """Write items like BatchWriteItem would, unless told to fail or leave some."""
        _check_batch(items)
        built = [item_from_dead_letter(dl) for dl in items]
        with self._lock:
            self.calls.append(len(items))
            self._active += 1
            self.max_concurrent = max(self.max_concurrent, self._active)
        try:
            self.gate.wait()
            with self._lock:
                if self._fail > 0:
                    self._fail -= 1
                    left = -1
                else:
                    left = min(len(items), self._unprocessed.popleft() if self._unprocessed else 0)
                    for item in built[: len(items) - left]:
                        self.items[(item["source"]["S"], int(item["offset"]["N"]))] = item
        finally:
            with self._lock:
                self._active -= 1
        if left < 0:
            raise DeadLetterUnavailable("memory store told to fail")
        return list(items[len(items) - left :])


def _check_batch(items: Sequence[DeadLetter]) -> None:
    """What DynamoDB rejects with ValidationException: a bug in the caller, never retried."""
    if len(items) > MAX_BATCH:
        raise ValueError(f"a batch holds at most {MAX_BATCH} items, got {len(items)}")
    if len({dead_letter_key(dl) for dl in items}) != len(items):
        raise ValueError("a batch must not hold two items with the same key")


def _describe(exc: BaseException) -> str:
    """An error's code and message, no request content (never payloads)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error = response.get("Error", {})
        return f"{error.get('Code', type(exc).__name__)}: {error.get('Message', '')}"
    return f"{type(exc).__name__}: {exc}"


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def dynamodb_client(
    settings: DeadLetterSettings,
    *,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    max_attempts: int = DEFAULT_BOTO_ATTEMPTS,
) -> DynamoDBClient:
    """A boto3 DynamoDB client with short timeouts; placeholder credentials on loopback."""
    import boto3
    from botocore.config import Config

    config = Config(
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        retries={"mode": "standard", "total_max_attempts": max_attempts},
    )
    access_key: str | None = None
    secret_key: str | None = None
    if settings.endpoint_url is not None and _is_loopback(settings.endpoint_url):
        access_key, secret_key = LOCAL_CREDENTIALS
    return boto3.session.Session().client(
        "dynamodb",
        region_name=settings.region,
        endpoint_url=settings.endpoint_url,
        config=config,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
    )


_KEY_SCHEMA = [("source", "HASH"), ("offset", "RANGE")]


def create_table(settings: DeadLetterSettings, *, timeout_s: float = 120.0) -> None:
    """Create the dead-letter table (on-demand) unless it exists; wait until it is ACTIVE.

    Raises ConfigError if a table of that name exists with another key schema, and
    DeadLetterUnavailable if DynamoDB cannot be reached or refuses.
    """
    from botocore.exceptions import BotoCoreError, ClientError

    client = dynamodb_client(settings)
    try:
        try:
            client.create_table(
                TableName=settings.table,
                KeySchema=[
                    {"AttributeName": "source", "KeyType": "HASH"},
                    {"AttributeName": "offset", "KeyType": "RANGE"},
                ],
                AttributeDefinitions=[
                    {"AttributeName": "source", "AttributeType": "S"},
                    {"AttributeName": "offset", "AttributeType": "N"},
                ],
                BillingMode="PAY_PER_REQUEST",
            )
            logger.info("created dead-letter table %s", settings.table)
        except client.exceptions.ResourceInUseException:
            logger.debug("dead-letter table %s already exists", settings.table)
        client.get_waiter("table_exists").wait(
            TableName=settings.table,
            WaiterConfig={"Delay": 1, "MaxAttempts": max(1, int(timeout_s))},
        )
        schema = client.describe_table(TableName=settings.table)["Table"].get("KeySchema", [])
    except (BotoCoreError, ClientError) as exc:
        raise DeadLetterUnavailable(
            f"creating table {settings.table!r} failed: {_describe(exc)}"
        ) from exc
    finally:
        client.close()
    found = [(k["AttributeName"], k["KeyType"]) for k in schema]
    if found != _KEY_SCHEMA:
        raise ConfigError(
            "dead_letters.table",
            f"table {settings.table!r} has key schema {found}, expected {_KEY_SCHEMA}",
        )


# --- the writer -----------------------------------------------------------------------


def backoff_delay(
    failures: int, cap: float, *, base: float = RETRY_BASE_S, rand: float = 1.0
) -> float:
    """Pause before the next try after `failures` consecutive failed writes (>= 1).

    base * 2**(failures-1), capped at `cap`, then scaled into [half, all] of itself by
    `rand` in [0, 1] ("equal jitter", so many proxies do not retry in step).
    """
    full = min(cap, base * 2.0 ** min(max(failures, 1) - 1, 64))
    return full * (0.5 + 0.5 * rand)


class WriterState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(slots=True)
class _Entry:
    seq: int
    """Submission order; flush() waits for every seq below its mark."""
    dl: DeadLetter
    key: DeadLetterKey


class DeadLetterWriter:
    """Batches dead letters into the store and reports each once it is durable."""

    def __init__(
        self,
        store: DeadLetterStore,
        settings: DeadLetterSettings,
        on_written: Callable[[DeadLetter], None],
        *,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
        sleep: Sleep = asyncio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if not 1 <= settings.batch_size <= MAX_BATCH:
            raise ConfigError("dead_letters.batch_size", f"must be 1..{MAX_BATCH}")
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self._store = store
        self._settings = settings
        self._on_written = on_written
        self._stop_timeout_s = stop_timeout_s
        self._sleep = sleep
        self._rand = rand
        self._state = WriterState.NEW
        self._task: asyncio.Task[None] | None = None
        self._slots = asyncio.Semaphore(max_in_flight)
        self._closing = asyncio.Event()
        self._wakeup = asyncio.Event()
        self._stopped = asyncio.Event()
        self._progress = asyncio.Event()
        self._queue: collections.deque[_Entry] = collections.deque()
        self._outstanding: collections.OrderedDict[int, None] = collections.OrderedDict()
        """Seqs submitted, writable and not yet written, oldest first."""
        self._parked: list[int] = []
        """Seqs of dead letters too large to ever write, in order."""
        self._next_seq = 0
        self._written = 0
        self._failed_writes = 0
        self._degraded_since: float | None = None

    # --- lifecycle ------------------------------------------------------------------

    @property
    def state(self) -> WriterState:
        return self._state

    async def start(self) -> None:
        """Launch the background task; a writer starts once."""
        if self._state is not WriterState.NEW:
            raise StateError(f"dead-letter writer already {self._state.value}")
        self._task = asyncio.create_task(self._run(), name="dead-letter-writer")
        self._state = WriterState.RUNNING
        logger.info(
            "dead-letter writer started: table=%s batch=%d flush=%dms",
            self._settings.table,
            self._settings.batch_size,
            self._settings.flush_interval_ms,
        )

    async def stop(self) -> None:
        """Finish in-flight writes (no new batches, no retries), then end; safe twice.

        Re-raises an unexpected error of the background task (a bug, e.g. in on_written).
        """
        if self._state is WriterState.NEW:
            self._state = WriterState.STOPPED
            self._stopped.set()
            return
        if self._state is WriterState.STOPPING:
            await self._stopped.wait()
            return
        if self._state is WriterState.STOPPED:
            return
        task = self._task
        assert task is not None
        self._state = WriterState.STOPPING
        logger.debug("dead-letter writer stopping: finishing writes in flight")
        self._closing.set()
        self._wakeup.set()
        try:
            done, _ = await asyncio.wait({task}, timeout=self._stop_timeout_s)
            if not done:
                logger.warning(
                    "dead-letter writes outlived the %.1fs stop timeout; cancelling them",
                    self._stop_timeout_s,
                )
                task.cancel()
                await asyncio.wait({task})
        finally:
            self._state = WriterState.STOPPED
            self._stopped.set()
            self._notify()
        logger.info(
            "dead-letter writer stopped: %d written, %d left unwritten (offsets stay uncommitted)",
            self._written,
            self.pending,
        )
        if not task.cancelled() and (exc := task.exception()) is not None:
            raise exc

    async def __aenter__(self) -> DeadLetterWriter:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # --- the API --------------------------------------------------------------------

    def submit(self, dl: DeadLetter) -> None:
        """Queue `dl` for writing; never blocks, never drops. Call on the event loop thread.

        Raises StateError once the writer is stopping (nothing would write it).
        """
        if self._state in (WriterState.STOPPING, WriterState.STOPPED):
            raise StateError(f"dead-letter writer is {self._state.value}")
        seq = self._next_seq
        self._next_seq += 1
        size = item_size(dl)
        if size > MAX_ITEM_BYTES:
            self._parked.append(seq)
            topic, partition, offset = dead_letter_key(dl)
            logger.error(
                "dead letter %s[%d]@%d needs %d bytes, over DynamoDB's item limit of %d: "
                "holding it unwritten, so its offset will not commit (large payloads need S3)",
                topic,
                partition,
                offset,
                size,
                MAX_ITEM_BYTES,
            )
            return
        self._outstanding[seq] = None
        self._queue.append(_Entry(seq, dl, dead_letter_key(dl)))
        self._wakeup.set()

    @property
    def pending(self) -> int:
        """Dead letters submitted but not yet durably written (too-large ones included)."""
        return len(self._outstanding) + len(self._parked)

    @property
    def written(self) -> int:
        """Dead letters written and reported so far."""
        return self._written

    @property
    def too_large(self) -> int:
        """Dead letters held because they exceed DynamoDB's item limit."""
        return len(self._parked)

    @property
    def degraded(self) -> bool:
        """True while writes are failing or being throttled."""
        return self._degraded_since is not None

    async def flush(self, timeout: float) -> bool:  # noqa: ASYNC109 (API: flush(timeout=))
        """Wait until everything submitted so far is written; False on timeout.

        Also False at once when the writer is not running (nothing would progress), and
        as soon as only too-large dead letters are left among those submitted.
        """
        mark = self._next_seq
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._outstanding and next(iter(self._outstanding)) < mark:
            if self._state is not WriterState.RUNNING or self._task is None or self._task.done():
                return False
            progress = self._progress
            try:
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await progress.wait()
            except TimeoutError:
                return False
        return not (self._parked and self._parked[0] < mark)

    # --- the background task --------------------------------------------------------

    def _notify(self) -> None:
        """Wake every flush() waiter: something was written or the state changed."""
        self._progress.set()
        self._progress = asyncio.Event()

    async def _run(self) -> None:
        try:
            async with asyncio.TaskGroup() as writes:
                while True:
                    await self._slots.acquire()
                    batch = await self._next_batch()
                    if batch is None:
                        self._slots.release()
                        break
                    writes.create_task(self._write(batch), name="dead-letter-batch")
        finally:
            self._notify()

    async def _next_batch(self) -> list[_Entry] | None:
        """Up to batch_size entries, waiting at most flush_interval_ms to fill; None to end."""
        queue = self._queue
        while not queue:
            if self._closing.is_set():
                return None
            self._wakeup.clear()
            await self._wakeup.wait()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settings.flush_interval_ms / 1000
        while len(queue) < self._settings.batch_size and not self._closing.is_set():
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._wakeup.wait()
        if self._closing.is_set():
            return None
        batch: list[_Entry] = []
        keys: set[DeadLetterKey] = set()
        later: list[_Entry] = []
        while queue and len(batch) < self._settings.batch_size:
            entry = queue.popleft()
            if entry.key in keys:  # one key twice in a batch fails the whole call
                later.append(entry)
            else:
                keys.add(entry.key)
                batch.append(entry)
        queue.extendleft(reversed(later))
        return batch

    async def _write(self, batch: list[_Entry]) -> None:
        """Write one batch until every entry is written or the writer stops."""
        try:
            todo = batch
            failures = 0
            while True:
                try:
                    unwritten = await asyncio.to_thread(self._store.put_batch, [e.dl for e in todo])
                except DeadLetterUnavailable as exc:
                    left, problem = todo, str(exc)
                else:
                    left = self._settle(todo, unwritten)
                    if not left:
                        self._recovered()
                        return
                    problem = f"{len(left)} of {len(todo)} items unprocessed (throttled)"
                failures += 1
                self._degrade(problem)
                if self._closing.is_set():
                    return  # stopping: `left` stays pending and its offsets uncommitted
                await self._pause(
                    backoff_delay(failures, self._settings.retry_max_s, rand=self._rand())
                )
                if self._closing.is_set():
                    return
                todo = left
        finally:
            self._slots.release()

    def _settle(self, todo: list[_Entry], unwritten: Sequence[DeadLetter]) -> list[_Entry]:
        """Report the written entries; return the ones still to write."""
        missing = {dead_letter_key(dl) for dl in unwritten}
        left: list[_Entry] = []
        written: list[_Entry] = []
        for entry in todo:
            if entry.key in missing:
                left.append(entry)
            else:
                del self._outstanding[entry.seq]
                written.append(entry)
        self._written += len(written)
        try:
            for entry in written:
                self._on_written(entry.dl)
        finally:
            if written:
                self._notify()
        return left

    def _degrade(self, problem: str) -> None:
        self._failed_writes += 1
        if self._degraded_since is None:
            self._degraded_since = asyncio.get_running_loop().time()
            logger.warning(
                "dead-letter writes failing, retrying with backoff up to %.1fs "
                "(%d pending, offsets held): %s",
                self._settings.retry_max_s,
                self.pending,
                problem,
            )

    def _recovered(self) -> None:
        if self._degraded_since is None:
            return
        elapsed = asyncio.get_running_loop().time() - self._degraded_since
        logger.info(
            "dead-letter writes recovered after %.1fs and %d failed attempts (%d pending)",
            elapsed,
            self._failed_writes,
            self.pending,
        )
        self._degraded_since = None
        self._failed_writes = 0

    async def _pause(self, delay: float) -> None:
        """Sleep `delay` (through the injectable sleep), cut short when stop() is called."""
        sleeper = asyncio.ensure_future(self._sleep(delay))
        closer = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait((sleeper, closer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            closer.cancel()
            await asyncio.wait((sleeper, closer))
        if not sleeper.cancelled():
            sleeper.result()
