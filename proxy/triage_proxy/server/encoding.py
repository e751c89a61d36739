"""The exact wire size of a `Deliveries` frame, and the frame limit a consumer may ask for.

Why exact: a gRPC stack refuses (RESOURCE_EXHAUSTED) any message over its receive limit
and fails the whole stream, so every delivery it held is redelivered with its attempt
raised. grpc-js, grpc-go and grpc-java default to 4 MiB; a frame filled "up to 4 MiB of
payload" is 4 MiB plus protobuf's per-delivery overhead and breaks them. The dispatcher
sums these sizes instead of guessing, and never sends a frame over the stream's limit
(`Hello.max_frame_bytes`, absent = 4 MiB). tests/unit/test_framing.py checks every formula
against protobuf's own `ByteSize()`.

The wire format (proto/triage/v1/triage.proto, proto3): every field number is below 16, so
each tag is one byte; a length-delimited field is tag + varint(length) + bytes; a scalar
equal to its default and an unset `optional` are not sent; a negative int32/int64 is a
10-byte varint.

    ProxyFrame   = 1 + varint(D) + D                       (field 2, deliveries)
    D            = topic field + partition field + sum(1 + varint(d) + d)
    d (Delivery) = offset + key? + value? + headers + timestamp_ms + attempt

Packed deliveries (`Deliveries.packed`, to a client whose Hello set packed_deliveries): the
records without headers of a frame as seven bytes columns (PROTOCOL.md, "Packed
deliveries"), built by `fill_packed` with one C-level pass per column instead of a
protobuf object per delivery. Each such record adds PACKED_ITEM_BYTES + its key and value
bytes; the sub-message's tags and lengths add at most PACKED_OVERHEAD_BYTES per frame.
"""

from __future__ import annotations

import sys
from array import array
from operator import itemgetter

from triage_protocol import triage_pb2 as pb
from triage_protocol.constants import DEFAULT_FRAME_BYTES, MIN_FRAME_BYTES
from triage_proxy.structs import Record

__all__ = [
    "FRAME_TARGET_BYTES",
    "PACKED_ITEM_BYTES",
    "PACKED_MAX_RECORD_BYTES",
    "PACKED_OVERHEAD_BYTES",
    "PLAIN_ITEM_MAX_OVERHEAD_BYTES",
    "attempt_size",
    "delivery_base_size",
    "fill_packed",
    "frame_header_size",
    "frame_limit",
    "frame_limit_problem",
    "frame_room",
    "frame_size",
    "item_size",
    "varint_size",
]

FRAME_TARGET_BYTES = 4 * 1024 * 1024
"""Frames are filled up to this many bytes (or the stream's limit when smaller); one
record alone may take a frame up to the limit. Larger frames gain nothing and hold a
batch back until all of it arrived."""


def varint_size(n: int) -> int:
    """Bytes of `n` as a protobuf varint (a negative int32/int64 takes 10)."""
    if n < 0:
        return 10
    return (n.bit_length() + 6) // 7 or 1


def _bytes_field(n: int) -> int:
    """A length-delimited field of `n` bytes, tag included."""
    return 1 + varint_size(n) + n


def delivery_base_size(record: Record) -> int:
    """Bytes of `record`'s Delivery message without its `attempt` field (which changes
    from delivery to delivery: add `attempt_size`). Inlined arithmetic: it runs once per
    fetched record on the proxy's hot path."""
    _, _, offset, key, value, headers, timestamp = record
    n = 0
    if offset:
        n = 11 if offset < 0 else 1 + (offset.bit_length() + 6) // 7
    if key is not None:
        k = len(key)
        n += 1 + ((k.bit_length() + 6) // 7 or 1) + k
    if value is not None:
        v = len(value)
        n += 1 + ((v.bit_length() + 6) // 7 or 1) + v
    for name, data in headers:
        h = 0
        if name:
            h = _bytes_field(len(name.encode()))
        if data is not None:
            h += _bytes_field(len(data))
        n += _bytes_field(h)
    if timestamp:
        n += 11 if timestamp < 0 else 1 + (timestamp.bit_length() + 6) // 7
    return n


def attempt_size(attempt: int) -> int:
    """Bytes of the Delivery's `attempt` field (absent when 0)."""
    return 1 + varint_size(attempt) if attempt else 0


def item_size(delivery: int) -> int:
    """Bytes a Delivery of `delivery` bytes adds to its Deliveries message."""
    return _bytes_field(delivery)


def frame_header_size(topic: str, partition: int) -> int:
    """Bytes of the Deliveries fields every frame carries (topic, partition)."""
    n = _bytes_field(len(topic.encode())) if topic else 0
    if partition:
        n += 1 + varint_size(partition)
    return n


def frame_size(header: int, items: int) -> int:
    """Bytes of a ProxyFrame whose Deliveries has `header` bytes of topic and partition
    and `items` bytes of deliveries (sum of `item_size`)."""
    return _bytes_field(header + items)


def frame_room(limit: int, header: int) -> int:
    """Most bytes of deliveries (sum of `item_size`) a frame of at most `limit` bytes holds:
    `frame_size(header, items) <= limit` whenever `items <= frame_room(limit, header)`.
    It takes the length prefix at its largest, varint(limit), so it may leave a byte or
    two unused (below 2 MiB, say), never one too many; one subtraction per delivery on
    the hot path instead of a varint each."""
    return limit - 1 - varint_size(limit) - header


def frame_limit_problem(requested: int) -> str | None:
    """Why a Hello's max_frame_bytes is refused (INVALID_ARGUMENT), or None."""
    if requested and requested < MIN_FRAME_BYTES:
        return (
            f"Hello.max_frame_bytes must be 0 (the default, {DEFAULT_FRAME_BYTES}) or at "
            f"least {MIN_FRAME_BYTES}, got {requested}"
        )
    return None


def frame_limit(requested: int, server_max: int) -> int:
    """The limit a stream gets: what its Hello asked for (0: the default), never above
    what the proxy itself may send (`server.max_frame_bytes`)."""
    return min(requested or DEFAULT_FRAME_BYTES, server_max)


PACKED_ITEM_BYTES = 28
"""Column bytes of one packed delivery besides its key and value: offset and timestamp
(8 each), attempt, key length and value length (4 each)."""
PACKED_OVERHEAD_BYTES = 48
"""Most bytes the packed sub-message's framing adds to a frame: its own tag and length in
Deliveries (1 + at most 5) and the tag and length of each of its seven fields (1 + 5)."""
PLAIN_ITEM_MAX_OVERHEAD_BYTES = 51
"""Most bytes a repeated Delivery of a record without headers adds to a frame besides
its key and value bytes: offset, timestamp_ms and attempt (1 + at most 10 each), the tags
and lengths of key and value (1 + at most 5 each) and its own tag and length (1 + 5)."""
PACKED_MAX_RECORD_BYTES = 16 * 1024
"""Records with more key and value bytes than this go as a repeated Delivery even to a
client that reads packed ones: packing gains nothing for them, and this bound keeps any
packed record (with the overhead) inside the smallest frame limit (MIN_FRAME_BYTES)."""

_OFFSET = itemgetter(2)
_KEY = itemgetter(3)
_VALUE = itemgetter(4)
_TIMESTAMP = itemgetter(6)
_SWAP = sys.byteorder == "big"
"""The columns are little-endian; `array` writes the machine's order."""
if (array("i").itemsize, array("I").itemsize, array("q").itemsize) != (4, 4, 8):
    raise ImportError("the packed columns need 4-byte C ints and 8-byte long longs")


def _column(data: list[bytes | None]) -> tuple[array[int], bytes]:
    """(lengths, payloads joined) of a key or value column; -1 marks a null."""
    try:
        return array("i", map(len, data)), b"".join(data)  # type: ignore[arg-type]
    except TypeError:  # a null among them (rare: tombstones, keyless records among keyed)
        lengths = array("i", [-1 if d is None else len(d) for d in data])
        return lengths, b"".join([d for d in data if d is not None])


def _le(column: array[int]) -> bytes:
    if _SWAP:
        column.byteswap()
    return column.tobytes()


def fill_packed(
    packed: pb.PackedDeliveries, records: list[Record], attempts: list[int] | None
) -> None:
    """Write `records` (none with headers) into `packed`, delivery i with attempt
    attempts[i] (None: every attempt is 1, and the attempts column stays empty)."""
    packed.offsets = _le(array("q", map(_OFFSET, records)))
    packed.timestamps_ms = _le(array("q", map(_TIMESTAMP, records)))
    if attempts is not None:
        packed.attempts = _le(array("I", attempts))
    lengths, values = _column(list(map(_VALUE, records)))
    packed.value_lengths = _le(lengths)
    packed.values = values
    keys = list(map(_KEY, records))
    if keys.count(None) != len(keys):
        lengths, joined = _column(keys)
        packed.key_lengths = _le(lengths)
        packed.keys = joined
