"""Sample dead letters and their table items, built one way for every test suite.

Why one module: the writer, the table, the renderer, the CLI and the Spark job's tests
all need "a dead letter of orders/0 at offset N", and copies spelled out per suite
drift apart. A suite whose assertions depend on other defaults (the reason, the timestamps)
wraps `make_dl` with its own values in one line.
"""

from __future__ import annotations

from typing import Any

from triage_proxy.store.deadletter_store import MEMORY_GROUP
from triage_proxy.store.items import STATE_ATTR, item_from_dead_letter, state_key
from triage_proxy.structs import DeadLetter, Headers, Record

T0 = 1_714_564_800_000  # 2024-05-01T12:00:00Z
GROUP = MEMORY_GROUP
"""The deployment (group id) sample items belong to; a MemoryStore's by default."""


def make_dl(
    offset: int,
    *,
    topic: str = "orders",
    partition: int = 0,
    key: bytes | None = b"k",
    value: bytes | None = b"v",
    headers: Headers = (),
    reason: str = "ValueError: bad",
    attempts: int = 3,
    consumer_id: str = "worker-1",
    timestamp_ms: int = T0 - 5,
    at_ms: int = T0,
) -> DeadLetter:
    """A dead letter of `topic`/`partition` at `offset`: Kafka timestamp `timestamp_ms`,
    dead-lettered at `at_ms`."""
    record = Record(topic, partition, offset, key, value, headers, timestamp_ms)
    return DeadLetter(record, reason, attempts, consumer_id, at_ms)


def item(
    offset: int, *, status: str = "pending", group: str = GROUP, **fields: Any
) -> dict[str, Any]:
    """The table item of `make_dl(offset, **fields)` in deployment `group`, with `status`."""
    built = item_from_dead_letter(make_dl(offset, **fields), group)
    built["status"] = {"S": status}
    built[STATE_ATTR] = {"S": state_key(status, group)}
    return built
