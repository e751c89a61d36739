"""The dead-letter table as the tools see it: select, read, claim, mark and discard items.

Why a module of its own: `triage dlq` (a handful of items), `triage status` and the
Spark replay job (millions, one scan segment per task) must select exactly the same
items and change their status the same way, or a rerun of one after the other would
replay twice. So everything they share lives here, with no CLI and no Spark in it:

- `Filters` (frozen) and the pure `matches(item, filters)`: the single definition of
  "selected"; `filter_clauses`, the one way its topic, partition and status become
  DynamoDB conditions; `parse_time` for `--since/--until` (ISO-8601 or relative like `1h`).
- `DeadLetterTable`: one deployment's view of the table (`group`, the Kafka group id its
  proxies commit with): paginated Query/Scan (parallel-scan segments for Spark) that
  yields only that deployment's dead letters, never a checkpoint or lease item
  (`offset < 0`), another deployment's item or a legacy one (no `group`: `triage dlq
  migrate`, see `migrate.py`); `get`, `load` (follows S3 pointers), and the conditional
  status changes that `replay.py` and discard use, all on that deployment's keys.

Status changes (all conditional UpdateItem calls, so concurrent tools cannot race):

    pending --claim(replay_id)--> pending + replay_claim --mark_replayed--> replayed
                                         |   (certainly not delivered: release)
                                         +--> pending
    pending (unclaimed, or claim stale) --discard--> discarded

A replay first *claims* each item (`replay_claim` = its replay id, valid until
`replay_claim_until`), so two replays running at once never both produce it; it marks
the item `replayed` (with `replayed_at`, `replayed_to`, `replay_id`, `replay_count`, and
`expires_at` when TTL is on) only while it still holds the claim. The protocol and its
failure cases are `replay.py`'s.

Errors added to the tree of `errors.py` (callers tell "not there" from "broken"):

    TriageError
    +-- NotFoundError             what was asked for does not exist (not retriable)
        +-- TableNotFound         the configured dead-letter table does not exist
        +-- DeadLetterNotFound    no item at (topic, partition, offset)

Unreachable DynamoDB or S3 raises `DeadLetterUnavailable` (through `aws.aws_errors`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.errors import DeadLetterUnavailable, NotFoundError
from triage_proxy.store.aws import (
    CONDITION_FAILED,
    TABLE_MISSING,
    AwsAnswer,
    aws_errors,
    dynamodb_client,
    s3_client,
)
from triage_proxy.store.items import (
    AT_ATTR,
    CLAIM_ATTR,
    CLAIM_UNTIL_ATTR,
    EXPIRES_AT_ATTR,
    INDEX_MARKER_OFFSET,
    INDEX_MARKER_SOURCE,
    INDEX_PROJECTION,
    PAYLOAD_S3_ATTR,
    STATE_ATTR,
    STATUS_DISCARDED,
    STATUS_PENDING,
    STATUS_REPLAYED,
    STATUSES,
    DeadLetterKey,
    check_group,
    dead_letter_from_item,
    dead_letter_source,
    dead_letter_table_key,
    dead_letter_with_payload,
    format_iso_ms,
    is_dead_letter,
    item_group,
    parse_iso_ms,
    state_key,
    table_key,
)
from triage_proxy.store.payload import S3_SETTLED_TAG, parse_s3_url
from triage_proxy.store.provisioning import state_index_status
from triage_proxy.structs import DeadLetter

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.client import DynamoDBClient
    from mypy_boto3_s3.client import S3Client

logger = logging.getLogger(__name__)

TABLE_ATTEMPTS = 5
"""botocore attempts per call for the tools (a lost mark would mean a second replay)."""

LIST_ATTRIBUTES = ("source", "offset", AT_ATTR, STATE_ATTR, *INDEX_PROJECTION)
"""What listing reads: the keys and what the by-state index copies, never the value and
headers (which may be 400 KB); equal to the index so that a Query on it reads them all."""
BATCH_GET = 100
"""Most keys one BatchGetItem call takes."""
BATCH_GET_ROUNDS = 8
"""Calls `get_many` makes for one batch's unprocessed keys before giving up."""
BATCH_GET_BACKOFF_S = 0.1
INDEX_RECHECK_S = 30.0
"""How long a table view trusts "the `by-state` index is not usable yet" before asking
DynamoDB again (a long-running console sees a migration finish)."""

_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}

# --- errors ---------------------------------------------------------------------------


class TableNotFound(NotFoundError):
    """The dead-letter table named in the config does not exist."""

    def __init__(self, table: str) -> None:
        super().__init__(f"table {table!r} does not exist")
        self.table = table


class DeadLetterNotFound(NotFoundError):
    """No dead letter at (topic, partition, offset), or it was deleted meanwhile."""

    def __init__(self, key: DeadLetterKey) -> None:
        topic, partition, offset = key
        super().__init__(f"no dead letter {topic}/{partition}/{offset} in the table")
        self.key = key


# --- selection ------------------------------------------------------------------------


@dataclass(frozen=True)
class Filters:
    """Which dead letters a command (or the Spark job) acts on; every field narrows."""

    topic: str | None = None
    """Only this source topic."""
    partition: int | None = None
    """Only this source partition."""
    offset: int | None = None
    """Only this offset."""
    status: str | None = None
    """Only this status (`pending`, `replayed`, `discarded`)."""
    reason: str | None = None
    """Only reasons containing this text (case-insensitive)."""
    since_ms: int | None = None
    """Only dead-lettered at or after this time (ms since the epoch)."""
    until_ms: int | None = None
    """Only dead-lettered before this time (ms since the epoch)."""

    def __post_init__(self) -> None:
        if self.partition is not None and self.partition < 0:
            raise ValueError(f"partition must be >= 0, got {self.partition}")
        if self.offset is not None and self.offset < 0:
            raise ValueError(f"offset must be >= 0, got {self.offset}")
        if self.status is not None and self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {self.status!r}")
        if self.topic is not None and (not self.topic or "#" in self.topic):
            raise ValueError(f"not a Kafka topic name: {self.topic!r}")
        if (
            self.since_ms is not None
            and self.until_ms is not None
            and self.since_ms >= self.until_ms
        ):
            raise ValueError(
                f"empty time range: since {format_iso_ms(self.since_ms)} is not before "
                f"until {format_iso_ms(self.until_ms)}"
            )

    @property
    def narrows(self) -> bool:
        """Whether any field is set (an empty Filters selects every dead letter)."""
        return any(getattr(self, f.name) is not None for f in dataclasses.fields(self))


def matches(item: Mapping[str, Any], filters: Filters, *, group: str) -> bool:
    """Whether a low-level DynamoDB item is a dead letter of deployment `group` that
    `filters` selects. Pure.

    Items with a negative offset (checkpoints, leases) are never dead letters; items of
    another deployment, or legacy ones without a group, are never selected.
    """
    if not is_dead_letter(item) or item_group(item) != group:
        return False
    offset = int(item["offset"]["N"])
    if filters.offset is not None and offset != filters.offset:
        return False
    if filters.topic is not None and item["topic"]["S"] != filters.topic:
        return False
    if filters.partition is not None and int(item["partition"]["N"]) != filters.partition:
        return False
    if filters.status is not None and item["status"]["S"] != filters.status:
        return False
    if filters.reason is not None and filters.reason.casefold() not in (
        item["reason"]["S"].casefold()
    ):
        return False
    if filters.since_ms is not None or filters.until_ms is not None:
        at = parse_iso_ms(item["dead_lettered_at"]["S"])
        if filters.since_ms is not None and at < filters.since_ms:
            return False
        if filters.until_ms is not None and at >= filters.until_ms:
            return False
    return True


FilterField = Literal["topic", "partition", "status"]
"""A `Filters` field that is an attribute of the same name compared for equality."""
_CLAUSES: Mapping[FilterField, tuple[str, str, str]] = {
    "topic": ("#t", ":topic", "S"),
    "partition": ("#p", ":partition", "N"),
    "status": ("#s", ":status", "S"),
}
"""Per field: its attribute-name alias, its value placeholder and its DynamoDB type."""


def filter_clauses(
    filters: Filters,
    fields: Sequence[FilterField],
    names: dict[str, str],
    values: dict[str, Any],
) -> list[str]:
    """The DynamoDB conditions `attribute = value` for each of `fields` that `filters`
    sets, in `fields` order, to be joined with AND (a key condition or a filter
    expression); their aliases and values are added to `names` and `values`.

    The one place a Query or Scan request (`DeadLetterTable.request`, `pages.py`) turns
    these fields into a condition; what DynamoDB does not filter, `matches` does.
    """
    clauses = []
    for name in fields:
        value = getattr(filters, name)
        if value is None:
            continue
        alias, placeholder, kind = _CLAUSES[name]
        names[alias] = name
        values[placeholder] = {kind: str(value)}
        clauses.append(f"{alias} = {placeholder}")
    return clauses


def parse_time(text: str, now_ms: int) -> int:
    """ms since the epoch of an ISO-8601 time or a time `text` ago (`90s`, `15m`, `1h`,
    `2d`, `1w`, `now`); a time without zone is UTC. ValueError when malformed."""
    if text.strip().lower() == "now":
        return now_ms
    relative = _RELATIVE.match(text)
    if relative:
        amount, unit = relative.groups()
        return now_ms - round(float(amount) * _UNITS_S[unit] * 1000)
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"not a time: {text!r} (use ISO-8601 like 2024-05-01T12:00:00Z, "
            "or an age like 30m, 1h, 2d)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return (moment - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)


def load_dead_letter(item: Mapping[str, Any], s3: S3Client | None) -> DeadLetter:
    """The dead letter of any item, byte-exact, fetching its payload from S3 if it is there.

    `s3` (see `aws.s3_client()`) is only used, and only required, for items with a
    `payload_s3` pointer: ValueError without one. Raises DeadLetterUnavailable when S3
    does not answer and ValueError when the object is missing or does not match the item.
    """
    if PAYLOAD_S3_ATTR not in item:
        return dead_letter_from_item(item)
    url = item[PAYLOAD_S3_ATTR]["S"]
    if s3 is None:
        raise ValueError(f"the payload is in S3 ({url}); an S3 client is needed to load it")
    bucket, key = parse_s3_url(url)
    with aws_errors(
        f"reading {url}", DeadLetterUnavailable, expect={"NoSuchKey", "NoSuchBucket", "404"}
    ) as missing:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"]
        try:
            data = body.read()
        finally:
            body.close()
    if missing:
        raise ValueError(f"the S3 payload {url} does not exist") from missing.error
    return dead_letter_with_payload(item, data)


# --- the table ------------------------------------------------------------------------


class DeadLetterTable:
    """One deployment's dead letters in the table (and overflow bucket) for tools; sync,
    thread-safe clients.

    Build it from the same `DeadLetterSettings` and group (`kafka.group_id`) the proxy
    uses, or hand it clients (the Spark executors build their own). `clock` gives wall
    time in seconds (for claims, replay times and TTL). Close it, or use it as a context
    manager.
    """

    def __init__(
        self,
        settings: DeadLetterSettings,
        *,
        group: str,
        dynamodb: DynamoDBClient | None = None,
        s3: S3Client | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.table = settings.table
        self.group = check_group(group)
        """The deployment whose items this view reads and changes."""
        self._clock = clock
        self._own = dynamodb is None
        self._client = dynamodb or dynamodb_client(settings, max_attempts=TABLE_ATTEMPTS)
        self._s3 = s3
        self._own_s3 = False
        self._s3_lock = threading.Lock()
        self._indexed = False
        self._index_checked: float | None = None

    # --- reading ----------------------------------------------------------------------

    def indexed(self) -> bool:
        """Whether the `by-state` index can answer for every dead letter: it is ACTIVE
        and the marker item says every item carries `dl_state` (`provisioning.py`).
        A yes is kept; a no is asked again after INDEX_RECHECK_S. Raises TableNotFound,
        DeadLetterUnavailable."""
        if self._indexed:
            return True
        now = time.monotonic()
        if self._index_checked is not None and now - self._index_checked < INDEX_RECHECK_S:
            return False
        with self.errors("DescribeTable"):
            ready = state_index_status(self._client, self.table) == "ACTIVE"
        if ready:
            with self.errors("GetItem"):
                found: Any = self._client.get_item(
                    TableName=self.table,
                    Key=table_key(INDEX_MARKER_SOURCE, INDEX_MARKER_OFFSET),
                    ConsistentRead=True,
                )
            ready = "Item" in found
        self._indexed, self._index_checked = ready, now
        return ready

    def check(self) -> None:
        """Raise TableNotFound or DeadLetterUnavailable unless the table can be used."""
        with self.errors("DescribeTable"):
            self._client.describe_table(TableName=self.table)

    def scan(
        self,
        filters: Filters,
        *,
        attributes: Sequence[str] | None = None,
        consistent: bool = False,
        segment: int | None = None,
        total_segments: int | None = None,
        page_size: int | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Every item of this deployment `filters` selects, page by page, never a
        checkpoint or lease item.

        With topic and partition given it is one Query on that partition (offset order;
        only segment 0 yields it). Otherwise a Scan, optionally one segment of a parallel
        scan. `attributes` limits what is read (e.g. LIST_ATTRIBUTES); the attributes
        `matches` needs are always read. Raises TableNotFound, DeadLetterUnavailable.
        (`pages.py` reads the same selection a bounded page at a time.)
        """
        request = self.request(
            filters,
            attributes=attributes,
            consistent=consistent,
            segment=segment,
            total_segments=total_segments,
            page_size=page_size,
        )
        if request is None:
            return
        operation, kwargs = request
        while True:
            page = self.fetch(operation, kwargs)
            for item in page.get("Items", []):
                if matches(item, filters, group=self.group):
                    yield item
            last = page.get("LastEvaluatedKey")
            if not last:
                return
            kwargs["ExclusiveStartKey"] = last

    def request(
        self,
        filters: Filters,
        *,
        attributes: Sequence[str] | None = None,
        consistent: bool = False,
        segment: int | None = None,
        total_segments: int | None = None,
        page_size: int | None = None,
    ) -> tuple[str, dict[str, Any]] | None:
        """(operation, arguments) of the first call `scan` makes for `filters` on the
        table itself (a Query with topic and partition, a Scan otherwise); None when
        this scan segment has nothing to read. Pure."""
        names: dict[str, str] = {"#o": "offset"}
        values: dict[str, Any] = {":zero": {"N": "0"}}
        kwargs: dict[str, Any] = {"TableName": self.table, "ConsistentRead": consistent}
        if page_size is not None:
            kwargs["Limit"] = page_size
        if attributes is not None:
            wanted = dict.fromkeys(
                (*attributes, "topic", "partition", "offset", "status", "reason", "group")
            )
            wanted.update(dict.fromkeys(("dead_lettered_at", "source")))
            aliases = {f"#a{i}": name for i, name in enumerate(wanted)}
            names.update(aliases)
            kwargs["ProjectionExpression"] = ", ".join(aliases)
        if filters.topic is not None and filters.partition is not None:
            if segment not in (None, 0):
                return None
            names["#src"] = "source"
            values[":src"] = {"S": dead_letter_source(filters.topic, filters.partition, self.group)}
            if filters.offset is not None:
                values[":off"] = {"N": str(filters.offset)}
                condition = "#src = :src AND #o = :off"
                del values[":zero"]
            else:
                condition = "#src = :src AND #o >= :zero"
            kwargs["KeyConditionExpression"] = condition
            if clauses := filter_clauses(filters, ("status",), names, values):
                kwargs["FilterExpression"] = " AND ".join(clauses)
            operation = "Query"
        else:
            clauses = ["#o >= :zero", "#g = :group"]
            names["#g"] = "group"
            values[":group"] = {"S": self.group}
            clauses += filter_clauses(filters, ("topic", "partition", "status"), names, values)
            kwargs["FilterExpression"] = " AND ".join(clauses)
            if total_segments is not None:
                kwargs["Segment"] = segment or 0
                kwargs["TotalSegments"] = total_segments
            operation = "Scan"
        kwargs["ExpressionAttributeNames"] = names
        kwargs["ExpressionAttributeValues"] = values
        return operation, kwargs

    def fetch(self, operation: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """One Query or Scan call (`operation`) with `kwargs`; its answer. Raises
        TableNotFound, DeadLetterUnavailable."""
        method = self._query if operation == "Query" else self._scan
        with self.errors(operation):
            page: Any = method(**kwargs)
        return dict(page)

    def _query(self, **kwargs: Any) -> Any:
        return self._client.query(**kwargs)

    def _scan(self, **kwargs: Any) -> Any:
        return self._client.scan(**kwargs)

    def get(self, key: DeadLetterKey) -> dict[str, Any]:
        """The item at `key` (consistent read); DeadLetterNotFound if there is none."""
        _, _, offset = key
        if offset < 0:
            raise DeadLetterNotFound(key)
        with self.errors("GetItem"):
            found: Any = self._client.get_item(
                TableName=self.table,
                Key=dead_letter_table_key(key, self.group),
                ConsistentRead=True,
            )
        item = found.get("Item")
        if item is None:
            raise DeadLetterNotFound(key)
        return dict(item)

    def get_many(self, keys: Sequence[DeadLetterKey]) -> list[dict[str, Any]]:
        """The items at `keys` (consistent reads, BatchGetItem, in `keys` order); keys with
        no item are left out. Raises TableNotFound, DeadLetterUnavailable."""
        found: dict[tuple[str, str], dict[str, Any]] = {}
        for start in range(0, len(keys), BATCH_GET):
            wanted: list[Any] = [
                dead_letter_table_key(key, self.group)
                for key in dict.fromkeys(keys[start : start + BATCH_GET])
                if key[2] >= 0
            ]
            for _ in range(BATCH_GET_ROUNDS):
                if not wanted:
                    break
                request: Any = {self.table: {"Keys": wanted, "ConsistentRead": True}}
                with self.errors("BatchGetItem"):
                    answer: Any = self._client.batch_get_item(RequestItems=request)
                for item in answer.get("Responses", {}).get(self.table, []):
                    found[(item["source"]["S"], item["offset"]["N"])] = dict(item)
                wanted = answer.get("UnprocessedKeys", {}).get(self.table, {}).get("Keys", [])
                if wanted:
                    time.sleep(BATCH_GET_BACKOFF_S)
            if wanted:
                raise DeadLetterUnavailable(
                    f"BatchGetItem on {self.table!r} left {len(wanted)} keys unread "
                    f"after {BATCH_GET_ROUNDS} tries (throttled?)"
                )
        ordered = []
        for key in keys:
            topic, partition, offset = key
            item = found.get((dead_letter_source(topic, partition, self.group), str(offset)))
            if item is not None:
                ordered.append(item)
        return ordered

    def load(self, item: Mapping[str, Any]) -> DeadLetter:
        """The dead letter of `item`, byte-exact (payload fetched from S3 if it is there)."""
        if PAYLOAD_S3_ATTR not in item:
            return load_dead_letter(item, None)
        return load_dead_letter(item, self._bucket_client())

    # --- status changes ---------------------------------------------------------------

    def claim(self, key: DeadLetterKey, replay_id: str, *, lease_s: float) -> bool:
        """Take `key` for replay `replay_id` for `lease_s`: True if it is pending and not
        claimed by another live replay (a stale claim, or our own, is taken over)."""
        now_ms = self.now_ms()
        return self._update(
            key,
            "SET #c = :id, #cu = :until",
            "#s = :pending AND (attribute_not_exists(#c) OR #c = :id OR #cu < :now)",
            {"#s": "status", "#c": CLAIM_ATTR, "#cu": CLAIM_UNTIL_ATTR},
            {
                ":id": {"S": replay_id},
                ":until": {"N": str(now_ms + round(lease_s * 1000))},
                ":now": {"N": str(now_ms)},
                ":pending": {"S": STATUS_PENDING},
            },
        )

    def release(self, key: DeadLetterKey, replay_id: str) -> bool:
        """Give up the claim of `replay_id` on `key` (its copy never reached the broker)."""
        return self._update(
            key,
            "REMOVE #c, #cu",
            "#c = :id",
            {"#c": CLAIM_ATTR, "#cu": CLAIM_UNTIL_ATTR},
            {":id": {"S": replay_id}},
        )

    def mark_replayed(
        self, key: DeadLetterKey, replay_id: str, replayed_to: str, item: Mapping[str, Any]
    ) -> bool:
        """Mark `key` replayed to `replayed_to`, if replay `replay_id` still claims it.

        Sets replayed_at, replayed_to, replay_id, replay_count (+1) and, with TTL on,
        expires_at; drops the claim. `item` is the item as read (for its S3 payload).
        """
        now = self._clock()
        names = {"#s": "status", "#c": CLAIM_ATTR, "#cu": CLAIM_UNTIL_ATTR, "#v": STATE_ATTR}
        values: dict[str, Any] = {
            ":replayed": {"S": STATUS_REPLAYED},
            ":state": {"S": state_key(STATUS_REPLAYED, self.group)},
            ":pending": {"S": STATUS_PENDING},
            ":at": {"S": format_iso_ms(int(now * 1000))},
            ":to": {"S": replayed_to},
            ":id": {"S": replay_id},
            ":zero": {"N": "0"},
            ":one": {"N": "1"},
        }
        update = (
            "SET #s = :replayed, #v = :state, replayed_at = :at, replayed_to = :to, "
            "replay_id = :id, replay_count = if_not_exists(replay_count, :zero) + :one"
        )
        update += self._expiry(now, values)
        done = self._update(
            key, update + " REMOVE #c, #cu", "#s = :pending AND #c = :id", names, values
        )
        if done:
            self._tag_settled(item)
        return done

    def discard(self, key: DeadLetterKey, item: Mapping[str, Any] | None = None) -> bool:
        """Mark `key` discarded if it is pending and no live replay claims it."""
        now = self._clock()
        values: dict[str, Any] = {
            ":discarded": {"S": STATUS_DISCARDED},
            ":state": {"S": state_key(STATUS_DISCARDED, self.group)},
            ":pending": {"S": STATUS_PENDING},
            ":at": {"S": format_iso_ms(int(now * 1000))},
            ":now": {"N": str(int(now * 1000))},
        }
        update = "SET #s = :discarded, #v = :state, discarded_at = :at" + self._expiry(now, values)
        done = self._update(
            key,
            update + " REMOVE #c, #cu",
            "#s = :pending AND (attribute_not_exists(#c) OR #cu < :now)",
            {"#s": "status", "#c": CLAIM_ATTR, "#cu": CLAIM_UNTIL_ATTR, "#v": STATE_ATTR},
            values,
        )
        if done and item is not None:
            self._tag_settled(item)
        return done

    def _expiry(self, now: float, values: dict[str, Any]) -> str:
        if self.settings.ttl_days is None:
            return ""
        values[":exp"] = {"N": str(int(now + self.settings.ttl_days * 86400))}
        return f", {EXPIRES_AT_ATTR} = :exp"

    def _update(
        self,
        key: DeadLetterKey,
        update: str,
        condition: str,
        names: dict[str, str],
        values: dict[str, Any],
    ) -> bool:
        with self.errors("UpdateItem", expect={CONDITION_FAILED}) as refused:
            self._client.update_item(
                TableName=self.table,
                Key=dead_letter_table_key(key, self.group),
                UpdateExpression=update,
                ConditionExpression=condition,
                ExpressionAttributeNames=names,
                ExpressionAttributeValues=values,
            )
        return not refused

    def _tag_settled(self, item: Mapping[str, Any]) -> None:
        """Tag the S3 payload of a settled item so the bucket's lifecycle rule expires it."""
        if self.settings.ttl_days is None or PAYLOAD_S3_ATTR not in item:
            return
        bucket, object_key = parse_s3_url(item[PAYLOAD_S3_ATTR]["S"])
        tag_key, tag_value = S3_SETTLED_TAG
        try:
            with aws_errors(f"tagging s3://{bucket}/{object_key}", DeadLetterUnavailable):
                self._bucket_client().put_object_tagging(
                    Bucket=bucket,
                    Key=object_key,
                    Tagging={"TagSet": [{"Key": tag_key, "Value": tag_value}]},
                )
        except DeadLetterUnavailable as exc:
            logger.warning("could not tag a payload for expiry (it will stay): %s", exc)

    # --- plumbing ---------------------------------------------------------------------

    def _bucket_client(self) -> S3Client:
        with self._s3_lock:
            if self._s3 is None:
                self._s3 = s3_client(self.settings, max_attempts=TABLE_ATTEMPTS)
                self._own_s3 = True
            return self._s3

    def now_ms(self) -> int:
        """The table's wall clock (`clock`) in ms: what claims are judged stale by."""
        return int(self._clock() * 1000)

    @property
    def client(self) -> DynamoDBClient:
        """The DynamoDB client (for `migrate.py`, which reads and writes legacy keys)."""
        return self._client

    @contextmanager
    def errors(self, operation: str, *, expect: Collection[str] = ()) -> Iterator[AwsAnswer]:
        """aws_errors for one call on the table: TableNotFound when the table does not
        exist, DeadLetterUnavailable when DynamoDB does not answer."""
        where = self.settings.endpoint_url or f"AWS {self.settings.region}"
        with aws_errors(
            f"{operation} on {self.table!r} at {where}",
            DeadLetterUnavailable,
            expect={TABLE_MISSING, *expect},
        ) as answer:
            yield answer
        if answer.code == TABLE_MISSING:
            raise TableNotFound(self.table) from answer.error

    def close(self) -> None:
        """Close the clients this object created; safe twice."""
        if self._own:
            self._client.close()
        if self._own_s3 and self._s3 is not None:
            self._s3.close()

    def __enter__(self) -> DeadLetterTable:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
