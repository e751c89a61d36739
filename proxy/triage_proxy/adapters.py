"""What each partition's pipeline talks to: its Kafka log, its lease item and its
checkpoint item, and what the process shares (the dead-letter store, every partition's
lease for Topology), built for real or taken from the twins a test injects.

One place decides it, so `Proxy` keeps only the process's lifecycle: a process that may
serve several partitions reads them all through one Kafka Consumer (kafka/reader.py,
set as `reader` by the proxy before any pipeline starts); a one-partition process's
pipeline opens its own. In fleet mode the log commits as the group's member.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from triage_proxy.config.settings import Settings
from triage_proxy.kafka.client import ConfluentPartition, PartitionLog
from triage_proxy.kafka.groups import GroupFence
from triage_proxy.kafka.reader import Reader, ReaderPartition
from triage_proxy.pipeline.partition import PartitionParts
from triage_proxy.store.checkpoints import CheckpointStore, DynamoDBCheckpoints
from triage_proxy.store.deadletter_store import DeadLetterStore, DynamoDBStore
from triage_proxy.store.leases import (
    DynamoDBLeaseReader,
    DynamoDBLeases,
    LeaseReader,
    LeaseStore,
    MemoryLeaseReader,
)
from triage_proxy.store.migrate import LegacyCheck
from triage_proxy.store.query import DeadLetterTable

if TYPE_CHECKING:
    from triage_proxy.fleet import FleetMembership

__all__ = ["Adapters", "PartsFactory"]

PartsFactory = Callable[[int], PartitionParts]
"""What a pipeline for partition p talks to (tests pass twins)."""


class Adapters:
    """Builds each partition's `PartitionParts` (closed by the pipeline that gets them)."""

    def __init__(
        self,
        settings: Settings,
        fleet: FleetMembership | None,
        *,
        log: PartitionLog | None = None,
        leases: LeaseStore | None = None,
        checkpoints: CheckpointStore | None = None,
        parts: PartsFactory | None = None,
        store: DeadLetterStore | None = None,
        lease_reader: LeaseReader | None = None,
    ) -> None:
        self._settings = settings
        self._fleet = fleet
        self._log = log
        self._leases = leases
        self._checkpoints = checkpoints
        """Injected (single-partition) twins are the caller's to close; the ones made here
        are closed by the pipeline."""
        self._parts = parts
        self._store = store
        self._lease_reader = lease_reader
        """Every partition's lease, for Topology; with `leases` injected and this not,
        only that store is read (a twin's world)."""
        self.reader: Reader | None = None
        """The process's one Kafka Consumer, when it may serve several partitions."""
        self._fence: GroupFence | None = None
        """The group fence every pinned partition asks: the group is the process's, and so
        is the one admin client that asks."""

    @property
    def real(self) -> bool:
        """Whether Kafka is reached for real (no twin log, no injected parts)."""
        return self._log is None and self._parts is None

    def open_store(
        self, stack: contextlib.ExitStack | contextlib.AsyncExitStack
    ) -> tuple[DeadLetterStore, LegacyCheck | None]:
        """The dead-letter store every pipeline writes to, and the look for legacy dead
        letters (None with an injected store); what is made here `stack` closes."""
        if self._store is not None:
            return self._store, None
        settings = self._settings
        group = settings.kafka.group_id
        store = DynamoDBStore(settings.dead_letters, group=group)
        stack.callback(store.close)
        view = DeadLetterTable(settings.dead_letters, group=group)
        stack.callback(view.close)
        return store, LegacyCheck(view, settings.kafka.topic)

    def open_lease_reader(
        self,
        stack: contextlib.ExitStack | contextlib.AsyncExitStack,
        pins: Sequence[int] | None,
    ) -> LeaseReader | None:
        """Every partition's lease, for Topology (None with ownership off)."""
        settings = self._settings
        reader = self._lease_reader
        if settings.ownership.enabled and reader is None:
            if self._leases is not None and pins:
                reader = MemoryLeaseReader({pins[0]: self._leases})
            else:
                reader = DynamoDBLeaseReader(
                    settings.dead_letters, settings.kafka.topic, settings.kafka.group_id
                )
                stack.callback(reader.close)
        return reader

    def for_partition(self, partition: int) -> PartitionParts:
        """The real adapters of `partition` (or the injected twins)."""
        if self._parts is not None:
            return self._parts(partition)
        settings = self._settings
        made: list[Callable[[], None]] = []
        read = None
        if self._log is not None:
            log = self._log
        else:
            log, read = self._new_log(partition)
        leases = None
        if settings.ownership.enabled:
            leases = self._leases
            if leases is None:
                leases = DynamoDBLeases(
                    settings.dead_letters, settings.kafka.topic, partition, settings.kafka.group_id
                )
                made.append(leases.close)
        fence = None
        if leases is not None and self._fleet is None and self._log is None:
            # A pinned process is no member of the group: it yields to the group's live
            # members, whatever their table (kafka/groups.py).
            if self._fence is None:
                self._fence = GroupFence(settings.kafka)
            fence = self._fence.busy
        checkpoints = self._checkpoints
        if checkpoints is None and settings.commit.encode_settled:
            checkpoints = DynamoDBCheckpoints(
                settings.dead_letters, settings.kafka.topic, partition, settings.kafka.group_id
            )
            made.append(checkpoints.close)

        def close() -> None:
            for fn in made:
                fn()

        return PartitionParts(
            log,
            checkpoints,
            leases,
            close,
            buffered=None if read is None else read.take_buffered,
            arm=None if read is None else read.arm,
            fence=fence,
        )

    def _new_log(self, partition: int) -> tuple[PartitionLog, ReaderPartition | None]:
        """The partition's log, and the process's reader for it, which holds its already
        fetched records (None for a log of its own)."""
        log: PartitionLog
        read = None
        if self.reader is not None:
            log = read = self.reader.partition(partition)  # the process's one Consumer
        else:
            log = ConfluentPartition(self._settings.kafka, partition)
        if self._fleet is not None:
            log = self._fleet.log_for(log, partition)  # commits as the group's member
        return log, read
