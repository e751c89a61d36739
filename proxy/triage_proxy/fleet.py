"""Fleet membership: a process serving the partitions its consumer group assigns it.

What differs from pinned partitions (pinned.py): the process listens at once (it
answers Topology, and tells a Hello for a partition it does not serve where that
partition is served), then joins the deployment's consumer group (exit 3 when its
coordinator cannot be reached). It starts a pipeline for each partition the group
gives it and drains the ones taken away (assignment.py says when); its pipelines
commit as the group's member (`MemberCommits`). A lost lease ends only that pipeline:
it waits as a standby again while the partition is still assigned here. Leaving the
group is the last step of the shutdown, once every pipeline released its lease, so
the other members take the partitions over at once.

    listen -> join the group -> follow the assignment until stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from triage_proxy.config.settings import Settings
from triage_proxy.errors import OwnershipLost
from triage_proxy.kafka.assignment import Assignment, MemberCommits, Membership
from triage_proxy.kafka.client import PartitionLog
from triage_proxy.pipeline.partition import PartitionPipeline
from triage_proxy.waiting import wait_any

logger = logging.getLogger(__name__)


class FleetMembership:
    """The group membership of a fleet process, and how it follows the assignment."""

    def __init__(self, settings: Settings, owner: str, membership: Membership | None) -> None:
        self._settings = settings
        self._owner = owner
        self.membership = membership
        """The group membership (made by `join` when not injected)."""

    def wanted(self) -> frozenset[int]:
        if self.membership is None:
            return frozenset()
        return self.membership.target()

    @property
    def joined(self) -> bool:
        return self.membership is not None and self.membership.joined

    @property
    def member(self) -> bool:
        """Holds the group's current assignment (False from a lost session until the next)."""
        return self.membership is not None and self.membership.member

    async def join(self, stack: contextlib.AsyncExitStack) -> Membership:
        """Join the deployment's consumer group; it is left as `stack` unwinds."""
        membership = self.membership
        if membership is None:
            membership = self.membership = Assignment(self._settings.kafka, self._owner)
        await membership.start()
        stack.push_async_callback(membership.stop)
        return membership

    def log_for(self, log: PartitionLog, partition: int) -> PartitionLog:
        """`log`, committing as the group's member."""
        assert self.membership is not None
        return MemberCommits(log, self.membership, partition)

    async def partition_count(self) -> int:
        assert self.membership is not None
        return await self.membership.partition_count()

    async def follow(
        self,
        pipelines: dict[int, PartitionPipeline],
        launch: Callable[[int], PartitionPipeline],
        closing: asyncio.Event,
    ) -> None:
        """Start a pipeline for each partition the group gives this process, drain the
        ones it takes away (see assignment.py for when), until `closing` is set."""
        membership = self.membership
        assert membership is not None
        while not closing.is_set():
            wanted = membership.target()
            for partition, pipeline in list(pipelines.items()):
                if partition not in wanted and not pipeline.stopping:
                    logger.info("partition %d is no longer assigned here: draining it", partition)
                    pipeline.stop()
            for partition in sorted(wanted - set(pipelines)):
                logger.info("partition %d assigned here: taking its lease", partition)
                launch(partition)
            await wait_any(membership.changed, closing, timeout=membership.next_decision_in())
            membership.changed.clear()

    def pipeline_ended(self) -> None:
        """A pipeline ended: look at the assignment again (still assigned here? then it
        waits as a standby)."""
        if self.membership is not None:
            self.membership.changed.set()

    def lost(self, pipeline: PartitionPipeline, exc: OwnershipLost) -> bool:
        """A lost lease ends only that pipeline (False: the process goes on)."""
        logger.warning("partition %d: %s", pipeline.partition, exc)
        return False
