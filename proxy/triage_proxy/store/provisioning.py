"""Creating the table and the overflow bucket: key schema, index, TTL, point-in-time recovery.

Why here: the key schema and the TTL attribute are the table's own contract (items.py),
so the code that creates them sits next to it rather than in the commands that call it
(`triage dev`, `triage deploy`, the tests). Every step is idempotent: a rerun finds what
exists, checks it matches, and goes on. Errors: `ConfigError` when what exists does not
match (another key schema, TTL on another attribute, an invalid bucket name),
`DeadLetterUnavailable` when DynamoDB or S3 cannot be reached or refuses.

The `by-state` index (`items.STATE_INDEX`): a new table is created with it and with the
index marker item (an empty table has nothing to backfill). An existing table without
it gets it from `ensure_state_index` (UpdateTable; `create_table` calls it, so `triage
deploy` and `triage dev` add it), but the items written before carry no `dl_state`, so
the marker is only written once `migrate.backfill_states` (`triage dlq migrate`) has
given them one; until then the tools list by a bounded scan (`pages.py`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.errors import ConfigError, DeadLetterUnavailable
from triage_proxy.store.aws import AwsAnswer, aws_errors, dynamodb_client, s3_client
from triage_proxy.store.items import (
    AT_ATTR,
    EXPIRES_AT_ATTR,
    INDEX_MARKER_OFFSET,
    INDEX_MARKER_SOURCE,
    INDEX_PROJECTION,
    STATE_ATTR,
    STATE_INDEX,
    table_key,
)
from triage_proxy.store.payload import S3_LIFECYCLE_RULE_ID, S3_SETTLED_TAG

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.client import DynamoDBClient
    from mypy_boto3_s3.client import S3Client

logger = logging.getLogger(__name__)

KEY_SCHEMA = [("source", "HASH"), ("offset", "RANGE")]
"""(attribute, key type) of the table's primary key; see the package docstring."""
KEY_SCHEMA_SPEC: list[Any] = [{"AttributeName": a, "KeyType": k} for a, k in KEY_SCHEMA]
"""The primary key, as CreateTable spells it."""
KEY_ATTRIBUTES: list[Any] = [
    {"AttributeName": "source", "AttributeType": "S"},
    {"AttributeName": "offset", "AttributeType": "N"},
]
"""The primary key's attribute types, as CreateTable spells them."""
PITR_TIMEOUT_S = 120.0
"""How long a new table may refuse point-in-time recovery before giving up."""
PITR_POLL_S = 2.0
INDEX_POLL_S = 1.0
TABLE_POLL_S = 1.0
"""How often a table that is not ACTIVE yet is described again (boto3's waiter's pace)."""
STATE_INDEX_SPEC: Any = {
    "IndexName": STATE_INDEX,
    "KeySchema": [
        {"AttributeName": STATE_ATTR, "KeyType": "HASH"},
        {"AttributeName": AT_ATTR, "KeyType": "RANGE"},
    ],
    "Projection": {"ProjectionType": "INCLUDE", "NonKeyAttributes": list(INDEX_PROJECTION)},
}
"""The `by-state` global secondary index, as CreateTable and UpdateTable spell it."""
STATE_INDEX_ATTRIBUTES: list[Any] = [
    {"AttributeName": STATE_ATTR, "AttributeType": "S"},
    {"AttributeName": AT_ATTR, "AttributeType": "S"},
]


T = TypeVar("T")


def poll(
    ask: Callable[[], T],
    done: Callable[[T], bool],
    *,
    timeout_s: float,
    every_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Ask until `done(answer)` or `timeout_s` has passed, every `every_s`; the last
    answer either way (the caller says what running out of time means).

    Provisioning's one wait: a table, an index or a backup setting that AWS brings up in
    the background. Errors `ask` raises pass through. `sleep` and `clock` are test seams."""
    deadline = clock() + timeout_s
    while True:
        answer = ask()
        if done(answer) or clock() > deadline:
            return answer
        sleep(every_s)


def create_table(settings: DeadLetterSettings, *, timeout_s: float = 120.0) -> None:
    """Create the table (on-demand) unless it exists; wait until it is ACTIVE.

    A new table has the `by-state` index and its marker; an existing one without the
    index gets it (`ensure_state_index`). With `ttl_days` set it also enables DynamoDB
    TTL on `expires_at`. Raises ConfigError
    if a table of that name exists with another key schema (or TTL on another
    attribute), and DeadLetterUnavailable if DynamoDB cannot be reached or refuses.
    """
    client = dynamodb_client(settings)
    try:
        with aws_errors(f"creating table {settings.table!r}", DeadLetterUnavailable):
            with aws_errors(
                f"creating table {settings.table!r}",
                DeadLetterUnavailable,
                expect={"ResourceInUseException"},
            ) as exists:
                client.create_table(
                    TableName=settings.table,
                    KeySchema=KEY_SCHEMA_SPEC,
                    AttributeDefinitions=[*KEY_ATTRIBUTES, *STATE_INDEX_ATTRIBUTES],
                    GlobalSecondaryIndexes=[STATE_INDEX_SPEC],
                    BillingMode="PAY_PER_REQUEST",
                )
            if exists:
                logger.debug("table %s already exists", settings.table)
            else:
                logger.info("created table %s", settings.table)
            described = _wait_active(client, settings.table, timeout_s)
            schema = described.get("KeySchema", [])
            found = [(k["AttributeName"], k["KeyType"]) for k in schema]
            if found != KEY_SCHEMA:
                raise ConfigError(
                    "dead_letters.table",
                    f"table {settings.table!r} has key schema {found}, expected {KEY_SCHEMA}",
                )
            if not exists:
                mark_indexed(client, settings.table)
            _ensure_state_index(client, settings.table, timeout_s, described=described)
            if settings.ttl_days is not None:
                _enable_ttl(client, settings.table)
    finally:
        client.close()


def ensure_state_index(settings: DeadLetterSettings, *, timeout_s: float = 120.0) -> bool:
    """Add the `by-state` index to an existing table unless it has it; wait up to
    `timeout_s` for it to be ACTIVE. True when it is ACTIVE (a large table's backfill
    may take longer: the tools scan meanwhile). Idempotent."""
    client = dynamodb_client(settings)
    try:
        with aws_errors(f"indexing table {settings.table!r}", DeadLetterUnavailable):
            return _ensure_state_index(client, settings.table, timeout_s)
    finally:
        client.close()


def state_index_status(client: DynamoDBClient, table: str) -> str | None:
    """The `IndexStatus` of the table's `by-state` index (ACTIVE, CREATING, ...); None
    when the table has no such index. Botocore errors pass through (callers wrap)."""
    return _index_status(client.describe_table(TableName=table)["Table"])


def _index_status(described: Mapping[str, Any]) -> str | None:
    """`state_index_status` of a DescribeTable answer's `Table`."""
    for index in described.get("GlobalSecondaryIndexes", []):
        if index.get("IndexName") == STATE_INDEX:
            return str(index.get("IndexStatus", "ACTIVE"))
    return None


def mark_indexed(client: DynamoDBClient, table: str) -> None:
    """Write the marker item: every dead letter of `table` carries `dl_state` now."""
    client.put_item(
        TableName=table,
        Item={
            **table_key(INDEX_MARKER_SOURCE, INDEX_MARKER_OFFSET),
            "indexed_at_ms": {"N": str(int(time.time() * 1000))},
        },
    )


def _wait_active(client: DynamoDBClient, table: str, timeout_s: float) -> Mapping[str, Any]:
    """The table's description once its status is ACTIVE, asked every TABLE_POLL_S.

    What boto3's `table_exists` waiter does, but it returns the answer, which holds the
    key schema and the index status `create_table` checks next: one DescribeTable for a
    table that is ready, not one per question. A table not found yet (just created, on an
    eventually consistent endpoint) is waited for too. Raises DeadLetterUnavailable after
    `timeout_s`; other botocore errors pass through (the caller wraps)."""

    def describe() -> Mapping[str, Any] | None:
        with aws_errors(
            f"describing table {table!r}",
            DeadLetterUnavailable,
            expect={"ResourceNotFoundException"},
        ) as missing:
            described: Mapping[str, Any] = client.describe_table(TableName=table)["Table"]
        return None if missing else described

    def status(described: Mapping[str, Any] | None) -> str | None:
        return None if described is None else described.get("TableStatus")

    described = poll(
        describe, lambda d: status(d) == "ACTIVE", timeout_s=timeout_s, every_s=TABLE_POLL_S
    )
    if described is None or status(described) != "ACTIVE":
        raise DeadLetterUnavailable(
            f"table {table!r} is {status(described) or 'not found'} after {timeout_s:.0f} s"
        )
    return described


def _ensure_state_index(
    client: DynamoDBClient,
    table: str,
    timeout_s: float,
    *,
    described: Mapping[str, Any] | None = None,
) -> bool:
    """Add the index unless `described` (or a fresh DescribeTable) shows it; wait until it
    is ACTIVE. True when it is."""
    status = (
        _index_status(described) if described is not None else state_index_status(client, table)
    )
    if status == "ACTIVE":
        return True
    if status is None:
        with aws_errors(
            f"adding index {STATE_INDEX} to {table!r}",
            DeadLetterUnavailable,
            expect={"LimitExceededException", "ResourceInUseException"},
        ) as busy:
            client.update_table(
                TableName=table,
                AttributeDefinitions=STATE_INDEX_ATTRIBUTES,
                GlobalSecondaryIndexUpdates=[{"Create": STATE_INDEX_SPEC}],
            )
        if busy:  # another UpdateTable is running (or a concurrent deploy added it)
            logger.warning("could not add index %s to %s yet: %s", STATE_INDEX, table, busy)
            return False
        logger.info("adding index %s to table %s", STATE_INDEX, table)
    status = poll(
        lambda: state_index_status(client, table),
        lambda s: s == "ACTIVE",
        timeout_s=timeout_s,
        every_s=INDEX_POLL_S,
    )
    if status == "ACTIVE":
        return True
    logger.warning(
        "index %s of %s is %s after %.0f s; the tools scan until it is ACTIVE",
        STATE_INDEX,
        table,
        status,
        timeout_s,
    )
    return False


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


def enable_point_in_time_recovery(
    settings: DeadLetterSettings, *, timeout_s: float = PITR_TIMEOUT_S
) -> None:
    """Turn on point-in-time recovery: dead letters are the only copy of what failed.

    A table created moments ago answers ContinuousBackupsUnavailable for a while: that
    is retried for `timeout_s`. Raises DeadLetterUnavailable otherwise.
    """
    what = f"enabling point-in-time recovery on {settings.table!r}"
    client = dynamodb_client(settings)

    def enable() -> AwsAnswer:
        with aws_errors(
            what,
            DeadLetterUnavailable,
            expect={"ContinuousBackupsUnavailableException"},
        ) as busy:
            client.update_continuous_backups(
                TableName=settings.table,
                PointInTimeRecoverySpecification={"PointInTimeRecoveryEnabled": True},
            )
        return busy

    try:
        busy = poll(enable, lambda b: not b, timeout_s=timeout_s, every_s=PITR_POLL_S)
    finally:
        client.close()
    if busy:
        raise DeadLetterUnavailable(f"{what} failed: {busy.describe()}") from busy.error


def create_bucket(settings: DeadLetterSettings) -> None:
    """Create the overflow bucket unless it exists (no-op without `overflow_bucket`).

    With `ttl_days` it also installs (or updates) one lifecycle rule that expires the
    payloads of replayed and discarded items, which `query.DeadLetterTable` tags when it
    marks them; other rules of a shared bucket are kept. Raises ConfigError for an invalid
    bucket name and DeadLetterUnavailable if S3 cannot be reached or refuses.
    """
    bucket = settings.overflow_bucket
    if bucket is None:
        return
    what = f"creating bucket {bucket!r}"
    client = s3_client(settings)
    try:
        with aws_errors(what, DeadLetterUnavailable):
            with aws_errors(
                what,
                DeadLetterUnavailable,
                expect={"InvalidBucketName", "BucketAlreadyOwnedByYou", "BucketAlreadyExists"},
            ) as refused:
                if settings.region == "us-east-1":
                    client.create_bucket(Bucket=bucket)
                else:
                    client.create_bucket(
                        Bucket=bucket,
                        CreateBucketConfiguration={"LocationConstraint": settings.region},  # type: ignore[typeddict-item]
                    )
            if refused.code == "InvalidBucketName":
                raise ConfigError(
                    "dead_letters.overflow_bucket", f"not a valid S3 bucket name: {bucket!r}"
                ) from refused.error
            if refused:
                client.head_bucket(Bucket=bucket)  # ours to use? raises (403) if not
                logger.debug("overflow bucket %s already exists", bucket)
            else:
                logger.info("created overflow bucket %s", bucket)
            if settings.ttl_days is not None:
                _expire_settled_payloads(client, bucket, math.ceil(settings.ttl_days))
    finally:
        client.close()


def _expire_settled_payloads(client: S3Client, bucket: str, days: int) -> None:
    rules: list[Any] = []
    with aws_errors(
        f"reading the lifecycle of {bucket!r}",
        DeadLetterUnavailable,
        expect={"NoSuchLifecycleConfiguration"},
    ):
        rules = list(client.get_bucket_lifecycle_configuration(Bucket=bucket).get("Rules", []))
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
