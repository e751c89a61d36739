"""The golden vectors in proto/triage/v1/vectors/, checked against the Python client and the
proxy. The TypeScript client's test/vectors.test.ts checks the same files: a rule both
clients implement cannot drift apart without one of the two failing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from triage_client.credits import credit_share
from triage_client.message import unpack_messages
from triage_client.pool import nack_reason
from triage_client.stream import DEFAULT_MAX_BACKOFF_S, INITIAL_BACKOFF_S, backoff_delay
from triage_client.writer import settle_frame
from triage_protocol import triage_pb2 as pb
from triage_protocol.constants import DEFAULT_FRAME_BYTES, MAX_REASON_CHARS, MIN_FRAME_BYTES
from triage_proxy.server.encoding import (
    attempt_size,
    delivery_base_size,
    fill_packed,
    frame_header_size,
    frame_limit,
    frame_limit_problem,
    frame_size,
    item_size,
)
from triage_proxy.server.grammar import settle_problem
from triage_proxy.structs import Record

VECTORS = Path(__file__).resolve().parents[2] / "proto" / "triage" / "v1" / "vectors"
COLUMNS = ("offsets", "timestamps_ms", "attempts", "value_lengths", "values", "key_lengths", "keys")


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((VECTORS / name).read_text())
    return data


def named(cases: list[dict[str, Any]]) -> pytest.MarkDecorator:
    return pytest.mark.parametrize(
        "case", cases, ids=[c.get("name", str(i)) for i, c in enumerate(cases)]
    )


def text(pieces: list[list[Any]]) -> str:
    """A vector string written as [text, times] pieces."""
    return "".join(part * times for part, times in pieces)


def unhex(value: str | None) -> bytes | None:
    return None if value is None else bytes.fromhex(value)


def test_every_vector_file_is_checked_here() -> None:
    checked = {
        "ack_ranges.json",
        "backoff.json",
        "credit_splits.json",
        "frame_sizes.json",
        "packed_deliveries.json",
        "reason_cutting.json",
    }
    assert {p.name for p in VECTORS.glob("*.json")} == checked


@named(load("credit_splits.json")["cases"])
def test_credit_splits(case: dict[str, Any]) -> None:
    count = max(1, case["streams"])
    shares = [credit_share(case["budget"], case["streams"], i) for i in range(count)]
    assert shares == case["shares"]


def test_backoff_defaults() -> None:
    vectors = load("backoff.json")
    assert vectors["initial_ms"] == INITIAL_BACKOFF_S * 1000
    assert vectors["cap_ms"] == DEFAULT_MAX_BACKOFF_S * 1000


@named(load("backoff.json")["cases"])
def test_backoff(case: dict[str, Any]) -> None:
    delay_s = backoff_delay(case["failures"], rand=lambda: case["rand"])
    assert delay_s * 1000 == pytest.approx(case["delay_ms"], abs=1e-6)


@named(load("reason_cutting.json")["cases"])
def test_reason_cutting(case: dict[str, Any]) -> None:
    assert load("reason_cutting.json")["max_chars"] == MAX_REASON_CHARS
    error_type = type(case["error_name"], (Exception,), {})
    assert nack_reason(error_type(text(case["message"]))) == text(case["reason"])


@named(load("packed_deliveries.json")["cases"])
def test_packed_deliveries_decode(case: dict[str, Any]) -> None:
    packed = pb.PackedDeliveries(**{k: bytes.fromhex(v) for k, v in case["columns"].items()})
    messages = unpack_messages(case["topic"], case["partition"], packed)
    got = [
        {
            "offset": m.offset,
            "key": None if m.key is None else m.key.hex(),
            "value": None if m.value is None else m.value.hex(),
            "timestamp_ms": m.timestamp,
            "attempt": m.attempt,
        }
        for m in messages
    ]
    assert got == case["deliveries"]
    assert all(m.topic == case["topic"] and m.partition == case["partition"] for m in messages)


@named(load("packed_deliveries.json")["cases"])
def test_packed_deliveries_encode(case: dict[str, Any]) -> None:
    records = [
        Record(
            case["topic"],
            case["partition"],
            d["offset"],
            unhex(d["key"]),
            unhex(d["value"]),
            (),
            d["timestamp_ms"],
        )
        for d in case["deliveries"]
    ]
    attempts = [d["attempt"] for d in case["deliveries"]] if case["attempts_column"] else None
    packed = pb.PackedDeliveries()
    fill_packed(packed, records, attempts)
    assert {name: getattr(packed, name).hex() for name in COLUMNS} == case["columns"]


@named(load("packed_deliveries.json")["refused"])
def test_packed_deliveries_refused(case: dict[str, Any]) -> None:
    packed = pb.PackedDeliveries(**{k: bytes.fromhex(v) for k, v in case["columns"].items()})
    with pytest.raises(ValueError, match=r"packed deliveries|bytes length"):
        unpack_messages("orders", 3, packed)


@named(load("ack_ranges.json")["client_settle"])
def test_ack_ranges_client_settle(case: dict[str, Any]) -> None:
    settle = settle_frame(case["acks"], [])
    assert list(settle.acks) == case["plain"]
    assert [[r.first, r.last] for r in settle.ack_ranges] == case["ranges"]


@named(load("ack_ranges.json")["proxy_checks"])
def test_ack_ranges_proxy_checks(case: dict[str, Any]) -> None:
    ranges = [pb.OffsetRange(first=first, last=last) for first, last in case["ranges"]]
    settle = pb.Settle(acks=case["acks"], ack_ranges=ranges)
    assert (settle_problem(settle) is None) == case["accepted"]


def test_frame_size_constants() -> None:
    vectors = load("frame_sizes.json")
    assert vectors["default_frame_bytes"] == DEFAULT_FRAME_BYTES
    assert vectors["min_frame_bytes"] == MIN_FRAME_BYTES


@named(load("frame_sizes.json")["limits"])
def test_frame_limits(case: dict[str, Any]) -> None:
    problem = frame_limit_problem(case["requested"])
    assert (problem is not None) == case["refused"]
    if not case["refused"]:
        assert frame_limit(case["requested"], case["server_max"]) == case["limit"]


@named(load("frame_sizes.json")["frames"])
def test_frame_sizes(case: dict[str, Any]) -> None:
    deliveries = case["deliveries"]
    records = [
        Record(
            case["topic"],
            case["partition"],
            d["offset"],
            unhex(d["key"]),
            unhex(d["value"]),
            tuple((k, unhex(v)) for k, v in d["headers"]),
            d["timestamp_ms"],
        )
        for d in deliveries
    ]
    sizes = [
        delivery_base_size(r) + attempt_size(d["attempt"])
        for r, d in zip(records, deliveries, strict=True)
    ]
    assert sizes == case["delivery_bytes"]
    header = frame_header_size(case["topic"], case["partition"])
    assert frame_size(header, sum(map(item_size, sizes))) == case["frame_bytes"]
    frame = pb.ProxyFrame(
        deliveries=pb.Deliveries(
            topic=case["topic"],
            partition=case["partition"],
            deliveries=[
                pb.Delivery(
                    offset=r.offset,
                    key=r.key,
                    value=r.value,
                    headers=[pb.Header(key=k, value=v) for k, v in r.headers],
                    timestamp_ms=r.timestamp_ms,
                    attempt=d["attempt"],
                )
                for r, d in zip(records, deliveries, strict=True)
            ],
        )
    )
    assert len(frame.SerializeToString()) == case["frame_bytes"]
