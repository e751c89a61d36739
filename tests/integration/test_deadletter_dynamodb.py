"""The dead-letter store and writer against a real DynamoDB endpoint (moto server).

Faults are real too: a port nothing listens on, a server killed with SIGKILL, and a
server frozen with SIGSTOP then thawed with SIGCONT (moto keeps tables in memory, so a
restarted server would come back empty; freezing keeps them).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import socket
from collections.abc import Coroutine, Iterator
from typing import Any, TypedDict

import boto3
import pytest

from tests import samples, waiting
from tests.integration.harness import wait_until
from tests.samples import GROUP, T0
from triage_cli.embedded import EmbeddedAWS, free_port
from triage_protocol.constants import MAX_CONSUMER_ID_CHARS, MAX_REASON_CHARS
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.deadletters.writer import DeadLetterWriter
from triage_proxy.errors import ConfigError, DeadLetterUnavailable
from triage_proxy.store.deadletter_store import DynamoDBStore
from triage_proxy.store.items import (
    MAX_ITEM_BYTES,
    dead_letter_from_item,
    is_dead_letter,
    item_size,
)
from triage_proxy.store.provisioning import create_bucket, create_table
from triage_proxy.store.query import DeadLetterTable
from triage_proxy.structs import DeadLetter

pytestmark = pytest.mark.integration

LOGGER = "triage_proxy.deadletters.writer"


class StoreOptions(TypedDict):
    """DynamoDBStore's client options, typed one by one for `**` (max_attempts is an int)."""

    connect_timeout_s: float
    read_timeout_s: float
    max_attempts: int


FAST: StoreOptions = {"connect_timeout_s": 0.5, "read_timeout_s": 0.5, "max_attempts": 1}
"""Store options that make a dead or frozen endpoint fail within about a second."""


def make_dl(offset: int, **fields: Any) -> DeadLetter:
    """The sample dead letter with reason "boom", 5 attempts and times that vary by offset."""
    varied = {"timestamp_ms": T0 + offset, "at_ms": T0 + 123 + offset % 1000}
    return samples.make_dl(offset, **{"reason": "boom", "attempts": 5, **varied, **fields})


def run(coro: Coroutine[Any, Any, None], timeout: float = 30.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout))


eventually = functools.partial(waiting.eventually, poll_s=0.02)


async def several_failures(writer: DeadLetterWriter, count: int = 3) -> None:
    """Until the writer has failed `count` writes (retries included): what it shows after
    them (nothing written, everything pending, one warning) holds through retries."""
    await eventually(lambda: writer._failed_writes >= count, within=20)


def raw_client(endpoint_url: str) -> Any:
    return boto3.session.Session().client(
        "dynamodb",
        region_name="us-east-1",
        endpoint_url=endpoint_url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def read_all(client: Any, table: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for page in client.get_paginator("scan").paginate(TableName=table, ConsistentRead=True):
        items.extend(page["Items"])
    return items


def read_dead_letters(client: Any, table: str) -> list[DeadLetter]:
    # Dead letters only: not the by-state index's marker item (offset < 0)
    found = [dead_letter_from_item(i) for i in read_all(client, table) if is_dead_letter(i)]
    return sorted(found, key=lambda d: (d.record.partition, d.record.offset))


@pytest.fixture
def table(aws: EmbeddedAWS, unique_name: str) -> DeadLetterSettings:
    settings = DeadLetterSettings(table=unique_name, endpoint_url=aws.endpoint_url)
    create_table(settings)
    return settings


@pytest.fixture
def dynamodb(aws: EmbeddedAWS) -> Iterator[Any]:
    client = raw_client(aws.endpoint_url)
    yield client
    client.close()


def test_create_table_is_idempotent(table: DeadLetterSettings, dynamodb: Any) -> None:
    create_table(table)
    description = dynamodb.describe_table(TableName=table.table)["Table"]
    assert description["TableStatus"] == "ACTIVE"
    assert description["BillingModeSummary"]["BillingMode"] == "PAY_PER_REQUEST"
    assert [(k["AttributeName"], k["KeyType"]) for k in description["KeySchema"]] == [
        ("source", "HASH"),
        ("offset", "RANGE"),
    ]


def test_create_table_refuses_a_foreign_key_schema(
    aws: EmbeddedAWS, unique_name: str, dynamodb: Any
) -> None:
    dynamodb.create_table(
        TableName=unique_name,
        KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    with pytest.raises(ConfigError, match="key schema"):
        create_table(DeadLetterSettings(table=unique_name, endpoint_url=aws.endpoint_url))


def test_round_trip_is_byte_exact(table: DeadLetterSettings, dynamodb: Any) -> None:
    every_byte = bytes(range(256))
    dls = [
        make_dl(0, key=None),
        make_dl(1, value=None),
        make_dl(2, key=None, value=None),
        make_dl(3, key=b"", value=b""),
        make_dl(4, key=every_byte[::-1], value=every_byte * 4),
        make_dl(
            5,
            headers=(
                ("h", b"1"),
                ("h", b"2"),
                ("none", None),
                ("h", None),
                ("", b""),
                ("bin", every_byte),
            ),
        ),
        make_dl(6, reason="💥 ünïcödé 失败 \x00 tab\tnl\n", consumer_id=""),
        make_dl(2**62, topic="a.b_c-d", partition=11),
    ]
    with DynamoDBStore(table, group=GROUP) as store:
        assert store.put_batch(dls) == []
    assert read_dead_letters(dynamodb, table.table) == sorted(
        dls, key=lambda d: (d.record.partition, d.record.offset)
    )
    raw = dynamodb.get_item(
        TableName=table.table,
        Key={"source": {"S": f"orders#0#dead#{GROUP}"}, "offset": {"N": "5"}},
        ConsistentRead=True,
    )["Item"]
    assert raw["status"] == {"S": "pending"}
    assert raw["dead_lettered_at"] == {"S": "2024-05-01T12:00:00.128Z"}
    assert raw["headers"]["L"][2] == {"M": {"k": {"S": "none"}}}
    null_key = dynamodb.get_item(
        TableName=table.table,
        Key={"source": {"S": f"orders#0#dead#{GROUP}"}, "offset": {"N": "2"}},
        ConsistentRead=True,
    )["Item"]
    assert "key" not in null_key
    assert "value" not in null_key
    assert "headers" not in null_key


def test_writing_a_message_again_overwrites_its_item(
    table: DeadLetterSettings, dynamodb: Any
) -> None:
    with DynamoDBStore(table, group=GROUP) as store:
        assert store.put_batch([make_dl(9, reason="first")]) == []
        assert store.put_batch([make_dl(9, reason="second")]) == []
    [only] = read_dead_letters(dynamodb, table.table)
    assert only.reason == "second"


def test_writer_writes_everything_and_reports_it(table: DeadLetterSettings, dynamodb: Any) -> None:
    written: list[DeadLetter] = []
    dls = [make_dl(i, partition=i % 2, value=bytes([i % 256]) * 100) for i in range(120)]

    async def main() -> None:
        with DynamoDBStore(table, group=GROUP) as store:
            async with DeadLetterWriter(store, table, written.append) as writer:
                for dl in dls:
                    writer.submit(dl)
                assert await writer.flush(15)
                assert writer.pending == 0

    run(main())
    assert sorted(written, key=lambda d: d.record.offset) == dls
    assert read_dead_letters(dynamodb, table.table) == sorted(
        dls, key=lambda d: (d.record.partition, d.record.offset)
    )


def test_the_largest_client_metadata_is_written_inline_or_with_its_payload_in_s3(
    aws: EmbeddedAWS, unique_name: str
) -> None:
    """A consumer id and a reason as long as a client may make them, in 4-byte characters,
    cannot push a dead letter over the item limit: with a payload that fits beside them it
    is written inline, with a larger one its payload goes to S3 (clienttext.py's bounds)."""
    bucket = unique_name.lower().replace("_", "-")[:55].strip("-") + "-b"
    settings = DeadLetterSettings(
        table=unique_name,
        endpoint_url=aws.endpoint_url,
        flush_interval_ms=5,
        overflow_bucket=bucket,
    )
    create_table(settings)
    create_bucket(settings)
    wide = "\U0001f600"
    consumer_id = wide * MAX_CONSUMER_ID_CHARS
    reason = f"delivery attempts exhausted ({2**32 - 1}): " + wide * MAX_REASON_CHARS
    inline = make_dl(1, value=b"v", reason=reason, consumer_id=consumer_id)
    room = MAX_ITEM_BYTES - item_size(inline, GROUP) + 1
    full = make_dl(2, value=b"v" * room, reason=reason, consumer_id=consumer_id)
    assert item_size(full, GROUP) == MAX_ITEM_BYTES
    huge = make_dl(3, value=b"v" * (2 * MAX_ITEM_BYTES), reason=reason, consumer_id=consumer_id)
    written: list[DeadLetter] = []

    async def main() -> None:
        with DynamoDBStore(settings, group=GROUP) as store:
            async with DeadLetterWriter(store, settings, written.append) as writer:
                for dl in (inline, full, huge):
                    writer.submit(dl)
                assert await writer.flush(30)
                assert writer.too_large == 0

    run(main())
    assert [dl.record.offset for dl in written] == [1, 2, 3]
    with DeadLetterTable(settings, group=GROUP) as table:
        items = {o: table.get(("orders", 0, o)) for o in (1, 2, 3)}
        assert ["payload_s3" in items[o] for o in (1, 2, 3)] == [False, False, True]
        assert [table.load(items[o]) for o in (1, 2, 3)] == [inline, full, huge]


def test_dead_endpoint_raises_unavailable() -> None:
    settings = DeadLetterSettings(table="t", endpoint_url=f"http://127.0.0.1:{free_port()}")
    with (
        DynamoDBStore(settings, **FAST, group=GROUP) as store,
        pytest.raises(DeadLetterUnavailable) as info,
    ):
        store.put_batch([make_dl(1)])
    assert info.value.retriable
    assert info.value.__cause__ is not None
    with pytest.raises(DeadLetterUnavailable):
        create_table(settings, timeout_s=1)


def test_writer_holds_everything_while_the_endpoint_is_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    settings = DeadLetterSettings(
        table="t", endpoint_url=f"http://127.0.0.1:{free_port()}", retry_max_s=0.2
    )
    written: list[DeadLetter] = []

    async def main() -> None:
        with DynamoDBStore(settings, **FAST, group=GROUP) as store:
            async with DeadLetterWriter(store, settings, written.append) as writer:
                for i in range(40):
                    writer.submit(make_dl(i))
                await several_failures(writer)
                assert writer.degraded
                assert writer.pending == 40
                assert not await writer.flush(0.3)
            assert writer.pending == 40

    run(main())
    assert written == []
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_killed_endpoint_reports_nothing_written(unique_name: str) -> None:
    written: list[DeadLetter] = []
    with EmbeddedAWS() as aws:
        settings = DeadLetterSettings(
            table=unique_name, endpoint_url=aws.endpoint_url, retry_max_s=0.2
        )
        create_table(settings)
        with DynamoDBStore(settings, **FAST, group=GROUP) as store:
            assert store.put_batch([make_dl(0)]) == []
            aws.signal(signal.SIGKILL)
            # Gone, not just signalled: its port refuses. (A fixed 0.2 s could end before a
            # loaded machine ran the kill, and the write below would reach a live server.)
            assert wait_until(lambda: not _accepts(aws.port), timeout=30)
            with pytest.raises(DeadLetterUnavailable):
                store.put_batch([make_dl(1)])

            async def main() -> None:
                async with DeadLetterWriter(store, settings, written.append) as writer:
                    for i in range(1, 30):
                        writer.submit(make_dl(i))
                    await several_failures(writer)
                    assert writer.pending == 29
                    assert not await writer.flush(0.2)

            run(main())
    assert written == []


def test_writer_recovers_when_a_frozen_endpoint_thaws(
    unique_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    written: list[DeadLetter] = []
    dls = [make_dl(i, value=bytes(range(256))) for i in range(60)]
    with EmbeddedAWS() as aws:
        settings = DeadLetterSettings(
            table=unique_name, endpoint_url=aws.endpoint_url, retry_max_s=0.3
        )
        create_table(settings)

        async def main() -> None:
            with DynamoDBStore(settings, **FAST, group=GROUP) as store:
                async with DeadLetterWriter(store, settings, written.append) as writer:
                    aws.signal(signal.SIGSTOP)
                    try:
                        for dl in dls:
                            writer.submit(dl)
                        await eventually(lambda: writer.degraded)
                        await several_failures(writer)
                        assert written == []
                        assert writer.pending == len(dls)
                    finally:
                        aws.signal(signal.SIGCONT)
                    assert await writer.flush(15)
                    assert not writer.degraded

        run(main())
        client = raw_client(aws.endpoint_url)
        try:
            assert read_dead_letters(client, settings.table) == dls
        finally:
            client.close()
    assert sorted(written, key=lambda d: d.record.offset) == dls
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [m for m in messages if m[0] == logging.WARNING][:1]
    assert any(level == logging.INFO and "recovered" in text for level, text in messages)
