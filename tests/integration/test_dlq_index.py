"""The `by-state` index against the real moto server: new tables have it, every write of
a status keeps `dl_state` current, and a table made before the index is migrated
(index added with UpdateTable, items backfilled, idempotent and resumable)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest

from tests import samples
from tests.integration.harness import create_unindexed_table, dynamodb, write_dead_letters
from tests.samples import GROUP
from triage_cli.embedded import EmbeddedAWS
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.store import aws as store_aws
from triage_proxy.store.items import STATE_ATTR, STATE_INDEX, state_key
from triage_proxy.store.migrate import Indexing
from triage_proxy.store.provisioning import create_table, state_index_status
from triage_proxy.store.query import DeadLetterTable

pytestmark = pytest.mark.integration


def old_item(offset: int, status: str = "pending", group: str = GROUP) -> dict[str, Any]:
    """An item as a proxy older than the index wrote it (no `dl_state`)."""
    item = samples.item(offset, status=status, group=group)
    del item[STATE_ATTR]
    return item


def index_states(client: Any, table: str, status: str, group: str = GROUP) -> list[int]:
    """Offsets the index holds under (status, group)."""
    found = client.query(
        TableName=table,
        IndexName=STATE_INDEX,
        KeyConditionExpression="dl_state = :v",
        ExpressionAttributeValues={":v": {"S": state_key(status, group)}},
    )["Items"]
    return sorted(int(i["offset"]["N"]) for i in found)


def test_a_new_table_is_indexed_and_every_status_change_moves_the_item(
    aws: EmbeddedAWS, unique_name: str
) -> None:
    settings = DeadLetterSettings(table=unique_name, endpoint_url=aws.endpoint_url)
    create_table(settings)
    client = dynamodb(aws)
    assert state_index_status(client, unique_name) == "ACTIVE"
    write_dead_letters(settings, [samples.make_dl(i) for i in range(4)])
    assert index_states(client, unique_name, "pending") == [0, 1, 2, 3]
    with DeadLetterTable(settings, group=GROUP) as table:
        assert table.indexed()
        assert table.claim(("orders", 0, 1), "run", lease_s=60)
        assert index_states(client, unique_name, "pending") == [0, 1, 2, 3]  # claimed: pending
        assert table.mark_replayed(("orders", 0, 1), "run", "orders/0/9", {})
        assert table.discard(("orders", 0, 2))
    assert index_states(client, unique_name, "pending") == [0, 3]
    assert index_states(client, unique_name, "replayed") == [1]
    assert index_states(client, unique_name, "discarded") == [2]
    create_table(settings)  # again: idempotent, index kept
    assert state_index_status(client, unique_name) == "ACTIVE"


def test_creating_a_table_describes_it_once_and_indexes_an_old_one(
    aws: EmbeddedAWS, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`triage dev`, `deploy` and every test that makes a table call `create_table`: one
    DescribeTable answers whether the table is ACTIVE, its key schema and its index."""
    calls: Counter[str] = Counter()
    make_client = store_aws._client

    def counted(service: str, options: dict[str, Any]) -> Any:
        client = make_client(service, options)
        client.meta.events.register(
            "before-call.dynamodb.*", lambda model, **_: calls.update([model.name])
        )
        return client

    monkeypatch.setattr(store_aws, "_client", counted)
    settings = DeadLetterSettings(table=unique_name, endpoint_url=aws.endpoint_url)
    create_table(settings)
    assert calls["DescribeTable"] == 1, calls
    calls.clear()
    create_table(settings)  # again: it exists, indexed
    assert calls == Counter(CreateTable=1, DescribeTable=1), calls

    old = f"{unique_name}-old"
    client = dynamodb(aws)
    create_unindexed_table(client, old)
    client.put_item(TableName=old, Item=old_item(0))
    old_settings = DeadLetterSettings(table=old, endpoint_url=aws.endpoint_url)
    create_table(old_settings)
    assert state_index_status(client, old) == "ACTIVE"  # added (UpdateTable), waited for
    with DeadLetterTable(old_settings, group=GROUP) as table:
        assert not table.indexed()  # its item has no dl_state yet: no marker until migrated


def test_an_old_table_is_migrated_then_indexed_idempotently(
    aws: EmbeddedAWS, unique_name: str
) -> None:
    client = dynamodb(aws)
    create_unindexed_table(client, unique_name)
    statuses = ["pending", "replayed", "discarded", "pending", "pending"]
    for offset, status in enumerate(statuses):
        client.put_item(TableName=unique_name, Item=old_item(offset, status))
    client.put_item(TableName=unique_name, Item=old_item(0, "pending", group="shipping"))
    before = {
        (i["source"]["S"], i["offset"]["N"]): i
        for i in client.scan(TableName=unique_name, ConsistentRead=True)["Items"]
    }
    settings = DeadLetterSettings(table=unique_name, endpoint_url=aws.endpoint_url)
    with DeadLetterTable(settings, group=GROUP) as table:
        assert not table.indexed()  # no index: listings scan
        dry = Indexing(table).run(apply=False)
        assert (dry.indexed, dry.complete) == (6, False)
        assert state_index_status(client, unique_name) is None  # a dry run changes nothing

        stop = threading.Event()
        stop.set()
        cut = Indexing(table).run(apply=True, stop=stop)  # interrupted before any page
        assert cut.interrupted
        assert cut.index_active
        assert not cut.complete
    with DeadLetterTable(settings, group=GROUP) as table:
        assert not table.indexed()  # index there, items not backfilled: still no
        done = Indexing(table).run(apply=True)
        assert (done.indexed, done.changed, done.complete) == (6, 0, True)
    with DeadLetterTable(settings, group=GROUP) as table:
        assert table.indexed()
        again = Indexing(table).run(apply=True)
        assert (again.indexed, again.complete) == (0, True)
    assert index_states(client, unique_name, "pending") == [0, 3, 4]
    assert index_states(client, unique_name, "replayed") == [1]
    assert index_states(client, unique_name, "pending", group="shipping") == [0]
    after = client.scan(TableName=unique_name, ConsistentRead=True)["Items"]
    for item in after:  # every item byte-exact but for its new attribute
        if int(item["offset"]["N"]) < 0:
            continue
        old = before[(item["source"]["S"], item["offset"]["N"])]
        assert {k: v for k, v in item.items() if k != STATE_ATTR} == old
        assert item[STATE_ATTR]["S"] == state_key(old["status"]["S"], old["group"]["S"])
