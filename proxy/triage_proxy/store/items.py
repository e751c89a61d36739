"""The items of the table: their keys, attributes and the dead-letter codec.

Why one module: the three kinds of item share one key space (see the package
docstring), so their key formats sit side by side here and nowhere else; and a dead
letter's item format is the contract between the proxy that writes it and every tool
that reads it, so its codec is pure and exact.

Keys. Every item belongs to one deployment: the Kafka group id its proxies commit with
(`kafka.group_id`), so two apps reading one topic (billing and shipping on `orders`)
share a table without touching each other's items. The partition key (`source`) is

    <topic>#<partition>#<kind>#<group>        kind: dead | checkpoint | lease

The group comes last, after fields that cannot hold a `#` (Kafka topic names are
[a-zA-Z0-9._-]; the partition is digits; the kind is one of three words), so it may
hold anything, `#` included: everything after the third `#` is the group
(`parse_source`). Groups are 1..`MAX_GROUP_BYTES` bytes of UTF-8.

Legacy keys (tables written before deployments were keyed; `triage dlq migrate` moves
their dead letters, see `migrate.py`): a dead letter `<topic>#<partition>` with no
`group` attribute, a lease `<topic>#<partition>#lease`. The checkpoint key has always
carried the group and is unchanged.

Dead-letter item (one per dead message):

| attribute          | type | content                                                       |
|--------------------|------|---------------------------------------------------------------|
| `source`           | S    | partition key: `<topic>#<partition>#dead#<group>` (above)     |
| `offset`           | N    | sort key: the message's offset                                |
| `group`            | S    | the deployment: the Kafka group id of the proxy that wrote it |
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
| `dl_state`         | S    | `<status>#<group>`: partition key of the `by-state` index     |
| `payload_s3`       | S    | only for large payloads: `s3://bucket/key` of key+value+headers |
| `payload_bytes`    | N    | only with `payload_s3`: the S3 object's length                |

Replay and discard (`query.py`, `replay.py`) add `replayed_at`, `replayed_to`
(`<topic>/<partition>/<offset>` of the copy), `replay_count`, `replay_id`,
`discarded_at`, `expires_at` (TTL) and, while a replay is producing it,
`replay_claim`/`replay_claim_until`.

The `by-state` global secondary index (`STATE_INDEX`; created by `provisioning.py`,
added to older tables by `triage dlq migrate`) is keyed `dl_state` (HASH) and
`dead_lettered_at` (RANGE; ISO-8601 with fixed width sorts as time), so "this
deployment's pending dead letters, newest first" (and any other status, and a
`--since/--until` range) is one Query. Checkpoints and leases carry neither attribute,
so they are not in it. Every write of the status keeps `dl_state` equal to
`state_key(status, group)`; `pages.py` still checks each item it returns with
`query.matches`, so an item a tool older than the index marked is never shown
under the wrong status.

Byte strings may be empty (then present, unlike null); headers keep duplicates and order.
`dead_letter_from_item` inverts `item_from_dead_letter(dl, group)` exactly (an empty `headers` list
reads as no headers); `dead_letter_with_payload` does the same for a pointer item and
the bytes of its S3 object (`payload.py`).

Large payloads: an item over DynamoDB's 400 KB limit (`MAX_ITEM_BYTES`, counted the way
DynamoDB counts, rounded up) is written as a pointer item (`pointer_item`) whose key,
value and headers live in one S3 object. `item_from_dead_letter` raises
`DeadLetterTooLarge` rather than build an item DynamoDB would refuse.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.config.validation import (  # noqa: F401  MAX_GROUP_BYTES: re-exported
    MAX_GROUP_BYTES,
    group_problem,
)
from triage_proxy.errors import ConfigError, DeadLetterTooLarge
from triage_proxy.store.payload import decode_payload, payload_object_key, payload_size
from triage_proxy.structs import DeadLetter, Record

MAX_ITEM_BYTES = 400_000
"""DynamoDB's item limit ("400 KB"), taken at its smallest reading; moto allows 405,000."""
CHECKPOINT_OFFSET = -1
"""Sort key of a commit checkpoint item (`checkpoints.py`)."""
LEASE_OFFSET = -2
"""Sort key of a partition lease item (`leases.py`)."""
STATUS_PENDING = "pending"
STATUS_REPLAYED = "replayed"
STATUS_DISCARDED = "discarded"
STATUSES = (STATUS_PENDING, STATUS_REPLAYED, STATUS_DISCARDED)
"""Every status a dead letter can have, in lifecycle order."""
CLAIM_ATTR = "replay_claim"
"""Set (to a replay id) while a replay is producing the item; writes leave such items be."""
CLAIM_UNTIL_ATTR = "replay_claim_until"
"""Epoch ms after which a claim is stale (its replay died) and may be taken over."""
EXPIRES_AT_ATTR = "expires_at"
"""DynamoDB TTL attribute (epoch seconds), set on replayed/discarded items when ttl_days is."""
PAYLOAD_S3_ATTR = "payload_s3"
PAYLOAD_BYTES_ATTR = "payload_bytes"

KIND_DEAD_LETTER = "dead"
KIND_CHECKPOINT = "checkpoint"
KIND_LEASE = "lease"
KINDS = (KIND_DEAD_LETTER, KIND_CHECKPOINT, KIND_LEASE)
"""The third field of every partition key (see the module docstring)."""
GROUP_ATTR = "group"
"""The deployment (Kafka group id) of a dead-letter item; absent on legacy items."""
STATE_ATTR = "dl_state"
"""`<status>#<group>` of a dead-letter item: the partition key of `STATE_INDEX`."""
AT_ATTR = "dead_lettered_at"
"""When it was dead-lettered (ISO-8601, fixed width): the sort key of `STATE_INDEX`."""
STATE_INDEX = "by-state"
"""The global secondary index (`STATE_ATTR`, `AT_ATTR`) of one deployment's dead letters
by status, in time order."""
INDEX_MARKER_SOURCE = "triage#index#by-state"
"""Partition key of the one item (sort key `INDEX_MARKER_OFFSET`) that says every dead
letter of the table carries `STATE_ATTR`, so `STATE_INDEX` holds them all."""
INDEX_MARKER_OFFSET = -3
INDEX_PROJECTION = (
    GROUP_ATTR,
    "topic",
    "partition",
    "key",
    "timestamp_ms",
    "reason",
    "attempts",
    "consumer_id",
    "status",
    PAYLOAD_S3_ATTR,
    PAYLOAD_BYTES_ATTR,
    "replayed_at",
    "replayed_to",
    "replay_count",
    "replay_id",
    "discarded_at",
    EXPIRES_AT_ATTR,
    CLAIM_ATTR,
    CLAIM_UNTIL_ATTR,
)
"""The attributes `STATE_INDEX` copies besides the keys: everything a listing shows,
never the value and headers (which may be 400 KB; `get` reads those from the table)."""

DeadLetterKey = tuple[str, int, int]
"""(topic, partition, offset): what identifies a dead letter (and its item) within one
deployment; the group is the store's or the table view's (`query.DeadLetterTable`)."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ISO_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"


# --- keys -------------------------------------------------------------------------------


def check_group(group: str) -> str:
    """`group` if it can key items (1..MAX_GROUP_BYTES bytes); ConfigError otherwise."""
    problem = group_problem(group)
    if problem is not None:
        raise ConfigError("kafka.group_id", problem)
    return group


def item_source(topic: str, partition: int, kind: str, group: str) -> str:
    """Partition key of the items of `kind` of (topic, partition) in deployment `group`."""
    return f"{topic}#{partition}#{kind}#{group}"


def dead_letter_source(topic: str, partition: int, group: str) -> str:
    """Partition key of the dead letters of one source partition in one deployment."""
    return item_source(topic, partition, KIND_DEAD_LETTER, group)


def checkpoint_source(topic: str, partition: int, group: str) -> str:
    """Partition key of the commit checkpoint of (topic, partition, group); the format
    predates deployment keys and did not change."""
    return item_source(topic, partition, KIND_CHECKPOINT, group)


def lease_source(topic: str, partition: int, group: str) -> str:
    """Partition key of the ownership lease of (topic, partition) in deployment `group`."""
    return item_source(topic, partition, KIND_LEASE, group)


def legacy_dead_letter_source(topic: str, partition: int) -> str:
    """Partition key of a dead letter written before deployment keys (no group)."""
    return f"{topic}#{partition}"


def legacy_lease_source(topic: str, partition: int) -> str:
    """Partition key of a lease written before deployment keys (no group)."""
    return f"{topic}#{partition}#lease"


def parse_source(source: str) -> tuple[str, int, str, str | None]:
    """(topic, partition, kind, group) of a partition key; group None for a legacy key
    (`<topic>#<partition>` is a legacy dead letter). ValueError when malformed."""
    parts = source.split("#", 3)
    if len(parts) < 2 or not parts[0] or not parts[1].isdigit():
        raise ValueError(f"not a table key: {source!r}")
    topic, partition = parts[0], int(parts[1])
    if len(parts) == 2:
        return topic, partition, KIND_DEAD_LETTER, None
    if len(parts) == 3 and parts[2] == KIND_LEASE:
        return topic, partition, KIND_LEASE, None
    if len(parts) == 4 and parts[2] in KINDS and parts[3]:
        return topic, partition, parts[2], parts[3]
    raise ValueError(f"not a table key: {source!r}")


def table_key(source: str, offset: int) -> dict[str, Any]:
    """The primary key of any item, as DynamoDB's low-level API spells it."""
    return {"source": {"S": source}, "offset": {"N": str(offset)}}


def dead_letter_table_key(key: DeadLetterKey, group: str) -> dict[str, Any]:
    """The primary key of the dead letter at (topic, partition, offset) of `group`."""
    topic, partition, offset = key
    return table_key(dead_letter_source(topic, partition, group), offset)


def dead_letter_key(dl: DeadLetter) -> DeadLetterKey:
    """(topic, partition, offset) of a dead letter."""
    return (dl.record.topic, dl.record.partition, dl.record.offset)


def item_key(item: Mapping[str, Any]) -> DeadLetterKey:
    """(topic, partition, offset) of a low-level dead-letter item."""
    return (item["topic"]["S"], int(item["partition"]["N"]), int(item["offset"]["N"]))


def state_key(status: str, group: str) -> str:
    """`STATE_ATTR` of a dead letter of deployment `group` with `status` (status first:
    it never holds a `#`, the group may)."""
    return f"{status}#{group}"


def is_dead_letter(item: Mapping[str, Any]) -> bool:
    """Whether a low-level item is a dead letter (checkpoints and leases have offset < 0)."""
    return int(item["offset"]["N"]) >= 0


def item_group(item: Mapping[str, Any]) -> str | None:
    """The deployment of a low-level dead-letter item; None for a legacy item."""
    group = item.get(GROUP_ATTR)
    return None if group is None else str(group["S"])


def is_legacy_dead_letter(item: Mapping[str, Any]) -> bool:
    """Whether a low-level item is a dead letter written before deployment keys."""
    return is_dead_letter(item) and GROUP_ATTR not in item


# --- the dead-letter codec --------------------------------------------------------------


def item_from_dead_letter(dl: DeadLetter, group: str) -> dict[str, Any]:
    """The DynamoDB item of `dl` in deployment `group` (low-level attribute values);
    DeadLetterTooLarge if over the limit."""
    item = _build_item(dl, group)
    size = _item_size(item)
    if size > MAX_ITEM_BYTES:
        raise DeadLetterTooLarge(dead_letter_key(dl), size, MAX_ITEM_BYTES)
    return item


def item_size(dl: DeadLetter, group: str) -> int:
    """Bytes the item takes by DynamoDB's accounting (an upper bound; numbers rounded up)."""
    return _item_size(_build_item(dl, group))


def dead_letter_from_item(item: Mapping[str, Any]) -> DeadLetter:
    """Inverse of item_from_dead_letter: the same bytes, headers and times back.

    ValueError for an item whose payload is in S3: use `query.load_dead_letter` (or
    `dead_letter_with_payload`) for those.
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


def _build_item(dl: DeadLetter, group: str) -> dict[str, Any]:
    record = dl.record
    item: dict[str, Any] = {
        **table_key(dead_letter_source(record.topic, record.partition, group), record.offset),
        GROUP_ATTR: {"S": group},
        "topic": {"S": record.topic},
        "partition": {"N": str(record.partition)},
        "timestamp_ms": {"N": str(record.timestamp_ms)},
        "reason": {"S": dl.reason},
        "attempts": {"N": str(dl.attempts)},
        "consumer_id": {"S": dl.consumer_id},
        "dead_lettered_at": {"S": format_iso_ms(dl.dead_lettered_at_ms)},
        "status": {"S": STATUS_PENDING},
        STATE_ATTR: {"S": state_key(STATUS_PENDING, group)},
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


# --- pointer items (payload in S3) ------------------------------------------------------


def pointer_item(
    dl: DeadLetter, group: str, bucket: str, object_key: str, payload_bytes: int
) -> dict[str, Any]:
    """The item of a dead letter whose key, value and headers live in S3.

    Raises DeadLetterTooLarge if even that item exceeds the limit (a huge reason).
    """
    item = _build_item(dl, group)
    for name in ("key", "value", "headers"):
        item.pop(name, None)
    item[PAYLOAD_S3_ATTR] = {"S": f"s3://{bucket}/{object_key}"}
    item[PAYLOAD_BYTES_ATTR] = {"N": str(payload_bytes)}
    size = _item_size(item)
    if size > MAX_ITEM_BYTES:
        raise DeadLetterTooLarge(dead_letter_key(dl), size, MAX_ITEM_BYTES)
    return item


def fits_with_overflow(dl: DeadLetter, settings: DeadLetterSettings, group: str) -> bool:
    """Whether `dl` can be written under `settings` for deployment `group`: inline, or
    via the overflow bucket."""
    if item_size(dl, group) <= MAX_ITEM_BYTES:
        return True
    if settings.overflow_bucket is None:
        return False
    topic, partition, offset = dead_letter_key(dl)
    object_key = payload_object_key(settings.table, topic, partition, offset, group)
    try:
        pointer_item(dl, group, settings.overflow_bucket, object_key, payload_size(dl.record))
    except DeadLetterTooLarge:
        return False
    return True


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
