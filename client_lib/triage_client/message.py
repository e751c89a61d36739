"""The message a handler receives, and the consumer's counters."""

from __future__ import annotations

import sys
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from itertools import accumulate, repeat
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from triage_protocol import triage_pb2

__all__ = ["ConsumerStats", "Headers", "Message", "messages_of", "unpack_messages"]

Headers = list[tuple[str, bytes | None]]
"""Kafka headers in broker order, as confluent-kafka gives them (a list, so it can be passed
straight back to `Producer.produce(headers=...)`, which rejects tuples)."""


@dataclass(frozen=True, slots=True)
class Message:
    """One Kafka message delivered by the proxy, byte-exact.

    Payload fields are left out of `repr` so a stray log line does not leak them.
    """

    topic: str
    """Source topic."""
    partition: int
    """Source partition."""
    offset: int
    """Offset within the partition; settlements name the message by it."""
    key: bytes | None = field(repr=False)
    """Message key; None when the producer sent none (b"" is a distinct, empty key)."""
    value: bytes | None = field(repr=False)
    """Message value; None for a tombstone."""
    headers: Headers = field(repr=False, hash=False)
    """Headers in broker order; a header value may be None. Never None itself (empty list)."""
    timestamp: int
    """Kafka timestamp in milliseconds since the epoch; a plain int, unlike confluent-kafka's
    (type, ms) tuple, because the proxy does not forward the timestamp type."""
    attempt: int
    """1 for the first delivery of this offset, higher for redeliveries."""


def _message_factory() -> Callable[
    [str, int, int, bytes | None, bytes | None, Headers, int, int], Message
]:
    """A Message constructor for the hot path, twice as fast as the frozen dataclass's
    `__init__` (which calls object.__setattr__ once per field): it fills the slots directly.
    Same fields, same order, same result; the consumer builds every delivery with it."""
    new = object.__new__
    setters = [Message.__dict__[f.name].__set__ for f in fields(Message)]
    topic, partition, offset, key, value, headers, timestamp, attempt = setters

    def make(
        t: str, p: int, o: int, k: bytes | None, v: bytes | None, h: Headers, ts: int, a: int
    ) -> Message:
        m = new(Message)
        topic(m, t)
        partition(m, p)
        offset(m, o)
        key(m, k)
        value(m, v)
        headers(m, h)
        timestamp(m, ts)
        attempt(m, a)
        return m

    return make


make_message = _message_factory()

_SETTERS = tuple(Message.__dict__[f.name].__set__ for f in fields(Message))
_SWAP = sys.byteorder == "big"
"""Packed columns are little-endian; `array` reads the machine's order."""


def _ints(code: str, data: bytes) -> list[int]:
    column = array(code)
    column.frombytes(data)
    if _SWAP:
        column.byteswap()
    return column.tolist()


def _payloads(lengths_data: bytes, data: bytes, count: int) -> list[bytes | None]:
    """A packed key or value column: `count` slices of `data` (-1: None)."""
    lengths = _ints("i", lengths_data)
    if len(lengths) != count:
        raise ValueError(f"packed deliveries: {len(lengths)} lengths for {count} offsets")
    if count and min(lengths) >= 0:
        ends = list(accumulate(lengths))
        if ends[-1] != len(data):
            raise ValueError("packed deliveries: the lengths do not add up to the payload")
        return list(map(data.__getitem__, map(slice, [0, *ends[:-1]], ends)))
    out: list[bytes | None] = []
    at = 0
    for n in lengths:
        if n < 0:
            out.append(None)
        else:
            out.append(data[at : at + n])
            at += n
    if at != len(data):
        raise ValueError("packed deliveries: the lengths do not add up to the payload")
    return out


def unpack_messages(
    topic: str, partition: int, packed: triage_pb2.PackedDeliveries
) -> list[Message]:
    """The Messages of a `Deliveries.packed` (PROTOCOL.md, "Packed deliveries"): every column
    read in one C-level pass, and each Message's slots filled column by column (`map` over
    the slot setters) instead of a Python call per Message. ValueError when the columns
    do not agree (a broken proxy)."""
    offsets = _ints("q", packed.offsets)
    count = len(offsets)
    timestamps = _ints("q", packed.timestamps_ms)
    if len(timestamps) != count:
        raise ValueError(f"packed deliveries: {len(timestamps)} timestamps for {count} offsets")
    attempts: Iterable[int] = repeat(1, count)
    if packed.attempts:
        listed = _ints("I", packed.attempts)
        if len(listed) != count:
            raise ValueError("packed deliveries: the attempts do not match the offsets")
        attempts = listed
    values = _payloads(packed.value_lengths, packed.values, count)
    keys: Iterable[bytes | None] = repeat(None, count)
    if packed.key_lengths:
        keys = _payloads(packed.key_lengths, packed.keys, count)
    messages = list(map(object.__new__, repeat(Message, count)))
    set_topic, set_partition, set_offset, set_key, set_value, set_headers, set_ts, set_att = (
        _SETTERS
    )
    run = deque[None](maxlen=0).extend  # drives each map without keeping its Nones
    run(map(set_topic, messages, repeat(topic, count)))
    run(map(set_partition, messages, repeat(partition, count)))
    run(map(set_offset, messages, offsets))
    run(map(set_key, messages, keys))
    run(map(set_value, messages, values))
    run(map(set_headers, messages, [[] for _ in range(count)]))
    run(map(set_ts, messages, timestamps))
    run(map(set_att, messages, attempts))
    return messages


def messages_of(batch: triage_pb2.Deliveries) -> list[Message]:
    """The Messages of a Deliveries frame: its packed columns (from a proxy that read the
    Hello's packed_deliveries), then any repeated Delivery (records with headers, large
    ones, or an older proxy's)."""
    topic, partition = batch.topic, batch.partition
    messages = unpack_messages(topic, partition, batch.packed) if batch.HasField("packed") else []
    if not batch.deliveries:
        return messages
    append = messages.append
    make = make_message
    has = type(batch.deliveries[0]).HasField
    for d in batch.deliveries:
        # Presence is asked only of an empty key or value (None and b"" differ); a
        # non-empty one is present.
        key: bytes | None = d.key
        if not key and not has(d, "key"):
            key = None
        value: bytes | None = d.value
        if not value and not has(d, "value"):
            value = None
        hs = d.headers
        append(
            make(
                topic,
                partition,
                d.offset,
                key,
                value,
                # iterating an empty repeated field costs microseconds: skip it
                [(h.key, h.value if h.HasField("value") else None) for h in hs] if hs else [],
                d.timestamp_ms,
                d.attempt,
            )
        )
    return messages


@dataclass(frozen=True, slots=True)
class ConsumerStats:
    """A snapshot of one consumer's counters since it was created: the fields are totals over
    every partition it consumes, and `partitions` has the same counters per partition."""

    delivered: int = 0
    """Messages received from the proxy."""
    acked: int = 0
    """Acks sent to the proxy."""
    nacked: int = 0
    """Nacks sent to the proxy (retry or not)."""
    rejected: int = 0
    """Settlements the proxy refused (it did not consider this instance their holder)."""
    dropped: int = 0
    """Deliveries given up without a settlement: their stream broke, or stop() released them
    before a handler started. The proxy redelivers them."""
    reconnects: int = 0
    """Streams opened after the first one."""
    extended: int = 0
    """Lease extensions sent: each offset listed in each Extend frame counts once (a handler
    running for n ack deadlines counts about 3n)."""
    partitions: Mapping[int, ConsumerStats] = field(default_factory=dict, hash=False)
    """The same counters per partition (their own `partitions` is empty); `reconnects` there
    counts the streams opened for that partition after its first."""
