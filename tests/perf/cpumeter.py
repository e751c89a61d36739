"""CPU seconds spent by this process's descendants, by role, over a time window.

Why: on a machine shared with other work, messages/s moves with the load, but the CPU a
message costs each process (proxy, consumer instances, broker) barely does; comparing
those tells which process a change made cheaper. Linux only (/proc); elsewhere it
reports nothing.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _role(cmdline: str) -> str | None:
    if "instance.py" in cmdline:
        return "instances"
    if "triage_cli.main" in cmdline and " proxy" in cmdline:
        return "proxy"
    if "tansu" in cmdline:
        return "broker"
    return None


def proc_stat(pid: int | str) -> tuple[int, int, float] | None:
    """(parent pid, start time in clock ticks, user + system CPU seconds) of a live process
    (Linux /proc); None once gone. The start time tells a process from a later one given
    the same pid."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / TICKS


def command_line(pid: int | str) -> str | None:
    """A live process's command line, its arguments joined by spaces; None once gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := proc_stat(entry.name)) is not None:
            tree.setdefault(stat[0], []).append(int(entry.name))
    return tree


def _cpu(pid: int) -> float | None:
    stat = proc_stat(pid)
    return None if stat is None else stat[2]


def reaped_children_cpu() -> float:
    """User + system CPU seconds of this process's children that have been waited for,
    with their own reaped children's (getrusage RUSAGE_CHILDREN): the difference around a
    `subprocess.run` is that command's CPU, whatever it waited for on a loaded machine."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` used so far (Linux /proc); 0 once gone."""
    return _cpu(pid) or 0.0


class CpuMeter:
    """Samples every descendant's CPU time every `period` s while open."""

    def __init__(self, period: float = 0.05) -> None:
        self._period = period
        self._samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuMeter:
        if Path("/proc/self/stat").exists():
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        me = os.getpid()
        roles: dict[int, str | None] = {}
        while not self._stop.wait(self._period):
            tree = _children()
            todo, found = list(tree.get(me, [])), {}
            while todo:
                pid = todo.pop()
                todo.extend(tree.get(pid, []))
                if pid not in roles:
                    if (cmd := command_line(pid)) is None:
                        continue
                    roles[pid] = _role(cmd)
                role = roles[pid]
                if role is not None and (cpu := _cpu(pid)) is not None:
                    found[pid] = (role, cpu)
            self._samples.append((time.time(), found))

    def between(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds by role from `start` to `end` (time.time()), from the samples nearest
        inside the window, for processes alive at both ends."""
        inside = [s for s in self._samples if start <= s[0] <= end]
        if len(inside) < 2:
            return {}
        (t0, first), (t1, last) = inside[0], inside[-1]
        scale = (end - start) / (t1 - t0) if t1 > t0 else 1.0
        used: dict[str, float] = {}
        for pid, (role, cpu) in last.items():
            if pid in first:
                used[role] = used.get(role, 0.0) + (cpu - first[pid][1]) * scale
        return used


def cpu_row(used: dict[str, float], messages: int) -> str:
    """CPU ms per 1,000 messages by role, for a table."""
    if not used:
        return "n/a"
    per = {role: 1000 * 1000 * s / messages for role, s in sorted(used.items())}
    return ", ".join(f"{role} {ms:.1f}" for role, ms in per.items())


def last_window(meter: CpuMeter, duration: float) -> dict[str, float]:
    """CPU by role over the `duration` s that ended when the consumer instances were last
    seen alive (they are stopped right after the last commit)."""
    seen = [t for t, found in meter._samples if any(r == "instances" for r, _ in found.values())]
    if not seen:
        return {}
    return meter.between(seen[-1] - duration, seen[-1])
