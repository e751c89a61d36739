"""The commit checkpoint item: where the settled-above-committed set survives a restart
besides Kafka.

The encoding (`triage_proxy.pipeline.settled`) rides in the commit's metadata, which Apache
Kafka, MSK, Confluent Cloud and Redpanda keep. Some brokers drop it: Tansu 0.6 (the
embedded broker) accepts a commit's metadata and returns null on fetch. So the
committer also writes the same text, tagged with the committed offset it belongs to,
to one item of the table after a Kafka commit, at most once a second (sooner while
the committed offset is held, see `triage_proxy.pipeline.committer`). A restarting
proxy uses it unless it is newer than Kafka's committed offset (the group was rewound);
when it trails Kafka by a commit, the offsets below Kafka's commit are dropped from it
(they are settled anyway). An operator who rewinds a group should delete the item.

The item also carries the failed-delivery counts of the window's messages
(`triage_proxy.pipeline.settled.encode_attempts`), so a crash-type pill's attempts survive a
restart; the committer rewrites it when they change even if the committed offset did not.
Items written before the counts existed have none: they decode as no counts.

Item: `source` = `checkpoint_source(topic, partition, group)`, `offset` =
`CHECKPOINT_OFFSET` (-1; see the package docstring), `committed` (N), `settled` (S),
`attempts` (S, left out when empty), `updated_at` (S). Failures raise `TableUnavailable`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.errors import TableUnavailable
from triage_proxy.store.aws import aws_errors, dynamodb_client
from triage_proxy.store.items import CHECKPOINT_OFFSET, checkpoint_source, table_key


@dataclass(frozen=True)
class Checkpoint:
    """What the checkpoint item holds."""

    committed: int
    """The Kafka commit it was written after."""
    settled: str
    """Offsets settled above `committed` (`encode_settled`; "" for none)."""
    attempts: str = ""
    """Failed-delivery counts (`encode_attempts`; "" for none, or an older item)."""


class CheckpointStore(Protocol):
    """Sync; called from a worker thread. Raises TableUnavailable when unreachable."""

    def put(self, committed: int, settled: str, attempts: str = "") -> None: ...

    def get(self) -> Checkpoint | None: ...

    def close(self) -> None: ...


class DynamoDBCheckpoints:
    """One item per (topic, partition, group) in the table."""

    def __init__(
        self, settings: DeadLetterSettings, topic: str, partition: int, group: str
    ) -> None:
        self._table = settings.table
        self._key = table_key(checkpoint_source(topic, partition, group), CHECKPOINT_OFFSET)
        # Short timeouts and one attempt: commits wait for this write, and a missing
        # checkpoint only costs redeliveries, so DynamoDB trouble must not stall them.
        self._client = dynamodb_client(
            settings, connect_timeout_s=1.0, read_timeout_s=1.0, max_attempts=1
        )

    def put(self, committed: int, settled: str, attempts: str = "") -> None:
        item = {
            **self._key,
            "committed": {"N": str(committed)},
            "settled": {"S": settled},
            "updated_at": {"S": datetime.now(UTC).isoformat()},
        }
        if attempts:
            item["attempts"] = {"S": attempts}
        with aws_errors("writing the commit checkpoint", TableUnavailable):
            self._client.put_item(TableName=self._table, Item=item)

    def get(self) -> Checkpoint | None:
        with aws_errors("reading the commit checkpoint", TableUnavailable):
            found = self._client.get_item(TableName=self._table, Key=self._key, ConsistentRead=True)
        item = found.get("Item")
        if item is None:
            return None
        return Checkpoint(
            int(item["committed"]["N"]),
            item["settled"]["S"],
            item.get("attempts", {}).get("S", ""),
        )

    def close(self) -> None:
        self._client.close()


class MemoryCheckpoints:
    """In-memory twin for unit tests."""

    def __init__(self) -> None:
        self.value: tuple[int, str] | None = None
        """(committed, settled) as last written."""
        self.attempts = ""
        """The failed-delivery counts last written."""
        self.puts = 0
        self._lock = threading.Lock()

    def put(self, committed: int, settled: str, attempts: str = "") -> None:
        with self._lock:
            self.value = (committed, settled)
            self.attempts = attempts
            self.puts += 1

    def get(self) -> Checkpoint | None:
        with self._lock:
            if self.value is None:
                return None
            return Checkpoint(*self.value, self.attempts)

    def close(self) -> None:
        pass
