"""tests/leftovers.py: what a run left running is found by its marker, and only that."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests import leftovers

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def test_a_marked_process_is_killed_and_named_and_an_unmarked_one_is_left() -> None:
    marker = "a-test-marker-of-test-leftovers"
    env = {**os.environ, leftovers.RUN_MARKER: marker}
    other = {**os.environ, leftovers.RUN_MARKER: "another-run"}
    ours = subprocess.Popen(SLEEPER, env=env)
    theirs = subprocess.Popen(SLEEPER, env=other)
    try:
        assert [p.pid for p in leftovers.marked(marker)] == [ours.pid]
        killed = leftovers.sweep(marker)
        assert [(p.pid, "time.sleep(120)" in p.command) for p in killed] == [(ours.pid, True)]
        assert ours.wait(timeout=30) == -9
        assert theirs.poll() is None
        assert leftovers.marked(marker) == []
    finally:
        for proc in (ours, theirs):
            proc.kill()
            proc.wait()


def test_a_run_marks_what_it_starts() -> None:
    """The controller marked the run before this test's process started (a worker under
    xdist, or this process itself with -n 0): a child of this test carries the mark."""
    marker = os.environ[leftovers.RUN_MARKER]
    child = subprocess.Popen(SLEEPER)
    try:
        deadline = time.monotonic() + 30
        while child.pid not in [p.pid for p in leftovers.marked(marker)]:
            assert time.monotonic() < deadline, "the child never showed the run's marker"
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()


def test_a_process_that_ends_within_the_grace_is_neither_killed_nor_named() -> None:
    """Like a multiprocessing resource tracker that exits just after its worker: only the
    process still running when the grace ends is a leftover."""
    marker = "a-test-marker-of-the-grace"
    env = {**os.environ, leftovers.RUN_MARKER: marker}
    ending = subprocess.Popen(["sleep", "0.2"], env=env)
    staying = subprocess.Popen(SLEEPER, env=env)
    try:
        killed = leftovers.sweep(marker, grace=5.0)
        assert [p.pid for p in killed] == [staying.pid]
        assert ending.wait(timeout=30) == 0
        assert staying.wait(timeout=30) == -9
    finally:
        for proc in (ending, staying):
            proc.kill()
            proc.wait()
