"""The soak's breakdown of a process's threads by name and descriptors by kind
(tests/perf/soak.py), read from this process's own /proc entries."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter

import psutil
import pytest

from tests.perf.soak import Sample, changes, differences, kinds, process_sample


def test_a_named_thread_and_an_open_pipe_are_counted_by_kind() -> None:
    names, fds = kinds(os.getpid())
    read, write = os.pipe()
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        with open(f"/proc/self/task/{worker.native_id}/comm", "w") as comm:
            comm.write("soak-probe")
        more_names, more_fds = kinds(os.getpid())
    finally:
        stop.set()
        worker.join()
        os.close(read)
        os.close(write)
    assert more_names["soak-probe"] == names["soak-probe"] + 1
    assert more_fds["pipe:[N]"] == fds["pipe:[N]"] + 2


def test_differences_name_each_count_that_changed() -> None:
    first = Counter({"event_engine": 5, "python": 10, "rdk:main": 3})
    last = Counter({"event_engine": 4, "python": 11, "rdk:main": 3, "grpc": 1})
    assert differences(first, last) == "event_engine 5 -> 4, grpc 0 -> 1, python 10 -> 11"
    assert differences(first, Counter(first)) == "none"


def sample(at_s: float, pid: int, threads: dict[str, int], fds: dict[str, int]) -> Sample:
    return Sample(
        at_s, pid, 50.0, sum(fds.values()), sum(threads.values()), Counter(threads), Counter(fds)
    )


def test_changes_compare_each_sample_with_the_same_process_previous_one() -> None:
    samples = [
        sample(60, 1, {"python": 10}, {"socket:[N]": 5}),
        sample(120, 1, {"python": 11}, {"socket:[N]": 5}),
        sample(180, 2, {"python": 9}, {"socket:[N]": 7}),  # a new proxy: nothing to compare
        sample(240, 2, {"python": 9}, {"socket:[N]": 8, "pipe:[N]": 1}),
    ]
    assert changes(samples) == [
        "",
        "threads: python 10 -> 11; fds: none",
        "",
        "threads: none; fds: pipe:[N] 0 -> 1, socket:[N] 7 -> 8",
    ]


def test_a_process_sample_counts_what_its_breakdown_shows() -> None:
    taken = process_sample(os.getpid(), 1.0)
    assert taken.threads == sum(taken.thread_names.values()) >= 1
    assert taken.fds == sum(taken.fd_kinds.values()) >= 3  # stdin, stdout, stderr at least
    assert taken.rss_mib > 0


def test_a_process_that_is_gone_is_no_sample() -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    with pytest.raises(psutil.NoSuchProcess):
        process_sample(int(gone.stdout), 1.0)


def test_a_process_that_exited_unreaped_is_no_sample() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        wait_for_zombie(child.pid)
        with pytest.raises(psutil.ZombieProcess):
            process_sample(child.pid, 1.0)
    finally:
        child.wait()


def wait_for_zombie(pid: int, bound_s: float = 30.0) -> None:
    deadline = time.monotonic() + bound_s
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"{pid} still running after {bound_s} s"
        time.sleep(0.01)
