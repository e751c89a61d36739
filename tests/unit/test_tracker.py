"""CommitTracker: edge cases, plus a stateful comparison against a trivially correct model."""

from __future__ import annotations

import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from triage_proxy.pipeline.tracker import _PAGE_SIZE as PAGE
from triage_proxy.pipeline.tracker import CommitTracker

# PAGE is the tracker's internal page size: cases straddle page boundaries on purpose.


def test_empty_tracker_commits_start_offset() -> None:
    tracker = CommitTracker(42)
    assert tracker.committable == 42
    assert tracker.pending == 0
    assert tracker.settled_above() == []
    assert not tracker.is_pending(42)
    assert not tracker.settle(42)


def test_negative_start_offset_raises() -> None:
    with pytest.raises(ValueError, match="start_offset"):
        CommitTracker(-1)


def test_in_order_settles_advance_committable() -> None:
    tracker = CommitTracker(10)
    for offset in range(10, 15):
        tracker.track(offset)
    assert tracker.committable == 10
    assert tracker.pending == 5
    for offset in range(10, 15):
        assert tracker.settle(offset)
        assert tracker.committable == offset + 1
    assert tracker.pending == 0
    assert tracker.committable == 15


def test_out_of_order_settle_waits_for_the_smallest() -> None:
    tracker = CommitTracker(0)
    for offset in range(5):
        tracker.track(offset)
    assert tracker.settle(3)
    assert tracker.settle(1)
    assert tracker.committable == 0
    assert tracker.settled_above() == [1, 3]
    assert tracker.settle(0)
    assert tracker.committable == 2
    assert tracker.settled_above() == [3]
    assert tracker.settle(2)
    assert tracker.committable == 4
    assert tracker.settled_above() == []


def test_first_track_may_be_above_start_offset() -> None:
    tracker = CommitTracker(100)
    tracker.track(105)
    assert tracker.committable == 105
    assert tracker.settle(105)
    assert tracker.committable == 106


def test_track_below_start_offset_raises() -> None:
    tracker = CommitTracker(5)
    with pytest.raises(ValueError, match="not above"):
        tracker.track(4)


@pytest.mark.parametrize("repeat", [5, 3])
def test_repeated_or_lower_track_raises_and_keeps_state(repeat: int) -> None:
    tracker = CommitTracker(0)
    tracker.track(5)
    with pytest.raises(ValueError, match="not above"):
        tracker.track(repeat)
    assert tracker.pending == 1
    assert tracker.committable == 5
    tracker.track(6)
    assert tracker.pending == 2


def test_gaps_are_skipped_by_committable() -> None:
    tracker = CommitTracker(0)
    for offset in (0, 2, 3, 7, PAGE - 1, PAGE + 4, 5 * PAGE):
        tracker.track(offset)
    assert tracker.settle(0)
    assert tracker.committable == 2
    assert not tracker.settle(1)  # a gap offset was never tracked
    assert not tracker.is_pending(1)
    assert tracker.settle(3)
    assert tracker.settle(2)
    assert tracker.committable == 7
    assert tracker.settle(PAGE + 4)
    assert tracker.settle(7)
    assert tracker.committable == PAGE - 1
    assert tracker.settled_above() == [PAGE + 4]
    assert tracker.settle(PAGE - 1)
    assert tracker.committable == 5 * PAGE
    assert tracker.settle(5 * PAGE)
    assert tracker.committable == 5 * PAGE + 1


def test_huge_gap_is_cheap_and_correct() -> None:
    tracker = CommitTracker(0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracker.track(0)
        tracker.track(10**12)
        tracker.track(10**12 + 1)
        tracker.track(10**18)
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert used < 64 * 1024
    assert tracker.pending == 4
    assert tracker.settle(10**12)
    assert tracker.settled_above() == [10**12]
    assert tracker.settle(0)
    assert tracker.committable == 10**12 + 1
    assert tracker.settle(10**12 + 1)
    assert tracker.committable == 10**18
    assert tracker.settle(10**18)
    assert tracker.committable == 10**18 + 1


def test_memory_is_released_as_committable_advances() -> None:
    tracker = CommitTracker(0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for offset in range(200_000):
            tracker.track(offset)
        grown = tracemalloc.get_traced_memory()[0] - before
        for offset in range(199_999):
            tracker.settle(offset)
        left = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown > 200_000  # the window really was held: at least a byte per offset
    assert left < grown // 4
    assert tracker.committable == 199_999


def test_settle_unknown_duplicate_and_below_committable() -> None:
    tracker = CommitTracker(10)
    tracker.track(10)
    tracker.track(11)
    assert not tracker.settle(9)  # below start, never tracked
    assert not tracker.settle(12)  # above last tracked
    assert not tracker.settle(-1)
    assert not tracker.settle(10**30)
    assert tracker.settle(10)
    assert not tracker.settle(10)  # duplicate, now below committable
    assert tracker.settle(11)
    assert not tracker.settle(11)  # duplicate after the window drained
    assert tracker.pending == 0
    assert tracker.committable == 12


def test_duplicate_settle_above_committable() -> None:
    tracker = CommitTracker(0)
    tracker.track(0)
    tracker.track(1)
    assert tracker.settle(1)
    assert not tracker.settle(1)
    assert tracker.pending == 1
    assert tracker.is_pending(0)
    assert not tracker.is_pending(1)


def test_tracking_resumes_after_window_drains() -> None:
    tracker = CommitTracker(0)
    tracker.track(PAGE - 1)
    assert tracker.settle(PAGE - 1)
    tracker.track(PAGE)  # a new page right after the drained one
    tracker.track(PAGE + 1)
    assert tracker.committable == PAGE
    assert tracker.settle(PAGE + 1)
    assert tracker.settled_above() == [PAGE + 1]
    tracker.track(PAGE + 2)
    assert tracker.settle(PAGE)
    assert tracker.committable == PAGE + 2


def test_drain_within_one_page_then_track_same_page() -> None:
    tracker = CommitTracker(0)
    tracker.track(3)
    assert tracker.settle(3)
    tracker.track(4)
    assert tracker.is_pending(4)
    assert tracker.committable == 4
    assert tracker.settle(4)
    assert tracker.committable == 5


@given(
    gaps=st.lists(st.integers(min_value=0, max_value=3 * PAGE), min_size=1, max_size=60),
    rng=st.randoms(use_true_random=False),
)
def test_any_settle_order_ends_at_last_plus_one(gaps: list[int], rng: random.Random) -> None:
    offsets = []
    offset = -1
    for gap in gaps:
        offset += gap + 1
        offsets.append(offset)
    tracker = CommitTracker(0)
    for offset in offsets:
        tracker.track(offset)
    order = list(offsets)
    rng.shuffle(order)
    for settled, offset in enumerate(order, start=1):
        assert tracker.settle(offset)
        assert tracker.pending == len(offsets) - settled
    assert tracker.committable == offsets[-1] + 1
    assert tracker.settled_above() == []


class Model:
    """The obviously correct version: plain sets, O(n) everything."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.tracked: set[int] = set()
        self.settled: set[int] = set()
        self.last: int | None = None

    def track(self, offset: int) -> None:
        if offset < self.start or (self.last is not None and offset <= self.last):
            raise ValueError(f"{offset} is not above the last tracked offset")
        self.tracked.add(offset)
        self.last = offset

    def settle(self, offset: int) -> bool:
        if offset in self.tracked and offset not in self.settled and offset >= self.committable:
            self.settled.add(offset)
            return True
        return False

    def is_pending(self, offset: int) -> bool:
        return offset in self.tracked and offset not in self.settled

    @property
    def committable(self) -> int:
        unsettled = self.tracked - self.settled
        if unsettled:
            return min(unsettled)
        return self.start if self.last is None else self.last + 1

    @property
    def pending(self) -> int:
        return len(self.tracked - self.settled)

    def settled_above(self) -> list[int]:
        return sorted(o for o in self.settled if o > self.committable)


GAPS = st.one_of(
    st.just(0),
    st.integers(min_value=0, max_value=3),
    st.integers(min_value=PAGE - 3, max_value=PAGE + 3),
    st.integers(min_value=0, max_value=4 * PAGE),
    st.integers(min_value=10**6, max_value=10**15),
)


class TrackerMachine(RuleBasedStateMachine):
    """Random interleavings of track and settle, checked against Model after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Model(0)
        self.tracker = CommitTracker(0)

    @initialize(start=st.one_of(st.integers(0, 3 * PAGE), st.integers(0, 10**15)))
    def start(self, start: int) -> None:
        self.model = Model(start)
        self.tracker = CommitTracker(start)

    def _next_offset(self, gap: int) -> int:
        return (self.model.start if self.model.last is None else self.model.last + 1) + gap

    @rule(gap=GAPS, count=st.integers(1, 8))
    def track_run(self, gap: int, count: int) -> None:
        first = self._next_offset(gap)
        for offset in range(first, first + count):
            self.model.track(offset)
            self.tracker.track(offset)

    @rule(gap=GAPS)
    def track_one(self, gap: int) -> None:
        offset = self._next_offset(gap)
        self.model.track(offset)
        self.tracker.track(offset)

    @rule(back=st.integers(0, 5))
    def track_not_increasing(self, back: int) -> None:
        offset = self._next_offset(0) - 1 - back
        with pytest.raises(ValueError, match="not above"):
            self.tracker.track(offset)
        with pytest.raises(ValueError, match="not above"):
            self.model.track(offset)

    @precondition(lambda self: self.model.pending > 0)
    @rule(data=st.data())
    def settle_pending(self, data: st.DataObject) -> None:
        unsettled = sorted(self.model.tracked - self.model.settled)
        offset = data.draw(st.sampled_from(unsettled))
        assert self.tracker.settle(offset) is self.model.settle(offset) is True

    @precondition(lambda self: self.model.pending > 0)
    @rule()
    def settle_committable(self) -> None:
        offset = self.model.committable
        assert self.tracker.settle(offset) is self.model.settle(offset) is True

    @rule(data=st.data())
    def settle_anything(self, data: st.DataObject) -> None:
        known = sorted(self.model.tracked)
        near = (self.model.last or self.model.start) if known else self.model.start
        candidates = st.one_of(
            st.integers(near - 2 * PAGE, near + 2 * PAGE),
            st.integers(-(10**16), 10**16),
            *([st.sampled_from(known)] if known else []),
        )
        offset = data.draw(candidates)
        assert self.tracker.settle(offset) is self.model.settle(offset)
        assert self.tracker.is_pending(offset) is self.model.is_pending(offset)

    @rule(data=st.data())
    def probe_is_pending(self, data: st.DataObject) -> None:
        pool = sorted(self.model.tracked | {self.model.start - 1, self._next_offset(0)})
        offset = data.draw(st.sampled_from(pool))
        assert self.tracker.is_pending(offset) is self.model.is_pending(offset)

    @invariant()
    def matches_model(self) -> None:
        assert self.tracker.committable == self.model.committable
        assert self.tracker.pending == self.model.pending
        assert self.tracker.settled_above() == self.model.settled_above()


TrackerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_tracker_matches_model = TrackerMachine.TestCase


@pytest.mark.parametrize(
    ("start", "spans"),
    [
        (0, [(0, 0)]),
        (5, [(5, PAGE + 3), (PAGE + 4, 3 * PAGE + 1)]),
        (PAGE - 2, [(PAGE - 2, PAGE + 1), (PAGE + 9, 2 * PAGE)]),  # a gap between the spans
    ],
)
def test_track_span_is_track_of_each_offset(start: int, spans: list[tuple[int, int]]) -> None:
    bulk, single = CommitTracker(start), CommitTracker(start)
    for first, last in spans:
        bulk.track_span(first, last)
        for offset in range(first, last + 1):
            single.track(offset)
    assert (bulk.committable, bulk.pending, bulk.next_offset) == (
        single.committable,
        single.pending,
        single.next_offset,
    )
    for first, last in spans:  # settle the same way, checking the two agree throughout
        for offset in range(last, first - 1, -1):
            assert bulk.settle(offset) == single.settle(offset)
            assert bulk.committable == single.committable
            assert bulk.settled_above() == single.settled_above()
    assert bulk.pending == 0
    with pytest.raises(ValueError, match="not above"):
        bulk.track_span(spans[-1][1], spans[-1][1] + 2)
