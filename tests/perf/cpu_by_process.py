"""CPU seconds a command and every process it starts use, by kind of process.

Why: the README's test command is CPU-bound on 2 cores, so its time follows the CPU its
processes use, spread over hundreds of short processes (proxies, `triage` commands, moto
servers, JVMs) that no profiler of one process sees. This runs the command, reads each
descendant's CPU (user + system, every thread) from /proc every `--every` seconds until
the command ends, and prints the total by kind and the costliest kinds' counts. A process
that lives less than one interval, or the CPU a process uses after the last reading, is
not counted, so the total is a floor. Linux only.

    .venv/bin/python -m tests.perf.cpu_by_process [--every 0.25] [--top 25] -- .venv/bin/pytest
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tests.perf.cpumeter import command_line, proc_stat

KINDS: tuple[tuple[str, str], ...] = (
    (r"exec\(eval\(sys\.stdin", "pytest worker (tests in-process)"),
    (r"bin/pytest", "pytest controller"),
    (r"tansu", "broker (Tansu)"),
    (r"motoserver|moto\.server", "moto server"),
    (r"org\.apache\.spark|spark-class", "Spark JVM"),
    (r"pyspark\.daemon|pyspark\.worker", "Spark Python worker"),
    (r"triage_cli\.main proxy|triage proxy", "proxy"),
    (r"tests\.fault\.instance", "fault-suite consumer"),
    (r"triage_conformance", "conformance kit"),
    (r"chrom", "Chromium"),
    (r"\btsc\b|typescript/bin", "tsc"),
    (r"\bnpm\b", "npm"),
    (r"\bnode\b", "node"),
    (r"\bmypy\b", "mypy"),
    (r"\bruff\b", "ruff"),
    (r"mkdocs", "mkdocs"),
    (r"triage_cli\.main|bin/triage\b", "triage command"),
    (r"python", "other Python"),
)


def kind(command: str) -> str:
    """The first kind whose pattern the command line matches; else its program's name."""
    for pattern, name in KINDS:
        if re.search(pattern, command):
            return name
    return Path(command.split(" ", 1)[0]).name or "?"


@dataclass
class Seen:
    command: str
    cpu: float = 0.0


def sample(root: int, seen: dict[tuple[int, int], Seen], tracked: set[int]) -> None:
    """One reading: each descendant of `root` (a process is one once its parent is)."""
    found = [(int(p), s) for p in os.listdir("/proc") if p.isdigit() and (s := proc_stat(p))]
    found.sort(key=lambda item: item[1][1])  # parents start before their children
    for pid, (ppid, started, cpu) in found:
        if pid != root and ppid not in tracked and pid not in tracked:
            continue
        tracked.add(pid)
        entry = seen.get((pid, started))
        if entry is None:
            entry = seen[(pid, started)] = Seen((command_line(pid) or "").strip())
        entry.cpu = max(entry.cpu, cpu)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=0.25, help="seconds between readings")
    parser.add_argument("--top", type=int, default=25, help="kinds to print")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    started = time.monotonic()
    process = subprocess.Popen(command)
    seen: dict[tuple[int, int], Seen] = {}
    tracked = {process.pid}
    while process.poll() is None:
        sample(process.pid, seen, tracked)
        time.sleep(args.every)
    wall = time.monotonic() - started
    by_kind: dict[str, list[float]] = defaultdict(list)
    for entry in seen.values():
        by_kind[kind(entry.command)].append(entry.cpu)
    total = sum(entry.cpu for entry in seen.values())
    print(f"\n{' '.join(command)}: exit {process.returncode}, {wall:.1f} s wall, ", end="")
    print(f"{total:.1f} s of CPU read in {len(seen)} processes ({os.cpu_count()} cores)")
    print(f"{'CPU s':>8} {'share':>6} {'procs':>6} {'median':>7}  kind")
    ranked = sorted(by_kind.items(), key=lambda item: -sum(item[1]))
    for name, cpus in ranked[: args.top]:
        median = sorted(cpus)[len(cpus) // 2]
        share = sum(cpus) / total * 100 if total else 0.0
        print(f"{sum(cpus):8.1f} {share:5.1f}% {len(cpus):6d} {median:7.2f}  {name}")
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
