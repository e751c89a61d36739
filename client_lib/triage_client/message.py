"""The message a handler receives, and the consumer's counters."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

__all__ = ["ConsumerStats", "Headers", "Message"]

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
