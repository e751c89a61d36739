"""Processes a test run started and left running: found by a marker in their environment,
killed by PID when the run ends, and named so the run fails.

Fixtures stop what they start, but a worker that dies (a segfault) runs no teardown: its
broker, moto server and whatever its test had started are reparented to init and outlive
the run. Every process the run starts inherits `RUN_MARKER` from the controller (unless
it was given an environment of its own), so `/proc/PID/environ` tells which ones are the
run's, wherever they were reparented.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

RUN_MARKER = "TRIAGE_TEST_RUN"


def mark_this_run() -> str:
    """A new marker in this process's environment, inherited by what it starts from now
    on; a nested run (a test that runs pytest) gets its own and sweeps only its own."""
    marker = uuid.uuid4().hex
    os.environ[RUN_MARKER] = marker
    return marker


@dataclass(frozen=True)
class Leftover:
    pid: int
    command: str


def marked(marker: str, proc: Path = Path("/proc")) -> list[Leftover]:
    """The live processes, other than this one, whose environment carries `marker`."""
    needle = f"{RUN_MARKER}={marker}".encode()
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            command = (entry / "cmdline").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            text = command.replace(b"\0", b" ").decode(errors="replace").strip()
            found.append(Leftover(int(entry.name), text))
    return found


ENDS_ALONE = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
"""Helpers that exit by themselves once the last process holding their pipe has: a
multiprocessing resource tracker started by a worker (a test spawned a child) reads EOF
when the worker exits, which may be just after xdist's controller stops waiting for it."""


def ends_alone(process: Leftover) -> bool:
    """A helper of ENDS_ALONE, or a process caught exiting: its memory (so its command
    line) was gone when `marked` read it, after its environment had matched (reported at
    once, it failed a run whose every test passed). One still there after the grace is
    killed and named like any other."""
    if not process.command:
        return True
    return any(f"from {module} import main" in process.command for module in ENDS_ALONE)


def sweep(marker: str, grace: float = 0.0) -> list[Leftover]:
    """Kill (SIGKILL) every process `marked(marker)`; return what was killed.

    Those that `ends_alone` get up to `grace` seconds to exit first; the others, a
    fixture's broker or a test's proxy, never end by themselves and are killed at once.
    """
    left = marked(marker)
    killed = [p for p in left if not ends_alone(p)]
    waiting = [p for p in left if ends_alone(p)]
    _kill(killed)
    deadline = time.monotonic() + grace
    while waiting and time.monotonic() < deadline:
        time.sleep(0.2)  # each look reads every process's environment
        alive = {p.pid for p in marked(marker)}
        waiting = [p for p in waiting if p.pid in alive]
    _kill(waiting)
    return killed + waiting


def _kill(processes: list[Leftover]) -> None:
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
