"""Value types shared across the proxy's components."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

Headers = tuple[tuple[str, bytes | None], ...]


class Record(NamedTuple):
    """One Kafka message as fetched, kept byte-exact until it is settled.

    A NamedTuple rather than a frozen dataclass: one is built per fetched message on
    the hot path, and `tuple.__new__` costs a quarter of a frozen dataclass __init__
    (measured 0.4 vs 1.7 us). It is just as immutable.
    """

    topic: str
    """Source topic."""
    partition: int
    """Source partition."""
    offset: int
    """Offset within the partition; the tracking key."""
    key: bytes | None
    """Message key, None when the producer sent none."""
    value: bytes | None
    """Message value, None for a tombstone."""
    headers: Headers
    """Headers in broker order; a header value may be None."""
    timestamp_ms: int
    """Broker or producer timestamp in milliseconds since the epoch."""

    @property
    def size(self) -> int:
        """Bytes this record holds in the in-flight window."""
        n = len(self.key or b"") + len(self.value or b"")
        for name, value in self.headers:
            n += len(name) + len(value or b"")
        return n


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A record that will not be processed, with why; written before its offset settles."""

    record: Record
    """The message, byte-exact."""
    reason: str
    """The consumer's nack reason or the proxy's own cause."""
    attempts: int
    """How many times the message was delivered."""
    consumer_id: str
    """The instance that settled it last (empty if none did)."""
    dead_lettered_at_ms: int
    """When the proxy decided to dead-letter it, ms since the epoch."""
