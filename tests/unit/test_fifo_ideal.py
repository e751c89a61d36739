"""The in-process FIFO dispatcher bench_efficiency measures Python's own floor with."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from tests.perf.fifo_ideal import run_tasks, run_threads

WORKLOAD = [("ordinary", 2)] * 40 + [("slow", 30), ("poison", 0)] + [("ordinary", 2)] * 20
SLOTS = 4


def check(makespan: float, records: list[list[float]]) -> None:
    """Every offset ran once; a pill held its slot for no time; the makespan is at least the
    longest job and the work spread over every slot (true of any schedule)."""
    assert sorted(int(r[0]) for r in records) == list(range(len(WORKLOAD)))
    by_offset = {int(r[0]): r for r in records}
    for offset, (kind, ms) in enumerate(WORKLOAD):
        _, start, finish = by_offset[offset]
        assert finish - start >= ms / 1000 * 0.99, (offset, kind)
        if kind == "poison":
            assert finish - start < 0.002
    nominal = [ms / 1000 for _, ms in WORKLOAD]
    assert makespan >= max(max(nominal), sum(nominal) / SLOTS) * 0.99
    assert makespan == pytest.approx(
        max(r[2] for r in records) - min(r[1] for r in records), abs=1e-9
    )


def test_threads_run_every_message_once_starting_in_offset_order() -> None:
    makespan, records = run_threads(WORKLOAD, SLOTS)
    check(makespan, records)
    # list scheduling: a later offset never starts before an earlier one
    starts = [start for _, start, _ in sorted(records)]
    assert starts == sorted(starts)


def test_async_tasks_run_every_message_once_starting_in_offset_order() -> None:
    makespan, records = asyncio.run(run_tasks(WORKLOAD, SLOTS))
    check(makespan, records)
    starts = [start for _, start, _ in sorted(records)]
    assert starts == sorted(starts)


@pytest.mark.parametrize("mode", [[], ["--async"]])
def test_the_script_reads_the_workload_and_prints_one_json_line(mode: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tests.perf.fifo_ideal", "--slots", str(SLOTS), *mode],
        input=json.dumps(WORKLOAD),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    check(answer["makespan"], answer["records"])
    assert answer["cpu"] > 0
