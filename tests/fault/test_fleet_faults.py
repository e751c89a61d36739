"""The fault suite's fleet scenario, shortened for CI: partitions move, nothing is lost.

Why in CI: a fleet moves partitions between processes whenever one joins, leaves or
dies, and each move must keep the guarantees (nothing lost, commits reach the end, no
redelivery beyond what was in flight, no partition long without a process). Same code
path as `python -m tests.fault.fleet` (`run_fleet`): 3 fleet processes on 6 partitions,
a 4th joins, one is SIGTERMed, one SIGKILLed, with crash pills killing instances: every
pill is dead-lettered and no healthy message is (an instance process streams several
partitions, and a pill on one must not cost the others' deliveries an attempt).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.fault.fleet import MAX_GAP_S, FleetOptions, render, run_fleet

# One xdist worker runs the CPU-heavy tests one after another (--dist loadgroup), while
# the others go on with the rest; the cpu_heavy lock guards any other --dist mode.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("cpu-heavy")]

CI_BUDGET_S = 150


@pytest.mark.usefixtures("cpu_heavy")  # its CI budget assumes the CPU to itself
def test_a_fleet_that_gains_and_loses_processes_loses_nothing(tmp_path: Path) -> None:
    options = FleetOptions(
        messages=2000, duration_s=30.0, seed=5, timeout_s=90.0, work_dir=tmp_path
    )
    started = time.monotonic()
    report = run_fleet(options)
    elapsed = time.monotonic() - started
    summary = render(report)

    assert not report.unfinished, summary
    assert report.lost == [], summary
    assert all(report.committed.get(p, -1) >= end for p, end in report.ends.items()), summary
    assert sorted(report.ends) == list(range(6)), summary
    assert [e.kind for e in report.events] == ["join", "sigterm", "sigkill"], summary
    assert not report.not_exact, summary
    assert not report.mismatched, report.mismatched[:5]
    assert report.crash_pills >= 1
    assert report.crash_pills_dead == report.crash_pills, summary
    assert report.collateral_dead == 0, summary  # crashes cost only the crasher
    assert max(report.per_move.values(), default=0) <= report.window, summary
    assert max(report.gaps.values()) <= MAX_GAP_S, summary
    assert not report.unexpected_exits, summary
    assert elapsed < CI_BUDGET_S, summary
