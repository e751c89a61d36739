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
"""

from __future__ import annotations

from triage_proxy.structs import Record

__all__ = [
    "DEFAULT_FRAME_BYTES",
    "FRAME_TARGET_BYTES",
    "MIN_FRAME_BYTES",
    "attempt_size",
    "delivery_base_size",
    "frame_header_size",
    "frame_limit",
    "frame_limit_problem",
    "frame_room",
    "frame_size",
    "item_size",
    "varint_size",
]

DEFAULT_FRAME_BYTES = 4 * 1024 * 1024
"""The limit of a stream whose Hello has no max_frame_bytes (or 0): most gRPC stacks'
default receive limit."""
MIN_FRAME_BYTES = 64 * 1024
"""Smallest Hello.max_frame_bytes accepted: below it ordinary records (and Rejected frames)
would not fit, so a smaller value is a mistake, refused with INVALID_ARGUMENT."""
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
