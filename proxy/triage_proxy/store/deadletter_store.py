"""The dead-letter store: idempotent batched writes of dead-letter items (and S3 payloads).

Why a store of its own: the proxy's writer (`triage_proxy.deadletters.writer`) needs one sync
call, `put_batch`, that either makes items durable or says which were not, with an
in-memory twin (`MemoryStore`) for unit tests. Everything about how that happens in
DynamoDB and S3 is here.

Idempotent writes: a write never clobbers an item that is `replayed`, `discarded` or
claimed by a running replay (otherwise a retried write, or a message redelivered after
a proxy restart and dead-lettered again, would turn a replayed item back to `pending`
and the next replay would produce it twice). BatchWriteItem takes no conditions, and
TransactWriteItems costs twice the write units and caps a call at 4 MB (fewer than ten
large items). So `DynamoDBStore.put_batch` first reads the batch's keys with one
consistent BatchGetItem (status and claim only), then
- writes the keys that do not exist with one BatchWriteItem (the common case),
- writes the keys that exist as unclaimed `pending` with a conditional PutItem each
  (`attribute_not_exists(status) OR (status = pending AND attribute_not_exists(claim))`,
  the same rule as the pure `writable`),
- leaves the others as they are and counts them written (the table holds the message).
A one-item batch is a single conditional PutItem. What is left unguarded: an item that
did not exist at the read and was both created by another writer and replayed in the
milliseconds before our BatchWriteItem lands.

Every item a store writes belongs to its deployment (`group`, the proxy's
`kafka.group_id`): the key and the `group` attribute say so (`items.py`), so another
deployment's item for the same offset is neither overwritten nor taken for ours.

Large payloads: an item over DynamoDB's limit keeps its key, value and headers in one S3
object (`<table>/<topic>/<partition>/<offset>/<group>` in `dead_letters.overflow_bucket`, format
in `payload.py`), written before the item that points to it, so a pointer never dangles.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from triage_proxy.config.sections import DEFAULT_DLQ_BATCH, DeadLetterSettings
from triage_proxy.errors import DeadLetterUnavailable
from triage_proxy.store.aws import (
    ANY_CODE,
    CONDITION_FAILED,
    DEFAULT_BOTO_ATTEMPTS,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_READ_TIMEOUT_S,
    aws_errors,
    dynamodb_client,
    s3_client,
)
from triage_proxy.store.items import (
    CLAIM_ATTR,
    MAX_ITEM_BYTES,
    PAYLOAD_S3_ATTR,
    STATUS_PENDING,
    check_group,
    dead_letter_from_item,
    dead_letter_key,
    dead_letter_source,
    dead_letter_with_payload,
    item_from_dead_letter,
    item_size,
    pointer_item,
    table_key,
)
from triage_proxy.store.payload import encode_payload, parse_s3_url, payload_object_key
from triage_proxy.structs import DeadLetter

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

logger = logging.getLogger(__name__)

MAX_BATCH = DEFAULT_DLQ_BATCH
"""Most items one BatchWriteItem call takes."""
MEMORY_GROUP = "triage-test"
"""The deployment of a `MemoryStore` built without one (unit tests)."""

_WRITE_CONDITION = "attribute_not_exists(#s) OR (#s = :pending AND attribute_not_exists(#c))"
"""What a write may replace: nothing, or a pending item no replay has claimed."""
_WRITE_NAMES = {"#s": "status", "#c": CLAIM_ATTR}
_WRITE_VALUES = {":pending": {"S": STATUS_PENDING}}


class DeadLetterStore(Protocol):
    """Where dead letters go; sync, called from a worker thread."""

    group: str
    """The deployment whose items it writes (sizes depend on it: `items.item_size`)."""

    def put_batch(self, items: Sequence[DeadLetter]) -> list[DeadLetter]:
        """Write up to 25 items with distinct keys; return those NOT written.

        Raises DeadLetterUnavailable when the store is unreachable, throttles or errors.
        """
        ...


def writable(existing: Mapping[str, Any] | None) -> bool:
    """Whether a write may replace `existing` (None: no item); the write condition, pure."""
    if existing is None or "status" not in existing:
        return True
    return existing["status"].get("S") == STATUS_PENDING and CLAIM_ATTR not in existing


class DynamoDBStore:
    """The real store: idempotent batched writes to the table in DeadLetterSettings.

    See the module docstring for the write path (BatchGetItem, then BatchWriteItem for
    new keys and conditional PutItem for existing pending ones) and for S3 overflow.
    Timeouts are short and botocore retries little, since the writer retries forever
    above it. A loopback endpoint_url (moto, for `triage dev` and tests) gets
    placeholder credentials; anything else uses boto3's usual credential chain.
    Close it (or use it as a context manager) to release its connections.
    """

    def __init__(
        self,
        settings: DeadLetterSettings,
        *,
        group: str,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        max_attempts: int = DEFAULT_BOTO_ATTEMPTS,
    ) -> None:
        self.table = settings.table
        self.group = check_group(group)
        self.bucket = settings.overflow_bucket
        self.kept = 0
        """Writes skipped because the item was already replayed, discarded or claimed."""
        self._client = dynamodb_client(
            settings,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            max_attempts=max_attempts,
        )
        self._s3: S3Client | None = None
        if self.bucket is not None:
            self._s3 = s3_client(
                settings,
                connect_timeout_s=connect_timeout_s,
                read_timeout_s=read_timeout_s,
                max_attempts=max_attempts,
            )
        self._lock = threading.Lock()

    def put_batch(self, items: Sequence[DeadLetter]) -> list[DeadLetter]:
        """Write `items` idempotently; return those NOT written (unprocessed or failed).

        Items found replayed, discarded or claimed are left as they are and count as
        written. Raises DeadLetterUnavailable when DynamoDB (or S3) does not answer.
        """
        _check_batch(items)
        if not items:
            return []
        if len(items) == 1:
            return self._put_conditional(items)
        existing, unread = self._read_states(items)
        fresh: list[DeadLetter] = []
        pending: list[DeadLetter] = []
        kept = 0
        for dl in items:
            key = self._item_key(dl)
            if key in unread:
                continue
            state = existing.get(key)
            if state is None:
                fresh.append(dl)
            elif writable(state):
                pending.append(dl)
            else:
                kept += 1
        self._count_kept(kept)
        unwritten = [dl for dl in items if self._item_key(dl) in unread]
        unwritten.extend(self._batch_write(fresh))
        unwritten.extend(self._put_conditional(pending))
        return unwritten

    def _read_states(
        self, items: Sequence[DeadLetter]
    ) -> tuple[dict[tuple[str, str], dict[str, Any]], set[tuple[str, str]]]:
        """Status and claim of every key (consistent read); also the keys left unread."""
        keys = [self._item_key(dl) for dl in items]
        request: Any = {
            self.table: {
                "Keys": [table_key(s, int(o)) for s, o in keys],
                "ConsistentRead": True,
                "ProjectionExpression": "#src, #o, #s, #c",
                "ExpressionAttributeNames": {
                    "#src": "source",
                    "#o": "offset",
                    "#s": "status",
                    "#c": CLAIM_ATTR,
                },
            }
        }
        with aws_errors(f"BatchGetItem on table {self.table!r}", DeadLetterUnavailable):
            response = self._client.batch_get_item(RequestItems=request)
        found = {
            (i["source"]["S"], i["offset"]["N"]): dict(i)
            for i in response.get("Responses", {}).get(self.table, [])
        }
        left: Any = response.get("UnprocessedKeys", {}).get(self.table, {})
        unread = {(k["source"]["S"], k["offset"]["N"]) for k in left.get("Keys", [])}
        return found, unread

    def _batch_write(self, items: Sequence[DeadLetter]) -> list[DeadLetter]:
        """One BatchWriteItem for keys known not to exist; returns the unprocessed ones."""
        if not items:
            return []
        by_key: dict[tuple[str, str], DeadLetter] = {}
        requests: list[Any] = []
        for dl in items:
            item = self._prepare(dl)
            by_key[self._item_key(dl)] = dl
            requests.append({"PutRequest": {"Item": item}})
        with aws_errors(f"BatchWriteItem on table {self.table!r}", DeadLetterUnavailable):
            response = self._client.batch_write_item(RequestItems={self.table: requests})
        unprocessed = response.get("UnprocessedItems", {}).get(self.table, [])
        unwritten: list[DeadLetter] = []
        for request in unprocessed:
            item = request.get("PutRequest", {}).get("Item", {})
            found = by_key.get((item["source"]["S"], item["offset"]["N"]))
            if found is not None:
                unwritten.append(found)
        return unwritten

    def _put_conditional(self, items: Sequence[DeadLetter]) -> list[DeadLetter]:
        """A conditional PutItem each; a lone item's failure raises, later ones are returned
        (an error without an AWS answer, e.g. a timeout, always raises)."""
        unwritten: list[DeadLetter] = []
        kept = 0
        for dl in items:
            item = self._prepare(dl)
            with aws_errors(
                f"PutItem on table {self.table!r}",
                DeadLetterUnavailable,
                expect=ANY_CODE if len(items) > 1 else {CONDITION_FAILED},
            ) as answer:
                self._client.put_item(
                    TableName=self.table,
                    Item=item,
                    ConditionExpression=_WRITE_CONDITION,
                    ExpressionAttributeNames=_WRITE_NAMES,
                    ExpressionAttributeValues=_WRITE_VALUES,
                )
            if answer.code == CONDITION_FAILED:
                kept += 1
            elif answer:
                unwritten.append(dl)
        self._count_kept(kept)
        return unwritten

    def _prepare(self, dl: DeadLetter) -> dict[str, Any]:
        """The item to write; uploads the payload to S3 first when it is too large inline."""
        group = self.group
        if self.bucket is None or self._s3 is None or item_size(dl, group) <= MAX_ITEM_BYTES:
            return item_from_dead_letter(dl, group)
        topic, partition, offset = dead_letter_key(dl)
        object_key = payload_object_key(self.table, topic, partition, offset, group)
        payload = encode_payload(dl.record)
        item = pointer_item(dl, group, self.bucket, object_key, len(payload))
        with aws_errors(f"PutObject s3://{self.bucket}/{object_key}", DeadLetterUnavailable):
            self._s3.put_object(
                Bucket=self.bucket,
                Key=object_key,
                Body=payload,
                ContentType="application/octet-stream",
            )
        return item

    def _item_key(self, dl: DeadLetter) -> tuple[str, str]:
        """(source, offset) of a dead letter's item as DynamoDB spells them."""
        record = dl.record
        return (dead_letter_source(record.topic, record.partition, self.group), str(record.offset))

    def _count_kept(self, kept: int) -> None:
        if not kept:
            return
        with self._lock:
            self.kept += kept
        logger.info(
            "%d dead letters already replayed, discarded or being replayed: kept as they are",
            kept,
        )

    def close(self) -> None:
        """Close the HTTP connections; safe twice."""
        self._client.close()
        if self._s3 is not None:
            self._s3.close()

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

    `items` maps (source, offset) to the item as DynamoDB would hold it; like the real
    store it leaves replayed, discarded and claimed items as they are (counted in
    `kept`), and with `overflow_bucket` keeps large payloads in `objects`. Tests can make
    the next calls fail (`fail_next`), leave items unprocessed (`leave_unprocessed`),
    or hold calls in flight by clearing `gate`.
    """

    def __init__(
        self,
        *,
        table: str = "dead-letters",
        overflow_bucket: str | None = None,
        group: str = MEMORY_GROUP,
    ) -> None:
        self.group = check_group(group)
        self.items: dict[tuple[str, int], dict[str, Any]] = {}
        """Written items by (source, offset)."""
        self.objects: dict[tuple[str, str], bytes] = {}
        """Large payloads by (bucket, key), like S3 would hold them."""
        self.kept = 0
        """Writes skipped because the item was already replayed, discarded or claimed."""
        self.table = table
        self.bucket = overflow_bucket
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
        """Every written item decoded (payloads from `objects`), by (source, offset)."""
        with self._lock:
            out = []
            for k in sorted(self.items):
                item = self.items[k]
                if PAYLOAD_S3_ATTR in item:
                    payload = self.objects[parse_s3_url(item[PAYLOAD_S3_ATTR]["S"])]
                    out.append(dead_letter_with_payload(item, payload))
                else:
                    out.append(dead_letter_from_item(item))
            return out

    def put_batch(self, items: Sequence[DeadLetter]) -> list[DeadLetter]:
        """Write items like DynamoDBStore would, unless told to fail or leave some."""
        _check_batch(items)
        built = [self._build(dl) for dl in items]
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
                    for item, upload in built[: len(items) - left]:
                        key = (item["source"]["S"], int(item["offset"]["N"]))
                        if not writable(self.items.get(key)):
                            self.kept += 1
                            continue
                        if upload is not None:
                            self.objects[upload[0]] = upload[1]
                        self.items[key] = item
        finally:
            with self._lock:
                self._active -= 1
        if left < 0:
            raise DeadLetterUnavailable("memory store told to fail")
        return list(items[len(items) - left :])

    def _build(self, dl: DeadLetter) -> tuple[dict[str, Any], tuple[tuple[str, str], bytes] | None]:
        group = self.group
        if self.bucket is None or item_size(dl, group) <= MAX_ITEM_BYTES:
            return item_from_dead_letter(dl, group), None
        topic, partition, offset = dead_letter_key(dl)
        object_key = payload_object_key(self.table, topic, partition, offset, group)
        payload = encode_payload(dl.record)
        item = pointer_item(dl, group, self.bucket, object_key, len(payload))
        return item, ((self.bucket, object_key), payload)


def _check_batch(items: Sequence[DeadLetter]) -> None:
    """What DynamoDB rejects with ValidationException: a bug in the caller, never retried."""
    if len(items) > MAX_BATCH:
        raise ValueError(f"a batch holds at most {MAX_BATCH} items, got {len(items)}")
    if len({dead_letter_key(dl) for dl in items}) != len(items):
        raise ValueError("a batch must not hold two items with the same key")
