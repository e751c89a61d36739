"""Two deployments on one topic and one table, and tables written before deployment keys.

Real proxies, the real broker (Tansu) and real DynamoDB and S3 (moto server): two apps
(group ids) reading one topic must not touch each other's leases, dead letters or
replays; items keyed without a deployment (raw PutItem with the legacy keys) are
honoured (a live legacy lease), moved by `triage dlq migrate`, then listed and replayed
like any other.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, Producer, TopicPartition
from typer.testing import CliRunner

from tests import samples
from tests.integration.harness import (
    TOKEN,
    RawConsumer,
    await_until,
    committed,
    create_topic,
    headers_of,
    produce,
    settings_for,
    target,
    write_dead_letters,
)
from triage_cli.devstack import write_config
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker
from triage_cli.exitcodes import ExitCode
from triage_cli.main import app
from triage_proxy.app import Proxy
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.config.settings import Settings
from triage_proxy.store.checkpoints import DynamoDBCheckpoints
from triage_proxy.store.items import LEASE_OFFSET, item_from_dead_letter, pointer_item
from triage_proxy.store.leases import DynamoDBLeases, Lease
from triage_proxy.store.migrate import Migration, Move
from triage_proxy.store.payload import encode_payload
from triage_proxy.store.provisioning import create_bucket
from triage_proxy.store.query import DeadLetterTable, Filters
from triage_proxy.structs import DeadLetter

pytestmark = pytest.mark.integration

BILLING = "billing#eu"
"""A group id with a `#`: the key encoding must keep it apart from every other field."""
SHIPPING = "shipping"


def triage(*args: str | Path) -> Any:
    runner = CliRunner(env={"COLUMNS": "200"})
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def config_of(path: Path, settings: Settings) -> Path:
    """A config file naming the same broker, topic, group and table as `settings`."""
    dead = settings.dead_letters
    table: dict[str, Any] = {"table": dead.table, "endpoint_url": dead.endpoint_url}
    if dead.overflow_bucket:
        table["overflow_bucket"] = dead.overflow_bucket
    kafka = settings.kafka
    write_config(
        path,
        {
            "kafka": {
                "bootstrap_servers": kafka.bootstrap_servers,
                "topic": kafka.topic,
                "group_id": kafka.group_id,
            },
            "auth": {"token": TOKEN},
            "dead_letters": table,
        },
    )
    return path


def listed(config: Path, *args: str) -> dict[int, dict[str, Any]]:
    out = triage("dlq", "list", "--config", config, "--json", *args)
    assert out.exit_code == 0, out.output
    return {d["offset"]: d for d in json_lines(out.stdout)}


SENTINEL = b"end-of-replays"


def consume_all(bootstrap: str, topic: str) -> list[Any]:
    """Every record the replays wrote to `topic` (they have returned, their producer
    flushed): a sentinel produced now to each partition comes after all of them, so reading
    up to the sentinels counts a second replay of anything, without waiting to see whether
    more arrives."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"check-{time.monotonic_ns()}",
            "auto.offset.reset": "earliest",
        }
    )
    try:
        partitions = list(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        producer = Producer({"bootstrap.servers": bootstrap})
        for p in partitions:
            producer.produce(topic, SENTINEL, partition=p)
        assert producer.flush(30) == 0, "the sentinels were not written"
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        got: list[Any] = []
        ended: set[int] = set()
        deadline = time.monotonic() + 30
        while len(ended) < len(partitions):
            assert time.monotonic() < deadline, f"sentinels read: {sorted(ended)} of {partitions}"
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            if msg.value() == SENTINEL:
                partition = msg.partition()
                assert partition is not None  # a consumed message has one
                ended.add(partition)
            else:
                got.append(msg)
        return got
    finally:
        consumer.close()


def replay_of(msg: Message) -> str:
    origin = dict(headers_of(msg))["triage-replay-of"]
    assert origin is not None
    return origin.decode()


# --- two deployments side by side -------------------------------------------------------


def test_two_deployments_share_a_topic_and_a_table_without_touching_each_other(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str, tmp_path: Path
) -> None:
    billing = settings_for(broker, aws, topic, kafka={"group_id": BILLING})
    shipping = settings_for(broker, aws, topic, kafka={"group_id": SHIPPING})
    assert billing.dead_letters.table == shipping.dead_letters.table  # one table
    produce(broker.bootstrap, topic, [(b"k%d" % i, b"v%d" % i, None) for i in range(5)])

    async def serve(settings: Settings, nacks: dict[int, str]) -> str:
        """Consume all five through a proxy of `settings`' deployment; its lease owner."""
        async with Proxy(settings, 0) as proxy, RawConsumer(target(proxy)) as consumer:
            got = await consumer.receive(5)
            consumer.settle(
                acks=[d.offset for d in got if d.offset not in nacks],
                nacks=sorted(nacks.items()),
            )
            group = settings.kafka.group_id
            assert await await_until(lambda: committed(broker.bootstrap, group, topic) == 5)
            # The lease is this deployment's: read it while the proxy serves.
            leases = DynamoDBLeases(settings.dead_letters, topic, 0, group)
            try:
                held = await asyncio.to_thread(leases.get)
            finally:
                leases.close()
            assert held is not None
            assert held.owner == proxy.owner
            return proxy.owner

    async def both() -> list[str]:
        # Both at once: neither waits as a standby on the other's lease.
        async with asyncio.timeout(60):
            return list(
                await asyncio.gather(
                    serve(billing, {2: "billing: no such account"}),
                    serve(shipping, {2: "shipping: no address", 3: "shipping: too heavy"}),
                )
            )

    owners = asyncio.run(both())
    assert owners[0] != owners[1]

    # Separate dead letters for the same offset, each as its deployment wrote it.
    billing_config = config_of(tmp_path / "billing.toml", billing)
    shipping_config = config_of(tmp_path / "shipping.toml", shipping)
    assert {o: d["reason"] for o, d in listed(billing_config).items()} == {
        2: "billing: no such account"
    }
    assert {o: d["reason"] for o, d in listed(shipping_config).items()} == {
        2: "shipping: no address",
        3: "shipping: too heavy",
    }
    # --group reads another deployment's with the same config.
    assert set(listed(billing_config, "--group", SHIPPING)) == {2, 3}

    # Separate replays: billing's replay leaves shipping's pending, and the reverse.
    target_topic = f"{topic}-replayed"
    create_topic(broker.bootstrap, target_topic)
    out = triage("dlq", "replay", "-c", billing_config, "--all", "--to-topic", target_topic)
    assert out.exit_code == 0, out.output
    assert "replayed 1" in out.stdout
    assert {o: d["status"] for o, d in listed(billing_config).items()} == {2: "replayed"}
    assert {o: d["status"] for o, d in listed(shipping_config).items()} == {
        2: "pending",
        3: "pending",
    }
    again = triage("dlq", "replay", "-c", billing_config, "--all", "--to-topic", target_topic)
    assert "selected 0" in again.stdout  # nothing of billing's is pending any more
    out = triage("dlq", "replay", "-c", shipping_config, "--all", "--to-topic", target_topic)
    assert out.exit_code == 0, out.output
    assert "replayed 2" in out.stdout
    copies = consume_all(broker.bootstrap, target_topic)
    assert sorted(replay_of(m) for m in copies) == [f"{topic}/0/2", f"{topic}/0/2", f"{topic}/0/3"]
    assert sorted(m.value() for m in copies) == [b"v2", b"v2", b"v3"]
    assert {o: d["status"] for o, d in listed(shipping_config).items()} == {
        2: "replayed",
        3: "replayed",
    }


def test_a_dead_letter_of_one_deployment_never_overwrites_or_hides_another(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """The writer's idempotence (never clobber a replayed item) is per deployment: a
    replayed billing item does not make shipping's dead letter at that offset vanish."""
    settings = settings_for(broker, aws, topic).dead_letters
    dl = samples.make_dl(7, topic=topic, reason="billing")
    write_dead_letters(settings, [dl], BILLING)
    with DeadLetterTable(settings, group=BILLING) as table:
        assert table.claim((topic, 0, 7), "r1", lease_s=60)
        assert table.mark_replayed((topic, 0, 7), "r1", "elsewhere/0/0", table.get((topic, 0, 7)))
    write_dead_letters(settings, [samples.make_dl(7, topic=topic, reason="shipping")], SHIPPING)
    with (
        DeadLetterTable(settings, group=BILLING) as billing,
        DeadLetterTable(settings, group=SHIPPING) as shipping,
    ):
        assert billing.get((topic, 0, 7))["status"] == {"S": "replayed"}
        assert billing.get((topic, 0, 7))["reason"] == {"S": "billing"}
        assert shipping.get((topic, 0, 7))["status"] == {"S": "pending"}
        assert shipping.get((topic, 0, 7))["reason"] == {"S": "shipping"}
        everything = Filters(topic=topic)
        assert [i["group"]["S"] for i in billing.scan(everything, consistent=True)] == [BILLING]
        assert [i["group"]["S"] for i in shipping.scan(everything, consistent=True)] == [SHIPPING]


# --- tables written before deployment keys ----------------------------------------------


def raw_client(settings: DeadLetterSettings) -> Any:
    return boto3.client(
        "dynamodb",
        endpoint_url=settings.endpoint_url,
        region_name=settings.region,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def legacy_item(dl: DeadLetter, status: str = "pending", **extra: Any) -> dict[str, Any]:
    """The item an old proxy wrote: key `<topic>#<partition>`, no `group` attribute."""
    item = item_from_dead_letter(dl, "unused")
    del item["group"]
    item["source"] = {"S": f"{dl.record.topic}#{dl.record.partition}"}
    item["status"] = {"S": status}
    item.update(extra)
    return item


def test_legacy_dead_letters_are_migrated_then_listed_and_replayed(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str, tmp_path: Path
) -> None:
    bucket = topic.lower()[:55].strip("-") + "-b"
    settings = settings_for(
        broker, aws, topic, kafka={"group_id": BILLING}, dead_letters={"overflow_bucket": bucket}
    )
    dead = settings.dead_letters
    create_bucket(dead)
    create_topic(broker.bootstrap, f"{topic}-fixed")
    config = config_of(tmp_path / "billing.toml", settings)
    dynamodb = raw_client(dead)
    s3 = boto3.client(
        "s3",
        endpoint_url=dead.endpoint_url,
        region_name=dead.region,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    now_ms = int(time.time() * 1000)
    big = samples.make_dl(5, topic=topic, key=None, value=bytes(range(256)) * 2000)
    old_object = f"{dead.table}/{topic}/0/5"  # the old S3 key: no group
    payload = encode_payload(big.record)
    s3.put_object(Bucket=bucket, Key=old_object, Body=payload)
    pointer = pointer_item(big, "unused", bucket, old_object, len(payload))
    del pointer["group"]
    pointer["source"] = {"S": f"{topic}#0"}
    legacy = {
        0: legacy_item(samples.make_dl(0, topic=topic, reason="old 0")),
        1: legacy_item(samples.make_dl(1, topic=topic), "replayed"),
        2: legacy_item(
            samples.make_dl(2, topic=topic),
            replay_claim={"S": "old-run"},
            replay_claim_until={"N": str(now_ms + 600_000)},
        ),
        3: legacy_item(samples.make_dl(3, topic=topic, reason="old 3")),
        4: legacy_item(samples.make_dl(4, topic=topic, reason="old 4")),
        5: pointer,
    }
    elsewhere = legacy_item(samples.make_dl(0, topic=f"{topic}-other"))
    for item in [*legacy.values(), elsewhere]:
        dynamodb.put_item(TableName=dead.table, Item=item)
    # The old format, spelled out: what these raw items are.
    assert legacy[0]["source"] == {"S": f"{topic}#0"}
    assert "group" not in legacy[0]
    # A new proxy of billing dead-lettered offsets 3 and 4 again; 4 is replayed since.
    write_dead_letters(
        dead,
        [samples.make_dl(3, topic=topic, reason="new 3"), samples.make_dl(4, topic=topic)],
        BILLING,
    )
    with DeadLetterTable(dead, group=BILLING) as table:
        assert table.claim((topic, 0, 4), "new-run", lease_s=60)
        assert table.mark_replayed((topic, 0, 4), "new-run", "x/0/0", table.get((topic, 0, 4)))

    # Before the migration, the commands see only the deployment's own items.
    assert set(listed(config)) == {3, 4}

    dry = triage("dlq", "migrate", "-c", config, "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    [plan] = json_lines(dry.stdout)
    assert plan["group"] == BILLING
    assert (plan["moved"], plan["replaced"], plan["in_use"], plan["conflict"]) == (3, 1, 1, 1)
    assert set(listed(config)) == {3, 4}  # a dry run changes nothing

    out = triage("dlq", "migrate", "-c", config)
    assert out.exit_code == ExitCode.FAILURE, out.output  # two are left, and say why
    assert f"CONFLICT  {topic}/0/4" in out.stderr
    assert f"IN USE    {topic}/0/2" in out.stderr
    now = listed(config)
    assert {o: d["status"] for o, d in now.items()} == {
        0: "pending",
        1: "replayed",  # a replayed legacy item stays replayed: never replayed twice
        3: "pending",
        4: "replayed",
        5: "pending",
    }
    assert now[0]["reason"] == "old 0"
    assert now[3]["reason"] == "old 3"  # the legacy item replaced the pending copy
    left = {
        int(i["offset"]["N"])
        for i in dynamodb.scan(TableName=dead.table)["Items"]
        if "group" not in i and int(i["offset"]["N"]) >= 0
    }
    assert left == {0, 2, 4}  # 0: the other topic's, never touched; 2 and 4 reported

    rerun = triage("dlq", "migrate", "-c", config, "--json")  # idempotent
    [again] = json_lines(rerun.stdout)
    assert (again["moved"], again["replaced"], again["in_use"], again["conflict"]) == (0, 0, 1, 1)

    # The conflict is the operator's to settle: the deployment replayed offset 4 already,
    # so its legacy copy goes (else it warns forever); the one in use stays.
    dropped = triage("dlq", "migrate", "-c", config, "--drop-conflicts", "--json")
    assert dropped.exit_code == ExitCode.FAILURE, dropped.output  # offset 2 is still in use
    [settled] = json_lines(dropped.stdout)
    assert (settled["dropped"], settled["conflict"], settled["in_use"]) == (1, 0, 1)
    left = {
        int(i["offset"]["N"])
        for i in dynamodb.scan(TableName=dead.table)["Items"]
        if "group" not in i and int(i["offset"]["N"]) >= 0
    }
    assert left == {0, 2}
    assert listed(config)[4]["status"] == "replayed"  # the deployment's own item stands

    # The migrated items replay like any other, the S3 payload byte-exact from its old key.
    out = triage("dlq", "replay", "-c", config, "--all", "--to-topic", f"{topic}-fixed")
    assert out.exit_code == 0, out.output
    assert "replayed 3" in out.stdout
    copies = consume_all(broker.bootstrap, f"{topic}-fixed")
    assert sorted(replay_of(m) for m in copies) == [f"{topic}/0/{o}" for o in (0, 3, 5)]
    assert [m.value() for m in copies if replay_of(m).endswith("/5")] == [big.record.value]
    dynamodb.close()
    s3.close()


def test_a_move_is_all_or_nothing_and_a_rerun_continues(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """An old proxy rewriting a legacy item between the read and the move makes the move
    do nothing (the item stays legacy, nothing is lost); a run stopped midway leaves
    every item either moved or legacy, and the next run moves the rest."""
    dead = settings_for(broker, aws, topic).dead_letters
    dynamodb = raw_client(dead)
    for offset in range(4):
        dl = samples.make_dl(offset, topic=topic)
        dynamodb.put_item(TableName=dead.table, Item=legacy_item(dl))
    with DeadLetterTable(dead, group=BILLING) as table:
        migration = Migration(table, topic)
        [first, *_] = sorted(migration.legacy_items(), key=lambda i: int(i["offset"]["N"]))
        assert migration.plan(first) is Move.MOVED
        rewritten = legacy_item(samples.make_dl(0, topic=topic, at_ms=samples.T0 + 1))
        dynamodb.put_item(TableName=dead.table, Item=rewritten)  # an old proxy, meanwhile
        assert not migration.move(first, Move.MOVED)
        assert list(table.scan(Filters(), consistent=True)) == []  # no copy written

        class StopAfter(threading.Event):
            """A stop event that is set once the run looked at `n` items."""

            def __init__(self, n: int) -> None:
                super().__init__()
                self.n = n

            def is_set(self) -> bool:
                self.n -= 1
                return self.n < 0

        stopped = migration.run(apply=True, stop=StopAfter(2))
        assert stopped.interrupted
        assert stopped.count(Move.MOVED) == 2
        moved = {int(i["offset"]["N"]) for i in table.scan(Filters(), consistent=True)}
        still = {int(i["offset"]["N"]) for i in migration.legacy_items()}
        assert len(moved) == 2
        assert moved | still == {0, 1, 2, 3}
        assert not moved & still
        rest = migration.run(apply=True)
        assert (rest.count(Move.MOVED), rest.left, rest.interrupted) == (2, 0, False)
        assert {int(i["offset"]["N"]) for i in table.scan(Filters(), consistent=True)} == {
            0,
            1,
            2,
            3,
        }
        assert list(migration.legacy_items()) == []
        assert table.get((topic, 0, 0))["dead_lettered_at"] == rewritten["dead_lettered_at"]
    dynamodb.close()


def test_a_live_legacy_lease_keeps_new_proxies_standing_by(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """An old proxy's lease (`<topic>#<partition>#lease`) fences every deployment's new
    proxies while it is live; once it lapses or is released the new leases are free, and
    an old proxy taking it again makes the new holder's next renewal fail."""
    settings = settings_for(broker, aws, topic, kafka={"group_id": BILLING})
    dead = settings.dead_letters
    dynamodb = raw_client(dead)
    now = int(time.time() * 1000)

    def old_proxy_holds(until_ms: int) -> None:
        dynamodb.put_item(
            TableName=dead.table,
            Item={
                "source": {"S": f"{topic}#0#lease"},
                "offset": {"N": str(LEASE_OFFSET)},
                "owner": {"S": "old-proxy"},
                "lease_until_ms": {"N": str(until_ms)},
                "acquired_at": {"S": "2024-05-01T12:00:00.000Z"},
                "renewed_at": {"S": "2024-05-01T12:00:00.000Z"},
            },
        )

    billing = DynamoDBLeases(dead, topic, 0, BILLING)
    shipping = DynamoDBLeases(dead, topic, 0, SHIPPING)
    try:
        old_proxy_holds(now + 10_000)
        held = billing.acquire("new-billing", now, now + 5000)
        assert held == Lease("old-proxy (legacy lease)", now + 10_000)
        assert shipping.acquire("new-shipping", now, now + 5000).owner.startswith("old-proxy")
        assert billing.get() is None  # nothing was written
        # Lapsed: both deployments take their own lease, at once.
        assert billing.acquire("new-billing", now + 10_001, now + 15_000).owner == "new-billing"
        assert shipping.acquire("new-shipping", now + 10_001, now + 15_000).owner == (
            "new-shipping"
        )
        assert billing.renew("new-billing", now + 11_000, now + 16_000)
        # An old standby takes the legacy lease: the new holders' next renewal fails.
        old_proxy_holds(now + 30_000)
        assert not billing.renew("new-billing", now + 12_000, now + 17_000)
        assert not shipping.renew("new-shipping", now + 12_000, now + 17_000)
        assert billing.get() == Lease("new-billing", now + 16_000)  # left as it was
    finally:
        billing.close()
        shipping.close()
        dynamodb.close()


def test_a_checkpoint_written_before_deployment_keys_reads_as_it_did(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """The checkpoint key always carried the group: an old item is the current format."""
    dead = settings_for(broker, aws, topic).dead_letters
    dynamodb = raw_client(dead)
    dynamodb.put_item(
        TableName=dead.table,
        Item={
            "source": {"S": f"{topic}#0#checkpoint#{BILLING}"},
            "offset": {"N": "-1"},
            "committed": {"N": "12"},
            "settled": {"S": "x"},
            "updated_at": {"S": "2024-05-01T12:00:00+00:00"},
        },
    )
    dynamodb.close()
    billing = DynamoDBCheckpoints(dead, topic, 0, BILLING)
    shipping = DynamoDBCheckpoints(dead, topic, 0, SHIPPING)
    try:
        found = billing.get()
        assert found is not None
        assert (found.committed, found.settled) == (12, "x")
        assert shipping.get() is None
    finally:
        billing.close()
        shipping.close()


def test_legacy_dead_letters_are_not_silent_until_migrated(
    broker: EmbeddedBroker,
    aws: EmbeddedAWS,
    unique_name: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Dead letters from before deployment keys are invisible to this version until
    `triage dlq migrate` moves them: `dlq list`, `status` and the proxy starting on their
    partition say so (one Limit-1 Query per partition), and stop once they are moved."""
    import logging

    topic = unique_name
    create_topic(broker.bootstrap, topic, partitions=2)
    settings = settings_for(broker, aws, topic, kafka={"group_id": BILLING})
    config = config_of(tmp_path / "billing.toml", settings)
    dynamodb = raw_client(settings.dead_letters)
    for offset in (3, 7):
        dl = samples.make_dl(offset, topic=topic)
        dynamodb.put_item(TableName=settings.dead_letters.table, Item=legacy_item(dl))
    dynamodb.close()
    hint = f"triage dlq migrate --config {config}"

    out = triage("dlq", "list", "-c", config)
    assert out.exit_code == 0, out.output
    assert "0 dead letters" in out.stdout
    assert "written before deployment keys (partition 0)" in out.stderr
    assert hint in out.stderr
    out = triage("dlq", "list", "-c", config, "--json")
    assert out.stdout == ""  # the warning stays off stdout
    assert hint in out.stderr
    assert "written before" not in triage("dlq", "list", "-c", config, "--partition", "1").stderr

    shown = triage("status", "-c", config, "--json")
    assert json.loads(shown.stdout)["legacy_dead_letters"] == [0]
    assert hint in shown.stderr

    async def start() -> None:
        async with Proxy(settings, 0) as proxy:
            assert await await_until(lambda: "written before" in caplog.text, timeout=10)
            assert proxy.state.value == "running"

    with caplog.at_level(logging.WARNING, logger="triage_proxy.app"):
        asyncio.run(asyncio.wait_for(start(), 60))
    warned = [r for r in caplog.records if "written before deployment keys" in r.message]
    assert len(warned) == 1
    assert "partition 0" in warned[0].message
    assert "triage dlq migrate" in warned[0].message

    assert triage("dlq", "migrate", "-c", config).exit_code == 0
    out = triage("dlq", "list", "-c", config)
    assert "2 dead letters" in out.stdout
    assert "written before" not in out.stderr
    assert json.loads(triage("status", "-c", config, "--json").stdout)["legacy_dead_letters"] == []
