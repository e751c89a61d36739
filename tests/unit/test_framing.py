"""Frame sizing: the formulas against protobuf's own ByteSize(), and the dispatcher never
sending a frame over the stream's limit (Hello.max_frame_bytes)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_dispatcher import connect, frames_of, make, records
from triage_protocol import triage_pb2 as pb
from triage_protocol.constants import DEFAULT_FRAME_BYTES, MIN_FRAME_BYTES
from triage_proxy.pipeline.dispatch import Entry, EntryState, Session
from triage_proxy.server.encoding import (
    PLAIN_ITEM_MAX_OVERHEAD_BYTES,
    attempt_size,
    delivery_base_size,
    frame_header_size,
    frame_limit,
    frame_limit_problem,
    frame_room,
    frame_size,
    item_size,
    varint_size,
)
from triage_proxy.server.outbox import Outbox
from triage_proxy.structs import Record

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
BLOB = st.none() | st.binary(max_size=300)
HEADERS = st.lists(st.tuples(st.text(max_size=20), BLOB), max_size=4)


def delivery_of(record: Record, attempt: int) -> pb.Delivery:
    delivery = pb.Delivery(offset=record.offset, timestamp_ms=record.timestamp_ms, attempt=attempt)
    if record.key is not None:
        delivery.key = record.key
    if record.value is not None:
        delivery.value = record.value
    for name, value in record.headers:
        delivery.headers.add(key=name, value=value)
    return delivery


@settings(max_examples=300, deadline=None)
@given(
    offset=st.integers(min_value=0, max_value=2**63 - 1),
    key=BLOB,
    value=BLOB,
    headers=HEADERS,
    timestamp=INT64,
    attempt=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_delivery_size_is_exact(
    offset: int,
    key: bytes | None,
    value: bytes | None,
    headers: list[tuple[str, bytes | None]],
    timestamp: int,
    attempt: int,
) -> None:
    record = Record("t", 0, offset, key, value, tuple(headers), timestamp)
    expected = delivery_of(record, attempt).ByteSize()
    assert delivery_base_size(record) + attempt_size(attempt) == expected
    assert Entry.of(record).size == record.size  # its inlined copy for records without headers


@settings(max_examples=100, deadline=None)
@given(
    batch=st.lists(st.tuples(BLOB, BLOB, HEADERS), min_size=1, max_size=5),
    fetched_at=st.floats(min_value=0, max_value=1e9),
)
def test_entries_built_in_bulk_are_ready_and_fresh(
    batch: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes | None]]]],
    fetched_at: float,
) -> None:
    """Entry.fetched sets every slot: the record, its size, READY, nothing delivered yet."""
    fetched = [Record("t", 0, n, k, v, tuple(h), 0) for n, (k, v, h) in enumerate(batch)]
    for entry, record in zip(Entry.fetched(fetched, fetched_at), fetched, strict=True):
        expected = {
            "record": record,
            "size": record.size,
            "attempt": 0,
            "holder": None,
            "state": EntryState.READY,
            "deadline": 0.0,
            "suspect": False,
            "acquittals": (0, -1),
            "fetched_at": fetched_at,
            "delivered_at": 0.0,
        }
        assert set(expected) == set(Entry.__slots__)
        for name, value in expected.items():
            assert getattr(entry, name) == value, name


@settings(max_examples=300, deadline=None)
@given(
    offset=st.integers(min_value=0, max_value=2**63 - 1),
    key=BLOB,
    value=BLOB,
    headers=HEADERS,
    timestamp=INT64,
    attempt=st.integers(min_value=1, max_value=2**32 - 1),
)
def test_the_outbox_sizes_a_delivery_exactly(
    offset: int,
    key: bytes | None,
    value: bytes | None,
    headers: list[tuple[str, bytes | None]],
    timestamp: int,
    attempt: int,
) -> None:
    """The outbox's inlined copy of the formulas: a delivery of exactly a frame's room is
    sent, one byte over it is refused."""
    record = Record("t", 0, offset, key, value, tuple(headers), timestamp)
    item = item_size(delivery_base_size(record) + attempt_size(attempt))
    header = frame_header_size("t", 0)
    for room, sent in ((item, 1), (item - 1, 0)):
        limit = next(n for n in range(room, room + 20) if frame_room(n, header) == room)
        entry = Entry.of(record)
        entry.attempt = attempt
        frames, refused = Outbox("t", 0, limit, packed=False).send([entry])
        assert (frames, len(refused)) == (sent, 1 - sent)


@settings(max_examples=300, deadline=None)
@given(
    offset=INT64,
    key=BLOB,
    value=BLOB,
    timestamp=INT64,
    attempt=st.integers(min_value=1, max_value=2**32 - 1),
)
def test_a_plain_delivery_adds_at_most_its_bytes_and_the_overhead_bound(
    offset: int, key: bytes | None, value: bytes | None, timestamp: int, attempt: int
) -> None:
    """The bound that lets the outbox skip sizing a batch that fits one frame anyway."""
    record = Record("t", 0, offset, key, value, (), timestamp)
    item = item_size(delivery_base_size(record) + attempt_size(attempt))
    assert item <= record.size + PLAIN_ITEM_MAX_OVERHEAD_BYTES


@settings(max_examples=200, deadline=None)
@given(
    topic=st.text(max_size=300),
    partition=st.integers(min_value=-(2**31), max_value=2**31 - 1),
    values=st.lists(BLOB, max_size=20),
)
def test_frame_size_is_exact(topic: str, partition: int, values: list[bytes | None]) -> None:
    frame = pb.ProxyFrame()
    frame.deliveries.topic = topic
    frame.deliveries.partition = partition
    items = 0
    for offset, value in enumerate(values):
        record = Record(topic, partition, offset, None, value, (), 1_700_000_000_000)
        frame.deliveries.deliveries.append(delivery_of(record, 1))
        items += item_size(delivery_base_size(record) + attempt_size(1))
    assert frame_size(frame_header_size(topic, partition), items) == frame.ByteSize()


def test_varint_sizes() -> None:
    assert [varint_size(n) for n in (0, 1, 127, 128, 16383, 16384, 2**63 - 1, -1)] == [
        1,
        1,
        1,
        2,
        2,
        3,
        9,
        10,
    ]


def test_frame_limit_policy() -> None:
    assert frame_limit(0, 64 << 20) == DEFAULT_FRAME_BYTES  # an old Hello: 4 MiB
    assert frame_limit(64 << 20, 64 << 20) == 64 << 20
    assert frame_limit(256 << 20, 64 << 20) == 64 << 20  # never above the server's own
    assert frame_limit(MIN_FRAME_BYTES, 64 << 20) == MIN_FRAME_BYTES
    assert frame_limit_problem(0) is None
    assert frame_limit_problem(MIN_FRAME_BYTES) is None
    problem = frame_limit_problem(MIN_FRAME_BYTES - 1)
    assert problem is not None
    assert "Hello.max_frame_bytes" in problem


def frames(session: Session) -> list[pb.ProxyFrame]:
    out = []
    for frame in frames_of(session):
        assert frame is not None
        out.append(frame)
    return out


def test_frames_never_exceed_a_4_mib_limit_with_4000_byte_records() -> None:
    """The grpc-js trap: 2,048 credits of 4,000-byte records add up to 4,213,082 bytes,
    over grpc-js's 4 MiB receive limit; every frame fits 4 MiB exactly, and is filled
    close to it."""
    d, _, dead = make(max_messages=5000, max_frame_bytes=64 << 20)
    s = connect(d, "js", 2048, DEFAULT_FRAME_BYTES)
    d.add(
        Record("orders", 0, o, b"k%d" % o, b"x" * 4000, (("h", b"v"),), 1_700_000_000_000)
        for o in range(2048)
    )
    sent = frames(s)
    assert sum(len(f.deliveries.deliveries) for f in sent) == 2048
    assert dead == []
    sizes = [f.ByteSize() for f in sent]
    assert max(sizes) <= DEFAULT_FRAME_BYTES
    item = sent[0].deliveries.deliveries[0].ByteSize() + 3
    assert all(size > DEFAULT_FRAME_BYTES - item for size in sizes[:-1])  # filled, not halved


def test_an_old_hello_gets_4_mib_frames() -> None:
    d, _, _ = make(max_frame_bytes=64 << 20)
    s = connect(d, "old", 100)  # no max_frame_bytes: the default
    d.add(records(0, 20, value=b"x" * (1 << 20)))
    sizes = [f.ByteSize() for f in frames(s)]
    assert sum(1 for _ in sizes) >= 7
    assert max(sizes) <= DEFAULT_FRAME_BYTES


def test_a_record_alone_may_fill_a_frame_up_to_the_limit() -> None:
    d, _, dead = make(max_frame_bytes=64 << 20)
    s = connect(d, "big", 10, 16 << 20)
    d.add(records(0, 3, value=b"x" * (6 << 20)))
    sent = frames(s)
    assert [len(f.deliveries.deliveries) for f in sent] == [1, 1, 1]
    assert dead == []
    assert max(f.ByteSize() for f in sent) <= 16 << 20


def test_a_record_over_the_limit_is_dead_lettered_and_the_rest_flow() -> None:
    d, tracker, dead = make(max_frame_bytes=64 << 20)
    s = connect(d, "js", 10, MIN_FRAME_BYTES)
    d.add(
        [
            Record("t", 0, 0, None, b"a", (), 0),
            Record("t", 0, 1, None, b"x" * MIN_FRAME_BYTES, (), 0),
            Record("t", 0, 2, None, b"b", (), 0),
        ]
    )
    got = [dl.offset for f in frames(s) for dl in f.deliveries.deliveries]
    assert got == [0, 2]
    assert len(dead) == 1
    assert dead[0].record.offset == 1
    assert dead[0].reason.startswith(f"record of {MIN_FRAME_BYTES} bytes needs a frame of ")
    assert f"over the consumer's frame limit of {MIN_FRAME_BYTES} bytes" in dead[0].reason
    d.dead_letter_written(dead[0])
    d.settle(s, [0, 2], [])
    assert tracker.committable == 3


def test_a_large_record_waits_for_an_instance_whose_limit_takes_it() -> None:
    """Mixed fleet: a record too large for one instance waits for one that can take it;
    once no connected instance can, it is dead-lettered."""
    d, _, dead = make(max_frame_bytes=64 << 20)
    big = connect(d, "big", 1, 8 << 20)
    d.add([Record("t", 0, 0, None, b"a", (), 0)])
    assert list(big.held) == [0]
    small = connect(d, "small", 10, MIN_FRAME_BYTES)
    d.add([Record("t", 0, 1, None, b"x" * (1 << 20), (), 0)])
    d.tick()
    assert 1 not in small.held
    assert 1 not in big.held  # big has no credit: it waits
    assert d.queued == 1
    assert dead == []
    d.settle(big, [0], [])
    assert list(big.held) == [1]
    d.close_session(big)  # big vanished holding it: no connected instance can receive it
    d.tick()
    assert [dl.record.offset for dl in dead] == [1]
    assert "frame limit of 65536 bytes" in dead[0].reason
    assert small.held == {}


@settings(max_examples=300, deadline=None)
@given(
    limit=st.integers(min_value=MIN_FRAME_BYTES, max_value=2**31 - 1),
    header=st.integers(min_value=0, max_value=300),
    data=st.data(),
)
def test_frame_room_never_lets_a_frame_exceed_the_limit(
    limit: int, header: int, data: st.DataObject
) -> None:
    room = frame_room(limit, header)
    items = data.draw(st.integers(min_value=0, max_value=room))
    assert frame_size(header, items) <= limit
    assert frame_size(header, room + 3) > limit - 3  # and leaves at most a few bytes


def test_records_at_the_edge_of_the_limit_are_delivered_or_dead_lettered() -> None:
    """Around the limit, each record goes out in a frame within it or is dead-lettered:
    never left waiting for an instance that can take it (the fit rule is one rule)."""
    d, _, dead = make(max_frame_bytes=64 << 20)
    s = connect(d, "edge", 100, MIN_FRAME_BYTES)
    sizes = range(MIN_FRAME_BYTES - 40, MIN_FRAME_BYTES + 1)
    d.add(Record("t", 0, o, None, b"x" * n, (), 0) for o, n in enumerate(sizes))
    d.tick()
    sent = frames(s)
    delivered = [dl.offset for f in sent for dl in f.deliveries.deliveries]
    assert max(f.ByteSize() for f in sent) <= MIN_FRAME_BYTES
    assert sorted(delivered + [dl.record.offset for dl in dead]) == list(range(len(sizes)))
    assert delivered  # the ones that fit were sent
    assert dead  # and the ones that did not were dead-lettered
    assert d.queued == 0
