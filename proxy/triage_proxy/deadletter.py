"""The dead-letter writer: a nacked message is durable in DynamoDB before its offset settles.

Why: a dead letter takes the place of its message in Kafka, so the commit tracker may
move past the offset only once the table holds the message byte-exact. The writer
reports an item (``on_written``) strictly after DynamoDB accepted it. While DynamoDB is
down or throttling it keeps every item and retries forever with capped exponential
backoff; the offsets then simply do not commit and the in-flight window eventually
pauses fetching. Nothing is dropped, nothing is reported written that was not.

Writes go through `DeadLetterStore`, a small sync Protocol with the real
`DynamoDBStore` and the in-memory `MemoryStore` for unit tests. `DeadLetterWriter`
batches submissions, runs `put_batch` in worker threads (up to `DEFAULT_MAX_IN_FLIGHT`
batches at once), retries what was not written, and tells an optional observer (the
notifier) about every dead letter once it is durable.

Item schema (one item per dead message):

| attribute          | type | content                                                       |
|--------------------|------|---------------------------------------------------------------|
| `source`           | S    | partition key: `<topic>#<partition>` (no `#` in topic names)  |
| `offset`           | N    | sort key: the message's offset                                |
| `topic`            | S    | source topic                                                  |
| `partition`        | N    | source partition                                              |
| `key`              | B    | message key; absent when null (or when the payload is in S3)  |
| `value`            | B    | message value; absent when null (tombstone) or in S3          |
| `headers`          | L    | of M {`k`: S, `v`: B, no `v` if null}, in order; absent if () |
| `timestamp_ms`     | N    | Kafka timestamp, ms since the epoch                           |
| `reason`           | S    | the consumer's nack reason or the proxy's own cause           |
| `attempts`         | N    | deliveries before it was dead-lettered                        |
| `consumer_id`      | S    | instance that settled it last (empty if none)                 |
| `dead_lettered_at` | S    | ISO-8601 UTC with ms and Z, e.g. `2024-05-01T12:00:00.123Z`   |
| `status`           | S    | `pending` when written; later `replayed` or `discarded`       |
| `payload_s3`       | S    | only for large payloads: `s3://bucket/key` of key+value+headers |
| `payload_bytes`    | N    | only with `payload_s3`: the S3 object's length                |

Replay and discard (`dlqtable.py`) add `replayed_at`, `replayed_to`, `replay_count`,
`replay_id`, `discarded_at`, `expires_at` (TTL) and, while a replay is producing it,
`replay_claim`/`replay_claim_until`.

Byte strings may be empty (then present, unlike null); headers keep duplicates and order.
`dead_letter_from_item` inverts `item_from_dead_letter` exactly (an empty `headers` list
reads as no headers); `load_dead_letter` also follows an S3 pointer.

Idempotent writes: a write never clobbers an item that is `replayed`, `discarded` or
claimed by a running replay (otherwise a retried write, or a message redelivered after
a proxy restart and dead-lettered again, would turn a replayed item back to `pending`
and the next replay would produce it twice). BatchWriteItem takes no conditions, and
TransactWriteItems costs twice the write units and caps a call at 4 MB (fewer than ten
large items). So `DynamoDBStore.put_batch` first reads the batch's keys with one
consistent BatchGetItem (status and claim only), then
- writes the keys that do not exist with one BatchWriteItem (the common case),
- writes the keys that exist as unclaimed `pending` with a conditional PutItem each
  (`attribute_not_exists(status) OR (status = pending AND attribute_not_exists(claim))`),
- leaves the others as they are and counts them written (the table holds the message).
A one-item batch is a single conditional PutItem. What is left unguarded: an item that
did not exist at the read and was both created by another writer and replayed in the
milliseconds before our BatchWriteItem lands.

Large payloads: an item over DynamoDB's 400 KB limit (`MAX_ITEM_BYTES`, counted the way
DynamoDB counts, rounded up) keeps its key, value and headers in one S3 object
(`<table>/<topic>/<partition>/<offset>` in `dead_letters.overflow_bucket`, format in
`encode_payload`), written before the item that points to it, so a pointer never
dangles. Without a bucket (or if even the pointer item is too large) the dead letter can
never be written, and writing it truncated or without its value would lose data. So the
writer never sends it (one oversized item would fail its whole batch forever); it logs
ERROR once, counts it in `too_large`, and holds it as pending for good. Its offset never
commits, the window stalls behind it after `window.max_messages`, and a restart
redelivers it: no loss, loudly visible. `item_from_dead_letter` raises
`DeadLetterTooLarge` for such a record so no other caller can send it inline either.

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
import ipaddress
import logging
import math
import random
import struct
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
from triage_proxy.lifecycle import Lifecycle, State
from triage_proxy.policies import backoff
from triage_proxy.settings import DEFAULT_DLQ_BATCH, DeadLetterSettings
from triage_proxy.structs import DeadLetter, Headers, Record
from triage_proxy.waiting import wait_any

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.client import DynamoDBClient
    from mypy_boto3_s3.client import S3Client

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
STATUS_REPLAYED = "replayed"
STATUS_DISCARDED = "discarded"
STATUSES = (STATUS_PENDING, STATUS_REPLAYED, STATUS_DISCARDED)
"""Every status an item can have, in lifecycle order."""
CLAIM_ATTR = "replay_claim"
"""Set (to a replay id) while a replay is producing the item; writes leave such items be."""
CLAIM_UNTIL_ATTR = "replay_claim_until"
"""Epoch ms after which a claim is stale (its replay died) and may be taken over."""
EXPIRES_AT_ATTR = "expires_at"
"""DynamoDB TTL attribute (epoch seconds), set on replayed/discarded items when ttl_days is."""
PAYLOAD_S3_ATTR = "payload_s3"
PAYLOAD_BYTES_ATTR = "payload_bytes"
PAYLOAD_MAGIC = b"TDL\x01"
"""First bytes of every S3 payload object (format version 1)."""
S3_SETTLED_TAG = ("triage-status", "settled")
"""Tag put on the S3 payload of a replayed/discarded item; a lifecycle rule expires them."""
S3_LIFECYCLE_RULE_ID = "triage-expire-settled-payloads"
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
    """Inverse of item_from_dead_letter: the same bytes, headers and times back.

    ValueError for an item whose payload is in S3: use `load_dead_letter` for those.
    """
    if PAYLOAD_S3_ATTR in item:
        raise ValueError(
            f"the payload of this item is in S3 ({item[PAYLOAD_S3_ATTR]['S']}): "
            "use load_dead_letter"
        )
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
        dead_lettered_at_ms=parse_iso_ms(item["dead_lettered_at"]["S"]),
    )


def format_iso_ms(ms: int) -> str:
    """ms since the epoch as ISO-8601 UTC with milliseconds and 'Z'."""
    stamp = (_EPOCH + timedelta(milliseconds=ms)).isoformat(timespec="milliseconds")
    return stamp.removesuffix("+00:00") + "Z"


def parse_iso_ms(text: str) -> int:
    """Inverse of format_iso_ms (the item's `dead_lettered_at`)."""
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


# --- large payloads in S3 ---------------------------------------------------------------


def payload_object_key(table: str, topic: str, partition: int, offset: int) -> str:
    """S3 key of a dead letter's payload: `<table>/<topic>/<partition>/<offset>`.

    The table name leads so that several tables (environments) can share one bucket.
    """
    return f"{table}/{topic}/{partition}/{offset}"


def encode_payload(record: Record) -> bytes:
    """Key, value and headers of `record` as one byte string (the S3 object).

    Format 1, all integers big-endian: `PAYLOAD_MAGIC`; key as i64 length (-1 for null)
    and bytes; value likewise; u32 header count; per header u32 name length, UTF-8 name,
    i64 value length (-1 for null) and bytes.
    """
    parts = [PAYLOAD_MAGIC, *_blob(record.key), *_blob(record.value)]
    parts.append(struct.pack(">I", len(record.headers)))
    for name, value in record.headers:
        raw = name.encode()
        parts.extend((struct.pack(">I", len(raw)), raw, *_blob(value)))
    return b"".join(parts)


def payload_size(record: Record) -> int:
    """len(encode_payload(record)) without building it."""
    size = len(PAYLOAD_MAGIC) + 8 + len(record.key or b"") + 8 + len(record.value or b"") + 4
    for name, value in record.headers:
        size += 4 + len(name.encode()) + 8 + len(value or b"")
    return size


def decode_payload(data: bytes) -> tuple[bytes | None, bytes | None, Headers]:
    """Inverse of encode_payload: (key, value, headers); ValueError if malformed."""
    if not data.startswith(PAYLOAD_MAGIC):
        raise ValueError("not a Triage dead-letter payload (bad magic)")
    view = memoryview(data)
    pos = len(PAYLOAD_MAGIC)

    def take(n: int) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(data):
            raise ValueError("truncated dead-letter payload")
        chunk = bytes(view[pos : pos + n])
        pos += n
        return chunk

    def blob() -> bytes | None:
        (length,) = struct.unpack(">q", take(8))
        return None if length == -1 else take(length)

    key = blob()
    value = blob()
    (count,) = struct.unpack(">I", take(4))
    headers: list[tuple[str, bytes | None]] = []
    for _ in range(count):
        (length,) = struct.unpack(">I", take(4))
        headers.append((take(length).decode(), blob()))
    if pos != len(data):
        raise ValueError("trailing bytes after the dead-letter payload")
    return key, value, tuple(headers)


def _blob(data: bytes | None) -> tuple[bytes, ...]:
    if data is None:
        return (struct.pack(">q", -1),)
    return (struct.pack(">q", len(data)), data)


def pointer_item(
    dl: DeadLetter, bucket: str, object_key: str, payload_bytes: int
) -> dict[str, Any]:
    """The item of a dead letter whose key, value and headers live in S3.

    Raises DeadLetterTooLarge if even that item exceeds the limit (a huge reason).
    """
    item = _build_item(dl)
    for name in ("key", "value", "headers"):
        item.pop(name, None)
    item[PAYLOAD_S3_ATTR] = {"S": f"s3://{bucket}/{object_key}"}
    item[PAYLOAD_BYTES_ATTR] = {"N": str(payload_bytes)}
    size = _item_size(item)
    if size > MAX_ITEM_BYTES:
        raise DeadLetterTooLarge(dead_letter_key(dl), size, MAX_ITEM_BYTES)
    return item


def fits_with_overflow(dl: DeadLetter, settings: DeadLetterSettings) -> bool:
    """Whether `dl` can be written under `settings`: inline, or via the overflow bucket."""
    if item_size(dl) <= MAX_ITEM_BYTES:
        return True
    if settings.overflow_bucket is None:
        return False
    topic, partition, offset = dead_letter_key(dl)
    object_key = payload_object_key(settings.table, topic, partition, offset)
    try:
        pointer_item(dl, settings.overflow_bucket, object_key, payload_size(dl.record))
    except DeadLetterTooLarge:
        return False
    return True


def parse_s3_url(url: str) -> tuple[str, str]:
    """("bucket", "key") of "s3://bucket/key"; ValueError otherwise."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc or len(parts.path) < 2:
        raise ValueError(f"not an s3://bucket/key URL: {url!r}")
    return parts.netloc, parts.path[1:]


def dead_letter_with_payload(item: Mapping[str, Any], payload: bytes) -> DeadLetter:
    """The dead letter of a pointer item, given the bytes of its S3 object."""
    expected = int(item[PAYLOAD_BYTES_ATTR]["N"])
    if len(payload) != expected:
        raise ValueError(
            f"S3 payload {item[PAYLOAD_S3_ATTR]['S']} has {len(payload)} bytes, "
            f"the item says {expected}"
        )
    key, value, headers = decode_payload(payload)
    inline = {k: v for k, v in item.items() if k not in (PAYLOAD_S3_ATTR, PAYLOAD_BYTES_ATTR)}
    dl = dead_letter_from_item(inline)
    return DeadLetter(
        record=dl.record._replace(key=key, value=value, headers=headers),
        reason=dl.reason,
        attempts=dl.attempts,
        consumer_id=dl.consumer_id,
        dead_lettered_at_ms=dl.dead_lettered_at_ms,
    )


def load_dead_letter(item: Mapping[str, Any], s3_client: S3Client | None) -> DeadLetter:
    """The dead letter of any item, byte-exact, fetching its payload from S3 if it is there.

    `s3_client` (see `s3_client()`) is only used, and only required, for items with a
    `payload_s3` pointer: ValueError without one. Raises DeadLetterUnavailable when S3
    does not answer and ValueError when the object is missing or does not match the item.
    """
    if PAYLOAD_S3_ATTR not in item:
        return dead_letter_from_item(item)
    url = item[PAYLOAD_S3_ATTR]["S"]
    if s3_client is None:
        raise ValueError(f"the payload is in S3 ({url}); an S3 client is needed to load it")
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = parse_s3_url(url)
    try:
        body = s3_client.get_object(Bucket=bucket, Key=key)["Body"]
        try:
            data = body.read()
        finally:
            body.close()
    except ClientError as exc:
        if _error_code(exc) in ("NoSuchKey", "NoSuchBucket", "404"):
            raise ValueError(f"the S3 payload {url} does not exist") from exc
        raise DeadLetterUnavailable(f"reading {url} failed: {_describe(exc)}") from exc
    except BotoCoreError as exc:
        raise DeadLetterUnavailable(f"reading {url} failed: {_describe(exc)}") from exc
    return dead_letter_with_payload(item, data)


# --- stores ---------------------------------------------------------------------------


class DeadLetterStore(Protocol):
    """Where dead letters go; sync, called from a worker thread."""

    def put_batch(self, items: Sequence[DeadLetter]) -> list[DeadLetter]:
        """Write up to 25 items with distinct keys; return those NOT written.

        Raises DeadLetterUnavailable when the store is unreachable, throttles or errors.
        """
        ...


_WRITE_CONDITION = "attribute_not_exists(#s) OR (#s = :pending AND attribute_not_exists(#c))"
"""What a write may replace: nothing, or a pending item no replay has claimed."""
_WRITE_NAMES = {"#s": "status", "#c": CLAIM_ATTR}
_WRITE_VALUES = {":pending": {"S": STATUS_PENDING}}


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
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        max_attempts: int = DEFAULT_BOTO_ATTEMPTS,
    ) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        self.table = settings.table
        self.bucket = settings.overflow_bucket
        self.kept = 0
        """Writes skipped because the item was already replayed, discarded or claimed."""
        self._errors = (BotoCoreError, ClientError)
        self._client_error = ClientError
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
            key = _item_key(dl)
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
        unwritten = [dl for dl in items if _item_key(dl) in unread]
        unwritten.extend(self._batch_write(fresh))
        unwritten.extend(self._put_conditional(pending))
        return unwritten

    def _read_states(
        self, items: Sequence[DeadLetter]
    ) -> tuple[dict[tuple[str, str], dict[str, Any]], set[tuple[str, str]]]:
        """Status and claim of every key (consistent read); also the keys left unread."""
        keys = [_item_key(dl) for dl in items]
        request: Any = {
            self.table: {
                "Keys": [{"source": {"S": s}, "offset": {"N": o}} for s, o in keys],
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
        try:
            response = self._client.batch_get_item(RequestItems=request)
        except self._errors as exc:
            raise DeadLetterUnavailable(
                f"BatchGetItem on table {self.table!r} failed: {_describe(exc)}"
            ) from exc
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
            by_key[_item_key(dl)] = dl
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

    def _put_conditional(self, items: Sequence[DeadLetter]) -> list[DeadLetter]:
        """A conditional PutItem each; a lone item's failure raises, later ones are returned."""
        unwritten: list[DeadLetter] = []
        kept = 0
        for dl in items:
            try:
                self._client.put_item(
                    TableName=self.table,
                    Item=self._prepare(dl),
                    ConditionExpression=_WRITE_CONDITION,
                    ExpressionAttributeNames=_WRITE_NAMES,
                    ExpressionAttributeValues=_WRITE_VALUES,
                )
            except self._client_error as exc:
                if _error_code(exc) == "ConditionalCheckFailedException":
                    kept += 1
                    continue
                if len(items) == 1:
                    raise DeadLetterUnavailable(
                        f"PutItem on table {self.table!r} failed: {_describe(exc)}"
                    ) from exc
                unwritten.append(dl)
            except self._errors as exc:
                raise DeadLetterUnavailable(
                    f"PutItem on table {self.table!r} failed: {_describe(exc)}"
                ) from exc
        self._count_kept(kept)
        return unwritten

    def _prepare(self, dl: DeadLetter) -> dict[str, Any]:
        """The item to write; uploads the payload to S3 first when it is too large inline."""
        if self.bucket is None or self._s3 is None or item_size(dl) <= MAX_ITEM_BYTES:
            return item_from_dead_letter(dl)
        topic, partition, offset = dead_letter_key(dl)
        object_key = payload_object_key(self.table, topic, partition, offset)
        payload = encode_payload(dl.record)
        item = pointer_item(dl, self.bucket, object_key, len(payload))
        try:
            self._s3.put_object(
                Bucket=self.bucket,
                Key=object_key,
                Body=payload,
                ContentType="application/octet-stream",
            )
        except self._errors as exc:
            raise DeadLetterUnavailable(
                f"PutObject s3://{self.bucket}/{object_key} failed: {_describe(exc)}"
            ) from exc
        return item

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


def _item_key(dl: DeadLetter) -> tuple[str, str]:
    """(source, offset) of a dead letter's item as DynamoDB spells them."""
    record = dl.record
    return (f"{record.topic}#{record.partition}", str(record.offset))


class MemoryStore:
    """In-memory twin of DynamoDBStore for unit tests; thread-safe.

    `items` maps (source, offset) to the item as DynamoDB would hold it; like the real
    store it leaves replayed, discarded and claimed items as they are (counted in
    `kept`), and with `overflow_bucket` keeps large payloads in `objects`. Tests can make
    the next calls fail (`fail_next`), leave items unprocessed (`leave_unprocessed`),
    or hold calls in flight by clearing `gate`.
    """

    def __init__(self, *, table: str = "dead-letters", overflow_bucket: str | None = None) -> None:
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
        if self.bucket is None or item_size(dl) <= MAX_ITEM_BYTES:
            return item_from_dead_letter(dl), None
        topic, partition, offset = dead_letter_key(dl)
        object_key = payload_object_key(self.table, topic, partition, offset)
        payload = encode_payload(dl.record)
        item = pointer_item(dl, self.bucket, object_key, len(payload))
        return item, ((self.bucket, object_key), payload)


def _check_batch(items: Sequence[DeadLetter]) -> None:
    """What DynamoDB rejects with ValidationException: a bug in the caller, never retried."""
    if len(items) > MAX_BATCH:
        raise ValueError(f"a batch holds at most {MAX_BATCH} items, got {len(items)}")
    if len({dead_letter_key(dl) for dl in items}) != len(items):
        raise ValueError("a batch must not hold two items with the same key")


def _error_code(exc: BaseException) -> str:
    """The AWS error code of a botocore ClientError ("" for anything else)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


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

    return boto3.session.Session().client(
        "dynamodb", **_client_options(settings, connect_timeout_s, read_timeout_s, max_attempts)
    )


def s3_client(
    settings: DeadLetterSettings,
    *,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    max_attempts: int = DEFAULT_BOTO_ATTEMPTS,
) -> S3Client:
    """A boto3 S3 client for the overflow bucket: same endpoint, region and credentials
    logic as dynamodb_client (path-style addressing when an endpoint_url is set, since a
    local endpoint has no per-bucket host names)."""
    import boto3

    options = _client_options(settings, connect_timeout_s, read_timeout_s, max_attempts)
    return boto3.session.Session().client("s3", **options)


def aws_client(
    service: str,
    settings: DeadLetterSettings,
    *,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    max_attempts: int = DEFAULT_BOTO_ATTEMPTS,
) -> Any:
    """A boto3 client of any `service` (e.g. "sns") with the same endpoint, region,
    timeouts and loopback-credentials logic as dynamodb_client."""
    import boto3

    options = _client_options(settings, connect_timeout_s, read_timeout_s, max_attempts)
    return boto3.session.Session().client(service, **options)  # type: ignore[call-overload]


def _client_options(
    settings: DeadLetterSettings,
    connect_timeout_s: float,
    read_timeout_s: float,
    max_attempts: int,
) -> dict[str, Any]:
    """Keyword arguments of boto3's client() shared by every AWS client of Triage."""
    from botocore.config import Config

    config = Config(
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        retries={"mode": "standard", "total_max_attempts": max_attempts},
        s3={"addressing_style": "path"} if settings.endpoint_url is not None else None,
    )
    access_key: str | None = None
    secret_key: str | None = None
    if settings.endpoint_url is not None and _is_loopback(settings.endpoint_url):
        access_key, secret_key = LOCAL_CREDENTIALS
    return {
        "region_name": settings.region,
        "endpoint_url": settings.endpoint_url,
        "config": config,
        "aws_access_key_id": access_key,
        "aws_secret_access_key": secret_key,
    }


_KEY_SCHEMA = [("source", "HASH"), ("offset", "RANGE")]


def create_table(settings: DeadLetterSettings, *, timeout_s: float = 120.0) -> None:
    """Create the dead-letter table (on-demand) unless it exists; wait until it is ACTIVE.

    With `ttl_days` set it also enables DynamoDB TTL on `expires_at`. Raises ConfigError
    if a table of that name exists with another key schema (or TTL on another
    attribute), and DeadLetterUnavailable if DynamoDB cannot be reached or refuses.
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
        found = [(k["AttributeName"], k["KeyType"]) for k in schema]
        if found != _KEY_SCHEMA:
            raise ConfigError(
                "dead_letters.table",
                f"table {settings.table!r} has key schema {found}, expected {_KEY_SCHEMA}",
            )
        if settings.ttl_days is not None:
            _enable_ttl(client, settings.table)
    except (BotoCoreError, ClientError) as exc:
        raise DeadLetterUnavailable(
            f"creating table {settings.table!r} failed: {_describe(exc)}"
        ) from exc
    finally:
        client.close()


def _enable_ttl(client: DynamoDBClient, table: str) -> None:
    ttl = client.describe_time_to_live(TableName=table).get("TimeToLiveDescription", {})
    status = ttl.get("TimeToLiveStatus", "DISABLED")
    if status in ("ENABLED", "ENABLING"):
        if ttl.get("AttributeName") != EXPIRES_AT_ATTR:
            raise ConfigError(
                "dead_letters.ttl_days",
                f"table {table!r} already has TTL on {ttl.get('AttributeName')!r}, "
                f"not {EXPIRES_AT_ATTR!r}",
            )
        return
    client.update_time_to_live(
        TableName=table,
        TimeToLiveSpecification={"Enabled": True, "AttributeName": EXPIRES_AT_ATTR},
    )
    logger.info("enabled TTL on %s.%s", table, EXPIRES_AT_ATTR)


def create_bucket(settings: DeadLetterSettings) -> None:
    """Create the overflow bucket unless it exists (no-op without `overflow_bucket`).

    With `ttl_days` it also installs (or updates) one lifecycle rule that expires the
    payloads of replayed and discarded items, which `dlqtable` tags when it marks them;
    other rules of a shared bucket are kept. Raises ConfigError for an invalid bucket
    name and DeadLetterUnavailable if S3 cannot be reached or refuses.
    """
    bucket = settings.overflow_bucket
    if bucket is None:
        return
    from botocore.exceptions import BotoCoreError, ClientError

    client = s3_client(settings)
    try:
        try:
            if settings.region == "us-east-1":
                client.create_bucket(Bucket=bucket)
            else:
                client.create_bucket(
                    Bucket=bucket,
                    CreateBucketConfiguration={"LocationConstraint": settings.region},  # type: ignore[typeddict-item]
                )
            logger.info("created overflow bucket %s", bucket)
        except ClientError as exc:
            if _error_code(exc) == "InvalidBucketName":
                raise ConfigError(
                    "dead_letters.overflow_bucket", f"not a valid S3 bucket name: {bucket!r}"
                ) from exc
            if _error_code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
            client.head_bucket(Bucket=bucket)  # ours to use? raises (403) if not
            logger.debug("overflow bucket %s already exists", bucket)
        if settings.ttl_days is not None:
            _expire_settled_payloads(client, bucket, math.ceil(settings.ttl_days))
    except (BotoCoreError, ClientError) as exc:
        raise DeadLetterUnavailable(f"creating bucket {bucket!r} failed: {_describe(exc)}") from exc
    finally:
        client.close()


def _expire_settled_payloads(client: S3Client, bucket: str, days: int) -> None:
    from botocore.exceptions import ClientError

    try:
        rules = list(client.get_bucket_lifecycle_configuration(Bucket=bucket).get("Rules", []))
    except ClientError as exc:
        if _error_code(exc) != "NoSuchLifecycleConfiguration":
            raise
        rules = []
    tag_key, tag_value = S3_SETTLED_TAG
    rule: Any = {
        "ID": S3_LIFECYCLE_RULE_ID,
        "Status": "Enabled",
        "Filter": {"Tag": {"Key": tag_key, "Value": tag_value}},
        "Expiration": {"Days": max(1, days)},
    }
    rules = [r for r in rules if r.get("ID") != S3_LIFECYCLE_RULE_ID] + [rule]
    client.put_bucket_lifecycle_configuration(
        Bucket=bucket,
        LifecycleConfiguration={"Rules": rules},
    )


# --- the writer -----------------------------------------------------------------------


def backoff_delay(
    failures: int, cap: float, *, base: float = RETRY_BASE_S, rand: float = 1.0
) -> float:
    """Pause before the next try after `failures` consecutive failed writes (>= 1).

    `policies.backoff` from `base`, doubling up to `cap`, then scaled into [half, all] of
    itself by `rand` in [0, 1] ("equal jitter", so many proxies do not retry in step).
    """
    return backoff(failures, initial=base, cap=cap) * (0.5 + 0.5 * rand)


class DeadLetterObserver(Protocol):
    """Told about every dead letter once it is durable (the notifier); on the loop thread."""

    def record(self, dl: DeadLetter) -> None:
        """Take note of `dl`; must be cheap and must not block."""
        ...


WriterState = State
"""The writer's lifecycle states (the shared `lifecycle.State`)."""


@dataclass(slots=True)
class _Entry:
    seq: int
    """Submission order; flush() waits for every seq below its mark."""
    dl: DeadLetter
    key: DeadLetterKey


class DeadLetterWriter(Lifecycle):
    """Batches dead letters into the store and reports each once it is durable.

    `on_written(dl)` runs for every dead letter once the store holds it (the commit
    tracker settles its offset); then `notifier.record(dl)`, if a notifier is given.
    Its lifecycle (start once, stop safe twice, `async with`) is `lifecycle.Lifecycle`.
    """

    name = "dead-letter writer"

    def __init__(
        self,
        store: DeadLetterStore,
        settings: DeadLetterSettings,
        on_written: Callable[[DeadLetter], None],
        *,
        notifier: DeadLetterObserver | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
        sleep: Sleep = asyncio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if not 1 <= settings.batch_size <= MAX_BATCH:
            raise ConfigError("dead_letters.batch_size", f"must be 1..{MAX_BATCH}")
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        super().__init__(stop_timeout_s)
        self._store = store
        self._settings = settings
        self._on_written = on_written
        self._notifier = notifier
        self._sleep = sleep
        self._rand = rand
        self._slots = asyncio.Semaphore(max_in_flight)
        self._wakeup = asyncio.Event()
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

    # --- lifecycle (see lifecycle.Lifecycle) ---------------------------------------

    def _on_started(self) -> None:
        logger.info(
            "dead-letter writer started: table=%s batch=%d flush=%dms",
            self._settings.table,
            self._settings.batch_size,
            self._settings.flush_interval_ms,
        )

    def _on_stopping(self) -> None:
        # No new batches, no retries: the writes in flight finish and report.
        logger.debug("dead-letter writer stopping: finishing writes in flight")
        self._wakeup.set()

    def _on_overran(self) -> None:
        logger.warning(
            "dead-letter writes outlived the %.1fs stop timeout; cancelling them",
            self._stop_timeout_s,
        )

    def _on_stopped(self) -> None:
        self._notify()

    def _on_finished(self) -> None:
        logger.info(
            "dead-letter writer stopped: %d written, %d left unwritten (offsets stay uncommitted)",
            self._written,
            self.pending,
        )

    # --- the API --------------------------------------------------------------------

    def submit(self, dl: DeadLetter) -> None:
        """Queue `dl` for writing; never blocks, never drops. Call on the event loop thread.

        Raises StateError once the writer is stopping (nothing would write it).
        """
        if self._state in (State.STOPPING, State.STOPPED):
            raise StateError(f"dead-letter writer is {self._state.value}")
        seq = self._next_seq
        self._next_seq += 1
        if not fits_with_overflow(dl, self._settings):
            self._parked.append(seq)
            topic, partition, offset = dead_letter_key(dl)
            logger.error(
                "dead letter %s[%d]@%d needs %d bytes, over DynamoDB's item limit of %d: "
                "holding it unwritten, so its offset will not commit (%s)",
                topic,
                partition,
                offset,
                item_size(dl),
                MAX_ITEM_BYTES,
                "even with its payload in S3"
                if self._settings.overflow_bucket
                else "set dead_letters.overflow_bucket to keep large payloads in S3",
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
        """Dead letters held because they exceed DynamoDB's item limit (and no S3 helps)."""
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
            if self._state is not State.RUNNING or self._task is None or self._task.done():
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
                delay = backoff_delay(failures, self._settings.retry_max_s, rand=self._rand())
                await wait_any(self._closing, timeout=delay, sleep=self._sleep)  # stop() cuts it
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
                if self._notifier is not None:
                    self._notifier.record(entry.dl)
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
