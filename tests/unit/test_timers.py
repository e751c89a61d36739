"""Timers: edge cases, plus a stateful comparison against a plain dict model."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from triage_proxy.pipeline.timers import Timers


def heap_size(timers: Timers[Any]) -> int:
    """Entries the heap holds, live and stale (internal: memory-bound checks only)."""
    return len(timers._heap)


def test_empty() -> None:
    timers: Timers[int] = Timers()
    assert len(timers) == 0
    assert timers.next_due() is None
    assert timers.pop_due(math.inf) == []
    assert timers.due_of(1) is None
    assert 1 not in timers
    assert not timers.cancel(1)


def test_pops_in_due_order_and_inclusive_of_now() -> None:
    timers: Timers[int] = Timers()
    timers.schedule(1, 30.0)
    timers.schedule(2, 10.0)
    timers.schedule(3, 20.0)
    assert timers.next_due() == 10.0
    assert timers.pop_due(9.999) == []
    assert timers.pop_due(20.0) == [2, 3]
    assert len(timers) == 1
    assert 1 in timers
    assert 2 not in timers
    assert timers.next_due() == 30.0
    assert timers.pop_due(100.0) == [1]
    assert timers.next_due() is None
    assert len(timers) == 0


def test_ties_go_in_schedule_order() -> None:
    timers: Timers[int] = Timers()
    for key in (5, 3, 9, 1):
        timers.schedule(key, 7.0)
    assert timers.pop_due(7.0) == [5, 3, 9, 1]


def test_reschedule_counts_as_a_new_schedule_for_ties() -> None:
    timers: Timers[int] = Timers()
    timers.schedule(1, 7.0)
    timers.schedule(2, 7.0)
    timers.schedule(1, 7.0)
    assert timers.pop_due(7.0) == [2, 1]


def test_reschedule_later_replaces_the_old_deadline() -> None:
    timers: Timers[int] = Timers()
    timers.schedule(1, 10.0)
    timers.schedule(1, 50.0)
    assert len(timers) == 1
    assert timers.due_of(1) == 50.0
    assert timers.next_due() == 50.0
    assert timers.pop_due(10.0) == []
    assert timers.pop_due(50.0) == [1]
    assert timers.pop_due(1e9) == []


def test_reschedule_earlier_replaces_the_old_deadline() -> None:
    timers: Timers[int] = Timers()
    timers.schedule(1, 50.0)
    timers.schedule(1, 10.0)
    assert timers.pop_due(10.0) == [1]
    assert timers.pop_due(50.0) == []
    assert len(timers) == 0


def test_cancel() -> None:
    timers: Timers[int] = Timers()
    timers.schedule(1, 10.0)
    timers.schedule(2, 20.0)
    assert timers.cancel(1)
    assert not timers.cancel(1)
    assert timers.due_of(1) is None
    assert timers.next_due() == 20.0
    assert timers.pop_due(100.0) == [2]
    timers.schedule(1, 5.0)  # a cancelled key can come back
    assert timers.pop_due(5.0) == [1]


def test_nan_deadline_is_refused_and_infinity_never_fires() -> None:
    timers: Timers[int] = Timers()
    with pytest.raises(ValueError, match="NaN"):
        timers.schedule(1, math.nan)
    assert len(timers) == 0
    timers.schedule(1, math.inf)
    timers.schedule(2, -math.inf)
    assert timers.pop_due(1e300) == [2]
    assert timers.next_due() == math.inf
    assert timers.pop_due(math.inf) == [1]


def test_keys_only_need_to_be_hashable() -> None:
    # Keys that do not order against each other: ties must never compare them.
    timers: Timers[object] = Timers()
    a, b, c = ("t", 0), frozenset({1}), None
    for key in (a, b, c):
        timers.schedule(key, 1.0)
    assert timers.pop_due(1.0) == [a, b, c]


def test_rescheduling_one_key_forever_keeps_memory_bounded() -> None:
    timers: Timers[int] = Timers()
    for i in range(10_000):
        timers.schedule(1, float(i % 97))
        assert heap_size(timers) <= 2 * len(timers)
    assert len(timers) == 1
    assert timers.due_of(1) == float(9_999 % 97)


def test_churn_keeps_memory_bounded_by_live_keys() -> None:
    rng = random.Random(7)
    timers: Timers[int] = Timers()
    for _ in range(50_000):
        key = rng.randrange(500)
        op = rng.random()
        if op < 0.6:
            timers.schedule(key, rng.uniform(0, 1000))
        elif op < 0.9:
            timers.cancel(key)
        else:
            timers.pop_due(rng.uniform(0, 300))
        assert heap_size(timers) <= 2 * len(timers)
    # Cancelling everything leaves nothing behind.
    for key in range(500):
        timers.cancel(key)
    assert len(timers) == 0
    assert heap_size(timers) == 0


def test_next_due_skips_stale_entries() -> None:
    timers: Timers[int] = Timers()
    for key in range(10):
        timers.schedule(key, float(key))
    for key in range(4):
        timers.schedule(key, 100.0 + key)
    assert timers.next_due() == 4.0
    assert timers.pop_due(99.0) == [4, 5, 6, 7, 8, 9]
    assert timers.pop_due(1000.0) == [0, 1, 2, 3]


# -- stateful comparison against a trivially correct model ------------------------------

KEYS = st.integers(0, 12)
# Few distinct deadlines, so ties and reschedules to the same deadline are common.
DUES = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, 5.0, 8.0, -1.0, math.inf])
NOWS = st.sampled_from([-2.0, 0.0, 0.5, 1.0, 2.5, 3.0, 6.0, 100.0, math.inf])


class TimersMachine(RuleBasedStateMachine):
    """Timers must behave exactly like a dict of key -> (due, schedule number)."""

    def __init__(self) -> None:
        super().__init__()
        self.timers: Timers[int] = Timers()
        self.model: dict[int, tuple[float, int]] = {}
        self.stamp = 0

    @rule(key=KEYS, due=DUES)
    def schedule(self, key: int, due: float) -> None:
        self.timers.schedule(key, due)
        self.model[key] = (due, self.stamp)
        self.stamp += 1

    @rule(key=KEYS)
    def cancel(self, key: int) -> None:
        expected = self.model.pop(key, None) is not None
        assert self.timers.cancel(key) == expected

    @rule(now=NOWS)
    def pop_due(self, now: float) -> None:
        due = sorted((entry, key) for key, entry in self.model.items() if entry[0] <= now)
        expected = [key for _, key in due]
        for key in expected:
            del self.model[key]
        assert self.timers.pop_due(now) == expected

    @rule()
    def next_due(self) -> None:
        expected = min((due for due, _ in self.model.values()), default=None)
        assert self.timers.next_due() == expected

    @invariant()
    def agrees_with_model(self) -> None:
        assert len(self.timers) == len(self.model)
        for key in range(13):
            assert (key in self.timers) == (key in self.model)
            entry = self.model.get(key)
            assert self.timers.due_of(key) == (None if entry is None else entry[0])
        assert heap_size(self.timers) <= 2 * len(self.model)


TimersMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
test_timers_match_model = TimersMachine.TestCase
