"""Records as CloudEvents, parsed back by the `cloudevents` SDK: every byte of key, value
and headers recovers, including null and binary keys, duplicate and null headers."""

from __future__ import annotations

import base64
import json
from typing import Any
from urllib.parse import unquote

import pytest
from cloudevents.v1.http import from_http, from_json

from triage_proxy.push.cloudevents import (
    EventShape,
    batch_body,
    batch_event,
    batch_size,
    binary_headers,
)
from triage_proxy.structs import Headers, Record

SHAPE = EventShape(source="triage://orders/orders", type="t.x", content_type="application/x")

RECORDS = [
    Record("orders", 0, 1, b"k", b"v", (), 1_700_000_000_123),
    Record("orders", 0, 2, None, b"", (), 0),
    Record("orders", 3, 7, b"", None, (("h", None),), -1),
    Record("orders", 1, 9, b"\xff\x00\n", b"\x00\xff" * 10, (("a", b"1"), ("a", b"\xfe")), 5),
    Record("orders", 1, 10, 'ü "%\n<'.encode(), b'{"j": 1}', (("é", b""),), 5),
]


def recover(
    attrs: dict[str, Any], data: bytes | None
) -> tuple[bytes | None, bytes | None, Headers]:
    """What a receiver does (docs/guides/push.md shows the same in TypeScript)."""
    key = base64.b64decode(attrs["triagekey"]) if "triagekey" in attrs else None
    rows = json.loads(base64.b64decode(attrs["triageheaders"])) if "triageheaders" in attrs else []
    headers = tuple((n, None if v is None else base64.b64decode(v)) for n, v in rows)
    value = None if attrs.get("triagetombstone") == "true" else (data or b"")
    return key, value, headers


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: f"offset{r.offset}")
def test_binary_mode_round_trips_through_the_sdk(record: Record) -> None:
    headers = binary_headers(record, SHAPE)
    assert all(v.isascii() and v.isprintable() for v in headers.values())
    event = from_http(headers, record.value or b"", data_unmarshaller=lambda b: b)
    attrs = event.get_attributes()
    assert attrs["id"] == f"orders/{record.partition}/{record.offset}"
    assert attrs["source"] == SHAPE.source
    assert attrs["type"] == "t.x"
    assert recover(dict(attrs), event.get_data()) == (record.key, record.value, record.headers)
    if record.key is not None and record.key != b"\xff\x00\n":
        assert unquote(attrs["partitionkey"]) == record.key.decode()
    else:
        assert "partitionkey" not in attrs
    if record.timestamp_ms >= 0:
        assert attrs["time"].endswith("Z")


def test_time_is_rfc3339_with_milliseconds() -> None:
    assert binary_headers(RECORDS[0], SHAPE)["ce-time"] == "2023-11-14T22:13:20.123Z"
    assert "ce-time" not in binary_headers(RECORDS[2], SHAPE)


def test_a_batch_round_trips_through_the_sdk() -> None:
    events = [batch_event(r, SHAPE) for r in RECORDS]
    body = batch_body(events)
    assert len(body) == batch_size(events)
    parsed = json.loads(body)
    assert len(parsed) == len(RECORDS)
    for record, raw in zip(RECORDS, parsed, strict=True):
        event = from_json(json.dumps(raw), data_unmarshaller=lambda b: b)
        attrs = dict(event.get_attributes())
        data = event.get_data()
        assert attrs["id"] == f"orders/{record.partition}/{record.offset}"
        assert attrs["datacontenttype"] == "application/x"
        assert recover(attrs, data) == (record.key, record.value, record.headers)
        if record.key is not None and record.key != b"\xff\x00\n":
            assert attrs["partitionkey"] == record.key.decode()


def test_an_empty_batch_is_an_empty_array() -> None:
    assert batch_body([]) == b"[]"
    assert batch_size([]) == 2
