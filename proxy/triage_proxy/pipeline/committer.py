"""The committer: commits the tracker's committable offset on an interval.

It commits when the committable offset advanced or, with `commit.encode_settled`,
when the set of offsets settled above it changed: that set rides along encoded in
the commit's metadata (and in a checkpoint item, see store/checkpoints.py) so a
restarted proxy does not redeliver it. When the encoding does not fit the broker's
metadata limit it commits the plain offset and counts the overflow; the checkpoint item
still records the set (up to settled.ITEM_LIMIT), so a restart or a partition move does
not redeliver it: with crash pills and suspects holding the commit, the set fragments
and outgrows the broker's 4 KB within a few thousand offsets.
The set includes what a previous run settled beyond this run's fetch so far
(`SettledAhead`): a restarted proxy's first commits must not shrink it to the part
the fetch has reached. A failed commit is retried on the next tick (the offset stays
uncommitted, so nothing is lost), and there is one final commit on shutdown.

The checkpoint item also carries the failed-delivery counts of the window (`attempts`,
from the dispatcher), so a crash-type pill's attempts survive a restart. When they
change the item is rewritten even if the committed offset did not move (a pill at the
head of the window holds the commit still), within the same once-a-second limit.

The limit gives way while the committed offset is held (a pill, a suspect waiting out
its redelivery backoff or a slow message at the head of the window): on a broker that
drops commit metadata the item is then all that records what settles above it, so once
CHECKPOINT_HELD_OFFSETS offsets settled there are not in it, it is written with the
next commit (policies.checkpoint_due), or at the next tick if nothing changed (the head
jumped onto a pill over offsets that had settled above it, and stopped). A burst does
not wait for the tick: between ticks the committer looks CHECKPOINT_POLLS times an
interval whether that many settled while the offset stood still (a count from the
tracker, O(1): `policies.held_burst`) and then writes the item at once with what a
commit would carry, without waiting for Kafka's commit (held, the item's committed
offset is Kafka's already; the commit follows at the tick). A kill -9 then redelivers
about what settled in one poll and one write, not in a whole commit interval (the fault
suite: a restarted proxy's instances settled 557 offsets in the 40 ms before the next
kill, at its 0.2 s interval). The write stays off the delivery path: the committer's own
task, one write at a time.

A partition that caught up does not wait for the tick either: once everything fetched
is settled (the dispatcher's `caught_up`) and at least EARLY_COMMIT_OFFSETS offsets
wait to be committed, or any wait after a commit that moved that many (the tail of the
burst: policies.early_commit_worth), the commit goes at once, at most
EARLY_COMMITS_PER_INTERVAL times an interval. The end of a burst is then committed
within a commit round trip instead of up to an interval later (bench_throughput: the
commit lag after the last ack was 123-228 ms at its 0.1 s interval, a tenth of the run);
a partition with a backlog never catches up, so it commits on the interval,
and a trickle commits early at most once per EARLY_COMMIT_OFFSETS offsets (and once
more right after a burst, for its tail).

What a kill -9 costs is bounded by the window (with the checkpoint item): the window
counts a record until a commit or a checkpoint write durably records it as settled
(policies.window_room). The committer tells the tracker, after each commit Kafka
acknowledged and each item written, how many of the run's records that record covers
(`CommitTracker.mark_durable`: the records below the committed offset for Kafka, every
record settled when the set was encoded for the item; Kafka's metadata is not counted,
since some brokers drop it), and then the dispatcher (`on_durable`), whose window may
take records again. When half the window waits for such a record (or a fetch is held
back for want of one), the dispatcher raises `durability` (policies.durability_due) and
the committer commits at once, and writes the item at
once too if the commit alone did not make room (a head held by a pill or a slow message:
only the item records what settled above it), past the interval and the limits above. A
round that recorded nothing more (a broker or table that refuses) is not repeated before
the next poll, so a refusing store is not asked in a loop.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Callable
from typing import Protocol

from triage_proxy.errors import BrokerUnavailable, TableUnavailable
from triage_proxy.kafka.client import KafkaThread, PartitionLog
from triage_proxy.pipeline.policies import checkpoint_due, early_commit_worth, held_burst
from triage_proxy.pipeline.settled import (
    ITEM_LIMIT,
    encode_attempts,
    encode_settled,
    kafka_metadata,
)
from triage_proxy.pipeline.tracker import CommitTracker
from triage_proxy.store.checkpoints import Checkpoint, CheckpointStore
from triage_proxy.waiting import wait_any

logger = logging.getLogger(__name__)

CHECKPOINT_INTERVAL_S = 1.0
"""Least time between checkpoint-item writes. A checkpoint that trails Kafka's commit is
still used (see app.py), so writing it on every fast commit would only cost DynamoDB
writes and proxy CPU (measured ~10% of no-op throughput at 10 commits/s)."""
CHECKPOINT_HELD_OFFSETS = 48
"""Offsets newly settled above a held committed offset that are worth a checkpoint write
before CHECKPOINT_INTERVAL_S is up (policies.checkpoint_due, held_burst). A write costs
the proxy about what a few hundred deliveries do, but every redelivery also runs a
handler again; a trickle (ten offsets a second) still waits out the interval. Half the
fault suite's in-flight window (3 instances x 32 credits): what a kill may redeliver is
this, what settles during one poll and one write, and what is in flight."""
CHECKPOINT_POLLS = 8
"""How often per commit interval the committer counts what settled above a held offset
(only while offsets are pending and the offset is held: an idle partition, or one whose
head moved past Kafka's committed offset, is not woken): every 25 ms at the
fault suite's 0.2 s, every 125 ms at the default 1 s. It is also the least time between
two such writes, so a burst costs at most this many times the commits of the interval
(the interval stays the operator's trade of cost against redeliveries)."""
EARLY_COMMIT_OFFSETS = 1024
"""Least offsets waiting for a commit that make a caught-up partition commit before the
tick: a trickle that catches up after every message commits early at most once per this
many offsets, and otherwise on the interval (bench_throughput: about 20 commits for its
200,000 messages at a 0.1 s interval, early ones included)."""
EARLY_COMMITS_PER_INTERVAL = 4
"""Most commits an interval may take from the start of the previous one, early ones
included: the operator's interval still bounds the commits a second (to 4x it)."""
TICK_SLACK_S = 1e-6
"""What is left of the interval after the polls counts as none (polls add float error:
waiting out 1e-13 s more would get nowhere on a clock at 1e4 s)."""


class FailureCounts(Protocol):
    """Where the failed-delivery counts come from (the dispatcher)."""

    @property
    def failures_version(self) -> int:
        """Moves whenever a count changed."""
        ...

    def failures(self) -> dict[int, int]:
        """Failed deliveries by offset of the unsettled records that failed."""
        ...


class SettledAhead(Protocol):
    """Where a previous run's settled offsets not fetched yet come from (the dispatcher)."""

    def settled_ahead(self) -> list[int]:
        """Sorted, all at or above the tracker's next offset."""
        ...


class Committer:
    """Owns the partition's committed offset as Kafka knows it."""

    def __init__(
        self,
        log: PartitionLog,
        thread: KafkaThread,
        tracker: CommitTracker,
        start_offset: int,
        interval_s: float,
        closing: asyncio.Event,
        *,
        checkpoints: CheckpointStore | None = None,
        attempts: FailureCounts | None = None,
        ahead: SettledAhead | None = None,
        caught_up: asyncio.Event | None = None,
        durability: asyncio.Event | None = None,
        on_durable: Callable[[], None] = lambda: None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """`caught_up`: set when everything fetched got settled (the dispatcher's; cleared
        here once looked at), the cue for an early commit; without it, commits go on the
        interval only. `durability`: set when the bounded window waits for a record of
        what settled (the dispatcher's; cleared here), the cue to commit and write the item
        at once; `on_durable` is called whenever the tracker's durable mark rose."""
        self._log = log
        self._thread = thread
        self._tracker = tracker
        self._interval_s = interval_s
        self._closing = closing
        self._checkpoints = checkpoints
        self._attempts = attempts
        """Their counts ride in the checkpoint item (only with `checkpoints`)."""
        self._ahead = ahead
        """A previous run's settled offsets beyond the fetch: they stay in the encoding."""
        self._caught_up = caught_up
        self._durability = durability
        self._on_durable = on_durable
        self._cue_quiet_until = -float("inf")
        """The durability cue is not taken before this (monotonic): its last round recorded
        nothing more."""
        self._monotonic = monotonic
        """The clock of the interval and the checkpoint interval (a test passes its own)."""
        self._attempted_at = -float("inf")
        """When the latest commit call started (monotonic): early commits keep their gap."""
        self.committed = start_offset
        """The last offset Kafka acknowledged as committed."""
        self._advanced = 0
        """How far the latest commit moved the offset: a large move makes its remainder
        worth an early commit (the tail of a burst)."""
        self.metadata: str | None = None
        """The settled-above encoding of the latest commit (None: none fitted even the
        item); Kafka got it as the commit's metadata only when it fitted DEFAULT_LIMIT."""
        self._record: tuple[str, list[int], int] | None = None
        """The newest settled-above record at the committed offset (the latest commit's
        encoding, or a newer one made for the item while the offset was held): its text,
        its offsets and how many of the run's records it records with the committed offset
        (every one settled when it was encoded; without an encoding, those below the
        offset). None until this run made one. The item is only ever written from it, so
        no write records less than an earlier one did."""
        self._encoded: list[int] = []
        """The offsets the latest `_encoding` holds (none when it did not fit)."""
        self._held = False
        """The latest tick left the offset where it was: its commit changed only the set
        above it, or nothing changed at all (a commit that moved the offset onto a pill
        leaves what settled above it to the next tick)."""
        self.degraded = False
        self.commits = 0
        self.metadata_overflows = 0
        """Commits made without the encoding in Kafka's metadata because it did not fit
        (the item may still hold it)."""
        self._checkpoint_degraded = False
        self._checkpoint_at = -CHECKPOINT_INTERVAL_S
        self._checkpoint_due = False
        """A Kafka commit or a failed-delivery count is not in the checkpoint item yet."""
        self._written: Checkpoint | None = None
        """What this run last wrote to the checkpoint item."""
        self._written_settled: list[int] = []
        """The settled-above offsets `_written` holds."""
        self._attempts_seen = 0
        """`failures_version` when the counts were last taken for a checkpoint."""
        self._settled_mark = 0
        """`_settled_count()` at the latest encoding: what settled since is in no record."""
        self.burst_writes = 0
        """Checkpoint writes made before the tick: a burst settled above a held offset."""
        self.early_commits = 0
        """Commits made before the tick because the partition caught up."""
        self.durability_commits = 0
        """Commits made before the tick because the bounded window waited for one."""

    async def run(self) -> None:
        poll_s = self._interval_s
        if self._checkpoints is not None:
            poll_s /= CHECKPOINT_POLLS
        while True:
            due = self._monotonic() + self._interval_s
            urgent = False
            while (left := due - self._monotonic()) > TICK_SLACK_S:
                if self._cue_taken():
                    urgent = True
                    break  # the bounded window waits for a commit: now
                # Only a held offset can make a burst due (`_held_burst`), and one that
                # moved past Kafka's stays moved until the next commit: a partition
                # moving along waits for the tick, not CHECKPOINT_POLLS times an interval
                # (16 partitions polled 1,280 times a second, each a multi-event wait).
                polling = (
                    poll_s < left
                    and self._tracker.pending > 0
                    and self._tracker.committable == self.committed
                )
                timeout = poll_s if polling else left
                events: tuple[asyncio.Event, ...] = (self._closing,)
                cue = self._durability
                if cue is not None and not self._cue_quiet():
                    events = (self._closing, cue)
                elif cue is not None:
                    timeout = min(timeout, self._cue_quiet_until - self._monotonic())
                early = self._early_in()
                if early is not None:
                    if early <= 0:
                        assert self._caught_up is not None
                        self._caught_up.clear()
                        self.early_commits += 1
                        break  # caught up: commit now
                    timeout = min(timeout, early)  # the cue stays set: not waited on
                elif self._caught_up is not None:
                    events = (*events, self._caught_up)
                await wait_any(*events, timeout=max(0.0, timeout))
                if self._closing.is_set():
                    logger.debug("committer stopped")
                    return
                if polling and self._held_burst():
                    # The item alone, at once: its committed offset is Kafka's already, and
                    # Kafka's commit (the first one of a run can take 100+ ms: the group
                    # coordinator is looked up) follows at the tick.
                    self._checkpoint_due = True
                    await self._flush_checkpoint(burst=True)
                    self.burst_writes += 1
            if urgent:
                await self._make_room()
            else:
                await self.commit()
            await self._flush_checkpoint()

    def _cue_quiet(self) -> bool:
        """Whether the durability cue is still kept off (with the tick's float slack: a
        wait of 1e-16 s is no wait on a clock at 2.363)."""
        return self._cue_quiet_until - self._monotonic() > TICK_SLACK_S

    def _cue_taken(self) -> bool:
        """Whether the durability cue is set and may be taken now (then it is cleared)."""
        cue = self._durability
        if cue is None or not cue.is_set() or self._cue_quiet():
            return False
        cue.clear()
        return True

    async def _make_room(self) -> None:
        """The bounded window waits for a record of what settled: commit now, and write
        the item now if the window still waits (what settled above a held offset). A round
        that recorded nothing of what waited (the broker or the table refused) keeps the
        cue off for an interval: a frozen store is not asked in a loop. One that found
        nothing waiting (the tick had just recorded it) does not: quieted, the next cue
        waited for the tick too, and so on, a window per interval."""
        before = self._tracker.durable
        waiting = self._tracker.settled > before
        self.durability_commits += 1
        await self.commit()
        self._on_durable()  # the window looks again: is it still waiting?
        cue = self._durability
        if cue is not None and cue.is_set() and self._checkpoints is not None:
            cue.clear()
            self._checkpoint_due = True
            await self._flush_checkpoint(force=True, burst=True)
        if waiting and self._tracker.durable == before:
            self._cue_quiet_until = self._monotonic() + self._interval_s

    def _early_in(self) -> float | None:
        """Seconds until an early commit may go (<= 0: now), None while none is due: the
        partition has not caught up, or too few offsets wait (then the tick commits them)."""
        cue = self._caught_up
        if cue is None or not cue.is_set():
            return None
        tracker = self._tracker
        if tracker.pending or not early_commit_worth(
            waiting=tracker.committable - self.committed,
            previous_advance=self._advanced,
            least=EARLY_COMMIT_OFFSETS,
        ):
            cue.clear()  # seen; the next catch-up sets it again
            return None
        gap = self._interval_s / EARLY_COMMITS_PER_INTERVAL
        return self._attempted_at + gap - self._monotonic()

    def _settled_count(self) -> int:
        """Offsets the tracker settled so far, give or take a constant (O(1)): every fetched
        offset is tracked, so whatever is not pending any more settled."""
        return self._tracker.next_offset - self._tracker.pending

    def _held_burst(self) -> bool:
        """Whether a checkpoint write is due before the tick (held_burst)."""
        return held_burst(
            held=self._tracker.committable == self.committed,
            newly_settled=self._settled_count() - self._settled_mark,
            recording=not self._checkpoint_degraded,
            held_offsets=CHECKPOINT_HELD_OFFSETS,
        )

    def _item_settled(self) -> tuple[str, list[int], int] | None:
        """The settled-above text (and offsets) for the checkpoint item now, and how many of
        the run's records it records with the committed offset: while the offset is held
        and more settled since the latest encoding, what a commit now would carry (its
        committed offset is Kafka's already, so it holds as is; it records every record
        settled now); else the newest record (`_record`), never the latest commit's when
        the item was written since with more (that rewrite let a kill redeliver what the
        window took as recorded: twice the window in the fault suite)."""
        if (
            self._tracker.committable == self.committed
            and self._settled_count() != self._settled_mark
        ):
            settled = self._tracker.settled
            text = self._encoding(self.committed, count_overflow=False)
            if text is not None:
                self._record = (text, self._encoded, settled)
        return self._record

    def _encoding(self, offset: int, *, count_overflow: bool = True) -> str | None:
        if self._checkpoints is None:
            return None
        self._settled_mark = self._settled_count()
        settled = self._tracker.settled_above()
        if self._ahead is not None and (ahead := self._ahead.settled_ahead()):
            # Above every tracked offset; the first may be the committable offset itself.
            settled += ahead[1:] if ahead[0] <= offset else ahead
        self._encoded = []
        if not settled:
            return ""
        text = encode_settled(offset, settled, limit=ITEM_LIMIT)
        if kafka_metadata(text) is None:
            self.metadata_overflows += count_overflow
        if text is not None:
            self._encoded = settled
        return text

    async def commit(self) -> bool:
        """Commit if anything changed; False if the broker refused."""
        tracker = self._tracker
        offset = tracker.committable
        settled, below = tracker.settled, tracker.below()
        metadata = self._encoding(offset)
        if offset < self.committed or (offset == self.committed and metadata == self.metadata):
            # Nothing settled for a tick: the offset is held, though the commit before this
            # tick moved it (the head jumped onto a pill over what settled above it).
            self._held = True
            if self._closing.is_set():  # the last chance for changed counts
                await self._flush_checkpoint(force=True)
            return True
        self._attempted_at = self._monotonic()
        try:
            await self._thread.run(self._log.commit, offset, kafka_metadata(metadata))
        except BrokerUnavailable as exc:
            if not self.degraded:
                logger.warning("degraded: commit of %d failed (%s); will retry", offset, exc)
                self.degraded = True
            return False
        if self.degraded:
            logger.info("recovered: committed offset %d", offset)
            self.degraded = False
        self._held = offset == self.committed
        self._advanced = offset - self.committed
        self.committed, self.metadata = offset, metadata
        # Encoded, the text records every record settled then; else only those below the
        # offset. Only the offset counts as durable at once (some brokers drop metadata):
        # the item, once written with this text, records the rest (`_flush_checkpoint`).
        self._record = (metadata or "", self._encoded, settled if metadata is not None else below)
        self._mark_durable(below)
        self.commits += 1
        if self._checkpoints is not None:
            self._checkpoint_due = True
            await self._flush_checkpoint(force=self._closing.is_set())
        return True

    async def _flush_checkpoint(self, *, force: bool = False, burst: bool = False) -> None:
        """Write the checkpoint if something is due and `checkpoint_due` says so (or
        `force`). Only after this run's first commit (until then the item still holds the
        previous run's settled-above set), or in a `burst` above the held offset (what it
        writes then holds that set: the part fetched settled in the tracker, the rest
        `settled_ahead`)."""
        if self._checkpoints is None or not (self.commits or burst):
            return
        attempts = self._attempts
        if attempts is not None and attempts.failures_version != self._attempts_seen:
            self._checkpoint_due = True
        now = self._monotonic()
        if not self._checkpoint_due:
            return
        written = self._written
        # After a failed write, only the interval: a frozen table is not asked 5x a second.
        held = (self._held or burst) and written is not None and not self._checkpoint_degraded
        record = self._item_settled()
        if record is None:
            return  # nothing of this run's yet: the item keeps the previous run's record
        text, settled, records = record
        # Settled above the committed offset, not in the item (which has what it had then).
        saved = self._written_settled
        unsaved = len(settled) - (len(saved) - bisect.bisect_right(saved, self.committed))
        if not force and not checkpoint_due(
            now - self._checkpoint_at,
            held=held,
            unsaved=unsaved,
            interval_s=CHECKPOINT_INTERVAL_S,
            held_offsets=CHECKPOINT_HELD_OFFSETS,
        ):
            return
        self._checkpoint_due = False
        counts = ""
        if attempts is not None:
            self._attempts_seen = attempts.failures_version
            counts = encode_attempts(self.committed, attempts.failures())
        checkpoint = Checkpoint(self.committed, text, counts)
        if checkpoint == written:
            return
        self._checkpoint_at = now
        if await self._write_checkpoint(checkpoint):
            self._written_settled = settled
            self._mark_durable(records)
            logger.debug(
                "checkpoint written: committed %d, %d offsets settled above it%s",
                checkpoint.committed,
                len(settled),
                " (held)" if held and unsaved >= CHECKPOINT_HELD_OFFSETS else "",
            )

    def _mark_durable(self, records: int) -> None:
        """`records` of the run's records are durably recorded as settled now."""
        if records > self._tracker.durable:
            self._tracker.mark_durable(records)
            self._on_durable()

    async def _write_checkpoint(self, checkpoint: Checkpoint) -> bool:
        """Best effort: a missing or stale checkpoint only means more redeliveries (and a
        crash-type pill's attempts counted again from where it last was written). False
        if the table refused it."""
        assert self._checkpoints is not None
        try:
            await asyncio.to_thread(
                self._checkpoints.put,
                checkpoint.committed,
                checkpoint.settled,
                checkpoint.attempts,
            )
        except TableUnavailable as exc:
            self._checkpoint_due = True  # again after the interval
            if not self._checkpoint_degraded:
                logger.warning("commit checkpoint not written (%s); will retry", exc)
                self._checkpoint_degraded = True
            return False
        self._written = checkpoint
        self._checkpoint_degraded = False
        return True
