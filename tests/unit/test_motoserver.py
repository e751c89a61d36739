"""The embedded moto server's sorts return what moto's own sorts return, in the same order.

`triage_cli.motoserver` replaces moto's two sort keys (DynamoType objects) with their
comparable values. These tests run moto in-process (moto's own `mock_aws`) on tables
shaped like Triage's (string hash, number range, a string index) and others (number and
binary keys, a hash-only table), and compare item for item: the two `Table` methods
directly, and Query/Scan answers page by page through boto3 with and without the patch.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import boto3
import pytest
from moto import mock_aws
from moto.core.models import DEFAULT_ACCOUNT_ID
from moto.dynamodb.models import dynamodb_backends
from moto.dynamodb.models.dynamo_type import DynamoType
from moto.dynamodb.models.table import Table

from triage_cli import motoserver

REGION = "us-east-1"


@pytest.fixture
def dynamodb() -> Iterator[Any]:
    assert not getattr(Table, "_triage_sorts", False), "the patch leaked into this process"
    with mock_aws():
        yield boto3.client("dynamodb", region_name=REGION)


def _table(name: str) -> Any:
    return dynamodb_backends[DEFAULT_ACCOUNT_ID][REGION].get_table(name)


def _numbers(rng: random.Random) -> str:
    """Numbers whose text order differs from their numeric order (9 < 10, -5 < 1.5)."""
    whole = rng.choice([rng.randrange(0, 12), rng.randrange(0, 10**12), -rng.randrange(1, 999)])
    return rng.choice([str(whole), f"{whole}.{rng.randrange(1, 99)}"])


def _create(client: Any, name: str, keys: dict[str, str], **more: Any) -> None:
    """A table keyed by `keys` (attribute -> type, hash first, then range if any)."""
    kinds = ["HASH", "RANGE"]
    client.create_table(
        TableName=name,
        KeySchema=[{"AttributeName": a, "KeyType": k} for a, k in zip(keys, kinds, strict=False)],
        AttributeDefinitions=[
            *({"AttributeName": a, "AttributeType": t} for a, t in keys.items()),
            *more.pop("indexed", ()),
        ],
        BillingMode="PAY_PER_REQUEST",
        **more,
    )


def _dead_letter_like(client: Any, rng: random.Random) -> str:
    _create(
        client,
        "dl",
        {"source": "S", "offset": "N"},
        indexed=[
            {"AttributeName": "state", "AttributeType": "S"},
            {"AttributeName": "at", "AttributeType": "S"},
        ],
        GlobalSecondaryIndexes=[
            {
                "IndexName": "by-state",
                "KeySchema": [
                    {"AttributeName": "state", "KeyType": "HASH"},
                    {"AttributeName": "at", "KeyType": "RANGE"},
                ],
                "Projection": {"ProjectionType": "ALL"},
            }
        ],
    )
    for _ in range(400):
        item: dict[str, Any] = {
            "source": {"S": rng.choice(["t#0", "t#1", "t#10", "t#2", "u#0"])},
            "offset": {"N": _numbers(rng)},
        }
        if rng.random() < 0.8:  # some items are not in the index
            item["state"] = {"S": rng.choice(["pending#g", "replayed#g", "pending#h"])}
            item["at"] = {"S": f"2026-11-{rng.randrange(1, 29):02d}T00:00:0{rng.randrange(10)}Z"}
        client.put_item(TableName="dl", Item=item)
    return "dl"


def _binary_keys(client: Any, rng: random.Random) -> str:
    _create(client, "bin", {"h": "B", "r": "B"})
    for _ in range(200):
        client.put_item(
            TableName="bin",
            Item={
                "h": {"B": bytes([rng.randrange(3)])},
                "r": {"B": rng.randbytes(rng.randrange(1, 6))},
            },
        )
    return "bin"


def _hash_only(client: Any, rng: random.Random) -> str:
    _create(client, "flat", {"n": "N"})
    for _ in range(200):
        client.put_item(TableName="flat", Item={"n": {"N": _numbers(rng)}})
    return "flat"


@pytest.mark.parametrize("make", [_dead_letter_like, _binary_keys, _hash_only])
def test_all_items_is_moto_order(dynamodb: Any, make: Any) -> None:
    table = _table(make(dynamodb, random.Random(7)))
    ours = motoserver.all_items(table)
    assert [id(i) for i in ours] == [id(i) for i in Table.all_items(table)]
    assert len(ours) > 100


def test_sorted_items_is_moto_order_for_an_index(dynamodb: Any) -> None:
    table = _table(_dead_letter_like(dynamodb, random.Random(11)))
    indexed = [i for i in Table.all_items(table) if "state" in i.attrs]
    shuffled = list(indexed)
    random.Random(3).shuffle(shuffled)
    hashes: list[str] = ["state", "source"]
    ranges: list[str | None] = ["at", "offset"]
    theirs = Table.sorted_items(table, hashes, ranges, list(shuffled))
    ours = motoserver.sorted_items(table, hashes, ranges, list(shuffled))
    assert [id(i) for i in ours] == [id(i) for i in theirs]
    numbers = [i.attrs["offset"].cast_value for i in ours if i.attrs["state"].value == "pending#g"]
    assert any(isinstance(n, Decimal) for n in numbers)


def _pages(client: Any, operation: str, **kwargs: Any) -> list[list[dict[str, Any]]]:
    pages: list[list[dict[str, Any]]] = []
    start = None
    while len(pages) < 200:  # a wrong order can make pages repeat: fail, do not hang
        if start is not None:
            kwargs["ExclusiveStartKey"] = start
        answer = getattr(client, operation)(Limit=7, **kwargs)
        pages.append(answer["Items"])
        start = answer.get("LastEvaluatedKey")
        if not start:
            return pages
    raise AssertionError(f"{operation} {kwargs} did not end within 200 pages")


def test_queries_and_scans_answer_the_same_pages(
    dynamodb: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _dead_letter_like(dynamodb, random.Random(5))
    requests: list[tuple[str, dict[str, Any]]] = [
        (
            "query",
            {
                "TableName": "dl",
                "IndexName": "by-state",
                "KeyConditionExpression": "#s = :s",
                "ExpressionAttributeNames": {"#s": "state"},
                "ExpressionAttributeValues": {":s": {"S": "pending#g"}},
                "ScanIndexForward": False,
            },
        ),
        (
            "query",
            {
                "TableName": "dl",
                "KeyConditionExpression": "#h = :h AND #r > :r",
                "ExpressionAttributeNames": {"#h": "source", "#r": "offset"},
                "ExpressionAttributeValues": {":h": {"S": "t#1"}, ":r": {"N": "5"}},
            },
        ),
        ("scan", {"TableName": "dl"}),
        ("scan", {"TableName": "dl", "IndexName": "by-state"}),
    ]
    theirs = [_pages(dynamodb, op, **dict(kw)) for op, kw in requests]
    monkeypatch.setattr(Table, "all_items", motoserver.all_items)
    monkeypatch.setattr(Table, "sorted_items", motoserver.sorted_items)
    monkeypatch.setattr(DynamoType, "__eq__", motoserver.equal)
    monkeypatch.setattr(DynamoType, "__ne__", motoserver.not_equal)
    ours = [_pages(dynamodb, op, **dict(kw)) for op, kw in requests]
    assert ours == theirs
    assert all(len(pages) > 2 for pages in ours)


def test_a_projection_is_moto_projection() -> None:
    from moto.dynamodb.models.dynamo_type import Item

    attrs: dict[str, Any] = {
        "source": {"S": "t#0"}, "offset": {"N": "10.50"}, "key": {"B": "YQ=="},
        "headers": {"L": [{"M": {"k": {"S": "a"}, "v": {"B": "Yg=="}}}, {"NULL": True}]},
        "meta": {"M": {"n": {"N": "-0"}, "tags": {"SS": ["b", "a"]}, "ok": {"BOOL": True}}},
        "nums": {"NS": ["1", "2.0"]},
    }  # fmt: skip
    item = Item(hash_key=DynamoType(attrs["source"]), range_key=None, attrs=attrs)
    projections = [
        [["source"], ["offset"]],
        [["meta"], ["headers"], ["key"], ["nums"]],
        [["offset"], ["missing"], ["offset"], ["source"]],  # order, duplicates, absent names
        [["missing"]],
        [["meta", "n"], ["meta"]],  # nested paths: moto's own
        [["headers[0]"], ["source"]],  # a list element: moto's own
    ]
    for paths in projections:
        ours = motoserver.project(item, paths)
        theirs = Item.project(item, paths)
        assert ours.to_json() == theirs.to_json(), paths
        assert list(ours.attrs) == list(theirs.attrs), paths


def _rich_value(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random AttributeValue of every member type, maps and lists nested."""
    kinds = ["S", "N", "B", "Bytes", "SS", "NS", "BS", "NULL", "BOOL"]
    kinds += ["M", "L"] if depth < 3 else []
    kind = rng.choice(kinds)
    if kind == "S":
        return {"S": rng.choice(["", "plain", "ünïcode ✓", 'quote " and \\ slash'])}
    if kind == "N":
        return {"N": _numbers(rng)}
    if kind == "B":
        return {"B": rng.choice(["YQ==", "", "AAEC"])}
    if kind == "Bytes":
        return {"B": rng.randbytes(rng.randrange(0, 5))}
    if kind == "SS":
        return {"SS": [f"s{i}" for i in range(rng.randrange(1, 4))]}
    if kind == "NS":
        return {"NS": [_numbers(rng) for _ in range(rng.randrange(1, 4))]}
    if kind == "BS":
        return {"BS": [rng.choice(["YQ==", b"\x00\x01"]) for _ in range(rng.randrange(1, 3))]}
    if kind == "NULL":
        return {"NULL": True}
    if kind == "BOOL":
        return {"BOOL": rng.random() < 0.5}
    if kind == "M":
        return {"M": {f"k{i}": _rich_value(rng, depth + 1) for i in range(rng.randrange(0, 4))}}
    return {"L": [_rich_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]}


def _serialized(operation: str, result: dict[str, Any]) -> str:
    from moto.core.serialize import JSONSerializer, XFormedAttributePicker
    from moto.core.utils import get_service_model

    model = get_service_model("dynamodb").operation_model(operation)
    serializer = JSONSerializer(
        operation_model=model, pretty_print=False, value_picker=XFormedAttributePicker()
    )
    return str(serializer.serialize(result)["body"])


def test_answers_are_serialized_as_moto_serializes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from moto.core.serialize import BaseJSONSerializer

    rng = random.Random(13)
    items = [{f"a{i}": _rich_value(rng) for i in range(rng.randrange(1, 9))} for _ in range(300)]
    odd: list[dict[str, Any]] = [
        {"x": {"S": 5}},  # not a string: moto's own path
        {"x": {"s": "lower-case member"}},
        {"x": {"M": {"y": {"N": "1"}, "z": None}}},
        {"x": {"L": [{"S": "a"}, {"Q": "unknown member"}]}},
        {"x": {"NULL": 1}},
    ]
    items.append({"x": {"S": "a", "N": "1"}})  # two members: both written, in model order
    results: dict[str, dict[str, Any]] = {
        "Query": {"Items": items + odd, "Count": 306, "ScannedCount": 307,
                  "LastEvaluatedKey": {"source": {"S": "t#0"}, "offset": {"N": "7"}}},
        "GetItem": {"Item": items[0]},
        "BatchGetItem": {"Responses": {"dl": items[:50]}, "UnprocessedKeys": {}},
    }  # fmt: skip
    theirs = {op: _serialized(op, result) for op, result in results.items()}
    own = BaseJSONSerializer._serialize_type_structure
    monkeypatch.setattr(BaseJSONSerializer, "_serialize_type_structure", own)  # restored after
    motoserver.fast_attribute_values()
    assert BaseJSONSerializer._serialize_type_structure is not own
    ours = {op: _serialized(op, result) for op, result in results.items()}
    assert ours == theirs
    assert '"B": "WVE9PQ=="' in theirs["Query"]  # blobs go through moto's base64 both ways
    written = [motoserver.attribute_value_json(lambda b: "", v) for i in odd for v in i.values()]
    assert written == [None] * len(odd)  # every odd value took moto's own path


def test_an_item_is_made_and_refused_as_moto_makes_and_refuses_it() -> None:
    from moto.dynamodb.exceptions import ItemSizeTooLarge
    from moto.dynamodb.models.dynamo_type import Item

    rng = random.Random(17)
    key = DynamoType({"S": "t#0"})
    for _ in range(50):
        attrs = {f"a{i}": _rich_value(rng) for i in range(rng.randrange(0, 12))}
        ours = Item.__new__(Item)
        motoserver.item_init(ours, key, None, attrs)
        theirs = Item(key, None, attrs)
        assert ours.to_json() == theirs.to_json()
        assert type(ours.attrs) is type(theirs.attrs)
        assert ours.size() == theirs.size()

    def refused(make: Any, attrs: dict[str, Any]) -> bool:
        try:
            make(attrs)
        except ItemSizeTooLarge:
            return True
        return False

    def make_ours(attrs: dict[str, Any]) -> None:
        motoserver.item_init(Item.__new__(Item), key, None, attrs)

    def make_theirs(attrs: dict[str, Any]) -> None:
        Item(key, None, attrs)

    for extra in (-1, 0, 1):
        # names "a" and "b" (1 byte each), values of 200,000 bytes and the rest to the limit
        attrs = {"a": {"S": "x" * 200_000}, "b": {"S": "y" * (204_998 + extra)}}
        assert refused(make_ours, attrs) == refused(make_theirs, attrs), extra
        assert refused(make_ours, attrs) == (extra > 0)


def test_equality_is_moto_equality() -> None:
    values: list[dict[str, Any]] = [
        {"S": "a"}, {"S": "1"}, {"S": ""}, {"N": "1"}, {"N": "1.0"}, {"N": "-0"}, {"N": "0"},
        {"B": "YQ=="}, {"B": "MQ=="}, {"NULL": True}, {"BOOL": True}, {"SS": ["a", "b"]},
        {"SS": ["b", "a"]}, {"L": [{"N": "1"}]}, {"L": [{"N": "1.00"}]}, {"M": {"x": {"S": "a"}}},
    ]  # fmt: skip
    typed = [DynamoType(v) for v in values]
    for a in typed:
        for b in typed:
            assert motoserver.equal(a, b) == DynamoType.__eq__(a, b), (a, b)
            assert motoserver.not_equal(a, b) == DynamoType.__ne__(a, b), (a, b)
    assert motoserver.equal(typed[3], typed[4])  # 1 == 1.0, as DynamoDB numbers
    assert not motoserver.equal(typed[1], typed[3])  # "1" is not 1


def test_the_module_list_is_read_once_and_is_motos_own() -> None:
    from moto import backends

    original = backends.list_of_moto_modules
    own = list(original())
    try:
        motoserver.cache_module_list()
        assert list(backends.list_of_moto_modules()) == own
        assert "dynamodb" in own
        first = backends.list_of_moto_modules()
        motoserver.cache_module_list()  # idempotent
        assert backends.list_of_moto_modules() is first
    finally:
        setattr(backends, "list_of_moto_modules", original)  # noqa: B010


def test_a_response_class_s_method_names_are_listed_once_and_are_moto_s_own() -> None:
    from moto.core import responses
    from moto.dynamodb.responses import DynamoHandler

    original = responses.method_names_from_class
    own = original(DynamoHandler)
    try:
        motoserver.cache_method_names()
        first = responses.method_names_from_class(DynamoHandler)
        assert first == own
        assert "update_item" in first
        motoserver.cache_method_names()  # idempotent
        assert responses.method_names_from_class(DynamoHandler) is first
    finally:
        setattr(responses, "method_names_from_class", original)  # noqa: B010


def test_the_embedded_server_writes_no_access_log_only_when_its_output_is_discarded(
    tmp_path: Any,
) -> None:
    from triage_cli.embedded import EmbeddedAWS

    assert motoserver.NO_ACCESS_LOG in EmbeddedAWS().command(5000)
    assert motoserver.NO_ACCESS_LOG not in EmbeddedAWS(tmp_path / "moto.log").command(5000)
