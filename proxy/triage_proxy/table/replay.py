"""Replaying dead letters: claim -> produce -> confirm -> mark.

Why a module of its own: `triage dlq replay` and the Spark job must replay the same
way, or a rerun of one after the other would replay twice.

A replay first claims each item (`query.DeadLetterTable.claim`), so two replays running
at once never both produce it. It marks the item `replayed` only after the producer's
delivery callback confirmed the message, and only while it still holds the claim, so
a rerun skips it. When delivery failed in a way that means the broker never took it
(still queued, unknown topic, too large), the claim is released and a rerun tries
again. When the outcome is unknown (timed out or purged in flight) the claim is kept:
the item is skipped until the claim goes stale (`DEFAULT_CLAIM_LEASE_S`), after which a
rerun may replay it once more. That, and a crash between a confirmed delivery and the
mark, are the only ways an item can be produced twice; the `triage-replay-of` header
lets a consumer drop such a duplicate.
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from triage_proxy.errors import DeadLetterUnavailable
from triage_proxy.structs import DeadLetter
from triage_proxy.table.items import STATUS_PENDING, DeadLetterKey, item_key
from triage_proxy.table.query import DeadLetterTable

logger = logging.getLogger(__name__)

REPLAY_OF_HEADER = "triage-replay-of"
"""Provenance header: "<topic>/<partition>/<offset>" of the dead letter replayed."""
REPLAY_REASON_HEADER = "triage-replay-reason"
"""Provenance header: the reason the message was dead-lettered (UTF-8)."""
REPLAY_ID_HEADER = "triage-replay-id"
"""Provenance header: the id of the replay run that produced this copy."""
DEFAULT_CLAIM_LEASE_S = 900.0
"""How long a replay's claim keeps other replays off an item it has not marked yet."""
DEFAULT_REPLAY_CHUNK = 500
"""Items claimed, produced and confirmed together by `replay`."""
DEFAULT_FLUSH_TIMEOUT_S = 30.0
"""How long `replay` waits for the broker to confirm one chunk."""

# delivery errors after which the broker may hold the message: keep the claim
_MAYBE_DELIVERED = {"_MSG_TIMED_OUT", "_PURGE_INFLIGHT", "_TIMED_OUT", "REQUEST_TIMED_OUT"}


def new_replay_id() -> str:
    """A fresh id for one replay run (goes into items and headers)."""
    return uuid.uuid4().hex


def provenance_headers(dl: DeadLetter, replay_id: str) -> list[tuple[str, bytes]]:
    """The headers a replayed copy carries in addition to the original ones."""
    record = dl.record
    return [
        (REPLAY_OF_HEADER, f"{record.topic}/{record.partition}/{record.offset}".encode()),
        (REPLAY_REASON_HEADER, dl.reason.encode("utf-8", "surrogateescape")),
        (REPLAY_ID_HEADER, replay_id.encode()),
    ]


def replay_headers(dl: DeadLetter, replay_id: str) -> list[tuple[str, bytes | None]]:
    """Original headers (order, duplicates and nulls kept), then the provenance headers."""
    return [*dl.record.headers, *provenance_headers(dl, replay_id)]


# --- replay ---------------------------------------------------------------------------


class Producer(Protocol):
    """The part of confluent_kafka.Producer that replay uses."""

    def produce(self, topic: str, **kwargs: Any) -> None: ...

    def poll(self, timeout: float) -> int: ...

    def flush(self, timeout: float) -> int: ...

    def purge(
        self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True
    ) -> None: ...


@dataclass
class ReplayResult:
    """What one `replay` call did, item by item."""

    replayed: list[DeadLetterKey] = field(default_factory=list)
    """Produced, confirmed by the broker and marked `replayed`."""
    skipped: list[tuple[DeadLetterKey, str]] = field(default_factory=list)
    """Not produced: no longer pending, or claimed by another live replay."""
    failed: list[tuple[DeadLetterKey, str]] = field(default_factory=list)
    """Not confirmed: the delivery failed or its outcome is unknown (see `why`)."""
    interrupted: bool = False
    """True when `stop` ended the run before every selected item was tried."""

    def merge(self, other: ReplayResult) -> None:
        self.replayed.extend(other.replayed)
        self.skipped.extend(other.skipped)
        self.failed.extend(other.failed)
        self.interrupted = self.interrupted or other.interrupted


def replay(
    table: DeadLetterTable,
    producer: Producer,
    items: Iterable[Mapping[str, Any]],
    *,
    replay_id: str,
    to_topic: str | None = None,
    chunk: int = DEFAULT_REPLAY_CHUNK,
    flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S,
    lease_s: float = DEFAULT_CLAIM_LEASE_S,
    stop: threading.Event | None = None,
) -> ReplayResult:
    """Produce the dead letters of `items` again and mark them replayed; see the module
    docstring for the claim/confirm/mark protocol that makes reruns and concurrent
    runs safe.

    Each copy has the original key, value and headers plus the provenance headers. It
    goes to `to_topic` (chosen there by the producer's partitioner) or, by default, back
    to the partition it came from. `items` are low-level items (e.g. from
    `table.scan(..., consistent=True)`); items that are not pending are skipped.
    `stop` is checked between chunks. Raises DeadLetterUnavailable if the table stops
    answering (claims already taken then expire after `lease_s`).
    """
    result = ReplayResult()
    iterator = iter(items)
    while True:
        if stop is not None and stop.is_set():
            result.interrupted = next(iterator, None) is not None
            return result
        batch = list(itertools.islice(iterator, chunk))
        if not batch:
            return result
        result.merge(
            _replay_chunk(table, producer, batch, replay_id, to_topic, flush_timeout_s, lease_s)
        )


def _replay_chunk(
    table: DeadLetterTable,
    producer: Producer,
    batch: list[Mapping[str, Any]],
    replay_id: str,
    to_topic: str | None,
    flush_timeout_s: float,
    lease_s: float,
) -> ReplayResult:
    result = ReplayResult()
    claimed: list[tuple[DeadLetterKey, Mapping[str, Any], DeadLetter]] = []
    for item in batch:
        key = item_key(item)
        status = item["status"]["S"]
        if status != STATUS_PENDING:
            result.skipped.append((key, f"status is {status}"))
            continue
        if not table.claim(key, replay_id, lease_s=lease_s):
            result.skipped.append((key, "no longer pending, or another replay holds it"))
            continue
        try:
            dl = table.load(item)
        except (ValueError, DeadLetterUnavailable) as exc:
            table.release(key, replay_id)
            result.failed.append((key, f"payload unreadable: {exc}"))
            continue
        claimed.append((key, item, dl))
    outcomes: dict[DeadLetterKey, Any] = {}

    def on_delivery(key: DeadLetterKey) -> Callable[[Any, Any], None]:
        def record(err: Any, msg: Any) -> None:
            outcomes[key] = err

        return record

    for key, _, dl in claimed:
        record = dl.record
        kwargs: dict[str, Any] = {
            "key": record.key,
            "value": record.value,
            "headers": replay_headers(dl, replay_id),
            "on_delivery": on_delivery(key),
        }
        if to_topic is None or to_topic == record.topic:
            kwargs["partition"] = record.partition
        while True:
            try:
                producer.produce(to_topic or record.topic, **kwargs)
                break
            except BufferError:
                producer.poll(0.1)
    if claimed and producer.flush(flush_timeout_s) > 0:
        producer.purge(in_queue=True, in_flight=True, blocking=True)
        producer.poll(0)
    for key, item, dl in claimed:
        target = to_topic or dl.record.topic
        if key not in outcomes:
            result.failed.append((key, "delivery not confirmed; claim kept until it expires"))
            continue
        err = outcomes[key]
        if err is not None:
            name = str(getattr(err, "name", lambda: "")() or err)
            if name in _MAYBE_DELIVERED:
                result.failed.append((key, f"{name}: outcome unknown; claim kept until it expires"))
            else:
                table.release(key, replay_id)
                result.failed.append((key, f"delivery failed: {err}"))
            continue
        if table.mark_replayed(key, replay_id, target, item):
            result.replayed.append(key)
        else:
            logger.warning(
                "%s/%d/%d was produced but its claim was lost before it was marked; "
                "it may be replayed again",
                *key,
            )
            result.failed.append((key, "produced, but the claim was lost before marking"))
    return result
