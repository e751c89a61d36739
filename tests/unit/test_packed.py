"""Packed deliveries (Deliveries.packed): what the dispatcher packs for a client whose Hello
asked for them, read back by the client's `unpack_messages`, is every record byte-exact, in
frames that never exceed the stream's limit; a client that did not ask gets none."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_dispatcher import connect, frames_of, make
from triage_client.message import Message, unpack_messages
from triage_protocol import triage_pb2 as pb
from triage_protocol.constants import MIN_FRAME_BYTES
from triage_proxy.pipeline.dispatch import Session
from triage_proxy.server.encoding import PACKED_MAX_RECORD_BYTES, fill_packed
from triage_proxy.structs import Record

BLOB = st.none() | st.binary(max_size=200)
RECORD = st.tuples(
    BLOB,
    BLOB,
    st.lists(st.tuples(st.text(max_size=8), BLOB), max_size=2),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.integers(min_value=0, max_value=40) | st.just(PACKED_MAX_RECORD_BYTES + 1),
)
"""key, value, headers, timestamp, and a size of padding added to the value (to cross the
packed size bound and the frame limit)."""

Row = tuple[int, bytes | None, bytes | None, tuple[tuple[str, bytes | None], ...], int, int]
"""A delivery as the client reads it: offset, key, value, headers, timestamp, attempt."""


def received(frame: pb.ProxyFrame) -> list[Row]:
    """Every delivery of `frame` as the client reads it, both forms."""
    batch = frame.deliveries
    out: list[Message | pb.Delivery] = []
    if batch.HasField("packed"):
        out.extend(unpack_messages(batch.topic, batch.partition, batch.packed))
    out.extend(batch.deliveries)
    rows: list[Row] = []
    for d in out:
        if isinstance(d, Message):
            rows.append((d.offset, d.key, d.value, tuple(d.headers), d.timestamp, d.attempt))
        else:
            key = d.key if d.HasField("key") else None
            value = d.value if d.HasField("value") else None
            headers = tuple((h.key, h.value if h.HasField("value") else None) for h in d.headers)
            rows.append((d.offset, key, value, headers, d.timestamp_ms, d.attempt))
    return rows


def outbox(session: Session) -> list[pb.ProxyFrame]:
    frames = []
    for frame in frames_of(session):
        assert frame is not None
        frames.append(frame)
    return frames


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(RECORD, min_size=1, max_size=60), limit_kib=st.integers(64, 200))
def test_packed_frames_carry_every_record_byte_exact_within_the_limit(
    rows: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes | None]], int, int]],
    limit_kib: int,
) -> None:
    d, _, dead = make(max_messages=1000, max_frame_bytes=64 << 20)
    limit = limit_kib * 1024
    s = connect(d, "packed", 1000, limit, packed=True)
    batch = [
        Record(
            "t",
            0,
            offset,
            key,
            None if value is None and not pad else (value or b"") + b"p" * pad,
            tuple(headers),
            timestamp,
        )
        for offset, (key, value, headers, timestamp, pad) in enumerate(rows)
    ]
    d.add(batch)
    frames = outbox(s)
    assert dead == []
    assert all(f.ByteSize() <= limit for f in frames)
    got = sorted(row for f in frames for row in received(f))
    expected = [(r.offset, r.key, r.value, r.headers, r.timestamp_ms, 1) for r in batch]
    assert got == expected
    # Redeliveries (suspects, one at a time) carry their attempt in the attempts column; a
    # vanished instance's deliveries lose an attempt only when it held one (blamed_on_vanish).
    d.close_session(s)
    again = connect(d, "packed-2", 1000, limit, packed=True)
    got = []
    while len(got) < len(batch):
        fresh = [row for f in outbox(again) for row in received(f)]
        assert fresh
        got.extend(fresh)
        d.settle(again, [row[0] for row in fresh], [])
    got.sort()
    assert [row[5] for row in got] == [2 if len(batch) == 1 else 1] * len(batch)
    assert [row[:5] for row in got] == [e[:5] for e in expected]


def test_a_client_that_did_not_ask_gets_repeated_deliveries_only() -> None:
    d, _, _ = make()
    old = connect(d, "old", 100)
    d.add([Record("t", 0, o, None, b"v", (), 5) for o in range(10)])
    frames = outbox(old)
    assert frames
    assert not any(f.deliveries.HasField("packed") for f in frames)
    assert sum(len(f.deliveries.deliveries) for f in frames) == 10


def test_unsent_packed_deliveries_are_given_back() -> None:
    """A revoked stream's queued frames never reached the wire: their packed offsets go
    back to the queue without an attempt, like repeated ones."""
    d, _, _ = make()
    s = connect(d, "packed", 100, packed=True)
    d.add([Record("t", 0, o, None, b"v", (), 5) for o in range(10)])
    d.end_session_now(s)
    other = connect(d, "other", 100, packed=True)
    got = [row for f in outbox(other) for row in received(f)]
    assert sorted(row[0] for row in got) == list(range(10))
    assert {row[5] for row in got} == {1}


def test_the_packed_wire_format_is_little_endian_columns() -> None:
    """The layout PROTOCOL.md documents, byte for byte, for other clients to implement."""
    packed = pb.PackedDeliveries()
    fill_packed(
        packed,
        [
            Record("t", 0, 7, None, b"ab", (), 1000),
            Record("t", 0, 8, b"k", None, (), -1),
            Record("t", 0, 9, None, b"", (), 0),
        ],
        [1, 3, 1],
    )
    assert packed.offsets == struct.pack("<3q", 7, 8, 9)
    assert packed.timestamps_ms == struct.pack("<3q", 1000, -1, 0)
    assert packed.attempts == struct.pack("<3I", 1, 3, 1)
    assert packed.value_lengths == struct.pack("<3i", 2, -1, 0)
    assert packed.values == b"ab"
    assert packed.key_lengths == struct.pack("<3i", -1, 1, -1)
    assert packed.keys == b"k"
    messages = unpack_messages("t", 0, packed)
    assert [(m.offset, m.key, m.value, m.timestamp, m.attempt) for m in messages] == [
        (7, None, b"ab", 1000, 1),
        (8, b"k", None, -1, 3),
        (9, None, b"", 0, 1),
    ]
    assert messages[0].headers == []
    assert messages[0].headers is not messages[2].headers
    keyless = pb.PackedDeliveries()
    fill_packed(keyless, [Record("t", 0, 1, None, b"x", (), 0)], None)
    assert keyless.key_lengths == b""
    assert keyless.attempts == b""


@pytest.mark.parametrize(
    "broken",
    [
        {"offsets": struct.pack("<2q", 1, 2), "timestamps_ms": struct.pack("<q", 0)},
        {"value_lengths": struct.pack("<2i", 1, 5), "values": b"abc"},
        {"attempts": struct.pack("<I", 1)},
        {"key_lengths": struct.pack("<i", 1)},
    ],
)
def test_columns_that_do_not_agree_are_refused(broken: dict[str, bytes]) -> None:
    packed = pb.PackedDeliveries(
        offsets=struct.pack("<2q", 1, 2),
        timestamps_ms=struct.pack("<2q", 0, 0),
        value_lengths=struct.pack("<2i", 1, 1),
        values=b"ab",
    )
    for name, data in broken.items():
        setattr(packed, name, data)
    with pytest.raises(ValueError, match="packed deliveries"):
        unpack_messages("t", 0, packed)


def test_the_smallest_frame_limit_takes_the_largest_packed_record() -> None:
    d, _, dead = make(max_frame_bytes=64 << 20)
    s = connect(d, "small", 10, MIN_FRAME_BYTES, packed=True)
    d.add([Record("t", 0, o, None, b"x" * PACKED_MAX_RECORD_BYTES, (), 0) for o in range(8)])
    frames = outbox(s)
    assert dead == []
    assert all(f.ByteSize() <= MIN_FRAME_BYTES for f in frames)
    assert all(f.deliveries.HasField("packed") for f in frames)
    assert sum(len(received(f)) for f in frames) == 8
