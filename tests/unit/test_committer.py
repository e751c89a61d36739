"""The committer against in-memory twins on a virtual clock: no broker, no real waiting.

The commit tracker is the real one (pure); the partition, the Kafka thread and the
checkpoint store are twins (tests/unit/twins.py). The committer's checkpoint clock is
the loop's virtual clock, so "at most once a second" is measured, not slept through.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass

import pytest

from tests.unit.twins import KAFKA_CALL_S, FlakyPartition, InlineKafkaThread, TimedCheckpoints
from tests.unit.virtual_time import gaps, run, until
from triage_proxy.errors import TableUnavailable
from triage_proxy.pipeline import committer as committer_module
from triage_proxy.pipeline.committer import (
    CHECKPOINT_HELD_OFFSETS,
    CHECKPOINT_INTERVAL_S,
    CHECKPOINT_POLLS,
    EARLY_COMMIT_OFFSETS,
    EARLY_COMMITS_PER_INTERVAL,
    Committer,
)
from triage_proxy.pipeline.settled import (
    DEFAULT_LIMIT,
    ITEM_LIMIT,
    decode_attempts,
    decode_settled,
    encode_settled,
)
from triage_proxy.pipeline.tracker import CommitTracker

INTERVAL_S = 1.0


@dataclass
class Rig:
    partition: FlakyPartition
    tracker: CommitTracker
    committer: Committer
    closing: asyncio.Event
    checkpoints: TimedCheckpoints | None
    task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.committer.run())

    async def stop(self) -> None:
        """Stop the loop as the proxy does, then make its final commit."""
        self.closing.set()
        if self.task is not None:
            async with asyncio.timeout(KAFKA_CALL_S * 3):  # no interval waited out
                await self.task
        await self.committer.commit()


class Counts:
    """The dispatcher's failed-delivery counts, set by hand (committer.FailureCounts)."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.failures_version = 0

    def fail(self, offset: int) -> None:
        self.counts[offset] = self.counts.get(offset, 0) + 1
        self.failures_version += 1

    def failures(self) -> dict[int, int]:
        return dict(self.counts)


class Ahead:
    """A previous run's settled offsets the fetch has not reached (committer.SettledAhead)."""

    def __init__(self, offsets: list[int]) -> None:
        self.offsets = offsets

    def settled_ahead(self) -> list[int]:
        return list(self.offsets)


def make(
    *,
    tracked: int = 100,
    interval_s: float = INTERVAL_S,
    encode_settled: bool = False,
    attempts: Counts | None = None,
    ahead: Ahead | None = None,
    caught_up: asyncio.Event | None = None,
) -> Rig:
    loop = asyncio.get_running_loop()
    partition = FlakyPartition(loop.time)
    tracker = CommitTracker(0)
    for offset in range(tracked):
        tracker.track(offset)
    checkpoints = TimedCheckpoints(loop.time) if encode_settled else None
    closing = asyncio.Event()
    committer = Committer(
        partition,
        InlineKafkaThread(),
        tracker,
        0,
        interval_s,
        closing,
        checkpoints=checkpoints,
        attempts=attempts,
        ahead=ahead,
        caught_up=caught_up,
        monotonic=loop.time,
    )
    return Rig(partition, tracker, committer, closing, checkpoints)


def settle(tracker: CommitTracker, *offsets: int) -> None:
    for offset in offsets:
        tracker.settle(offset)


def test_commits_the_committable_offset_each_interval_and_only_when_it_moved() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        rig = make()
        settle(rig.tracker, 0, 1, 2, 5)  # committable 3 (4 is pending)
        rig.start()
        await asyncio.sleep(INTERVAL_S / 2)
        assert rig.partition.commits == []  # nothing before the first interval
        await until(lambda: rig.partition.commits)
        assert rig.partition.commits == [(3, None)]
        assert rig.partition.commit_times == [pytest.approx(INTERVAL_S + KAFKA_CALL_S)]
        assert (rig.committer.committed, rig.committer.commits) == (3, 1)

        await asyncio.sleep(5 * INTERVAL_S)  # unchanged: no commit at all
        assert rig.partition.commits == [(3, None)]

        settle(rig.tracker, 3, 4, 6)
        settled_at = loop.time()
        await until(lambda: len(rig.partition.commits) == 2)
        assert rig.partition.commits[-1] == (7, None)
        assert 0 < rig.partition.commit_times[-1] - settled_at <= INTERVAL_S + KAFKA_CALL_S
        await rig.stop()
        assert rig.partition.commits == [(3, None), (7, None)]  # final commit: nothing new

    run(main())


def test_a_partition_that_caught_up_commits_at_once_within_its_gap() -> None:
    """Everything fetched settled and enough offsets wait: the commit goes before the
    tick, and early commits keep EARLY_COMMITS_PER_INTERVAL a interval at most."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        caught_up = asyncio.Event()
        burst = 3 * EARLY_COMMIT_OFFSETS
        rig = make(tracked=burst, caught_up=caught_up)
        rig.start()
        await asyncio.sleep(INTERVAL_S / 10)
        settle(rig.tracker, *range(burst - 1))  # one left pending: not caught up
        await asyncio.sleep(INTERVAL_S / 10)
        assert rig.partition.commits == []
        rig.tracker.settle(burst - 1)
        caught_up.set()  # as the dispatcher does once nothing is pending
        settled_at = loop.time()
        await until(lambda: rig.partition.commits)
        assert rig.partition.commits == [(burst, None)]
        assert rig.partition.commit_times[0] - settled_at <= 2 * KAFKA_CALL_S
        assert rig.committer.early_commits == 1

        # A second burst right after: it waits out the gap, not the interval.
        caught_up.clear()
        for offset in range(burst, 2 * burst):
            rig.tracker.track(offset)
        settle(rig.tracker, *range(burst, 2 * burst))
        caught_up.set()
        await until(lambda: len(rig.partition.commits) == 2)
        assert rig.partition.commits[-1] == (2 * burst, None)
        gap = gaps(rig.partition.commit_times)[0]
        assert INTERVAL_S / EARLY_COMMITS_PER_INTERVAL <= gap + KAFKA_CALL_S < INTERVAL_S / 2
        await rig.stop()

    run(main())


def test_a_caught_up_trickle_below_the_early_threshold_commits_on_the_interval() -> None:
    async def main() -> None:
        caught_up = asyncio.Event()
        rig = make(tracked=EARLY_COMMIT_OFFSETS - 1, caught_up=caught_up)
        rig.start()
        settle(rig.tracker, *range(EARLY_COMMIT_OFFSETS - 1))
        caught_up.set()
        await until(lambda: rig.partition.commits)
        assert rig.partition.commit_times == [pytest.approx(INTERVAL_S + KAFKA_CALL_S)]
        assert rig.committer.early_commits == 0
        await rig.stop()

    run(main())


def test_the_tail_of_a_burst_commits_early_however_short() -> None:
    """A commit that moved the offset by a burst makes the remainder worth an early commit
    even when fewer than EARLY_COMMIT_OFFSETS are left (else the tail of a burst waits up
    to an interval); after that short commit a trickle is back on the interval."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        caught_up = asyncio.Event()
        burst, tail = 2 * EARLY_COMMIT_OFFSETS, 7
        rig = make(tracked=burst, caught_up=caught_up)
        rig.start()
        settle(rig.tracker, *range(burst))
        caught_up.set()
        await until(lambda: rig.partition.commits)
        assert rig.partition.commits == [(burst, None)]
        assert rig.committer.early_commits == 1

        for offset in range(burst, burst + tail + 1):
            rig.tracker.track(offset)  # fetched after the commit
        settle(rig.tracker, *range(burst, burst + tail))
        await asyncio.sleep(0)
        assert not rig.partition.commits[1:]  # one is pending: not caught up
        rig.tracker.settle(burst + tail)
        tail += 1
        caught_up.set()
        settled_at = loop.time()
        await until(lambda: len(rig.partition.commits) == 2)
        assert rig.partition.commits[-1] == (burst + tail, None)
        gap = INTERVAL_S / EARLY_COMMITS_PER_INTERVAL
        assert rig.partition.commit_times[-1] - settled_at <= gap + 2 * KAFKA_CALL_S
        assert rig.committer.early_commits == 2

        rig.tracker.track(burst + tail)  # a trickle after the tail: the interval again
        rig.tracker.settle(burst + tail)
        caught_up.set()
        await until(lambda: len(rig.partition.commits) == 3)
        assert gaps(rig.partition.commit_times)[-1] >= INTERVAL_S - KAFKA_CALL_S
        assert rig.committer.early_commits == 2
        await rig.stop()

    run(main())


def test_final_commit_takes_what_settled_since_the_last_tick() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        rig = make(encode_settled=True)
        assert rig.checkpoints is not None
        settle(rig.tracker, 0, 1)
        rig.start()
        await until(lambda: rig.partition.commits)
        assert rig.partition.commits == [(2, "")]
        settle(rig.tracker, 2, 3, 4, 9)
        stopped_at = loop.time()
        await rig.stop()
        encoded = encode_settled(5, [9])
        assert rig.partition.commits[-1] == (5, encoded)
        # Shutdown writes the checkpoint at once, inside the once-a-second limit.
        assert rig.checkpoints.value == (5, encoded)
        assert len(rig.checkpoints.put_times) == 2
        assert rig.checkpoints.put_times[1] - rig.checkpoints.put_times[0] < 1.0
        assert loop.time() - stopped_at < 3 * KAFKA_CALL_S

    run(main())


def test_a_failed_commit_is_retried_each_interval_until_the_broker_is_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="triage_proxy.pipeline.committer")

    async def main() -> None:
        rig = make()
        settle(rig.tracker, *range(5))
        rig.partition.failing_commits = 3
        assert not await rig.committer.commit()  # the broker refused: False, not raised
        assert (rig.committer.committed, rig.committer.degraded) == (0, True)

        rig.start()
        await until(lambda: rig.partition.commits)
        assert rig.partition.commits == [(5, None)]  # the offset was kept, not lost
        assert (rig.committer.committed, rig.committer.degraded) == (5, False)
        # One attempt right away above, then one per interval until it went through.
        assert gaps(rig.partition.commit_times) == pytest.approx([INTERVAL_S + KAFKA_CALL_S] * 3)
        await rig.stop()

    run(main())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(warnings) == 1  # once for the outage, not once per failed commit
    assert warnings[0].startswith("degraded: commit of 5 failed")
    assert infos == ["recovered: committed offset 5"]


def test_offsets_settled_above_ride_the_commit_when_only_they_changed() -> None:
    async def main() -> None:
        rig = make(encode_settled=True)
        assert rig.checkpoints is not None
        settle(rig.tracker, 2, 3, 7)  # 0 is pending: the committable offset stays 0
        assert await rig.committer.commit()
        encoded = encode_settled(0, [2, 3, 7])
        assert encoded
        assert rig.partition.commits == [(0, encoded)]
        assert decode_settled(0, encoded) == [2, 3, 7]
        assert (rig.committer.committed, rig.committer.metadata) == (0, encoded)
        assert rig.checkpoints.value == (0, encoded)

        assert await rig.committer.commit()  # nothing changed: no commit
        assert len(rig.partition.commits) == 1

        settle(rig.tracker, 8)  # the same offset, a new set above it: commit again
        assert await rig.committer.commit()
        assert rig.partition.commits[-1] == (0, encode_settled(0, [2, 3, 7, 8]))

    run(main())


def test_a_previous_runs_offsets_beyond_the_fetch_stay_in_the_encoding() -> None:
    # A restarted proxy whose window holds back the fetch: its first commit must not
    # record only the part of the previous run's set that it has fetched.
    async def main() -> None:
        ahead = Ahead(list(range(150, 200)))
        rig = make(encode_settled=True, ahead=ahead)  # tracked 0..99
        assert rig.checkpoints is not None
        settle(rig.tracker, 2, 3)  # 0 pending
        assert await rig.committer.commit()
        encoded = encode_settled(0, [2, 3, *range(150, 200)])
        assert rig.partition.commits == [(0, encoded)]
        assert rig.checkpoints.value == (0, encoded)

        # Nothing pending: the committable offset is where the fetch goes on, and a settled
        # offset there cannot ride above it (it is redelivered once).
        settle(rig.tracker, *(o for o in range(100) if o not in (2, 3)))
        ahead.offsets = [100, 101, 150]
        assert await rig.committer.commit()
        assert rig.partition.commits[-1] == (100, encode_settled(100, [101, 150]))

    run(main())


def test_an_encoding_over_the_brokers_limit_commits_the_plain_offset_and_the_item_keeps_it() -> (
    None
):
    async def main() -> None:
        rig = make(tracked=40_000, encode_settled=True)
        assert rig.checkpoints is not None
        rng = random.Random(7)
        # Half of 40,000 offsets at random: ~1 bit each even compressed, over 4,096 bytes.
        settle(rig.tracker, 0, *(o for o in range(3, 40_000) if rng.random() < 0.5))
        above = rig.tracker.settled_above()
        assert encode_settled(1, above) is None
        encoded = encode_settled(1, above, limit=ITEM_LIMIT)
        assert encoded is not None
        assert await rig.committer.commit()
        assert rig.partition.commits == [(1, None)]  # Kafka's metadata: over its limit
        assert rig.committer.metadata_overflows == 1
        assert rig.checkpoints.value == (1, encoded)  # a restart skips the set still
        assert decode_settled(1, rig.checkpoints.value[1]) == above

    run(main())


def test_an_encoding_over_the_items_limit_is_recorded_nowhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(committer_module, "ITEM_LIMIT", DEFAULT_LIMIT)

    async def main() -> None:
        rig = make(tracked=40_000, encode_settled=True)
        assert rig.checkpoints is not None
        rng = random.Random(7)
        settle(rig.tracker, 0, *(o for o in range(3, 40_000) if rng.random() < 0.5))
        assert await rig.committer.commit()
        assert rig.partition.commits == [(1, None)]  # at-least-once for the set above
        assert rig.committer.metadata_overflows == 1
        assert rig.checkpoints.value == (1, "")

    run(main())


def test_the_checkpoint_is_written_at_most_once_a_second() -> None:
    # Commits every 0.1 s, each with a new settled-above set: ten commits a second, one
    # checkpoint write a second, and the latest state written once the second is up.
    async def main() -> None:
        rig = make(tracked=1000, interval_s=0.1, encode_settled=True)
        assert rig.checkpoints is not None
        rig.start()
        for offset in range(2, 42):
            settle(rig.tracker, offset)
            await asyncio.sleep(0.1)
        commits = len(rig.partition.commits)
        assert commits >= 35
        puts = rig.checkpoints.put_times
        assert 3 <= len(puts) <= 5
        assert min(gaps(puts)) >= 1.0
        await asyncio.sleep(1.2)  # nothing changes now: the due checkpoint is written
        assert len(rig.partition.commits) == commits
        assert rig.checkpoints.value == (0, rig.committer.metadata)
        assert rig.checkpoints.value == (0, encode_settled(0, list(range(2, 42))))
        rig.closing.set()
        assert rig.task is not None
        await rig.task

    run(main())


def test_a_held_commit_writes_what_settles_above_it_without_waiting_out_the_second() -> None:
    # The fault suite's restarted proxies: offset 0 (a crash pill, or a suspect backing off)
    # holds the commit, the instances come back and settle hundreds a tick above it, and a
    # kill -9 comes within a second of the run's first checkpoint write. On a broker that
    # drops commit metadata only the item keeps those offsets from being redelivered, so it
    # must not wait out the once-a-second limit for them.
    async def main() -> None:
        loop = asyncio.get_running_loop()
        rig = make(tracked=3000, interval_s=0.2, encode_settled=True)
        assert rig.checkpoints is not None
        checkpoints = rig.checkpoints
        rig.start()
        await until(lambda: checkpoints.puts == 1)  # the run's first commit and write
        first_write = checkpoints.put_times[0]
        n = CHECKPOINT_HELD_OFFSETS
        settle(rig.tracker, *range(1, 1 + n))
        settled_at = loop.time()
        await until(lambda: checkpoints.puts == 2)
        assert checkpoints.put_times[1] - settled_at <= 0.2 + 2 * KAFKA_CALL_S  # next commit
        assert checkpoints.put_times[1] - first_write < CHECKPOINT_INTERVAL_S
        assert checkpoints.value == (0, encode_settled(0, list(range(1, 1 + n))))
        assert decode_settled(0, checkpoints.value[1]) == list(range(1, 1 + n))

        # Each tick's batch reaches the item with that tick's commit, all held at 0.
        for tick in range(1, 4):
            settle(rig.tracker, *range(n * tick + 1, n * tick + n + 1))
            await until(lambda: checkpoints.puts == 2 + tick)  # noqa: B023 - awaited here
        assert checkpoints.value == (0, encode_settled(0, list(range(1, 4 * n + 1))))
        assert max(gaps(checkpoints.put_times)) < CHECKPOINT_INTERVAL_S
        assert all(c[0] == 0 for c in rig.partition.commits)

        # While the commit moves, the interval holds again: what the item lacks then is
        # about the in-flight spread, whatever the pace of the writes.
        writes = checkpoints.puts
        pending = 0
        for start in range(4 * n + 1, 4 * n + 2001, 200):  # the head settles, 199 above it
            settle(rig.tracker, pending, *range(start, start + 199))
            pending = start + 199
            await asyncio.sleep(0.2)
        assert rig.partition.commits[-1][0] == pending
        assert min(gaps(checkpoints.put_times[writes - 1 :])) >= CHECKPOINT_INTERVAL_S
        await rig.stop()

    run(main())


def test_a_commit_held_right_after_it_moved_writes_without_waiting_out_the_second() -> None:
    # The fault suite's slow messages: the head jumps to the next one and stays there. The
    # item still has the committed offset from before the jump; what settles above the new
    # one must not wait out the second either.
    async def main() -> None:
        loop = asyncio.get_running_loop()
        rig = make(tracked=3000, interval_s=0.2, encode_settled=True)
        assert rig.checkpoints is not None
        checkpoints = rig.checkpoints
        rig.start()
        await until(lambda: checkpoints.puts == 1)
        first_write = checkpoints.put_times[0]
        settle(rig.tracker, *range(200), *range(300, 350))  # the head jumps to 200
        await until(lambda: rig.partition.commits[-1][0] == 200)
        assert checkpoints.puts == 1  # it moved: the interval holds
        settle(rig.tracker, *range(201, 300))  # 149 above 200 now, none in the item
        await until(lambda: checkpoints.puts == 2)
        assert loop.time() - first_write < CHECKPOINT_INTERVAL_S
        assert checkpoints.value == (200, encode_settled(200, list(range(201, 350))))
        await rig.stop()

    run(main())


def test_a_burst_above_a_held_commit_is_written_within_a_poll_not_at_the_tick() -> None:
    # The fault suite's kill 50 ms after a restarted proxy's instances came back: they
    # settled hundreds above a held offset in 40 ms, and the 0.2 s tick came too late.
    # At the default 1 s interval, too, a burst reaches the item within a poll (an eighth
    # of the interval) and a write.
    async def main() -> None:
        loop = asyncio.get_running_loop()
        rig = make(tracked=3000, interval_s=1.0, encode_settled=True)
        assert rig.checkpoints is not None
        checkpoints = rig.checkpoints
        rig.start()
        await until(lambda: checkpoints.puts == 1)  # the run's first commit and write
        await asyncio.sleep(0.3)  # well inside the interval
        n = CHECKPOINT_HELD_OFFSETS
        settle(rig.tracker, *range(1, 1 + n))
        settled_at = loop.time()
        await until(lambda: checkpoints.puts == 2)
        poll_s = 1.0 / CHECKPOINT_POLLS
        assert checkpoints.put_times[1] - settled_at <= poll_s + 2 * KAFKA_CALL_S
        assert checkpoints.value == (0, encode_settled(0, list(range(1, 1 + n))))
        assert rig.committer.burst_writes == 1

        # Burst after burst: each within a poll of the one before, all held at 0.
        for burst in range(2, 6):
            settle(rig.tracker, *range(n * (burst - 1) + 1, n * burst + 1))
            await until(lambda: checkpoints.puts == 1 + burst)  # noqa: B023 - awaited here
        assert max(gaps(checkpoints.put_times[1:])) <= poll_s + 2 * KAFKA_CALL_S
        assert checkpoints.value == (0, encode_settled(0, list(range(1, 5 * n + 1))))
        assert all(c[0] == 0 for c in rig.partition.commits)

        # Fewer than a burst: no early write, the tick (and the interval) decide.
        bursts = rig.committer.burst_writes
        settle(rig.tracker, *range(5 * n + 1, 6 * n))
        await asyncio.sleep(0.5)
        assert rig.committer.burst_writes == bursts
        await rig.stop()

    run(main())


def test_a_partition_moving_past_the_commit_is_not_polled_between_ticks() -> None:
    # Only a held offset can make a burst due, and a head that moved past Kafka's
    # committed offset stays past it until the next commit: a fleet process's 16 busy
    # partitions were woken CHECKPOINT_POLLS times an interval each for nothing.
    async def main() -> None:
        rig = make(tracked=3000, interval_s=1.0, encode_settled=True)
        assert rig.checkpoints is not None
        checkpoints = rig.checkpoints
        rig.start()
        await until(lambda: checkpoints.puts == 1)  # the run's first commit and write
        looks = 0
        held_burst = rig.committer._held_burst

        def counted() -> bool:
            nonlocal looks
            looks += 1
            return held_burst()

        rig.committer._held_burst = counted  # type: ignore[method-assign]
        settle(rig.tracker, *range(0, 10))  # the head moves to 10, past Kafka's 0
        await asyncio.sleep(0.5)  # four polls' worth, well inside the interval
        assert looks <= 1  # the poll under way when it moved
        await rig.stop()
        assert rig.committer.committed == 10

    run(main())


def test_a_burst_reaches_the_item_without_waiting_for_kafkas_commit() -> None:
    # The fault suite's kill 6 (second run): a restarted proxy's first Kafka commit took
    # 160 ms (the group coordinator), its instances settled 1,135 offsets above the held
    # offset meanwhile, and the write waited for that commit. The item's committed offset
    # is Kafka's already while the offset is held, so the write does not wait; here Kafka
    # refuses every commit, and the previous run's set (ahead) stays in what is written.
    async def main() -> None:
        counts = Counts()
        rig = make(
            tracked=3000,
            interval_s=0.2,
            encode_settled=True,
            attempts=counts,
            ahead=Ahead([5000, 5001]),
        )
        assert rig.checkpoints is not None
        checkpoints = rig.checkpoints
        rig.partition.failing_commits = 10**6
        counts.fail(0)
        rig.start()
        await asyncio.sleep(0.5)
        assert checkpoints.puts == 0  # counts alone wait for the run's first commit
        settle(rig.tracker, *range(1, 1 + CHECKPOINT_HELD_OFFSETS))
        await until(lambda: checkpoints.puts == 1)
        assert rig.committer.commits == 0
        expected = [*range(1, 1 + CHECKPOINT_HELD_OFFSETS), 5000, 5001]
        assert checkpoints.value == (0, encode_settled(0, expected))
        assert decode_attempts(0, checkpoints.attempts) == {0: 1}
        rig.closing.set()
        assert rig.task is not None
        await rig.task

    run(main())


def test_a_head_that_jumps_onto_a_pill_and_stops_is_written_at_the_next_tick() -> None:
    # The fault suite's kill 3: the instances settled ~1,000 offsets above a crash pill
    # and the pill crashed them; the commit that took the head onto the pill moved it (so
    # the interval held) and nothing settled after it, and a kill 0.7 s later redelivered
    # them all. The tick after such a jump finds the offset held and writes.
    async def main() -> None:
        rig = make(tracked=3000, interval_s=0.2, encode_settled=True)
        assert rig.checkpoints is not None
        checkpoints = rig.checkpoints
        rig.start()
        await until(lambda: checkpoints.puts == 1)
        settle(rig.tracker, *range(200), *range(201, 1200))  # the head jumps to 200
        await until(lambda: rig.partition.commits[-1][0] == 200)
        jumped_at = rig.partition.commit_times[-1]
        assert checkpoints.puts == 1  # the commit moved: not with it
        await until(lambda: checkpoints.puts == 2)
        assert checkpoints.put_times[1] - jumped_at <= 0.2 + 2 * KAFKA_CALL_S
        assert checkpoints.value == (200, encode_settled(200, list(range(201, 1200))))
        assert len(rig.partition.commits) == 2  # no Kafka commit for it
        await rig.stop()

    run(main())


def test_a_burst_while_the_commit_moves_waits_for_the_tick() -> None:
    # Kafka's commit records the head: no commit comes early however much settles.
    async def main() -> None:
        loop = asyncio.get_running_loop()
        rig = make(tracked=3000, interval_s=1.0, encode_settled=True)
        assert rig.checkpoints is not None
        rig.start()
        await until(lambda: rig.partition.commits)
        first = loop.time()
        settle(rig.tracker, *range(0, 1000))
        await until(lambda: len(rig.partition.commits) == 2)
        assert rig.partition.commits[-1][0] == 1000
        assert loop.time() - first >= 1.0 - KAFKA_CALL_S
        assert rig.committer.burst_writes == 0
        await rig.stop()

    run(main())


def test_a_held_burst_after_a_failed_write_waits_out_the_interval() -> None:
    # DynamoDB frozen: a held burst does not turn into a Kafka commit and a write attempt
    # every poll.
    async def main() -> None:
        rig = make(tracked=3000, interval_s=0.2, encode_settled=True)
        assert rig.checkpoints is not None
        checkpoints = rig.checkpoints
        tries: list[float] = []
        loop = asyncio.get_running_loop()

        def frozen(committed: int, settled: str, attempts: str = "") -> None:
            tries.append(loop.time())
            raise TableUnavailable("frozen (twin)")

        rig.start()
        await until(lambda: checkpoints.puts == 1)
        checkpoints.put = frozen  # type: ignore[method-assign]
        for burst in range(1, 11):  # a burst every 0.1 s for a second
            n = CHECKPOINT_HELD_OFFSETS
            settle(rig.tracker, *range(n * (burst - 1) + 1, n * burst + 1))
            await asyncio.sleep(0.1)
        assert 1 <= len(tries) <= 2
        assert len(rig.partition.commits) <= 7  # the ticks, and the one early commit
        await rig.stop()

    run(main())


def test_a_held_commit_with_a_trickle_above_it_keeps_the_once_a_second_limit() -> None:
    async def main() -> None:
        rig = make(tracked=1000, interval_s=0.2, encode_settled=True)
        assert rig.checkpoints is not None
        rig.start()
        await until(lambda: rig.checkpoints is not None and rig.checkpoints.puts == 1)
        for offset in range(1, CHECKPOINT_HELD_OFFSETS):  # 99 in ~10 s: never a burst
            settle(rig.tracker, offset)
            await asyncio.sleep(0.1)
        assert min(gaps(rig.checkpoints.put_times)) >= CHECKPOINT_INTERVAL_S
        await rig.stop()

    run(main())


# --- failed-delivery counts in the checkpoint item -----------------------------------------


def test_changed_counts_rewrite_the_checkpoint_though_the_commit_stands_still() -> None:
    # A crash pill at offset 0 holds the commit; its failures still reach the item, at
    # most once a second, and without any new Kafka commit.
    async def main() -> None:
        counts = Counts()
        rig = make(interval_s=0.1, encode_settled=True, attempts=counts)
        assert rig.checkpoints is not None
        rig.start()
        await until(lambda: rig.checkpoints is not None and rig.checkpoints.puts == 1)
        assert rig.partition.commits == [(0, "")]  # the run's first commit
        assert rig.checkpoints.attempts == ""
        for _ in range(3):
            counts.fail(0)
            counts.fail(7)
            await asyncio.sleep(0.1)
        await until(lambda: decode_attempts(0, rig.checkpoints.attempts) == {0: 3, 7: 3})  # type: ignore[union-attr]
        assert rig.partition.commits == [(0, "")]  # no Kafka commit for it
        assert rig.checkpoints.value == (0, "")
        assert min(gaps(rig.checkpoints.put_times)) >= 1.0
        puts = rig.checkpoints.puts
        await asyncio.sleep(3)  # nothing changed: nothing written
        assert rig.checkpoints.puts == puts
        counts.fail(0)
        await rig.stop()  # shutdown writes the last counts at once
        assert decode_attempts(0, rig.checkpoints.attempts) == {0: 4, 7: 3}

    run(main())


def test_counts_ride_along_with_a_commit_and_drop_what_it_passed() -> None:
    async def main() -> None:
        counts = Counts()
        rig = make(encode_settled=True, attempts=counts)
        assert rig.checkpoints is not None
        counts.fail(1)
        counts.fail(4)
        settle(rig.tracker, 0, 1, 2)
        assert await rig.committer.commit()
        assert rig.checkpoints.value == (3, "")
        assert decode_attempts(3, rig.checkpoints.attempts) == {4: 1}  # 1 is committed

    run(main())


def test_no_checkpoint_before_the_runs_first_commit() -> None:
    # Until then the item holds the previous run's settled-above set: counts alone must
    # not overwrite it.
    async def main() -> None:
        counts = Counts()
        rig = make(encode_settled=True, attempts=counts)
        assert rig.checkpoints is not None
        rig.partition.failing_commits = 2
        counts.fail(0)
        rig.start()
        await asyncio.sleep(2.5)
        assert rig.checkpoints.puts == 0
        await until(lambda: rig.checkpoints is not None and rig.checkpoints.puts == 1)
        assert decode_attempts(0, rig.checkpoints.attempts) == {0: 1}
        await rig.stop()

    run(main())


def test_a_failed_checkpoint_write_is_retried_without_a_commit() -> None:
    async def main() -> None:
        counts = Counts()
        rig = make(encode_settled=True, attempts=counts)
        assert rig.checkpoints is not None
        checkpoints = rig.checkpoints
        real_put = checkpoints.put
        failing = [1]

        def put(committed: int, settled: str, attempts: str = "") -> None:
            if failing and attempts:
                failing.pop()
                raise TableUnavailable("frozen (twin)")
            real_put(committed, settled, attempts)

        checkpoints.put = put  # type: ignore[method-assign]
        rig.start()
        await until(lambda: checkpoints.puts == 1)
        counts.fail(0)
        await until(lambda: checkpoints.attempts != "")
        assert not failing  # one write failed, the next one went through
        assert decode_attempts(0, checkpoints.attempts) == {0: 1}
        assert len(rig.partition.commits) == 1
        await rig.stop()

    run(main())
