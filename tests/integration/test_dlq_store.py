"""The complete dead-letter store against real parts: moto server (DynamoDB, S3, SNS,
SQS) and the Tansu broker. Idempotent writes, S3 overflow, TTL, scanning, the replay
protocol (byte-exact, provenance, reruns and concurrent runs), and notifications."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Literal, overload

import boto3
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from tests import samples
from tests.integration.harness import create_topic, write_dead_letters
from tests.samples import GROUP, T0
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.deadletters.notifier import notifier_from_settings
from triage_proxy.deadletters.writer import DeadLetterWriter
from triage_proxy.kafka.producer import never_written
from triage_proxy.store.aws import s3_client
from triage_proxy.store.checkpoints import DynamoDBCheckpoints
from triage_proxy.store.deadletter_store import DynamoDBStore
from triage_proxy.store.items import MAX_ITEM_BYTES, item_size
from triage_proxy.store.provisioning import create_bucket, create_table
from triage_proxy.store.query import DeadLetterTable, Filters, load_dead_letter
from triage_proxy.store.replay import (
    REPLAY_ID_HEADER,
    REPLAY_OF_HEADER,
    REPLAY_REASON_HEADER,
    ReplayResult,
    new_replay_id,
    replay,
)
from triage_proxy.store.replay import Producer as ReplayProducer
from triage_proxy.structs import DeadLetter

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.client import DynamoDBClient
    from mypy_boto3_s3.client import S3Client

pytestmark = pytest.mark.integration

EVERY_BYTE = bytes(range(256))


def make_dl(offset: int, **fields: Any) -> DeadLetter:
    """The sample dead letter, with a Kafka timestamp that varies by offset."""
    return samples.make_dl(offset, **{"timestamp_ms": T0 - 1000 + offset, **fields})


def bucket_for(name: str) -> str:
    return name.lower().replace("_", "-")[:55].strip("-") + "-b"


@overload
def boto(aws: EmbeddedAWS, service: Literal["dynamodb"]) -> DynamoDBClient: ...
@overload
def boto(aws: EmbeddedAWS, service: Literal["s3"]) -> S3Client: ...
@overload
def boto(aws: EmbeddedAWS, service: Literal["sns", "sqs"]) -> Any: ...  # no mypy_boto3_sns/sqs
def boto(aws: EmbeddedAWS, service: Literal["dynamodb", "s3", "sns", "sqs"]) -> Any:
    return boto3.session.Session().client(
        service,
        region_name="us-east-1",
        endpoint_url=aws.endpoint_url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


@pytest.fixture
def settings(aws: EmbeddedAWS, unique_name: str) -> DeadLetterSettings:
    made = DeadLetterSettings(
        table=unique_name,
        endpoint_url=aws.endpoint_url,
        flush_interval_ms=5,
        overflow_bucket=bucket_for(unique_name),
        ttl_days=7,
    )
    create_table(made)
    create_bucket(made)
    return made


@pytest.fixture
def table(settings: DeadLetterSettings) -> Iterator[DeadLetterTable]:
    with DeadLetterTable(settings, group=GROUP) as opened:
        yield opened


def producer(broker: EmbeddedBroker) -> ReplayProducer:
    return Producer(
        {"bootstrap.servers": broker.bootstrap, "acks": "all", "enable.idempotence": True}
    )


def consume(broker: EmbeddedBroker, topic: str, partition: int = 0, expect: int = 0) -> list[Any]:
    """Every message of a partition from offset 0 (waits for `expect`, then a quiet second)."""
    consumer = Consumer(
        {"bootstrap.servers": broker.bootstrap, "group.id": f"check-{time.monotonic_ns()}"}
    )
    consumer.assign([TopicPartition(topic, partition, 0)])
    found: list[Any] = []
    deadline = time.monotonic() + 30
    quiet_until = None
    try:
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                found.append(msg)
                quiet_until = None
                continue
            if len(found) >= expect:
                quiet_until = quiet_until or time.monotonic() + 1.0
                if time.monotonic() > quiet_until:
                    break
    finally:
        consumer.close()
    return found


# --- idempotent writes ----------------------------------------------------------------


@pytest.mark.parametrize("batched", [True, False], ids=["batch", "single"])
def test_a_retried_write_never_clobbers_a_replayed_or_discarded_item(
    settings: DeadLetterSettings, table: DeadLetterTable, batched: bool
) -> None:
    first = [make_dl(i, reason="first") for i in range(4)]
    with DynamoDBStore(settings, group=GROUP) as store:
        assert store.put_batch(first) == []
        assert table.claim(("orders", 0, 0), "run-1", lease_s=60)
        assert table.mark_replayed(("orders", 0, 0), "run-1", "orders", table.get(("orders", 0, 0)))
        assert table.discard(("orders", 0, 1))
        assert table.claim(("orders", 0, 2), "run-2", lease_s=60)
        again = [make_dl(i, reason="again") for i in range(4)]
        if batched:
            assert store.put_batch(again) == []
        else:
            for dl in again:
                assert store.put_batch([dl]) == []
        assert store.kept == 3
    replayed = table.get(("orders", 0, 0))
    assert replayed["status"] == {"S": "replayed"}
    assert replayed["reason"] == {"S": "first"}
    assert replayed["replay_id"] == {"S": "run-1"}
    assert replayed["replay_count"] == {"N": "1"}
    assert table.get(("orders", 0, 1))["status"] == {"S": "discarded"}
    claimed = table.get(("orders", 0, 2))
    assert claimed["replay_claim"] == {"S": "run-2"}
    assert claimed["reason"] == {"S": "first"}
    assert table.get(("orders", 0, 3))["reason"] == {"S": "again"}  # pending: overwritten


# --- large payloads -------------------------------------------------------------------


def test_large_payload_goes_to_s3_and_comes_back_byte_exact(
    settings: DeadLetterSettings, table: DeadLetterTable, aws: EmbeddedAWS
) -> None:
    big = make_dl(
        7,
        key=None,
        value=EVERY_BYTE * 2000,
        headers=(("h", None), ("bin", EVERY_BYTE), ("h", b"")),
    )
    assert item_size(big, GROUP) > MAX_ITEM_BYTES
    write_dead_letters(settings, [big, make_dl(8)])
    item = table.get(("orders", 0, 7))
    assert "value" not in item
    assert "key" not in item
    assert "headers" not in item
    assert settings.overflow_bucket is not None
    url = f"s3://{settings.overflow_bucket}/{settings.table}/orders/0/7/{GROUP}"
    assert item["payload_s3"] == {"S": url}
    assert item["reason"] == {"S": "ValueError: bad"}
    client = s3_client(settings)
    try:
        assert load_dead_letter(item, client) == big
        head = client.head_object(Bucket=settings.overflow_bucket, Key=url.split("/", 3)[3])
        assert head["ContentLength"] == int(item["payload_bytes"]["N"])
    finally:
        client.close()
    assert table.load(item) == big
    assert table.load(table.get(("orders", 0, 8))) == make_dl(8)


# --- TTL ------------------------------------------------------------------------------


def test_ttl_is_enabled_and_set_when_items_settle(
    settings: DeadLetterSettings, table: DeadLetterTable, aws: EmbeddedAWS
) -> None:
    create_table(settings)  # again: idempotent with TTL on
    create_bucket(settings)
    bucket = settings.overflow_bucket
    assert bucket is not None  # the fixture's settings have one
    dynamodb = boto(aws, "dynamodb")
    s3 = boto(aws, "s3")
    try:
        ttl = dynamodb.describe_time_to_live(TableName=settings.table)["TimeToLiveDescription"]
        assert ttl == {"TimeToLiveStatus": "ENABLED", "AttributeName": "expires_at"}
        rules = s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
        assert [r["ID"] for r in rules] == ["triage-expire-settled-payloads"]
        big = make_dl(1, value=os.urandom(MAX_ITEM_BYTES))
        write_dead_letters(settings, [big, make_dl(2)])
        assert "expires_at" not in table.get(("orders", 0, 1))
        before = time.time()
        assert table.claim(("orders", 0, 1), "r", lease_s=60)
        assert table.mark_replayed(("orders", 0, 1), "r", "elsewhere", table.get(("orders", 0, 1)))
        assert table.discard(("orders", 0, 2))
        week = 7 * 86400
        for offset in (1, 2):
            expires = int(table.get(("orders", 0, offset))["expires_at"]["N"])
            assert before + week - 1 <= expires <= time.time() + week
        key = f"{settings.table}/orders/0/1/{GROUP}"
        tags = s3.get_object_tagging(Bucket=bucket, Key=key)["TagSet"]
        assert tags == [{"Key": "triage-status", "Value": "settled"}]
    finally:
        dynamodb.close()
        s3.close()


# --- scanning -------------------------------------------------------------------------


def test_scan_paginates_never_yields_checkpoints_and_splits_into_segments(
    settings: DeadLetterSettings, table: DeadLetterTable
) -> None:
    dls = [make_dl(i, partition=i % 3) for i in range(40)]
    write_dead_letters(settings, dls)
    checkpoints = DynamoDBCheckpoints(settings, "orders", 0, "group")
    try:
        checkpoints.put(5, "settled-text")
    finally:
        checkpoints.close()
    everything = list(table.scan(Filters(), page_size=7))
    assert len(everything) == 40
    segments = [
        [i["offset"]["N"] for i in table.scan(Filters(), segment=s, total_segments=4)]
        for s in range(4)
    ]
    assert sorted(int(o) for seg in segments for o in seg) == list(range(40))
    queried = list(table.scan(Filters(topic="orders", partition=0), page_size=3))
    assert [int(i["offset"]["N"]) for i in queried] == list(range(0, 40, 3))
    assert list(table.scan(Filters(topic="orders", partition=0), segment=1, total_segments=4)) == []
    one = list(table.scan(Filters(topic="orders", partition=1, offset=4)))
    assert [int(i["offset"]["N"]) for i in one] == [4]


# --- replay ---------------------------------------------------------------------------


def mixed_set(topic: str) -> list[DeadLetter]:
    return [
        make_dl(0, topic=topic, key=None, value=b"null key"),
        make_dl(1, topic=topic, key=b"\x00\xff", value=EVERY_BYTE),
        make_dl(2, topic=topic, key=b"k", value=None, reason="tombstone ✗"),
        make_dl(3, topic=topic, headers=(("h", None), ("h", b"2"), ("", b""), ("b", EVERY_BYTE))),
        make_dl(4, topic=topic, key=b"big", value=os.urandom(450_000), headers=(("x", b"y"),)),
        make_dl(5, topic=topic, key=b"", value=b""),
    ]


def test_replay_is_byte_exact_with_provenance_and_a_rerun_replays_nothing(
    settings: DeadLetterSettings, table: DeadLetterTable, broker: EmbeddedBroker, unique_name: str
) -> None:
    create_topic(broker.bootstrap, unique_name)
    dls = mixed_set(unique_name)
    write_dead_letters(settings, dls)
    assert "payload_s3" in table.get((unique_name, 0, 4))
    replay_id = new_replay_id()
    kafka = producer(broker)
    items = list(table.scan(Filters(topic=unique_name), consistent=True))
    result = replay(table, kafka, items, replay_id=replay_id, never_written=never_written)
    assert sorted(result.replayed) == [(unique_name, 0, i) for i in range(6)]
    assert result.failed == []
    rescan = list(table.scan(Filters(topic=unique_name)))
    rerun = replay(table, kafka, rescan, replay_id="again", never_written=never_written)
    assert rerun.replayed == []
    assert len(rerun.skipped) == 6
    kafka.flush(10)
    copies = consume(broker, unique_name, expect=6)
    assert len(copies) == 6  # the rerun produced nothing
    by_origin = {dict(m.headers())[REPLAY_OF_HEADER]: m for m in copies}
    for dl in dls:
        copy = by_origin[f"{unique_name}/0/{dl.record.offset}".encode()]
        assert copy.key() == dl.record.key
        assert copy.value() == dl.record.value
        assert copy.headers() == [
            *dl.record.headers,
            (REPLAY_OF_HEADER, f"{unique_name}/0/{dl.record.offset}".encode()),
            (REPLAY_REASON_HEADER, dl.reason.encode()),
            (REPLAY_ID_HEADER, replay_id.encode()),
        ]
        item = table.get((unique_name, 0, dl.record.offset))
        assert item["status"] == {"S": "replayed"}
        assert item["replayed_to"] == {"S": f"{unique_name}/0/{copy.offset()}"}
        assert item["replay_id"] == {"S": replay_id}
        assert item["replay_count"] == {"N": "1"}
        assert item["replayed_at"]["S"].endswith("Z")
        assert "replay_claim" not in item


class SerialAWS(EmbeddedAWS):
    """moto serving one request at a time. moto server's conditional writes are not
    atomic across its request threads (two claims of one item sent at the same instant
    both succeeded, 39 of 300 in a measurement); DynamoDB's are, and the claims rely on
    that. Served one at a time, moto's are too."""

    def command(self, port: int) -> list[str]:
        script = (
            "import sys\n"
            "from moto.server import DomainDispatcherApplication, create_backend_app\n"
            "from werkzeug.serving import run_simple\n"
            "run_simple(sys.argv[1], int(sys.argv[2]),"
            " DomainDispatcherApplication(create_backend_app), threaded=False)\n"
        )
        return [sys.executable, "-c", script, self.host, str(port)]


@pytest.fixture
def serial_settings(unique_name: str) -> Iterator[DeadLetterSettings]:
    with SerialAWS() as aws:
        made = DeadLetterSettings(table=unique_name, endpoint_url=aws.endpoint_url)
        create_table(made)
        yield made


def test_concurrent_replays_produce_every_item_once(
    serial_settings: DeadLetterSettings, broker: EmbeddedBroker, unique_name: str
) -> None:
    settings = serial_settings
    table = DeadLetterTable(settings, group=GROUP)
    create_topic(broker.bootstrap, unique_name)
    write_dead_letters(
        settings, [make_dl(i, topic=unique_name, value=b"%d" % i) for i in range(60)]
    )
    items = list(table.scan(Filters(topic=unique_name), consistent=True))
    results: list[ReplayResult] = []

    def run() -> None:
        with DeadLetterTable(settings, group=GROUP) as own:
            replayed = replay(
                own,
                producer(broker),
                items,
                replay_id=new_replay_id(),
                never_written=never_written,
                chunk=7,
            )
            results.append(replayed)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sum(len(r.replayed) for r in results) == 60
    assert all(r.failed == [] for r in results)
    table.close()
    copies = consume(broker, unique_name, expect=60)
    assert sorted(m.value() for m in copies) == sorted(b"%d" % i for i in range(60))


class RefusingProducer:
    """Reports every delivery as failed the way librdkafka does for an unknown topic."""

    class Error:
        def name(self) -> str:
            return "UNKNOWN_TOPIC_OR_PART"

        def __str__(self) -> str:
            return "Broker: Unknown topic or partition"

    def __init__(self) -> None:
        self.callbacks: list[Any] = []

    def produce(self, topic: str, **kwargs: Any) -> None:
        self.callbacks.append(kwargs["on_delivery"])

    def poll(self, timeout: float) -> int:
        return 0

    def flush(self, timeout: float) -> int:
        for callback in self.callbacks:
            callback(self.Error(), None)
        self.callbacks.clear()
        return 0

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        pass


def test_a_failed_delivery_releases_the_claim_for_a_later_replay(
    settings: DeadLetterSettings, table: DeadLetterTable, broker: EmbeddedBroker, unique_name: str
) -> None:
    create_topic(broker.bootstrap, unique_name)
    write_dead_letters(settings, [make_dl(i, topic=unique_name) for i in range(3)])
    items = list(table.scan(Filters(topic=unique_name), consistent=True))
    failed = replay(
        table, RefusingProducer(), items, replay_id="doomed", never_written=never_written
    )
    assert len(failed.failed) == 3
    assert all("Unknown topic" in why for _, why in failed.failed)
    for offset in range(3):
        item = table.get((unique_name, 0, offset))
        assert item["status"] == {"S": "pending"}
        assert "replay_claim" not in item
    retried = replay(
        table, producer(broker), items, replay_id=new_replay_id(), never_written=never_written
    )
    assert len(retried.replayed) == 3


def test_a_live_claim_keeps_other_replays_and_discards_off(
    table: DeadLetterTable, settings: DeadLetterSettings
) -> None:
    write_dead_letters(settings, [make_dl(1)])
    key = ("orders", 0, 1)
    assert table.claim(key, "a", lease_s=60)
    assert not table.claim(key, "b", lease_s=60)
    assert not table.discard(key)
    assert table.claim(key, "a", lease_s=60)  # a replay may renew its own claim
    assert not table.mark_replayed(key, "b", "orders", table.get(key))
    assert table.release(key, "a")
    assert table.claim(key, "b", lease_s=-1)  # already stale
    assert table.claim(key, "c", lease_s=60)  # a stale claim is taken over
    assert table.mark_replayed(key, "c", "orders", table.get(key))
    assert not table.claim(key, "d", lease_s=60)


# --- notifications --------------------------------------------------------------------


def test_a_burst_of_dead_letters_makes_a_few_sns_summaries(
    aws: EmbeddedAWS, unique_name: str
) -> None:
    sns = boto(aws, "sns")
    sqs = boto(aws, "sqs")
    try:
        topic_arn = sns.create_topic(Name=unique_name)["TopicArn"]
        queue_url = sqs.create_queue(QueueName=unique_name)["QueueUrl"]
        queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])[
            "Attributes"
        ]["QueueArn"]
        sns.subscribe(TopicArn=topic_arn, Protocol="sqs", Endpoint=queue_arn)
        settings = DeadLetterSettings(
            table=unique_name,
            endpoint_url=aws.endpoint_url,
            flush_interval_ms=5,
            notify_sns_topic_arn=topic_arn,
            notify_interval_s=1.0,
        )
        create_table(settings)

        async def main() -> None:
            notifier = notifier_from_settings(settings, "orders[0]")
            assert notifier is not None
            async with notifier:
                with DynamoDBStore(settings, group=GROUP) as store:
                    async with DeadLetterWriter(
                        store, settings, lambda dl: None, notifier=notifier
                    ) as writer:
                        for i in range(2000):
                            writer.submit(make_dl(i, reason=f"E{i % 3}"))
                        assert await writer.flush(60)
            assert notifier.failed == 0

        asyncio.run(asyncio.wait_for(main(), 120))
        bodies = []
        while True:
            got = sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=1)
            if not got.get("Messages"):
                break
            bodies += [json.loads(json.loads(m["Body"])["Message"]) for m in got["Messages"]]
    finally:
        sns.close()
        sqs.close()
    assert 1 <= len(bodies) <= 10
    assert sum(b["count"] for b in bodies) == 2000
    assert all(b["type"] == "triage.dead_letters" and b["table"] == unique_name for b in bodies)
    assert {r["reason"] for b in bodies for r in b["top_reasons"]} <= {"E0", "E1", "E2"}


class Hook(http.server.BaseHTTPRequestHandler):
    received: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        Hook.received.append(json.loads(self.rfile.read(length)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_webhook_gets_a_few_json_summaries_for_ten_thousand_dead_letters() -> None:
    Hook.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/hooks/dlq"
        settings = DeadLetterSettings(table="t", notify_webhook_url=url, notify_interval_s=0.5)

        async def main() -> float:
            notifier = notifier_from_settings(settings, "orders[0]")
            assert notifier is not None
            started = time.monotonic()
            async with notifier:
                for i in range(10_000):
                    notifier.record(make_dl(i, partition=i % 2))
                    if i % 1000 == 0:
                        await asyncio.sleep(0.1)  # the burst lasts about a second
            assert notifier.failed == 0
            return time.monotonic() - started

        took = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        server.shutdown()
        server.server_close()
    # One summary an interval at most, plus the final one at the end: counted over the
    # burst as it ran (some 1 s, so 4), a burst slowed by a loaded machine only loosens it.
    assert 2 <= len(Hook.received) <= took / settings.notify_interval_s + 2
    assert sum(doc["count"] for doc in Hook.received) == 10_000
    partitions = {p["partition"] for doc in Hook.received for p in doc["partitions"]}
    assert partitions == {0, 1}
