"""The dead-letter table as the tools see it: select, inspect, replay and discard items.

Why a module of its own: `triage dlq` (a handful of items) and the Spark replay job
(millions, one scan segment per task) must select exactly the same items and must
replay them the same way, or a rerun of one after the other would replay twice. So
everything they share lives here, with no CLI and no Spark in it:

- `Filters` (frozen) and the pure `matches(item, filters)`: the single definition of
  "selected"; `parse_time` for `--since/--until` (ISO-8601 or relative like `1h`).
- `DeadLetterTable`: paginated Query/Scan (parallel-scan segments for Spark) that
  never yields the checkpoint items (`offset < 0`), `get`, `load` (follows S3
  pointers), and the conditional status changes.
- `replay(...)`: claim -> produce -> confirmed delivery -> mark `replayed`.
- Rendering for people (`render_bytes`, `item_summary`) that never crashes on binary
  and never writes terminal control characters.

Status changes (all conditional UpdateItem calls, so concurrent tools cannot race):

    pending --claim(replay_id)--> pending + replay_claim --mark_replayed--> replayed
                                         |   (delivery failed before the broker
                                         +-- had it: release) --> pending
    pending (unclaimed, or claim stale) --discard--> discarded

A replay first *claims* each item (`replay_claim` = its replay id, valid until
`replay_claim_until`), so two replays running at once never both produce it. It marks
the item `replayed` (with `replayed_at`, `replayed_to`, `replay_id`, `replay_count`, and
`expires_at` when TTL is on) only after the producer's delivery callback confirmed the
message, and only while it still holds the claim, so a rerun skips it. When delivery
failed in a way that means the broker never took it (still queued, unknown topic,
too large), the claim is released and a rerun tries again. When the outcome is unknown
(timed out or purged in flight) the claim is kept: the item is skipped until the claim
goes stale (`DEFAULT_CLAIM_LEASE_S`), after which a rerun may replay it once more.
That, and a crash between a confirmed delivery and the mark, are the only ways an
item can be produced twice; the `triage-replay-of` header lets a consumer drop such a
duplicate.

Errors added to the tree of `errors.py` (callers tell "not there" from "broken"):

    TriageError
    +-- NotFoundError             what was asked for does not exist (not retriable)
        +-- TableNotFound         the configured dead-letter table does not exist
        +-- DeadLetterNotFound    no item at (topic, partition, offset)

Unreachable DynamoDB or S3 raises `DeadLetterUnavailable` (botocore errors are
translated here, at the adapter edge).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import itertools
import json
import logging
import re
import threading
import time
import unicodedata
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from triage_proxy.deadletter import (
    CLAIM_ATTR,
    CLAIM_UNTIL_ATTR,
    EXPIRES_AT_ATTR,
    PAYLOAD_BYTES_ATTR,
    PAYLOAD_S3_ATTR,
    S3_SETTLED_TAG,
    STATUS_DISCARDED,
    STATUS_PENDING,
    STATUS_REPLAYED,
    STATUSES,
    DeadLetterKey,
    dynamodb_client,
    format_iso_ms,
    load_dead_letter,
    parse_iso_ms,
    parse_s3_url,
    s3_client,
)
from triage_proxy.errors import DeadLetterUnavailable, NotFoundError, TriageError
from triage_proxy.settings import DeadLetterSettings
from triage_proxy.structs import DeadLetter

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.client import DynamoDBClient
    from mypy_boto3_s3.client import S3Client

logger = logging.getLogger(__name__)

REPLAY_OF_HEADER = "triage-replay-of"
"""Provenance header: "<topic>/<partition>/<offset>" of the dead letter replayed."""
REPLAY_REASON_HEADER = "triage-replay-reason"
"""Provenance header: the reason the message was dead-lettered (UTF-8)."""
REPLAY_ID_HEADER = "triage-replay-id"
"""Provenance header: the id of the replay run that produced this copy."""
DEFAULT_CLAIM_LEASE_S = 900.0
"""How long a replay's claim keeps other replays off an item it has not marked yet."""
DEFAULT_REPLAY_CHUNK = 500
"""Items claimed, produced and confirmed together by `replay`."""
DEFAULT_FLUSH_TIMEOUT_S = 30.0
"""How long `replay` waits for the broker to confirm one chunk."""
HEX_DUMP_LIMIT = 4096
"""Binary payloads up to this size render as a hex dump, larger ones as base64."""
TABLE_ATTEMPTS = 5
"""botocore attempts per call for the tools (a lost mark would mean a second replay)."""
LIST_ATTRIBUTES = (
    "source",
    "offset",
    "topic",
    "partition",
    "key",
    "timestamp_ms",
    "reason",
    "attempts",
    "consumer_id",
    "dead_lettered_at",
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
"""What listing reads: everything but the value and headers (which may be 400 KB)."""

_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# delivery errors after which the broker may hold the message: keep the claim
_MAYBE_DELIVERED = {"_MSG_TIMED_OUT", "_PURGE_INFLIGHT", "_TIMED_OUT", "REQUEST_TIMED_OUT"}


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


def matches(item: Mapping[str, Any], filters: Filters) -> bool:
    """Whether a low-level DynamoDB item is a dead letter `filters` selects. Pure.

    Items with a negative offset (commit checkpoints) are never dead letters.
    """
    offset = int(item["offset"]["N"])
    if offset < 0:
        return False
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


def item_key(item: Mapping[str, Any]) -> DeadLetterKey:
    """(topic, partition, offset) of a low-level item."""
    return (item["topic"]["S"], int(item["partition"]["N"]), int(item["offset"]["N"]))


def _key_attrs(key: DeadLetterKey) -> dict[str, Any]:
    topic, partition, offset = key
    return {"source": {"S": f"{topic}#{partition}"}, "offset": {"N": str(offset)}}


# --- rendering for people -------------------------------------------------------------


@dataclass(frozen=True)
class Rendering:
    """Bytes made safe to print."""

    kind: str
    """`null`, `empty`, `json`, `text`, `hex` or `base64`."""
    text: str
    """What to print: no control characters but newlines and tabs."""


def render_bytes(data: bytes | None, *, hex_limit: int = HEX_DUMP_LIMIT) -> Rendering:
    """UTF-8 text if it decodes cleanly (JSON objects and arrays pretty-printed), else a
    hex dump up to `hex_limit` bytes, else base64. Never raises."""
    if data is None:
        return Rendering("null", "(null)")
    if not data:
        return Rendering("empty", "(empty)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and not any(
        unicodedata.category(c) == "Cc" and c not in "\t\n\r" for c in text
    ):
        pretty = _pretty_json(text)
        if pretty is not None:
            return Rendering("json", safe_text(pretty))
        return Rendering("text", safe_text(text))
    if len(data) <= hex_limit:
        return Rendering("hex", hex_dump(data))
    return Rendering("base64", base64.b64encode(data).decode("ascii"))


def _pretty_json(text: str) -> str | None:
    stripped = text.strip()
    if not stripped or stripped[0] not in "{[":
        return None

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate key")  # pretty-printing would drop one
        return dict(pairs)

    try:
        parsed = json.loads(stripped, object_pairs_hook=no_duplicates)
    except (ValueError, RecursionError):
        return None
    return json.dumps(parsed, indent=2, ensure_ascii=False)


def safe_text(text: str) -> str:
    """`text` with every control or format character but newline and tab escaped
    (\\r, \\x1b, \\u202e ...), so printing it cannot drive the terminal."""
    out: list[str] = []
    for c in text:
        if c in "\n\t" or unicodedata.category(c) not in ("Cc", "Cf", "Cs", "Zl", "Zp"):
            out.append(c)
        elif c == "\r":
            out.append("\\r")
        elif ord(c) <= 0xFF:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(f"\\u{ord(c):04x}")
    return "".join(out)


def hex_dump(data: bytes, width: int = 16) -> str:
    """`xxd`-style lines: offset, hex bytes, printable ASCII (others as '.')."""
    lines = []
    for start in range(0, len(data), width):
        chunk = data[start : start + width]
        hexes = " ".join(f"{b:02x}" for b in chunk)
        ascii_ = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in chunk)
        lines.append(f"{start:08x}  {hexes:<{width * 3 - 1}}  {ascii_}")
    return "\n".join(lines)


def short_text(data: bytes | None, limit: int = 32) -> str:
    """A one-line rendering of a key for tables, cut to `limit` characters."""
    shown = render_bytes(data, hex_limit=0)
    if shown.kind == "base64":  # binary: show hex, it reads better in a column
        assert data is not None
        text = binascii.hexlify(data[: limit // 2]).decode() + (
            "…" if len(data) > limit // 2 else ""
        )
        return f"0x{text}"
    one_line = shown.text.replace("\n", "\\n").replace("\t", "\\t")
    return one_line if len(one_line) <= limit else one_line[: limit - 1] + "…"


def item_summary(item: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON-ready dict of an item's metadata (no value or headers): what
    `triage dlq list --json` prints per line and what an export can keep."""

    def s(name: str) -> str | None:
        attr = item.get(name)
        return None if attr is None else str(attr["S"])

    def n(name: str) -> int | None:
        attr = item.get(name)
        return None if attr is None else int(attr["N"])

    key = item.get("key")
    return {
        "topic": s("topic"),
        "partition": n("partition"),
        "offset": n("offset"),
        "status": s("status"),
        "reason": s("reason"),
        "attempts": n("attempts"),
        "consumer_id": s("consumer_id"),
        "dead_lettered_at": s("dead_lettered_at"),
        "timestamp_ms": n("timestamp_ms"),
        "key_b64": None if key is None else base64.b64encode(bytes(key["B"])).decode("ascii"),
        "payload_s3": s(PAYLOAD_S3_ATTR),
        "payload_bytes": n(PAYLOAD_BYTES_ATTR),
        "replayed_at": s("replayed_at"),
        "replayed_to": s("replayed_to"),
        "replay_count": n("replay_count"),
        "replay_id": s("replay_id"),
        "discarded_at": s("discarded_at"),
        "expires_at": n(EXPIRES_AT_ATTR),
        "replay_claim": s(CLAIM_ATTR),
    }


# --- replay headers -------------------------------------------------------------------


def new_replay_id() -> str:
    """A fresh id for one replay run (goes into items and headers)."""
    return uuid.uuid4().hex


def provenance_headers(dl: DeadLetter, replay_id: str) -> list[tuple[str, bytes]]:
    """The headers a replayed copy carries in addition to the original ones."""
    record = dl.record
    return [
        (REPLAY_OF_HEADER, f"{record.topic}/{record.partition}/{record.offset}".encode()),
        (REPLAY_REASON_HEADER, dl.reason.encode("utf-8", "surrogateescape")),
        (REPLAY_ID_HEADER, replay_id.encode()),
    ]


def replay_headers(dl: DeadLetter, replay_id: str) -> list[tuple[str, bytes | None]]:
    """Original headers (order, duplicates and nulls kept), then the provenance headers."""
    return [*dl.record.headers, *provenance_headers(dl, replay_id)]


# --- the table ------------------------------------------------------------------------


class DeadLetterTable:
    """The dead-letter table (and overflow bucket) for tools; sync, thread-safe clients.

    Build it from the same `DeadLetterSettings` the proxy uses, or hand it clients (the
    Spark executors build their own). `clock` gives wall time in seconds (for claims,
    replay times and TTL). Close it, or use it as a context manager.
    """

    def __init__(
        self,
        settings: DeadLetterSettings,
        *,
        dynamodb: DynamoDBClient | None = None,
        s3: S3Client | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        self.settings = settings
        self.table = settings.table
        self._errors = (BotoCoreError, ClientError)
        self._client_error = ClientError
        self._clock = clock
        self._own = dynamodb is None
        self._client = dynamodb or dynamodb_client(settings, max_attempts=TABLE_ATTEMPTS)
        self._s3 = s3
        self._own_s3 = False
        self._s3_lock = threading.Lock()

    # --- reading ----------------------------------------------------------------------

    def check(self) -> None:
        """Raise TableNotFound or DeadLetterUnavailable unless the table can be used."""
        self._call("DescribeTable", lambda: self._client.describe_table(TableName=self.table))

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
        """Every item `filters` selects, page by page, never a checkpoint item.

        With topic and partition given it is one Query on that partition (offset order;
        only segment 0 yields it). Otherwise a Scan, optionally one segment of a parallel
        scan. `attributes` limits what is read (e.g. LIST_ATTRIBUTES); the attributes
        `matches` needs are always read. Raises TableNotFound, DeadLetterUnavailable.
        """
        names: dict[str, str] = {"#o": "offset"}
        values: dict[str, Any] = {":zero": {"N": "0"}}
        kwargs: dict[str, Any] = {"TableName": self.table, "ConsistentRead": consistent}
        if page_size is not None:
            kwargs["Limit"] = page_size
        if attributes is not None:
            wanted = dict.fromkeys(
                (*attributes, "topic", "partition", "offset", "status", "reason")
            )
            wanted.update(dict.fromkeys(("dead_lettered_at", "source")))
            aliases = {f"#a{i}": name for i, name in enumerate(wanted)}
            names.update(aliases)
            kwargs["ProjectionExpression"] = ", ".join(aliases)
        if filters.topic is not None and filters.partition is not None:
            if segment not in (None, 0):
                return
            names["#src"] = "source"
            values[":src"] = {"S": f"{filters.topic}#{filters.partition}"}
            if filters.offset is not None:
                values[":off"] = {"N": str(filters.offset)}
                condition = "#src = :src AND #o = :off"
                del values[":zero"]
            else:
                condition = "#src = :src AND #o >= :zero"
            kwargs["KeyConditionExpression"] = condition
            operation, method = "Query", self._query
        else:
            clauses = ["#o >= :zero"]
            if filters.topic is not None:
                names["#t"] = "topic"
                values[":topic"] = {"S": filters.topic}
                clauses.append("#t = :topic")
            if filters.status is not None:
                names["#s"] = "status"
                values[":status"] = {"S": filters.status}
                clauses.append("#s = :status")
            kwargs["FilterExpression"] = " AND ".join(clauses)
            if total_segments is not None:
                kwargs["Segment"] = segment or 0
                kwargs["TotalSegments"] = total_segments
            operation, method = "Scan", self._scan
        kwargs["ExpressionAttributeNames"] = names
        kwargs["ExpressionAttributeValues"] = values
        while True:
            page: Any = self._call(operation, lambda: method(**kwargs))
            for item in page.get("Items", []):
                if matches(item, filters):
                    yield item
            last = page.get("LastEvaluatedKey")
            if not last:
                return
            kwargs["ExclusiveStartKey"] = last

    def _query(self, **kwargs: Any) -> Any:
        return self._client.query(**kwargs)

    def _scan(self, **kwargs: Any) -> Any:
        return self._client.scan(**kwargs)

    def get(self, key: DeadLetterKey) -> dict[str, Any]:
        """The item at `key` (consistent read); DeadLetterNotFound if there is none."""
        _, _, offset = key
        if offset < 0:
            raise DeadLetterNotFound(key)
        found: Any = self._call(
            "GetItem",
            lambda: self._client.get_item(
                TableName=self.table, Key=_key_attrs(key), ConsistentRead=True
            ),
        )
        item = found.get("Item")
        if item is None:
            raise DeadLetterNotFound(key)
        return dict(item)

    def load(self, item: Mapping[str, Any]) -> DeadLetter:
        """The dead letter of `item`, byte-exact (payload fetched from S3 if it is there)."""
        if PAYLOAD_S3_ATTR not in item:
            return load_dead_letter(item, None)
        return load_dead_letter(item, self._bucket_client())

    # --- status changes ---------------------------------------------------------------

    def claim(self, key: DeadLetterKey, replay_id: str, *, lease_s: float) -> bool:
        """Take `key` for replay `replay_id` for `lease_s`: True if it is pending and not
        claimed by another live replay (a stale claim, or our own, is taken over)."""
        now_ms = self._now_ms()
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
        names = {"#s": "status", "#c": CLAIM_ATTR, "#cu": CLAIM_UNTIL_ATTR}
        values: dict[str, Any] = {
            ":replayed": {"S": STATUS_REPLAYED},
            ":pending": {"S": STATUS_PENDING},
            ":at": {"S": format_iso_ms(int(now * 1000))},
            ":to": {"S": replayed_to},
            ":id": {"S": replay_id},
            ":zero": {"N": "0"},
            ":one": {"N": "1"},
        }
        update = (
            "SET #s = :replayed, replayed_at = :at, replayed_to = :to, replay_id = :id, "
            "replay_count = if_not_exists(replay_count, :zero) + :one"
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
            ":pending": {"S": STATUS_PENDING},
            ":at": {"S": format_iso_ms(int(now * 1000))},
            ":now": {"N": str(int(now * 1000))},
        }
        update = "SET #s = :discarded, discarded_at = :at" + self._expiry(now, values)
        done = self._update(
            key,
            update + " REMOVE #c, #cu",
            "#s = :pending AND (attribute_not_exists(#c) OR #cu < :now)",
            {"#s": "status", "#c": CLAIM_ATTR, "#cu": CLAIM_UNTIL_ATTR},
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
        try:
            self._client.update_item(
                TableName=self.table,
                Key=_key_attrs(key),
                UpdateExpression=update,
                ConditionExpression=condition,
                ExpressionAttributeNames=names,
                ExpressionAttributeValues=values,
            )
        except self._client_error as exc:
            if _code(exc) == "ConditionalCheckFailedException":
                return False
            raise self._translate("UpdateItem", exc) from exc
        except self._errors as exc:
            raise self._translate("UpdateItem", exc) from exc
        return True

    def _tag_settled(self, item: Mapping[str, Any]) -> None:
        """Tag the S3 payload of a settled item so the bucket's lifecycle rule expires it."""
        if self.settings.ttl_days is None or PAYLOAD_S3_ATTR not in item:
            return
        bucket, object_key = parse_s3_url(item[PAYLOAD_S3_ATTR]["S"])
        tag_key, tag_value = S3_SETTLED_TAG
        try:
            self._bucket_client().put_object_tagging(
                Bucket=bucket,
                Key=object_key,
                Tagging={"TagSet": [{"Key": tag_key, "Value": tag_value}]},
            )
        except self._errors as exc:
            logger.warning(
                "could not tag s3://%s/%s for expiry (it will stay): %s",
                bucket,
                object_key,
                _code(exc) or type(exc).__name__,
            )

    # --- plumbing ---------------------------------------------------------------------

    def _bucket_client(self) -> S3Client:
        with self._s3_lock:
            if self._s3 is None:
                self._s3 = s3_client(self.settings, max_attempts=TABLE_ATTEMPTS)
                self._own_s3 = True
            return self._s3

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _call(self, operation: str, call: Callable[[], object]) -> object:
        try:
            return call()
        except self._errors as exc:
            raise self._translate(operation, exc) from exc

    def _translate(self, operation: str, exc: Exception) -> TriageError:
        if _code(exc) == "ResourceNotFoundException":
            return TableNotFound(self.table)
        where = self.settings.endpoint_url or f"AWS {self.settings.region}"
        detail = _code(exc) or type(exc).__name__
        response = getattr(exc, "response", None) or {}  # None on e.g. ReadTimeoutError
        message = response.get("Error", {}).get("Message") or str(exc)
        return DeadLetterUnavailable(
            f"{operation} on {self.table!r} at {where}: {detail}: {message}"
        )

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


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


# --- replay ---------------------------------------------------------------------------


class Producer(Protocol):
    """The part of confluent_kafka.Producer that replay uses."""

    def produce(self, topic: str, **kwargs: Any) -> None: ...

    def poll(self, timeout: float) -> int: ...

    def flush(self, timeout: float) -> int: ...

    def purge(
        self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True
    ) -> None: ...


@dataclass
class ReplayResult:
    """What one `replay` call did, item by item."""

    replayed: list[DeadLetterKey] = field(default_factory=list)
    """Produced, confirmed by the broker and marked `replayed`."""
    skipped: list[tuple[DeadLetterKey, str]] = field(default_factory=list)
    """Not produced: no longer pending, or claimed by another live replay."""
    failed: list[tuple[DeadLetterKey, str]] = field(default_factory=list)
    """Not confirmed: the delivery failed or its outcome is unknown (see `why`)."""
    interrupted: bool = False
    """True when `stop` ended the run before every selected item was tried."""

    def merge(self, other: ReplayResult) -> None:
        self.replayed.extend(other.replayed)
        self.skipped.extend(other.skipped)
        self.failed.extend(other.failed)
        self.interrupted = self.interrupted or other.interrupted


def replay(
    table: DeadLetterTable,
    producer: Producer,
    items: Iterable[Mapping[str, Any]],
    *,
    replay_id: str,
    to_topic: str | None = None,
    chunk: int = DEFAULT_REPLAY_CHUNK,
    flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S,
    lease_s: float = DEFAULT_CLAIM_LEASE_S,
    stop: threading.Event | None = None,
) -> ReplayResult:
    """Produce the dead letters of `items` again and mark them replayed; see the module
    docstring for the claim/confirm/mark protocol that makes reruns and concurrent
    runs safe.

    Each copy has the original key, value and headers plus the provenance headers. It
    goes to `to_topic` (chosen there by the producer's partitioner) or, by default, back
    to the partition it came from. `items` are low-level items (e.g. from
    `table.scan(..., consistent=True)`); items that are not pending are skipped.
    `stop` is checked between chunks. Raises DeadLetterUnavailable if the table stops
    answering (claims already taken then expire after `lease_s`).
    """
    result = ReplayResult()
    iterator = iter(items)
    while True:
        if stop is not None and stop.is_set():
            result.interrupted = next(iterator, None) is not None
            return result
        batch = list(itertools.islice(iterator, chunk))
        if not batch:
            return result
        result.merge(
            _replay_chunk(table, producer, batch, replay_id, to_topic, flush_timeout_s, lease_s)
        )


def _replay_chunk(
    table: DeadLetterTable,
    producer: Producer,
    batch: list[Mapping[str, Any]],
    replay_id: str,
    to_topic: str | None,
    flush_timeout_s: float,
    lease_s: float,
) -> ReplayResult:
    result = ReplayResult()
    claimed: list[tuple[DeadLetterKey, Mapping[str, Any], DeadLetter]] = []
    for item in batch:
        key = item_key(item)
        status = item["status"]["S"]
        if status != STATUS_PENDING:
            result.skipped.append((key, f"status is {status}"))
            continue
        if not table.claim(key, replay_id, lease_s=lease_s):
            result.skipped.append((key, "no longer pending, or another replay holds it"))
            continue
        try:
            dl = table.load(item)
        except (ValueError, DeadLetterUnavailable) as exc:
            table.release(key, replay_id)
            result.failed.append((key, f"payload unreadable: {exc}"))
            continue
        claimed.append((key, item, dl))
    outcomes: dict[DeadLetterKey, Any] = {}

    def on_delivery(key: DeadLetterKey) -> Callable[[Any, Any], None]:
        def record(err: Any, msg: Any) -> None:
            outcomes[key] = err

        return record

    for key, _, dl in claimed:
        record = dl.record
        kwargs: dict[str, Any] = {
            "key": record.key,
            "value": record.value,
            "headers": replay_headers(dl, replay_id),
            "on_delivery": on_delivery(key),
        }
        if to_topic is None or to_topic == record.topic:
            kwargs["partition"] = record.partition
        while True:
            try:
                producer.produce(to_topic or record.topic, **kwargs)
                break
            except BufferError:
                producer.poll(0.1)
    if claimed and producer.flush(flush_timeout_s) > 0:
        producer.purge(in_queue=True, in_flight=True, blocking=True)
        producer.poll(0)
    for key, item, dl in claimed:
        target = to_topic or dl.record.topic
        if key not in outcomes:
            result.failed.append((key, "delivery not confirmed; claim kept until it expires"))
            continue
        err = outcomes[key]
        if err is not None:
            name = str(getattr(err, "name", lambda: "")() or err)
            if name in _MAYBE_DELIVERED:
                result.failed.append((key, f"{name}: outcome unknown; claim kept until it expires"))
            else:
                table.release(key, replay_id)
                result.failed.append((key, f"delivery failed: {err}"))
            continue
        if table.mark_replayed(key, replay_id, target, item):
            result.replayed.append(key)
        else:
            logger.warning(
                "%s/%d/%d was produced but its claim was lost before it was marked; "
                "it may be replayed again",
                *key,
            )
            result.failed.append((key, "produced, but the claim was lost before marking"))
    return result
