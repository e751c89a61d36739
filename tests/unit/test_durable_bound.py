"""The bound on what a kill -9 redelivers: the window counts a record until its settlement
is durably recorded (policies.window_room, window.py, committer.py).

A state machine drives the real dispatcher and tracker through fetches (with offset
gaps, as on a compacted topic), deliveries, acks, nacks, disconnects and commits whose
snapshot is taken before the broker answers (settles go on in between), and checks
after every step what a kill at that moment would redeliver: each record this run
delivered that no landed commit or checkpoint records. The same machine with the bound
off finds a kill that costs more than the window, so the check can fail. Then the
committer on a virtual clock: the dispatcher's cue makes it commit (and write the item)
at once, and a refusing broker is not asked in a loop.
"""

from __future__ import annotations

import asyncio
import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.unit.test_committer import Counts
from tests.unit.test_dispatcher import connect, frames_of
from tests.unit.twins import KAFKA_CALL_S, FlakyPartition, InlineKafkaThread, TimedCheckpoints
from tests.unit.virtual_time import run, until
from triage_protocol import triage_pb2 as pb
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.errors import TableUnavailable
from triage_proxy.pipeline.committer import Committer
from triage_proxy.pipeline.dispatch import Dispatcher, Session
from triage_proxy.pipeline.policies import durability_due, window_room
from triage_proxy.pipeline.settled import decode_settled, encode_settled
from triage_proxy.pipeline.tracker import CommitTracker
from triage_proxy.structs import DeadLetter, Record

WINDOW = 12


# --- the two policies --------------------------------------------------------------------


@given(
    max_messages=st.integers(1, 50),
    unsettled=st.integers(0, 60),
    extra=st.integers(0, 60),
    bounded=st.booleans(),
)
def test_the_bounded_room_never_lets_the_undurable_records_pass_the_window(
    max_messages: int, unsettled: int, extra: int, bounded: bool
) -> None:
    undurable = unsettled + extra  # every unsettled record is undurable too
    room = window_room(
        max_messages=max_messages, unsettled=unsettled, undurable=undurable, bounded=bounded
    )
    assert room >= 0
    assert unsettled + room <= max(max_messages, unsettled)
    if bounded:
        assert undurable + room <= max(max_messages, undurable)
    # Never tighter than the plain window, and the same as it when nothing waits.
    plain = window_room(
        max_messages=max_messages, unsettled=unsettled, undurable=unsettled, bounded=bounded
    )
    assert room <= plain
    assert plain == max(0, max_messages - unsettled)


@given(
    room=st.integers(0, 40),
    settled_waiting=st.integers(0, 40),
    refill=st.integers(1, 20),
    extra=st.integers(0, 20),
)
def test_a_commit_is_forced_only_when_it_unblocks_a_fetch_or_gives_back_a_refill(
    room: int, settled_waiting: int, refill: int, extra: int
) -> None:
    low = refill + extra  # half the window, at least a refill
    due = durability_due(room=room, settled_waiting=settled_waiting, refill=refill, low=low)
    if room + settled_waiting < refill:
        assert not due  # unsettled records hold the room: a commit frees nothing
    elif room < refill:
        assert due  # the fetch is held back and the commit lets it go
    elif room >= low:
        assert not due  # more than half the window is free: the tick commits
    else:
        assert due == (settled_waiting >= refill)  # under way early, a refill at least


# --- the tracker's record counts ---------------------------------------------------------


@given(st.lists(st.tuples(st.integers(1, 1500), st.booleans()), min_size=1, max_size=60))
def test_the_tracker_counts_records_below_and_above_its_head_across_gaps(
    steps: list[tuple[int, bool]],
) -> None:
    tracker = CommitTracker(0)
    offset, tracked, settled = -1, list[int](), set[int]()
    for gap, settle in steps:
        offset += gap
        tracker.track(offset)
        tracked.append(offset)
        if settle:
            # Settle the oldest pending record or the newest one, in turn.
            pending = [o for o in tracked if o not in settled]
            pick = pending[0] if len(settled) % 2 else pending[-1]
            tracker.settle(pick)
            settled.add(pick)
        head = min((o for o in tracked if o not in settled), default=None)
        below = sum(1 for o in tracked if head is None or o < head)
        assert tracker.tracked == len(tracked)
        assert tracker.settled == len(settled)
        assert tracker.below() == below
        assert tracker.settled_above_count() == len(settled) - below


def test_the_durable_mark_only_rises_and_never_passes_what_settled() -> None:
    tracker = CommitTracker(0)
    tracker.track_span(0, 9)
    tracker.settle_span(0, 3)
    tracker.mark_durable(3)
    assert (tracker.durable, tracker.undurable) == (3, 7)
    tracker.mark_durable(2)  # an older record landing late
    assert tracker.durable == 3
    tracker.mark_durable(50)
    assert tracker.durable == 4  # only settled records can be recorded as settled


# --- the state machine: a kill at any moment ---------------------------------------------


@dataclass
class Snapshot:
    """A commit or checkpoint encoded now; it records `offsets` once it lands."""

    offsets: frozenset[int]
    records: int
    """The count the committer passes to mark_durable for it."""


class KillCostMachine(RuleBasedStateMachine):
    """Fetches, deliveries, settles and commits in any order; a kill costs <= WINDOW."""

    bounded = True

    def __init__(self) -> None:
        super().__init__()
        raw = {
            "kafka": {"bootstrap_servers": "b", "topic": "t", "group_id": "g", "fetch_batch": 4},
            "auth": {"token": "unit-test-token-0123"},
            "dead_letters": {"table": "dlq"},
            "window": {"max_messages": WINDOW},
            "delivery": {"max_attempts": 3, "ack_deadline_s": 5},
        }
        self.now = 0.0
        self.tracker = CommitTracker(0)
        self.dead: list[DeadLetter] = []
        self.d = Dispatcher(
            settings_from_dict(raw, {}),
            0,
            self.tracker,
            self.dead.append,
            monotonic=lambda: self.now,
            bounded=self.bounded,
        )
        self.sessions: list[Session] = []
        self.held: dict[int, set[int]] = {}
        self.next_offset = 0
        self.tracked: list[int] = []
        self.settled: set[int] = set()
        self.delivered: set[int] = set()
        self.recorded: set[int] = set()
        self.in_flight: list[Snapshot] = []

    def _drain(self) -> None:
        for i, s in enumerate(self.sessions):
            for frame in frames_of(s):
                if frame is None:
                    continue
                for delivery in frame.deliveries.deliveries:
                    self.delivered.add(delivery.offset)
                    self.held.setdefault(i, set()).add(delivery.offset)

    @rule(gaps=st.lists(st.integers(1, 3), min_size=1, max_size=6))
    def fetch(self, gaps: list[int]) -> None:
        room = self.d.room_for
        batch = []
        for gap in gaps[:room]:
            offset = self.next_offset + gap - 1
            batch.append(Record("t", 0, offset, None, b"v", (), 0))
            self.tracked.append(offset)
            self.next_offset = offset + 1
        self.d.add(batch)
        self._drain()

    @rule(credits=st.integers(1, 8))
    def connect(self, credits: int) -> None:
        self.sessions.append(connect(self.d, f"i{len(self.sessions)}", credits))
        self._drain()

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(sorted(i for i, h in self.held.items() if h)))
        held = sorted(self.held[i])
        acks = data.draw(st.lists(st.sampled_from(held), unique=True, max_size=len(held)))
        nacks = [o for o in held if o not in acks][: data.draw(st.integers(0, 1))]
        self.d.settle(self.sessions[i], acks, [pb.Nack(offset=o, reason="x") for o in nacks])
        self.held[i] -= set(acks) | set(nacks)
        self.settled.update(acks)
        self._drain()

    @precondition(lambda self: self.dead)
    @rule()
    def dead_letter_written(self) -> None:
        dl = self.dead.pop(0)
        self.d.dead_letter_written(dl)
        self.settled.add(dl.record.offset)
        self._drain()

    @precondition(lambda self: any(not s.closed for s in self.sessions))
    @rule(data=st.data())
    def disconnect(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from([i for i, s in enumerate(self.sessions) if not s.closed]))
        self.d.close_session(self.sessions[i])
        self.held[i] = set()
        self.now += 10  # past any redelivery backoff
        self.d.tick()
        self._drain()

    @rule(item=st.booleans())
    def encode(self, item: bool) -> None:
        """The committer encodes a commit (records below the committable offset) or the
        item (every record settled now); it lands later."""
        tracker = self.tracker
        if item:
            offsets = frozenset(self.settled)
            records = tracker.settled
        else:
            head = tracker.committable
            offsets = frozenset(o for o in self.tracked if o < head)
            records = tracker.below()
        self.in_flight.append(Snapshot(offsets, records))

    @precondition(lambda self: self.in_flight)
    @rule()
    def land(self) -> None:
        snapshot = self.in_flight.pop(0)
        self.recorded |= snapshot.offsets
        self.tracker.mark_durable(snapshot.records)
        self.d.durable_moved()
        self._drain()

    @invariant()
    def a_kill_now_redelivers_at_most_the_window(self) -> None:
        redelivered = self.delivered - self.recorded
        assert len(redelivered) <= WINDOW, sorted(redelivered)

    @invariant()
    def the_durable_count_is_never_more_than_what_is_recorded(self) -> None:
        assert self.tracker.durable <= len(self.recorded & set(self.tracked))

    @invariant()
    def the_cue_is_raised_whenever_a_record_would_let_the_fetch_go_on(self) -> None:
        tracker = self.tracker
        room = self.d.room_for
        if room < 3 <= room + tracker.settled - tracker.durable:  # refill: 12 // 4
            assert self.d.durability.is_set()


class UnboundedMachine(KillCostMachine):
    bounded = False


TestKillCost = KillCostMachine.TestCase
TestKillCost.settings = hsettings(
    max_examples=150, stateful_step_count=60, suppress_health_check=[HealthCheck.too_slow]
)


def test_without_the_bound_a_kill_can_cost_more_than_the_window() -> None:
    """The invariant is a real check: the plain window (unsettled records only) breaks it."""
    machine = UnboundedMachine()
    machine.connect(credits=8)
    for _ in range(10):
        machine.fetch(gaps=[1, 1, 1, 1])
        for i, held in machine.held.items():
            machine.d.settle(machine.sessions[i], sorted(held), [])
            machine.delivered |= held
            machine.settled |= held
            held.clear()
        machine._drain()
    with pytest.raises(AssertionError):
        machine.a_kill_now_redelivers_at_most_the_window()
    bounded = KillCostMachine()
    bounded.connect(credits=8)
    for _ in range(10):
        bounded.fetch(gaps=[1, 1, 1, 1])
        for i, held in bounded.held.items():
            bounded.d.settle(bounded.sessions[i], sorted(held), [])
            bounded.settled |= held
            held.clear()
        bounded._drain()
    bounded.a_kill_now_redelivers_at_most_the_window()
    assert bounded.d.room_for == 0  # it waits for a commit instead
    assert bounded.d.durability.is_set()


# --- the committer takes the cue ---------------------------------------------------------

INTERVAL_S = 1.0


@dataclass
class Rig:
    partition: FlakyPartition
    tracker: CommitTracker
    committer: Committer
    checkpoints: TimedCheckpoints
    cue: asyncio.Event
    closing: asyncio.Event
    moved: list[float]


def make() -> Rig:
    loop = asyncio.get_running_loop()
    partition = FlakyPartition(loop.time)
    tracker = CommitTracker(0)
    tracker.track_span(0, 99)
    checkpoints = TimedCheckpoints(loop.time)
    cue, closing = asyncio.Event(), asyncio.Event()
    moved: list[float] = []
    committer = Committer(
        partition,
        InlineKafkaThread(),
        tracker,
        0,
        INTERVAL_S,
        closing,
        checkpoints=checkpoints,
        durability=cue,
        on_durable=lambda: moved.append(loop.time()),
        monotonic=loop.time,
    )
    return Rig(partition, tracker, committer, checkpoints, cue, closing, moved)


def test_the_cue_commits_at_once_and_marks_what_the_commit_records() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        rig = make()
        task = asyncio.create_task(rig.committer.run())
        await asyncio.sleep(0.3)
        rig.tracker.settle_span(0, 59)
        cued_at = loop.time()
        rig.cue.set()
        await until(lambda: rig.partition.commits)
        assert rig.partition.commit_times[0] - cued_at < 2 * KAFKA_CALL_S  # not at the tick
        assert rig.partition.commits[0][0] == 60
        assert rig.tracker.durable == 60
        assert rig.moved
        assert rig.committer.durability_commits == 1
        rig.closing.set()
        await task

    run(main())


def test_a_held_offset_gets_the_item_written_at_once_with_every_settled_record() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        rig = make()
        task = asyncio.create_task(rig.committer.run())
        await asyncio.sleep(0.3)
        rig.tracker.settle_span(1, 80)  # offset 0 (a slow message, a pill) holds the head
        cued_at = loop.time()

        def still_waiting() -> None:  # the dispatcher: the window still waits
            if rig.tracker.durable < rig.tracker.settled:
                rig.cue.set()

        rig.committer._on_durable = still_waiting
        rig.cue.set()
        await until(lambda: rig.checkpoints.put_times)
        assert rig.checkpoints.put_times[0] - cued_at < 0.1  # not the once-a-second limit
        item = rig.checkpoints.get()
        assert item is not None
        assert decode_settled(item.committed, item.settled) == list(range(1, 81))
        assert rig.tracker.durable == 80  # all settled; none below the held offset
        rig.closing.set()
        await task

    run(main())


def test_a_cue_with_nothing_left_to_record_does_not_quiet_the_next_one() -> None:
    """A cue the tick's commit already answered (set before the tick, taken after it)
    records nothing, but nothing was refused either: the next cue must still commit at
    once. Quieted for an interval, the cue was only ever taken right after a tick, found
    nothing again, and a bounded window of 64 crawled at one window per interval."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        rig = make()
        task = asyncio.create_task(rig.committer.run())
        rig.cue.set()  # nothing settled: nothing to record
        await until(lambda: rig.committer.durability_commits == 1)
        await asyncio.sleep(0.2)
        rig.tracker.settle_span(0, 59)
        cued_at = loop.time()
        rig.cue.set()
        await until(lambda: rig.tracker.durable == 60)
        assert loop.time() - cued_at < 3 * KAFKA_CALL_S  # not at the tick (INTERVAL_S)
        assert rig.committer.durability_commits == 2
        rig.closing.set()
        await task

    run(main())


def test_a_refusing_broker_is_not_asked_in_a_loop() -> None:
    async def main() -> None:
        rig = make()
        rig.committer._checkpoints = None  # no item: only the broker can record
        rig.tracker.settle_span(0, 59)
        rig.partition.failing_commits = 10**6

        def still_waiting() -> None:
            rig.cue.set()

        rig.committer._on_durable = still_waiting
        rig.cue.set()
        task = asyncio.create_task(rig.committer.run())
        await asyncio.sleep(3 * INTERVAL_S)
        # Once a poll at most (the interval here: without the item there are no polls),
        # plus the ticks: never a tight loop.
        assert 2 <= len(rig.partition.commit_times) <= 3 * 2 + 1
        assert rig.tracker.durable == 0
        rig.closing.set()
        await task

    run(main())


def test_a_frozen_table_is_asked_once_an_interval_at_most() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        rig = make()
        rig.tracker.settle_span(1, 59)  # held at 0: only the item can record them
        tries: list[float] = []

        def frozen(committed: int, settled: str, attempts: str = "") -> None:
            tries.append(loop.time())
            raise TableUnavailable("frozen (twin)")

        rig.checkpoints.put = frozen  # type: ignore[method-assign]

        def still_waiting() -> None:
            rig.cue.set()

        rig.committer._on_durable = still_waiting
        rig.cue.set()
        task = asyncio.create_task(rig.committer.run())
        await asyncio.sleep(3 * INTERVAL_S)
        assert 1 <= rig.committer.durability_commits <= 3 + 1
        assert 1 <= len(tries) <= 2 * 3 + 1  # the cue's rounds and the ticks' writes
        assert rig.tracker.durable == 0
        rig.closing.set()
        await task

    run(main())


def recorded(rig: Rig, tracked: Sequence[int]) -> int:
    """How many of `tracked` a restart would find settled: below Kafka's committed offset,
    or in the item's set (as partition.restore joins them; Tansu drops the metadata)."""
    kafka = rig.partition.committed
    item = rig.checkpoints.get()
    above: set[int] = set()
    if item is not None and item.committed <= kafka and item.settled:
        above = {o for o in decode_settled(item.committed, item.settled) if o >= kafka}
    return sum(1 for o in tracked if o < kafka or o in above)


def test_an_item_written_during_a_commit_is_not_rewritten_with_the_commit_s_older_set() -> None:
    """The cue's round: the commit encodes what settled so far (1..40), more settle while
    Kafka answers (41..80), the item written after it records all 80 and the mark says
    so; the round's forced write must not then put the commit's 40 back: a kill would
    redeliver 40 records the window had taken as recorded (twice the window in the fault
    suite)."""

    async def main() -> None:
        rig = make()
        thread = rig.committer._thread
        assert isinstance(thread, InlineKafkaThread)
        rig.committer._on_durable = rig.cue.set  # the window still waits, each time it looks
        task = asyncio.create_task(rig.committer.run())
        await asyncio.sleep(0.3)
        rig.tracker.settle_span(1, 40)  # offset 0 holds the head
        calls = thread.calls
        rig.cue.set()
        await until(lambda: thread.calls > calls, poll=KAFKA_CALL_S / 10)
        rig.tracker.settle_span(41, 80)  # while Kafka answers the cue's commit
        await until(lambda: rig.committer.durability_commits >= 1 and rig.checkpoints.puts)
        await asyncio.sleep(0.05)  # the rest of the round
        item = rig.checkpoints.get()
        assert item is not None
        assert decode_settled(item.committed, item.settled) == list(range(1, 81))
        assert rig.tracker.durable == 80
        assert rig.tracker.durable <= recorded(rig, range(100))
        rig.closing.set()
        await task

    run(main())


class _Ahead:
    """The dispatcher's carryover: a previous run's settled offsets not fetched yet (unlike
    test_committer's fixed `Ahead`, only those above the tracker's fetch, as they go)."""

    def __init__(self, tracker: CommitTracker, offsets: list[int]) -> None:
        self._tracker, self.offsets = tracker, offsets

    def settled_ahead(self) -> list[int]:
        return self.offsets[bisect.bisect_left(self.offsets, self._tracker.next_offset) :]


@pytest.mark.parametrize("seed", range(40))
def test_the_mark_never_passes_what_a_restart_would_find(seed: int) -> None:
    """Random rounds of fetches, settles (the head often held), cues, failed counts, and
    refusing brokers and tables against the real committer, in odd seeds after a run
    that settled 40 offsets beyond this one's first fetch: after every step the durable
    mark is at most what Kafka's offset and the item record (the kill bound rests on it),
    and the item still holds every offset of that previous run above Kafka's."""
    rng = random.Random(seed)
    broken: list[str] = []

    async def main() -> None:
        rig = make()
        counts = Counts()
        rig.committer._attempts = counts
        ahead = sorted(rng.sample(range(101, 400), 40)) if seed % 2 else []
        if ahead:
            rig.checkpoints.put(0, encode_settled(0, ahead) or "")
            rig.committer._ahead = _Ahead(rig.tracker, ahead)
        tracked: list[int] = list(range(100))
        task = asyncio.create_task(rig.committer.run())
        for step in range(300):
            pending = [o for o in tracked if rig.tracker.is_pending(o)]
            roll = rng.random()
            if roll < 0.2:
                first = tracked[-1] + 1
                last = first + rng.randint(0, 19)
                rig.tracker.track_span(first, last)
                tracked.extend(range(first, last + 1))
                for offset in ahead[bisect.bisect_left(ahead, first) :]:
                    if offset > last:
                        break
                    rig.tracker.settle(offset)  # the dispatcher skips it: settled before
            elif roll < 0.6 and pending:
                held = pending[1:] if len(pending) > 1 and rng.random() < 0.8 else pending
                for offset in rng.sample(held, min(len(held), rng.randint(1, 10))):
                    rig.tracker.settle(offset)
            elif roll < 0.7:
                rig.cue.set()
            elif roll < 0.75:
                rig.partition.failing_commits += 1
            elif roll < 0.8:
                rig.checkpoints.refusing += 1
            elif roll < 0.85 and pending:
                counts.fail(pending[0])
            await asyncio.sleep(rng.choice([0, 0, 0.001, 0.005, 0.02, 0.1]))
            if rig.tracker.durable > recorded(rig, tracked):
                broken.append(f"step {step}: {rig.tracker.durable} > {recorded(rig, tracked)}")
            item, kafka = rig.checkpoints.get(), rig.partition.committed
            if ahead and item is not None and item.committed <= kafka:
                kept = set(decode_settled(item.committed, item.settled)) if item.settled else set()
                if gone := [o for o in ahead if o > kafka and o not in kept]:
                    broken.append(f"step {step}: {gone[:5]} of the previous run's set gone")
        rig.closing.set()
        await task

    run(main())
    assert not broken, broken[:3]
