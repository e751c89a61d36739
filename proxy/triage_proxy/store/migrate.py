"""Moving legacy dead letters (written before deployment keys) to a deployment's keys.

Why a command and not a second way of reading: before deployment keys a dead letter was
keyed `<topic>#<partition>` with no group, so nothing in it says which deployment wrote
it. Reading such items as everyone's would bring back the collision keys exist to end
(billing replaying shipping's dead letters); reading them as one deployment's would need
that deployment named anyway, and every read path (list, show, replay, discard, status,
Spark) would carry two formats for good. So the operator names the deployment once
(`triage dlq migrate --config F [--group G]`, the config's `kafka.group_id` by default)
and this module moves the topic's legacy dead letters to it; afterwards there is one
format. Checkpoint keys always held the group (nothing to move) and leases lapse by
themselves (`leases.py` still honours a live legacy lease).

One legacy item L at (topic, partition, offset), with N the deployment's item there:

    L claimed by a live replay        in use    left as is (an old `triage dlq replay` is
                                                 producing it): rerun once it is done
    N absent                          moved      N := L with the new key and `group`
    N pending and unclaimed           replaced   the same message dead-lettered again by a
                                                 new proxy; N := L (L's status wins, so a
                                                 replayed L keeps a second replay away)
    N replayed, discarded or claimed  conflict   both left as they are and reported: the
                                                 deployment already settled that offset;
                                                 with `drop_conflicts` L is deleted
                                                 (dropped): the operator's call that N's
                                                 settlement stands

A move is ONE TransactWriteItems: put N (if N is still as planned: absent, or pending and
unclaimed) and delete L (if L is still as read: same status, `dead_lettered_at` and
claim). So nothing is lost at any crash: either both happened or neither did, and a rerun
picks up what is left (idempotent and resumable: moved items are legacy no more). An old
proxy or tool that writes L meanwhile makes the transaction fail (`changed`: rerun). An
old proxy still running writes new legacy items the run may not see; the intended order
is: stop the old proxies, start the new ones, then migrate (dry run first). Each moved
item keeps every attribute, its S3 payload pointer (`payload_s3`, a URL: the object does
not move) and a stale claim (then it is in doubt, as it was).

Dry run (`apply=False`) reads and plans without writing.

Indexing (`Indexing`, also run by `triage dlq migrate`): tables created before the
`by-state` index (items.py) get it (UpdateTable, `provisioning.ensure_state_index`), and
every dead letter of every deployment without the right `dl_state` gets it, one
conditional UpdateItem each (`status` still as read, `dl_state` still absent or as read,
so a concurrent mark or discard wins). When a full pass set them all, it writes the
index marker item, from which on the tools list through the index. Idempotent and
resumable: a rerun scans again and writes only what is still missing. Stop the proxies
older than the index first (they write items without `dl_state`), as for the move above.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from triage_proxy.errors import TriageError
from triage_proxy.store.aws import CHECK_FAILED, CONDITION_FAILED, TRANSACTION_CANCELLED
from triage_proxy.store.deadletter_store import writable
from triage_proxy.store.items import (
    CLAIM_ATTR,
    CLAIM_UNTIL_ATTR,
    GROUP_ATTR,
    STATE_ATTR,
    DeadLetterKey,
    dead_letter_table_key,
    is_legacy_dead_letter,
    item_key,
    legacy_dead_letter_source,
    state_key,
    table_key,
)
from triage_proxy.store.provisioning import ensure_state_index, mark_indexed
from triage_proxy.store.query import DeadLetterNotFound, DeadLetterTable

logger = logging.getLogger(__name__)

MIGRATE_HINT = "triage dlq migrate --config {config} (--dry-run first)"
"""What moves them (the command every warning below names)."""


def legacy_partitions(table: DeadLetterTable, topic: str, partitions: Iterable[int]) -> list[int]:
    """The partitions of `topic` that still hold legacy dead letters, which no command
    shows until `triage dlq migrate` moves them: one Query per partition,
    Limit 1 (cheap enough for every `triage status`, `dlq list` and proxy start)."""
    found = []
    for partition in partitions:
        with table.errors("Query"):
            page: Any = table.client.query(
                TableName=table.table,
                KeyConditionExpression="#s = :s",
                ExpressionAttributeNames={"#s": "source"},
                ExpressionAttributeValues={
                    ":s": {"S": legacy_dead_letter_source(topic, partition)}
                },
                ProjectionExpression="#s",
                Limit=1,
            )
        if page.get("Items"):
            found.append(partition)
    return found


def legacy_warning(topic: str, partitions: Sequence[int], config: str = "<config>") -> str:
    """The one wording of the warning about legacy dead letters in `partitions`."""
    where = ", ".join(map(str, partitions))
    many = "s" if len(partitions) > 1 else ""
    return (
        f"dead letters of {topic!r} written before deployment keys (partition{many} {where}) "
        f"are not shown or replayed until moved: {MIGRATE_HINT.format(config=config)}"
    )


class LegacyCheck:
    """A proxy's look for legacy dead letters: once per partition it starts to serve, one
    WARNING when that partition still has some (it neither shows nor replays them until
    `triage dlq migrate`)."""

    def __init__(self, table: DeadLetterTable, topic: str) -> None:
        self._table = table
        self._topic = topic
        self._checked: set[int] = set()
        """Partitions looked at (once per process)."""

    def due(self, partition: int) -> bool:
        """True the first time `partition` is asked about (then `warn` looks)."""
        if partition in self._checked:
            return False
        self._checked.add(partition)
        return True

    async def warn(self, partition: int) -> None:
        """Look (in a thread: a DynamoDB Query) and warn if any are left."""
        topic = self._topic
        try:
            found = await asyncio.to_thread(legacy_partitions, self._table, topic, [partition])
        except TriageError as exc:
            logger.debug("partition %d: legacy dead letters not looked for: %s", partition, exc)
            return
        if found:
            logger.warning("%s", legacy_warning(topic, found))


class Move(enum.Enum):
    """What migrating one legacy item does (or, in a dry run, would do)."""

    MOVED = "moved"
    """Copied to the deployment's key and deleted, in one transaction."""
    REPLACED = "replaced"
    """As MOVED, over the deployment's pending, unclaimed copy of the same message."""
    IN_USE = "in_use"
    """Left: a live replay claims it."""
    CONFLICT = "conflict"
    """Left: the deployment's item there is replayed, discarded or claimed."""
    DROPPED = "dropped"
    """Deleted (`drop_conflicts`): a conflict resolved for the deployment's item, which
    settled that offset already; without it the legacy copy warns forever."""
    CHANGED = "changed"
    """Left: it (or the deployment's item) changed between the read and the move."""


def plan_move(legacy: Mapping[str, Any], current: Mapping[str, Any] | None, now_ms: int) -> Move:
    """What to do with `legacy` given the deployment's item at its offset (`current`,
    None if absent), at wall time `now_ms` (to judge its claim). Pure."""
    if CLAIM_ATTR in legacy and int(legacy.get(CLAIM_UNTIL_ATTR, {}).get("N", "0")) >= now_ms:
        return Move.IN_USE
    if current is None:
        return Move.MOVED
    if writable(current):
        return Move.REPLACED
    return Move.CONFLICT


def migrated_item(legacy: Mapping[str, Any], group: str) -> dict[str, Any]:
    """`legacy` keyed for deployment `group`: every attribute kept, `group` and its
    `dl_state` (for the `by-state` index) added."""
    topic, partition, offset = item_key(legacy)
    return {
        **legacy,
        **dead_letter_table_key((topic, partition, offset), group),
        GROUP_ATTR: {"S": group},
        STATE_ATTR: {"S": state_key(legacy["status"]["S"], group)},
    }


@dataclass
class MigrationResult:
    """What a migration did (or would do), item by item."""

    moves: dict[Move, list[DeadLetterKey]] = field(
        default_factory=lambda: {move: [] for move in Move}
    )
    """(topic, partition, offset) of every legacy item seen, by what happened to it."""
    interrupted: bool = False
    """True when `stop` ended the run before every legacy item was seen."""

    def count(self, move: Move) -> int:
        return len(self.moves[move])

    @property
    def left(self) -> int:
        """Legacy items still there after the run (all of them in a dry run)."""
        return sum(self.count(m) for m in (Move.IN_USE, Move.CONFLICT, Move.CHANGED))


class Migration:
    """Moves the legacy dead letters of `topic` to the deployment of `table` (its group)."""

    def __init__(self, table: DeadLetterTable, topic: str) -> None:
        if not topic or "#" in topic:
            raise ValueError(f"not a Kafka topic name: {topic!r}")
        self.table = table
        self.topic = topic

    def legacy_items(self) -> Iterator[dict[str, Any]]:
        """Every legacy dead letter of the topic (consistent scan, page by page)."""
        kwargs: dict[str, Any] = {
            "TableName": self.table.table,
            "ConsistentRead": True,
            "FilterExpression": "#o >= :zero AND attribute_not_exists(#g) AND #t = :topic",
            "ExpressionAttributeNames": {"#o": "offset", "#g": GROUP_ATTR, "#t": "topic"},
            "ExpressionAttributeValues": {":zero": {"N": "0"}, ":topic": {"S": self.topic}},
        }
        while True:
            with self.table.errors("Scan"):
                page: Any = self.table.client.scan(**kwargs)
            for item in page.get("Items", []):
                if is_legacy_dead_letter(item):
                    yield dict(item)
            last = page.get("LastEvaluatedKey")
            if not last:
                return
            kwargs["ExclusiveStartKey"] = last

    def run(
        self,
        *,
        apply: bool,
        stop: threading.Event | None = None,
        drop_conflicts: bool = False,
    ) -> MigrationResult:
        """Plan every legacy item and, with `apply`, move it (and with `drop_conflicts`
        delete a conflicting one); `stop` is checked between items (each step is atomic
        on its own)."""
        result = MigrationResult()
        for item in self.legacy_items():
            if stop is not None and stop.is_set():
                result.interrupted = True
                return result
            move = self.plan(item)
            if move is Move.CONFLICT and drop_conflicts:
                move = Move.DROPPED
            if apply and move in (Move.MOVED, Move.REPLACED) and not self.move(item, move):
                move = Move.CHANGED
            if apply and move is Move.DROPPED and not self.drop(item):
                move = Move.CHANGED
            result.moves[move].append(item_key(item))
        return result

    def plan(self, legacy: Mapping[str, Any]) -> Move:
        """`plan_move` with the deployment's item as it stands now."""
        try:
            current: dict[str, Any] | None = self.table.get(item_key(legacy))
        except DeadLetterNotFound:
            current = None
        return plan_move(legacy, current, self.table.now_ms())

    def move(self, legacy: Mapping[str, Any], move: Move) -> bool:
        """Put the copy and delete `legacy` in one transaction; False if either was not
        as planned any more (nothing written then)."""
        topic, partition, offset = item_key(legacy)
        if move is Move.MOVED:
            put_condition = "attribute_not_exists(#src)"
            put_names = {"#src": "source"}
            put_values: dict[str, Any] = {}
        else:
            put_condition = "#s = :pending AND attribute_not_exists(#c)"
            put_names = {"#s": "status", "#c": CLAIM_ATTR}
            put_values = {":pending": {"S": "pending"}}
        put: dict[str, Any] = {
            "TableName": self.table.table,
            "Item": migrated_item(legacy, self.table.group),
            "ConditionExpression": put_condition,
            "ExpressionAttributeNames": put_names,
        }
        if put_values:
            put["ExpressionAttributeValues"] = put_values
        call: Any = self.table.client.transact_write_items
        with self.table.errors("TransactWriteItems", expect={TRANSACTION_CANCELLED}) as refused:
            call(TransactItems=[{"Put": put}, {"Delete": self._delete(legacy)}])
        if not refused:
            return True
        if CHECK_FAILED not in refused.reasons:  # a conflicting transaction: try next run
            logger.warning(
                "moving %s/%d/%d was cancelled (%s); a rerun retries it",
                topic,
                partition,
                offset,
                refused.describe(),
            )
        return False

    def drop(self, legacy: Mapping[str, Any]) -> bool:
        """Delete `legacy` (a conflict) if it is still as read; False if not (it changed:
        a rerun plans it again)."""
        with self.table.errors("DeleteItem", expect={CONDITION_FAILED}) as refused:
            self.table.client.delete_item(**self._delete(legacy))
        return not refused

    def _delete(self, legacy: Mapping[str, Any]) -> dict[str, Any]:
        """The deletion of `legacy`, on condition that it is still as read (status,
        `dead_lettered_at` and claim): an old proxy or tool that wrote it meanwhile wins."""
        topic, partition, offset = item_key(legacy)
        names = {"#s": "status", "#at": "dead_lettered_at", "#c": CLAIM_ATTR}
        values: dict[str, Any] = {":status": legacy["status"], ":at": legacy["dead_lettered_at"]}
        if CLAIM_ATTR in legacy:
            names["#cu"] = CLAIM_UNTIL_ATTR
            values[":claim"] = legacy[CLAIM_ATTR]
            values[":until"] = legacy.get(CLAIM_UNTIL_ATTR, {"N": "0"})
            claim = "#c = :claim AND #cu = :until"
        else:
            claim = "attribute_not_exists(#c)"
        return {
            "TableName": self.table.table,
            "Key": table_key(legacy_dead_letter_source(topic, partition), offset),
            "ConditionExpression": f"#s = :status AND #at = :at AND {claim}",
            "ExpressionAttributeNames": names,
            "ExpressionAttributeValues": values,
        }


# --- indexing -----------------------------------------------------------------------

INDEX_SCAN_PAGE = 1000
"""Items read per Scan call while indexing (keys, group, status and dl_state only)."""


@dataclass
class IndexingResult:
    """What indexing did (or, in a dry run, would do)."""

    index_active: bool = False
    """Whether the `by-state` index is ACTIVE (False in a dry run without it)."""
    indexed: int = 0
    """Dead letters given their `dl_state` (or, in a dry run, that lack it)."""
    changed: int = 0
    """Dead letters whose status changed under us: the next run indexes them."""
    complete: bool = False
    """Every dead letter carries `dl_state` and the marker is written: lists use the index."""
    interrupted: bool = False
    """True when `stop` ended the run before every item was seen."""


class Indexing:
    """Gives every dead letter of the table its `dl_state` and the table its `by-state`
    index (see the module docstring). Works on the whole table (every deployment), since
    the index does."""

    def __init__(self, table: DeadLetterTable, *, index_timeout_s: float = 600.0) -> None:
        self.table = table
        self._index_timeout_s = index_timeout_s

    def run(self, *, apply: bool, stop: threading.Event | None = None) -> IndexingResult:
        """Add the index (with `apply`), then index every item still missing `dl_state`;
        `stop` is checked between pages."""
        result = IndexingResult()
        if apply:
            result.index_active = ensure_state_index(
                self.table.settings, timeout_s=self._index_timeout_s
            )
        for item in self._unindexed(stop, result):
            if not apply or self._index(item):
                result.indexed += 1
            else:
                result.changed += 1
        if apply and not result.interrupted and not result.changed:
            with self.table.errors("PutItem"):
                mark_indexed(self.table.client, self.table.table)
            result.complete = result.index_active
        return result

    def _unindexed(
        self, stop: threading.Event | None, result: IndexingResult
    ) -> Iterator[dict[str, Any]]:
        """Every dead letter whose `dl_state` is missing or not its status's."""
        kwargs: dict[str, Any] = {
            "TableName": self.table.table,
            "ConsistentRead": True,
            "Limit": INDEX_SCAN_PAGE,
            "FilterExpression": "#o >= :zero AND attribute_exists(#g)",
            "ProjectionExpression": "#src, #o, #g, #s, #v",
            "ExpressionAttributeNames": {
                "#src": "source",
                "#o": "offset",
                "#g": GROUP_ATTR,
                "#s": "status",
                "#v": STATE_ATTR,
            },
            "ExpressionAttributeValues": {":zero": {"N": "0"}},
        }
        while True:
            if stop is not None and stop.is_set():
                result.interrupted = True
                return
            with self.table.errors("Scan"):
                page: Any = self.table.client.scan(**kwargs)
            for item in page.get("Items", []):
                want = state_key(item["status"]["S"], item[GROUP_ATTR]["S"])
                if item.get(STATE_ATTR, {}).get("S") != want:
                    yield dict(item)
            last = page.get("LastEvaluatedKey")
            if not last:
                return
            kwargs["ExclusiveStartKey"] = last

    def _index(self, item: Mapping[str, Any]) -> bool:
        """Set the item's `dl_state` if its status and `dl_state` are still as read."""
        names = {"#s": "status", "#v": STATE_ATTR}
        values: dict[str, Any] = {
            ":status": item["status"],
            ":state": {"S": state_key(item["status"]["S"], item[GROUP_ATTR]["S"])},
        }
        if STATE_ATTR in item:
            values[":old"] = item[STATE_ATTR]
            unchanged = "#v = :old"
        else:
            unchanged = "attribute_not_exists(#v)"
        with self.table.errors("UpdateItem", expect={CONDITION_FAILED}) as refused:
            self.table.client.update_item(
                TableName=self.table.table,
                Key={"source": item["source"], "offset": item["offset"]},
                UpdateExpression="SET #v = :state",
                ConditionExpression=f"#s = :status AND {unchanged}",
                ExpressionAttributeNames=names,
                ExpressionAttributeValues=values,
            )
        return not refused
