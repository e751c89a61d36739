"""The Spark replay job for real: PySpark local mode, the moto server and the Tansu broker.

What must hold: replayed messages (null keys, binary values, headers with None, a
payload kept in S3) arrive byte-exact with provenance headers; a rerun replays nothing
new; a failure midway (an exception in a task, or a worker killed after its chunk was
delivered and before it was marked) followed by a rerun leaves every selected item in
Kafka exactly once; filters select exactly what they say. Dead letters are written
straight into the table in the proxy's own item format (`item_from_dead_letter`, and
the store itself for the S3 one). One SparkSession (local[2]) serves the module.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import boto3
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, TopicPartition
from confluent_kafka.admin import AdminClient

from tests import samples
from tests.integration.harness import TOKEN, create_topic, headers_of
from tests.samples import GROUP
from triage_cli.devstack import write_config
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker
from triage_cli.exitcodes import ExitCode
from triage_proxy.config.loader import load_settings
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.errors import ConfigError, NotFoundError
from triage_proxy.kafka.logs import KafkaLog
from triage_proxy.store.deadletter_store import DynamoDBStore
from triage_proxy.store.items import item_from_dead_letter
from triage_proxy.store.provisioning import create_bucket, create_table
from triage_proxy.store.query import TableNotFound
from triage_proxy.structs import DeadLetter
from triage_replay import Fault, Filters, ReplayFailed, ReplayOptions, Summary, run_replay
from triage_replay.job import (
    ExportExists,
    build_parser,
    local_session,
    options_from_args,
    python_for_workers,
    spark_cause,
    stop_session,
)
from triage_replay.job import main as job_main

# One xdist worker runs the module (--dist loadgroup), so its one JVM serves every test;
# a group of its own, not the CPU-heavy one: chained after the Spark cluster and the fault
# suites on one worker, it made that worker's tests the run's last minutes.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("spark-local")]

BASE_MS = 1_714_564_800_000
"""2024-05-01T12:00:00Z: dead letters are dead-lettered at BASE_MS + offset seconds."""
ALL_BYTES = bytes(range(256))


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """One local[2] session for the module; its JVM is stopped (and reaped) at the end."""
    session = local_session(
        "local[2]",
        {
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.sql.shuffle.partitions": "2",
            "spark.default.parallelism": "2",
        },
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    stop_session(session)


@pytest.fixture
def table(aws: EmbeddedAWS, unique_name: str) -> DeadLetterSettings:
    settings = DeadLetterSettings(
        table=unique_name, endpoint_url=aws.endpoint_url, overflow_bucket=f"{unique_name}-payloads"
    )
    create_table(settings)
    create_bucket(settings)
    return settings


@pytest.fixture
def dynamodb(aws: EmbeddedAWS) -> Iterator[Any]:
    client = boto3.client(
        "dynamodb",
        endpoint_url=aws.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    yield client
    client.close()


# --- helpers ------------------------------------------------------------------------------


def make_dl(topic: str, partition: int, offset: int, **fields: Any) -> DeadLetter:
    """The sample dead letter of topic/partition, dead-lettered a second per offset apart."""
    times = {"timestamp_ms": BASE_MS - 5000 + offset, "at_ms": BASE_MS + offset * 1000}
    fields = {"reason": "handler raised ValueError", **times, **fields}
    return samples.make_dl(offset, topic=topic, partition=partition, **fields)


def write(dynamodb: Any, table: str, dls: Iterable[DeadLetter], status: str = "pending") -> None:
    requests = []
    for dl in dls:
        item = item_from_dead_letter(dl, GROUP)
        item["status"] = {"S": status}
        requests.append({"PutRequest": {"Item": item}})
    for start in range(0, len(requests), 25):
        response = dynamodb.batch_write_item(RequestItems={table: requests[start : start + 25]})
        assert not response.get("UnprocessedItems")


def write_checkpoint(dynamodb: Any, table: str, topic: str) -> None:
    """A commit checkpoint item (offset -1) shares the table; the job must skip it."""
    dynamodb.put_item(
        TableName=table,
        Item={
            "source": {"S": f"{topic}#0#checkpoint#g"},
            "offset": {"N": "-1"},
            "committed": {"N": "7"},
            "settled": {"S": ""},
        },
    )


def items(dynamodb: Any, table: str) -> dict[tuple[str, int, int], dict[str, Any]]:
    """Every dead-letter item by (topic, partition, offset)."""
    found: dict[tuple[str, int, int], dict[str, Any]] = {}
    kwargs: dict[str, Any] = {"TableName": table, "ConsistentRead": True}
    while True:
        page = dynamodb.scan(**kwargs)
        for item in page["Items"]:
            if int(item["offset"]["N"]) >= 0:
                key = (item["topic"]["S"], int(item["partition"]["N"]), int(item["offset"]["N"]))
                found[key] = item
        if "LastEvaluatedKey" not in page:
            return found
        kwargs["ExclusiveStartKey"] = page["LastEvaluatedKey"]


def consume(
    bootstrap: str, topic: str, partitions: int, expected: int, quiet_s: float = 1.5
) -> list[Message]:
    """Everything in the topic: read until `expected` arrived and then `quiet_s` of silence
    (so duplicates would show), or 30 s. Never trusts the high watermark (Tansu)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"check-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    out: list[Message] = []
    deadline = time.monotonic() + 30
    quiet_until = None
    try:
        while time.monotonic() < deadline:
            batch = consumer.consume(1000, 0.2)
            for msg in batch:
                assert msg.error() is None, msg.error()
                out.append(msg)
            if batch:
                quiet_until = None
            if len(out) >= expected:
                if quiet_until is None:
                    quiet_until = time.monotonic() + quiet_s
                elif time.monotonic() > quiet_until:
                    break
        return out
    finally:
        consumer.close()


def header(msg: Message, name: str) -> bytes | None:
    values = [v for k, v in headers_of(msg) if k == name]
    assert len(values) == 1, (name, msg.headers())
    return values[0]


def replay_of(msg: Message) -> str:
    value = header(msg, "triage-replay-of")
    assert value is not None
    return value.decode()


def options(
    table: DeadLetterSettings, broker: EmbeddedBroker | None = None, **kwargs: Any
) -> ReplayOptions:
    return ReplayOptions(
        table,
        bootstrap=broker.bootstrap if broker else None,
        segments=kwargs.pop("segments", 3),
        delivery_timeout_s=kwargs.pop("delivery_timeout_s", 20.0),
        **kwargs,
        group=GROUP,
    )


def coords(dls: Sequence[DeadLetter]) -> set[str]:
    return {f"{d.record.topic}/{d.record.partition}/{d.record.offset}" for d in dls}


def mixed_set(topic: str) -> list[DeadLetter]:
    """Null and empty keys, binary and null values, headers with None, duplicates, order."""
    return [
        make_dl(topic, 0, 0, key=None, value=ALL_BYTES),
        make_dl(topic, 0, 1, key=b"", value=b""),
        make_dl(topic, 0, 2, key=b"\x00\xff", value=None),
        make_dl(
            topic,
            1,
            0,
            key=b"order-7",
            value=b'{"total": 12}',
            headers=(("trace", b"\x01\x02"), ("empty", None), ("trace", b""), ("z", b"last")),
        ),
        make_dl(topic, 1, 5, key=ALL_BYTES[::-1], value=ALL_BYTES * 40, headers=(("n", None),)),
        make_dl(topic, 1, 9, reason="caf\u00e9 timeout \u2603"),
    ]


# --- tests --------------------------------------------------------------------------------


def test_replay_arrives_byte_exact_with_provenance(
    spark: Any, broker: EmbeddedBroker, table: DeadLetterSettings, dynamodb: Any, unique_name: str
) -> None:
    topic = unique_name
    create_topic(broker.bootstrap, topic, partitions=2)
    large = make_dl(  # over DynamoDB's item limit: the store keeps its payload in S3
        topic,
        1,
        11,
        key=b"big",
        value=ALL_BYTES * 2000,
        headers=(("h", ALL_BYTES), ("none", None)),
    )
    dls = [*mixed_set(topic), large]
    write(dynamodb, table.table, dls[:-1])
    with DynamoDBStore(table, group=GROUP) as store:
        assert store.put_batch([large]) == []
    assert "payload_s3" in items(dynamodb, table.table)[(topic, 1, 11)]
    write_checkpoint(dynamodb, table.table, topic)

    with_ttl = dataclasses.replace(table, ttl_days=7)
    summary = run_replay(options(with_ttl, broker), spark=spark)

    # read counts what DynamoDB evaluated: the checkpoint item and the by-state index's
    # marker item (offset -3, written when the table was created) too
    assert (summary.read, summary.selected, summary.replayed) == (9, 7, 7), summary
    assert (summary.skipped, summary.failed, summary.in_doubt, summary.errors) == (0, 0, 0, ())
    assert summary.ok
    messages = consume(broker.bootstrap, topic, 2, expected=7)
    by_origin = {replay_of(m): m for m in messages}
    assert len(messages) == len(by_origin) == 7
    for dl in dls:
        record = dl.record
        msg = by_origin[f"{record.topic}/{record.partition}/{record.offset}"]
        assert msg.partition() == record.partition  # back to where it came from
        assert msg.key() == record.key
        assert msg.value() == record.value
        provenance = [
            ("triage-replay-of", f"{record.topic}/{record.partition}/{record.offset}".encode()),
            ("triage-replay-reason", dl.reason.encode()),
            ("triage-replay-id", summary.replay_id.encode()),
        ]
        assert (msg.headers() or []) == [*record.headers, *provenance]
    stored = items(dynamodb, table.table)
    for dl in dls:
        item = stored[(dl.record.topic, dl.record.partition, dl.record.offset)]
        msg = by_origin[f"{dl.record.topic}/{dl.record.partition}/{dl.record.offset}"]
        assert item["status"]["S"] == "replayed"
        assert item["replay_id"]["S"] == summary.replay_id
        assert item["replayed_to"]["S"] == f"{topic}/{msg.partition()}/{msg.offset()}"
        assert item["replay_count"]["N"] == "1"
        assert int(item["expires_at"]["N"]) > time.time() + 6 * 86400
        assert "replay_claim" not in item
        assert "replay_claim_until" not in item


def test_rerun_replays_nothing_new(
    spark: Any, broker: EmbeddedBroker, table: DeadLetterSettings, dynamodb: Any, unique_name: str
) -> None:
    topic = unique_name
    create_topic(broker.bootstrap, topic, partitions=2)
    write(dynamodb, table.table, mixed_set(topic))

    first = run_replay(options(table, broker), spark=spark)
    second = run_replay(options(table, broker), spark=spark)

    assert first.replayed == 6
    # read: the six and the index's marker item
    assert (second.read, second.selected, second.replayed, second.skipped) == (7, 6, 0, 6)
    assert second.ok
    assert second.replay_id != first.replay_id
    messages = consume(broker.bootstrap, topic, 2, expected=6)
    assert sorted(Counter(replay_of(m) for m in messages).values()) == [1] * 6


def test_replay_to_another_topic_with_filters(
    spark: Any, broker: EmbeddedBroker, table: DeadLetterSettings, dynamodb: Any, unique_name: str
) -> None:
    source, target = unique_name, f"{unique_name}-fixed"
    create_topic(broker.bootstrap, target, partitions=3)
    dls = [
        make_dl(source, p, o, reason=f"{'Timeout' if o % 2 else 'bad json'}")
        for p in (0, 1)
        for o in range(6)
    ]
    write(dynamodb, table.table, dls)
    chosen = [d for d in dls if d.record.partition == 1 and "timeout" in d.reason.lower()]

    filters = Filters(topic=source, partition=1, reason="TIMEOUT")
    summary = run_replay(options(table, broker, filters=filters, to_topic=target), spark=spark)

    # topic + partition is one Query on that partition: only its 6 items are read
    assert (summary.read, summary.selected, summary.replayed) == (6, 3, 3), summary
    messages = consume(broker.bootstrap, target, 3, expected=3)
    assert sorted(replay_of(m) for m in messages) == sorted(coords(chosen))
    stored = items(dynamodb, table.table)
    replayed = {k for k, item in stored.items() if item["status"]["S"] == "replayed"}
    assert replayed == {(d.record.topic, d.record.partition, d.record.offset) for d in chosen}


def export_offsets(spark: Any, table: DeadLetterSettings, path: Path, filters: Filters) -> set[str]:
    summary = run_replay(options(table, export_path=str(path), filters=filters), spark=spark)
    rows = spark.read.parquet(str(path)).select("topic", "partition", "offset").collect()
    assert summary.exported == summary.selected == len(rows)
    return {f"{r.topic}/{r.partition}/{r.offset}" for r in rows}


def test_filters_select_exactly_what_they_say(
    spark: Any, table: DeadLetterSettings, dynamodb: Any, tmp_path: Path
) -> None:
    dls = [
        make_dl(topic, partition, offset, reason=reason)
        for topic in ("orders", "payments")
        for partition in (0, 1)
        for offset, reason in enumerate(["Timeout calling bank", "bad JSON", "timeout", "oops"])
    ]
    pending = [d for d in dls if d.record.offset != 3]
    write(dynamodb, table.table, pending)
    write(dynamodb, table.table, [d for d in dls if d.record.offset == 3], status="replayed")
    write_checkpoint(dynamodb, table.table, "orders")

    # Five runs cover every filter field and both read paths (Scan, and the Query of
    # one source partition); table.query's `matches` is tested case by case in tests/unit.
    cases: list[tuple[Filters, list[DeadLetter]]] = [
        (Filters(), dls),  # everything but the checkpoint item
        (
            Filters(topic="payments", partition=1, reason="TIMEOUT"),
            [
                d
                for d in dls
                if d.record.topic == "payments"
                and d.record.partition == 1
                and "timeout" in d.reason.lower()
            ],
        ),
        (Filters(status="replayed"), [d for d in dls if d.record.offset == 3]),
        (  # dead-lettered at BASE + offset s: [BASE+1s, BASE+3s) holds offsets 1 and 2
            Filters(topic="orders", since_ms=BASE_MS + 1000, until_ms=BASE_MS + 3000),
            [d for d in dls if d.record.topic == "orders" and d.record.offset in (1, 2)],
        ),
        (
            Filters(status="pending", reason="json", partition=0),
            [d for d in dls if d.record.partition == 0 and d.record.offset == 1],
        ),
    ]
    for n, (filters, expected) in enumerate(cases):
        got = export_offsets(spark, table, tmp_path / f"case{n}", filters)
        assert got == coords(expected), filters


def test_export_writes_every_column(
    spark: Any, table: DeadLetterSettings, dynamodb: Any, tmp_path: Path
) -> None:
    dls = mixed_set("orders")
    write(dynamodb, table.table, dls)
    path = tmp_path / "export"

    summary = run_replay(options(table, export_path=str(path)), spark=spark)

    # read: the six and the index's marker item
    assert (summary.mode, summary.read, summary.selected, summary.exported) == ("export", 7, 6, 6)
    rows = {(r.topic, r.partition, r.offset): r for r in spark.read.parquet(str(path)).collect()}
    for dl in dls:
        row = rows[(dl.record.topic, dl.record.partition, dl.record.offset)]
        assert (row.key, row.value) == (dl.record.key, dl.record.value)
        assert [(h.key, h.value) for h in row.headers] == list(dl.record.headers)
        assert (row.reason, row.attempts, row.consumer_id) == (dl.reason, 3, "worker-1")
        assert row.status == "pending"
        assert int(row.timestamp.timestamp() * 1000) == dl.record.timestamp_ms
        assert int(row.dead_lettered_at.timestamp() * 1000) == dl.dead_lettered_at_ms
        assert row.replay_id is None
    assert {item["status"]["S"] for item in items(dynamodb, table.table).values()} == {"pending"}


def many(topic: str, partitions: int, per_partition: int) -> list[DeadLetter]:
    return [
        make_dl(topic, p, o, key=f"k{p}-{o}".encode(), value=bytes([o % 256]) * (o + 1))
        for p in range(partitions)
        for o in range(per_partition)
    ]


def test_failure_midway_then_rerun_replays_each_item_exactly_once(
    spark: Any, broker: EmbeddedBroker, table: DeadLetterSettings, dynamodb: Any, unique_name: str
) -> None:
    """A segment raises mid-chunk (after producing 15 messages, chunk size 10): it marks
    what was delivered, releases the rest, and the rerun replays exactly the rest."""
    topic = unique_name
    create_topic(broker.bootstrap, topic, partitions=3)
    dls = many(topic, 3, 40)
    write(dynamodb, table.table, dls)

    first = run_replay(options(table, broker, chunk_size=10, fault=Fault(after=15)), spark=spark)

    assert first.errors, first  # every segment holding a partition's 40 items failed
    assert all("InjectedFault" in e for e in first.errors)
    assert first.in_doubt == 0  # an exception leaves nothing claimed
    assert 0 < first.replayed < 120
    stored = items(dynamodb, table.table)
    assert not [k for k, item in stored.items() if "replay_claim" in item]
    assert sum(item["status"]["S"] == "replayed" for item in stored.values()) == first.replayed

    second = run_replay(options(table, broker, chunk_size=10), spark=spark)

    assert second.ok, second
    assert second.replayed == 120 - first.replayed
    assert second.skipped == first.replayed
    messages = consume(broker.bootstrap, topic, 3, expected=120)
    counts = Counter(replay_of(m) for m in messages)
    assert set(counts) == coords(dls)
    assert set(counts.values()) == {1}
    by_origin = {replay_of(m): m for m in messages}
    for dl in dls:  # and byte-exact, from whichever run
        msg = by_origin[f"{topic}/{dl.record.partition}/{dl.record.offset}"]
        assert (msg.key(), msg.value()) == (dl.record.key, dl.record.value)


def test_worker_crash_after_produce_never_replays_twice(
    spark: Any, broker: EmbeddedBroker, table: DeadLetterSettings, dynamodb: Any, unique_name: str
) -> None:
    """The worst moment: the worker dies after its chunk was delivered and before it was
    marked. The chunk stays claimed (in doubt) and no later run produces it again."""
    topic = unique_name
    create_topic(broker.bootstrap, topic, partitions=1)
    dls = many(topic, 1, 40)  # one partition key: one segment holds them all
    write(dynamodb, table.table, dls)

    with pytest.raises(ReplayFailed) as failed:
        run_replay(
            options(table, broker, chunk_size=10, fault=Fault(after=15, crash=True)), spark=spark
        )
    # the cause Spark found, not py4j's "An error occurred while calling o61.collect..."
    assert "Python worker exited unexpectedly" in str(failed.value), failed.value
    assert "a rerun is safe" in str(failed.value)

    stored = items(dynamodb, table.table)
    claimed = {k[2] for k, item in stored.items() if "replay_claim" in item}
    replayed = {k[2] for k, item in stored.items() if item["status"]["S"] == "replayed"}
    assert claimed == set(range(10, 20))  # the chunk holding the 15th message
    assert replayed == set(range(10))

    second = run_replay(options(table, broker, chunk_size=10), spark=spark)
    third = run_replay(options(table, broker, chunk_size=10), spark=spark)

    assert (second.replayed, second.skipped, second.in_doubt) == (20, 10, 10), second
    assert (third.replayed, third.skipped, third.in_doubt) == (0, 30, 10), third
    assert not second.ok
    messages = consume(broker.bootstrap, topic, 1, expected=40)
    counts = Counter(replay_of(m) for m in messages)
    assert set(counts) == coords(dls)  # the in-doubt chunk did reach Kafka, once
    assert set(counts.values()) == {1}


def test_retry_in_doubt_takes_over_expired_claims_only(
    spark: Any, broker: EmbeddedBroker, table: DeadLetterSettings, dynamodb: Any, unique_name: str
) -> None:
    """Claims left by a run that died before producing: reported in doubt, and replayed
    once an operator asks for it, but only after their lease expired."""
    topic = unique_name
    create_topic(broker.bootstrap, topic, partitions=1)
    dls = many(topic, 1, 6)
    write(dynamodb, table.table, dls)
    now_ms = int(time.time() * 1000)
    for offset, until in [(0, now_ms - 1000), (1, now_ms - 1000), (2, now_ms + 600_000)]:
        dynamodb.update_item(
            TableName=table.table,
            Key={"source": {"S": f"{topic}#0#dead#{GROUP}"}, "offset": {"N": str(offset)}},
            UpdateExpression="SET replay_claim = :c, replay_claim_until = :u",
            ExpressionAttributeValues={":c": {"S": "dead-run"}, ":u": {"N": str(until)}},
        )

    plain = run_replay(options(table, broker), spark=spark)
    taken = run_replay(options(table, broker, retry_in_doubt=True), spark=spark)

    assert (plain.replayed, plain.in_doubt, plain.skipped) == (3, 3, 0), plain
    assert (taken.replayed, taken.in_doubt, taken.skipped) == (2, 1, 3), taken
    messages = consume(broker.bootstrap, topic, 1, expected=5)
    assert sorted(replay_of(m) for m in messages) == sorted(
        f"{topic}/0/{o}" for o in (0, 1, 3, 4, 5)
    )


def test_an_existing_export_path_is_refused_until_overwrite(
    spark: Any,
    table: DeadLetterSettings,
    dynamodb: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What a failed export leaves behind (the directory and Spark's _temporary) makes
    the rerun fail: the message says --overwrite, and --overwrite replaces it."""
    write(dynamodb, table.table, mixed_set("orders"))
    path = tmp_path / "export"
    (path / "_temporary" / "0").mkdir(parents=True)
    (path / "_temporary" / "0" / "part-00000.parquet").write_bytes(b"half")

    with pytest.raises(ExportExists, match="rerun with --overwrite"):
        run_replay(options(table, export_path=str(path)), spark=spark)
    argv = ["--table", table.table, "--group", GROUP, "--endpoint-url", str(table.endpoint_url)]
    argv += ["--export", str(path)]
    assert job_main(argv) == ExitCode.BAD_INPUT  # the active session: this module's
    assert f"error: {path} exists" in capsys.readouterr().err

    summary = run_replay(options(table, export_path=str(path), overwrite=True), spark=spark)

    assert summary.exported == 6
    assert len(spark.read.parquet(str(path)).collect()) == 6
    assert not (path / "_temporary").exists()


class _JavaException:
    def __init__(self, text: str) -> None:
        self.text = text

    def toString(self) -> str:  # py4j's JavaObject method
        return self.text


class _Py4JJavaError(Exception):
    def __init__(self, java: str) -> None:
        super().__init__("An error occurred while calling o61.collectAndServe.\n: " + java)
        self.java_exception = _JavaException(java)


def test_spark_cause_names_what_failed_not_the_call() -> None:
    stage = "org.apache.spark.SparkException: Job aborted due to stage failure: Lost task 0.3"
    missing = f'{stage} (executor 1): java.io.IOException: Cannot run program "py": error=2'
    assert spark_cause(_Py4JJavaError(f"{missing}\n\tat java.lang.ProcessBuilder.start")) == missing
    traceback = (
        f"{stage}: org.apache.spark.api.python.PythonException: Traceback (most recent call"
        ' last):\n  File "worker.py", line 1, in main\n    import triage_replay\n'
        "ModuleNotFoundError: No module named 'triage_replay'\n\n\tat org.apache.spark.X"
    )
    assert spark_cause(_Py4JJavaError(traceback)) == (
        f"{stage}: org.apache.spark.api.python.PythonException: "
        "ModuleNotFoundError: No module named 'triage_replay'"
    )
    python = (
        "An exception was thrown from the Python worker:\nTraceback (most recent call last):"
        '\n  File "x.py", line 6, in f\n    raise ValueError("boom")\nValueError: boom\nmore'
    )
    assert spark_cause(RuntimeError(python)) == "ValueError: boom"
    assert spark_cause(RuntimeError("[PATH_ALREADY_EXISTS] Path x exists.\nmore")) == (
        "[PATH_ALREADY_EXISTS] Path x exists."
    )
    assert spark_cause(RuntimeError()) == "RuntimeError"


def test_python_for_workers_is_absolute(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    monkeypatch.delenv("PYSPARK_DRIVER_PYTHON", raising=False)
    python_for_workers()
    assert "PYSPARK_PYTHON" not in os.environ  # spark-submit's choice stands
    python_for_workers(default=sys.executable)
    assert os.environ["PYSPARK_PYTHON"] == os.environ["PYSPARK_DRIVER_PYTHON"] == sys.executable
    monkeypatch.setenv("PYSPARK_PYTHON", ".venv/bin/python")
    python_for_workers(default=sys.executable)
    assert os.environ["PYSPARK_PYTHON"] == str(tmp_path / ".venv/bin/python")
    monkeypatch.setenv("PYSPARK_PYTHON", "python3.11")  # a name: looked up on the PATH
    python_for_workers(default=sys.executable)
    assert os.environ["PYSPARK_PYTHON"] == "python3.11"


def test_a_missing_target_topic_fails_before_spark_starts_and_creates_none(
    spark: Any, broker: EmbeddedBroker, table: DeadLetterSettings, dynamodb: Any, unique_name: str
) -> None:
    """As `triage dlq replay` without --spark: a mistyped --to-topic made the producer
    create the topic (the broker creates topics on demand) and the items were marked
    replayed into it."""
    dls = [make_dl(unique_name, 0, o) for o in range(3)]
    write(dynamodb, table.table, dls)
    typo = f"{unique_name}-typo"
    with pytest.raises(NotFoundError, match=f"topic {typo} does not exist"):
        run_replay(options(table, broker, to_topic=typo), spark=spark)
    with pytest.raises(NotFoundError, match=f"topic {typo} does not exist"):  # the filter's
        run_replay(options(table, broker, filters=Filters(topic=typo)), spark=spark)
    admin = AdminClient({"bootstrap.servers": broker.bootstrap, **KafkaLog().config()})
    assert typo not in admin.list_topics(timeout=30).topics
    assert {item["status"]["S"] for item in items(dynamodb, table.table).values()} == {"pending"}


def test_unknown_table_fails_before_spark_starts(spark: Any, aws: EmbeddedAWS) -> None:
    missing = DeadLetterSettings(table="no-such-table", endpoint_url=aws.endpoint_url)
    with pytest.raises(TableNotFound):
        run_replay(options(missing, export_path="/nonexistent"), spark=spark)


def config_file(path: Path, bootstrap: str, table: DeadLetterSettings, topic: str) -> Path:
    """A proxy config file, as `triage dev` writes it, naming this table and broker."""
    dead_letters: dict[str, Any] = {"table": table.table, "endpoint_url": table.endpoint_url}
    if table.overflow_bucket:
        dead_letters["overflow_bucket"] = table.overflow_bucket
    write_config(
        path,
        {
            "kafka": {"bootstrap_servers": bootstrap, "topic": topic, "group_id": GROUP},
            "auth": {"token": TOKEN},
            "dead_letters": dead_letters,
        },
    )
    return path


def test_triage_dlq_replay_spark_runs_the_job_from_the_config_file(
    broker: EmbeddedBroker,
    table: DeadLetterSettings,
    dynamodb: Any,
    unique_name: str,
    tmp_path: Path,
) -> None:
    """`triage dlq replay --spark` in a real process: its own local session (and JVM),
    the proxy's config file, the same filters and refusal rules as without --spark."""
    topic = unique_name
    create_topic(broker.bootstrap, topic, partitions=2)
    dls = mixed_set(topic)
    write(dynamodb, table.table, dls)
    config = config_file(tmp_path / "triage.toml", broker.bootstrap, table, topic)

    # No Spark UI: it would listen on the default port 4040 (or the next free one).
    env = {**os.environ, "PYSPARK_SUBMIT_ARGS": "--conf spark.ui.enabled=false pyspark-shell"}

    def triage(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "triage_cli.main", "dlq", "replay", "-c", str(config)]
        return subprocess.run(
            [*argv, *args], capture_output=True, text=True, timeout=120, check=False, env=env
        )

    refused = triage("--spark")
    assert refused.returncode == ExitCode.BAD_INPUT, refused.stderr
    assert "give a filter or --all" in refused.stderr

    out = triage("--spark", "--master", "local[1]", "--topic", topic, "--partition", "1", "--json")

    assert out.returncode == ExitCode.OK, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    chosen = [d for d in dls if d.record.partition == 1]
    assert (summary["selected"], summary["replayed"], summary["ok"]) == (3, 3, True), summary
    messages = consume(broker.bootstrap, topic, 2, expected=3)
    assert sorted(replay_of(m) for m in messages) == sorted(coords(chosen))
    assert {header(m, "triage-replay-id") for m in messages} == {summary["replay_id"].encode()}


def test_command_line_options_and_summary(tmp_path: Path) -> None:
    argv = ["--table", "t", "--group", "g#1", "--bootstrap", "b:9092", "--topic", "orders"]
    argv += ["--reason", "json"]
    argv += ["--since", "2024-05-01T12:00:01Z", "--until", "2024-05-01T16:00:01+02:00"]
    argv += ["--to-topic", "fixed", "-X", "security.protocol=SSL", "--master", "local[2]"]
    args = build_parser().parse_args(argv)
    opts = options_from_args(args)
    assert opts.filters == Filters(
        topic="orders", reason="json", since_ms=BASE_MS + 1000, until_ms=BASE_MS + 7201000
    )
    assert (opts.to_topic, opts.master, opts.mode) == ("fixed", "local[2]", "replay")
    assert opts.kafka_config == {"security.protocol": "SSL"}
    assert opts.group == "g#1"
    no_group = build_parser().parse_args(["--table", "t", "--bootstrap", "b"])
    with pytest.raises(ValueError, match="--table needs --group"):
        options_from_args(no_group)
    bad = build_parser().parse_args(["--table", "t", "--bootstrap", "b", "--since", "yesterday"])
    with pytest.raises(ValueError, match="not a time"):
        options_from_args(bad)
    with pytest.raises(ConfigError, match="bootstrap"):
        ReplayOptions(DeadLetterSettings(table="t"), group=GROUP)
    table = DeadLetterSettings(table="dlq", endpoint_url="http://127.0.0.1:1", ttl_days=3)
    config = config_file(tmp_path / "triage.toml", "b:9092", table, "orders")
    from_file = options_from_args(
        build_parser().parse_args(["-c", str(config), "--export", "/x", "-X", "acks=1"])
    )
    assert from_file.dead_letters == load_settings(config).dead_letters
    assert from_file.group == load_settings(config).kafka.group_id
    assert (from_file.bootstrap, from_file.mode) == ("b:9092", "export")
    assert from_file.kafka_config == {"security.protocol": "plaintext", "acks": "1"}
    both = build_parser().parse_args(["-c", str(config), "--table", "t", "--export", "/x"])
    with pytest.raises(ValueError, match="--config names the table"):
        options_from_args(both)
    text = str(
        Summary(
            mode="replay", replay_id="abc", segments=4, read=3, selected=2, replayed=1, skipped=1
        )
    )
    assert "read=3 selected=2 replayed=1 skipped=1 failed=0 in_doubt=0" in text
