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


TRACKER = "from multiprocessing.resource_tracker import main"


def test_a_helper_that_ends_within_the_grace_is_neither_killed_nor_named() -> None:
    """A multiprocessing resource tracker exits once its worker has, maybe just after the
    run's last test: it gets the grace. A process that is no such helper does not."""
    marker = "a-test-marker-of-the-grace"
    env = {**os.environ, leftovers.RUN_MARKER: marker}
    ending = subprocess.Popen(
        [sys.executable, "-c", f"import time; time.sleep(0.5)  # {TRACKER}"], env=env
    )
    staying = subprocess.Popen(
        [sys.executable, "-c", f"import time; time.sleep(120)  # {TRACKER}"], env=env
    )
    other = subprocess.Popen(SLEEPER, env=env)
    try:
        started = time.monotonic()
        killed = leftovers.sweep(marker, grace=10.0)
        assert sorted(p.pid for p in killed) == sorted([staying.pid, other.pid])
        assert time.monotonic() - started >= 10.0  # the helper that stays had the grace
        assert ending.wait(timeout=30) == 0
        assert staying.wait(timeout=30) == -9
        assert other.wait(timeout=30) == -9
    finally:
        for proc in (ending, staying, other):
            proc.kill()
            proc.wait()


def test_a_process_that_is_no_helper_is_killed_at_once() -> None:
    marker = "a-test-marker-of-no-grace"
    other = subprocess.Popen(SLEEPER, env={**os.environ, leftovers.RUN_MARKER: marker})
    try:
        started = time.monotonic()
        assert [p.pid for p in leftovers.sweep(marker, grace=60.0)] == [other.pid]
        assert time.monotonic() - started < 30.0
        assert other.wait(timeout=30) == -9
    finally:
        other.kill()
        other.wait()


def test_a_process_caught_exiting_gets_the_grace_and_any_other_is_killed_at_once() -> None:
    """`marked` read its environment, then found its command line gone: it is exiting."""
    assert leftovers.ends_alone(leftovers.Leftover(1, ""))
    assert not leftovers.ends_alone(leftovers.Leftover(1, "python -c import time"))
    tracker = "python -c from multiprocessing.resource_tracker import main;main(5)"
    assert leftovers.ends_alone(leftovers.Leftover(1, tracker))
