"""The partition lease item: who may deliver a (topic, partition) of a deployment right now.

Why a store of its own: `triage_proxy.pipeline.ownership` decides when to acquire, renew and give
up a lease (and how to fence); this module only makes the three conditional writes
atomic in DynamoDB, with an in-memory twin (`MemoryLeases`) for unit tests.

Item: `source` = `lease_source(topic, partition, group)` (`<topic>#<partition>#lease#<group>`),
`offset` = `LEASE_OFFSET` (-2; see the package docstring), `owner` (S: host, pid and a
random part, unique per process),
`lease_until_ms` (N: epoch ms; not `expires_at`, the table's TTL attribute),
`acquired_at` and `renewed_at` (S, ISO-8601), `endpoint` (S: host:port consumers dial to
reach the holder, its `server.advertised_*`; absent while not known, e.g. an ephemeral
port not bound yet, and in items written before the attribute existed: read as "").

    acquire: PutItem     if attribute_not_exists(source) OR lease_until_ms < now OR owner = me
    renew:   UpdateItem  if owner = me          (so it fails once anyone else acquired)
    release: DeleteItem  if owner = me          (graceful stop: the standby takes over at once)

Each deployment (group) has its own lease per partition, so two apps on one topic serve
it at once. A proxy from before deployment keys holds the legacy item
`<topic>#<partition>#lease` instead and knows nothing of the new one. So acquire and
renew first read the legacy item (one consistent GetItem): while an old proxy of any
deployment holds it live, a new one waits as a standby (`acquire` returns the legacy
holder, its owner marked "(legacy lease)", and writes nothing) and one that serves
gives the partition up at its next renewal (renew False). The old proxy checks only the
legacy item, so the two may overlap for at most one renewal interval (it may take the
legacy lease right after our read; a TransactWriteItems with a ConditionCheck would
narrow the instant but not that interval, at twice the write cost per renewal). The
upgrade is "stop the old proxies, start the new ones" (README); this check guards an
accidental overlap. Releasing deletes only our own item; migration never touches
leases (they lapse by themselves).

Failures raise `TableUnavailable`; a condition that does not hold is an answer (False,
or the lease as it stands), not an error.

Reading every partition's lease at once (the Topology RPC, see topology.py) is a
`LeaseReader`: one BatchGetItem for up to 100 partitions, the deployment's items only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.errors import NotFoundError, TableUnavailable
from triage_proxy.store.aws import CONDITION_FAILED, TABLE_MISSING, aws_errors, dynamodb_client
from triage_proxy.store.items import (
    LEASE_OFFSET,
    check_group,
    format_iso_ms,
    lease_source,
    legacy_lease_source,
    parse_source,
    table_key,
)

CALL_TIMEOUT_S = 1.0
"""boto3 connect and read timeouts of the lease calls (one attempt each)."""
BATCH_GET_MAX_KEYS = 100
"""DynamoDB's BatchGetItem takes at most 100 keys."""
BATCH_GET_ROUNDS = 3
"""BatchGetItem calls per 100 keys when DynamoDB returns some keys unprocessed (throttled);
what is still unprocessed after them is an error, not an absent lease."""
LEGACY_OWNER_SUFFIX = " (legacy lease)"
"""Appended to the owner of a legacy lease item, so logs tell an old proxy's hold apart."""


@dataclass(frozen=True)
class Lease:
    """The lease item as one call saw it."""

    owner: str
    """Who holds (or last held) the partition."""
    until_ms: int
    """Epoch ms after which anyone may take it over."""
    endpoint: str = ""
    """host:port the holder serves consumers at; "" when unknown (not advertised yet, or
    an item written by an older proxy)."""


class LeaseStore(Protocol):
    """Sync; called from a worker thread. Raises TableUnavailable when unreachable."""

    def acquire(self, owner: str, now_ms: int, until_ms: int, endpoint: str = "") -> Lease:
        """Take the lease if free, lapsed or ours, advertising `endpoint` ("": unknown);
        return the lease as it now stands."""
        ...

    def renew(self, owner: str, now_ms: int, until_ms: int, endpoint: str = "") -> bool:
        """Extend the lease if `owner` still holds it (and advertise `endpoint`, when
        given); False if someone else does."""
        ...

    def release(self, owner: str) -> bool:
        """Delete the lease if `owner` holds it; False if not."""
        ...

    def get(self) -> Lease | None: ...

    def close(self) -> None: ...


class DynamoDBLeases:
    """The lease item of one (topic, partition) of deployment `group` in the table."""

    def __init__(
        self, settings: DeadLetterSettings, topic: str, partition: int, group: str
    ) -> None:
        self._table = settings.table
        self._key = table_key(lease_source(topic, partition, check_group(group)), LEASE_OFFSET)
        self._legacy_key = table_key(legacy_lease_source(topic, partition), LEASE_OFFSET)
        # One attempt, short timeouts: the caller retries on its own schedule, and a
        # renewal that answers late is worth nothing (the lease counts from the send).
        self._client = dynamodb_client(
            settings,
            connect_timeout_s=CALL_TIMEOUT_S,
            read_timeout_s=CALL_TIMEOUT_S,
            max_attempts=1,
        )

    def _conditional(self, what: str, call: Callable[[], Any]) -> bool:
        doing = f"{what} the partition lease"
        expect = {CONDITION_FAILED, TABLE_MISSING}
        with aws_errors(doing, TableUnavailable, expect=expect) as refused:
            call()
        if refused.code == TABLE_MISSING:
            raise self._missing(doing) from refused.error
        return not refused

    def _missing(self, doing: str) -> NotFoundError:
        # Waiting cannot help (a standby would wait forever): say which table.
        return NotFoundError(
            f"{doing}: the dead-letter table {self._table!r} does not exist (create it: "
            f"`triage deploy` does; `triage config check --connect` checks it)"
        )

    def _read(self, what: str, key: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The item at `key` (a consistent read; `what` it is, for errors), None when there
        is none."""
        doing = f"reading {what}"
        with aws_errors(doing, TableUnavailable, expect={TABLE_MISSING}) as refused:
            found = self._client.get_item(TableName=self._table, Key=key, ConsistentRead=True)
        if refused.code == TABLE_MISSING:
            raise self._missing(doing) from refused.error
        item: Mapping[str, Any] | None = found.get("Item")
        return item

    def acquire(self, owner: str, now_ms: int, until_ms: int, endpoint: str = "") -> Lease:
        stamp = format_iso_ms(now_ms)
        item = {
            **self._key,
            "owner": {"S": owner},
            "lease_until_ms": {"N": str(until_ms)},
            "acquired_at": {"S": stamp},
            "renewed_at": {"S": stamp},
        }
        if endpoint:
            item["endpoint"] = {"S": endpoint}
        legacy = self._live_legacy(now_ms)
        if legacy is not None:  # an old proxy serves the partition: stand by
            return legacy
        took = self._conditional(
            "acquiring",
            lambda: self._client.put_item(
                TableName=self._table,
                Item=item,
                ConditionExpression="attribute_not_exists(#src) OR #until < :now OR #owner = :me",
                ExpressionAttributeNames={
                    "#src": "source",
                    "#until": "lease_until_ms",
                    "#owner": "owner",
                },
                ExpressionAttributeValues={":now": {"N": str(now_ms)}, ":me": {"S": owner}},
            ),
        )
        if took:
            return Lease(owner, until_ms, endpoint)
        # Held by someone else; it may be released between the two calls: then say so
        # with a lease that has already lapsed, and the caller tries again at once.
        return self.get() or Lease("", 0)

    def renew(self, owner: str, now_ms: int, until_ms: int, endpoint: str = "") -> bool:
        update = "SET #until = :until, renewed_at = :at"
        values = {
            ":until": {"N": str(until_ms)},
            ":at": {"S": format_iso_ms(now_ms)},
            ":me": {"S": owner},
        }
        if endpoint:
            update += ", endpoint = :endpoint"
            values[":endpoint"] = {"S": endpoint}
        if self._live_legacy(now_ms) is not None:  # an old proxy took the partition
            return False
        return self._conditional(
            "renewing",
            lambda: self._client.update_item(
                TableName=self._table,
                Key=self._key,
                UpdateExpression=update,
                ConditionExpression="#owner = :me",
                ExpressionAttributeNames={"#until": "lease_until_ms", "#owner": "owner"},
                ExpressionAttributeValues=values,
            ),
        )

    def release(self, owner: str) -> bool:
        return self._conditional(
            "releasing",
            lambda: self._client.delete_item(
                TableName=self._table,
                Key=self._key,
                ConditionExpression="#owner = :me",
                ExpressionAttributeNames={"#owner": "owner"},
                ExpressionAttributeValues={":me": {"S": owner}},
            ),
        )

    def get(self) -> Lease | None:
        item = self._read("the partition lease", self._key)
        return None if item is None else lease_from_item(item)

    def _live_legacy(self, now_ms: int) -> Lease | None:
        """The legacy lease item of an old proxy if it is live at `now_ms` (its owner
        marked as such); None when there is none or it lapsed."""
        item = self._read("the partition's legacy lease", self._legacy_key)
        if item is None:
            return None
        lease = lease_from_item(item)
        if lease.until_ms < now_ms:
            return None
        return Lease(lease.owner + LEGACY_OWNER_SUFFIX, lease.until_ms, lease.endpoint)

    def close(self) -> None:
        self._client.close()


def lease_from_item(item: Mapping[str, Any]) -> Lease:
    """The Lease a lease item holds; no `endpoint` attribute (an older proxy) reads as ""."""
    endpoint = item.get("endpoint", {}).get("S", "")
    return Lease(item["owner"]["S"], int(item["lease_until_ms"]["N"]), endpoint)


class LeaseReader(Protocol):
    """Every partition's lease of one topic, read at once. Sync; called from a worker
    thread. Raises TableUnavailable when the table cannot be read."""

    def get_many(self, partitions: Sequence[int]) -> dict[int, Lease]:
        """partition -> its lease item as it stands; a partition without one is left out."""
        ...

    def close(self) -> None: ...


class DynamoDBLeaseReader:
    """Reads the lease items of a topic's partitions in deployment `group` with
    BatchGetItem (strongly consistent, 100 keys per call)."""

    def __init__(self, settings: DeadLetterSettings, topic: str, group: str) -> None:
        self._table = settings.table
        self._topic = topic
        self._group = check_group(group)
        self._client = dynamodb_client(
            settings,
            connect_timeout_s=CALL_TIMEOUT_S,
            read_timeout_s=CALL_TIMEOUT_S,
            max_attempts=1,
        )

    def get_many(self, partitions: Sequence[int]) -> dict[int, Lease]:
        found: dict[int, Lease] = {}
        wanted = list(dict.fromkeys(partitions))
        for start in range(0, len(wanted), BATCH_GET_MAX_KEYS):
            keys = [
                table_key(lease_source(self._topic, p, self._group), LEASE_OFFSET)
                for p in wanted[start : start + BATCH_GET_MAX_KEYS]
            ]
            for item in self._batch_get(keys):
                found[self._partition_of(item)] = lease_from_item(item)
        return found

    def _batch_get(self, keys: list[dict[str, Any]]) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        for _ in range(BATCH_GET_ROUNDS):
            request: Any = {self._table: {"Keys": keys, "ConsistentRead": True}}
            with aws_errors("reading the partition leases", TableUnavailable):
                answer: Any = self._client.batch_get_item(RequestItems=request)
            items.extend(answer.get("Responses", {}).get(self._table, []))
            keys = answer.get("UnprocessedKeys", {}).get(self._table, {}).get("Keys", [])
            if not keys:
                return items
        raise TableUnavailable(
            f"reading the partition leases failed: {len(keys)} keys left unprocessed"
        )

    def _partition_of(self, item: Mapping[str, Any]) -> int:
        _, partition, _, _ = parse_source(item["source"]["S"])
        return partition

    def close(self) -> None:
        self._client.close()


class MemoryLeases:
    """In-memory twin for unit tests; `down` makes every call fail like an outage."""

    def __init__(self) -> None:
        self.lease: Lease | None = None
        self.down = False
        self.calls = 0
        self._lock = threading.Lock()

    def _check(self) -> None:
        self.calls += 1
        if self.down:
            raise TableUnavailable("lease store is down")

    def acquire(self, owner: str, now_ms: int, until_ms: int, endpoint: str = "") -> Lease:
        with self._lock:
            self._check()
            held = self.lease
            if held is None or held.until_ms < now_ms or held.owner == owner:
                self.lease = Lease(owner, until_ms, endpoint)
            assert self.lease is not None
            return self.lease

    def renew(self, owner: str, now_ms: int, until_ms: int, endpoint: str = "") -> bool:
        with self._lock:
            self._check()
            if self.lease is None or self.lease.owner != owner:
                return False
            self.lease = Lease(owner, until_ms, endpoint or self.lease.endpoint)
            return True

    def release(self, owner: str) -> bool:
        with self._lock:
            self._check()
            if self.lease is None or self.lease.owner != owner:
                return False
            self.lease = None
            return True

    def get(self) -> Lease | None:
        with self._lock:
            self._check()
            return self.lease

    def close(self) -> None:
        pass


class MemoryLeaseReader:
    """In-memory twin of DynamoDBLeaseReader over per-partition stores (`MemoryLeases`, or
    any LeaseStore: each is read with `get()`); `down` makes it fail like an outage."""

    def __init__(self, stores: Mapping[int, LeaseStore] | None = None) -> None:
        self.stores: dict[int, LeaseStore] = dict(stores or {})
        self.down = False
        self.calls = 0

    def get_many(self, partitions: Sequence[int]) -> dict[int, Lease]:
        self.calls += 1
        if self.down:
            raise TableUnavailable("lease table is down")
        found: dict[int, Lease] = {}
        for p in partitions:
            store = self.stores.get(p)
            lease = store.get() if store is not None else None
            if lease is not None:
                found[p] = lease
        return found

    def close(self) -> None:
        pass
