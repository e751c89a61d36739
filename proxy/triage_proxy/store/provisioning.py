"""Creating the table and the overflow bucket: key schema, TTL, point-in-time recovery.

Why here: the key schema and the TTL attribute are the table's own contract (items.py),
so the code that creates them sits next to it rather than in the commands that call it
(`triage dev`, `triage deploy`, the tests). Every step is idempotent: a rerun finds what
exists, checks it matches, and goes on. Errors: `ConfigError` when what exists does not
match (another key schema, TTL on another attribute, an invalid bucket name),
`DeadLetterUnavailable` when DynamoDB or S3 cannot be reached or refuses.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any

from triage_proxy.config.settings import DeadLetterSettings
from triage_proxy.errors import ConfigError, DeadLetterUnavailable
from triage_proxy.store.aws import aws_errors, dynamodb_client, s3_client
from triage_proxy.store.items import EXPIRES_AT_ATTR
from triage_proxy.store.payload import S3_LIFECYCLE_RULE_ID, S3_SETTLED_TAG

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.client import DynamoDBClient
    from mypy_boto3_s3.client import S3Client

logger = logging.getLogger(__name__)

KEY_SCHEMA = [("source", "HASH"), ("offset", "RANGE")]
"""(attribute, key type) of the table's primary key; see the package docstring."""
PITR_TIMEOUT_S = 120.0
"""How long a new table may refuse point-in-time recovery before giving up."""
PITR_POLL_S = 2.0


def create_table(settings: DeadLetterSettings, *, timeout_s: float = 120.0) -> None:
    """Create the table (on-demand) unless it exists; wait until it is ACTIVE.

    With `ttl_days` set it also enables DynamoDB TTL on `expires_at`. Raises ConfigError
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
            if exists:
                logger.debug("table %s already exists", settings.table)
            else:
                logger.info("created table %s", settings.table)
            client.get_waiter("table_exists").wait(
                TableName=settings.table,
                WaiterConfig={"Delay": 1, "MaxAttempts": max(1, int(timeout_s))},
            )
            schema = client.describe_table(TableName=settings.table)["Table"].get("KeySchema", [])
            found = [(k["AttributeName"], k["KeyType"]) for k in schema]
            if found != KEY_SCHEMA:
                raise ConfigError(
                    "dead_letters.table",
                    f"table {settings.table!r} has key schema {found}, expected {KEY_SCHEMA}",
                )
            if settings.ttl_days is not None:
                _enable_ttl(client, settings.table)
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


def enable_point_in_time_recovery(
    settings: DeadLetterSettings, *, timeout_s: float = PITR_TIMEOUT_S
) -> None:
    """Turn on point-in-time recovery: dead letters are the only copy of what failed.

    A table created moments ago answers ContinuousBackupsUnavailable for a while: that
    is retried for `timeout_s`. Raises DeadLetterUnavailable otherwise.
    """
    what = f"enabling point-in-time recovery on {settings.table!r}"
    client = dynamodb_client(settings)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            with aws_errors(
                what,
                DeadLetterUnavailable,
                expect={"ContinuousBackupsUnavailableException"},
            ) as busy:
                client.update_continuous_backups(
                    TableName=settings.table,
                    PointInTimeRecoverySpecification={"PointInTimeRecoveryEnabled": True},
                )
            if not busy:
                return
            if time.monotonic() > deadline:
                raise DeadLetterUnavailable(f"{what} failed: {busy.describe()}") from busy.error
            time.sleep(PITR_POLL_S)
    finally:
        client.close()


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
