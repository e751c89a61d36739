"""The FIFO bound the head-of-line benchmarks measure their efficiency against."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.perf.fifo_bound import efficiency, fifo_bound


def test_no_jobs_take_no_time() -> None:
    assert fifo_bound([], 4) == 0.0


def test_one_slot_is_the_serial_sum() -> None:
    assert fifo_bound([1.0, 2.0, 3.0], 1) == pytest.approx(6.0)


def test_uniform_jobs_fill_the_slots_evenly() -> None:
    assert fifo_bound([0.002] * 3200, 32) == pytest.approx(0.2)


def test_more_slots_than_jobs_is_the_longest_job() -> None:
    assert fifo_bound([0.1, 0.5, 0.2], 8) == pytest.approx(0.5)


def test_a_slow_job_late_in_the_order_sets_the_end() -> None:
    # 2 slots: 1 1 | 1 1 | then the slow one starts at 2 and ends at 12.
    assert fifo_bound([1, 1, 1, 1, 10], 2) == pytest.approx(12.0)


def test_first_in_first_out_is_not_the_optimal_schedule() -> None:
    # Longest first would give 10; in order, the 10 starts only after a 1 on its slot.
    assert fifo_bound([1, 1, 10], 2) == pytest.approx(11.0)


def test_poison_pills_hold_a_slot_for_no_time() -> None:
    assert fifo_bound([0.0] * 100 + [1.0], 2) == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_nonsense_durations_are_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="durations"):
        fifo_bound([1.0, bad], 2)


def test_no_slots_is_refused() -> None:
    with pytest.raises(ValueError, match="slots"):
        fifo_bound([1.0], 0)


def test_efficiency_is_bound_over_measured() -> None:
    assert efficiency(0.9, 1.0) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="measured"):
        efficiency(1.0, 0.0)


@given(
    st.lists(st.floats(min_value=0, max_value=10, allow_nan=False), max_size=200),
    st.integers(min_value=1, max_value=40),
)
def test_the_bound_lies_between_the_averages_and_graham(durations: list[float], slots: int) -> None:
    bound = fifo_bound(durations, slots)
    total, longest = sum(durations), max(durations, default=0.0)
    slack = 1e-9 * (1 + total)
    assert bound >= max(total / slots, longest) - slack
    # Graham's list-scheduling guarantee: never worse than average load + longest job.
    assert bound <= total / slots + longest + slack
    assert fifo_bound(durations, slots + 1) <= bound + slack
