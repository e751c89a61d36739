"""Start-up cost: the CPU a `triage` command, and a proxy until it listens, spend.

Why: every command a user types and every proxy a fleet starts (a rollout, a failover,
the test suite's ~70 proxies and ~80 commands) pays it before doing any work. Measured:

- `triage --help` (imports and the command tree);
- `triage config check -c FILE` (a command that parses its options and reads a config);
- `triage proxy --config FILE --partition 0` against the embedded broker and DynamoDB
  endpoint: its CPU from the start until its gRPC port accepts (from /proc, every thread),
  and the wall time to that point. The proxy is then stopped with SIGTERM.

Each figure is the median over `--rounds`. With `--python` given twice (two interpreters,
e.g. two virtual environments holding different dependency versions), the rounds
alternate between them on one dev stack (A B, then B A, ...) and the ratios are printed:
side by side, as the shared machine's speed moves.

    .venv/bin/python -m tests.perf.bench_start [--rounds 9] [--python A --python B] [--verbose]

A second environment that differs in one package, e.g. typer 0.29.2, layered over this
one (its own site-packages first, then the project's .venv):

    python3 -m venv --without-pip /tmp/typer029
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \
        > /tmp/typer029/lib/python3.11/site-packages/zz_project.pth
    .venv/bin/uv pip install --python /tmp/typer029/bin/python --no-deps typer==0.29.2
    .venv/bin/python -m tests.perf.bench_start --rounds 12 \
        --python /tmp/typer029/bin/python --python .venv/bin/python
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.perf.cpumeter import cpu_seconds, reaped_children_cpu
from triage_cli.devstack import DevStack
from triage_cli.embedded import stop_process, wait_for_port

PROXY_READY_TIMEOUT_S = 60.0


@dataclass
class Figures:
    """One interpreter's samples, seconds."""

    help_cpu: list[float] = field(default_factory=list)
    check_cpu: list[float] = field(default_factory=list)
    proxy_cpu: list[float] = field(default_factory=list)
    proxy_wall: list[float] = field(default_factory=list)

    def samples(self) -> dict[str, list[float]]:
        return {
            "triage --help, CPU": self.help_cpu,
            "triage config check, CPU": self.check_cpu,
            "proxy start -> listening, CPU": self.proxy_cpu,
            "proxy start -> listening, wall": self.proxy_wall,
        }

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(values) for name, values in self.samples().items()}


def command_cpu(argv: list[str]) -> float:
    """CPU seconds (user + system) of one run of `argv`, which must succeed."""
    before = reaped_children_cpu()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    used = reaped_children_cpu() - before
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}")
    return used


def proxy_start(python: str, config: Path, port: int, log: Path) -> tuple[float, float]:
    """Start a proxy for partition 0, wait until it listens; (CPU, wall) seconds to that."""
    argv = [python, "-m", "triage_cli.main", "proxy", "--config", str(config), "-p", "0"]
    started = time.perf_counter()
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        wait_for_port("127.0.0.1", port, PROXY_READY_TIMEOUT_S, proc)
        wall = time.perf_counter() - started
        cpu = cpu_seconds(proc.pid)  # every thread's, from /proc
    finally:
        stop_process(proc, 30)
    return cpu, wall


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--python",
        action="append",
        default=None,
        help="interpreter to measure (default: this one); twice: side by side",
    )
    parser.add_argument("--verbose", action="store_true", help="print every round's figure")
    args = parser.parse_args()
    pythons: list[str] = args.python or [sys.executable]
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"start-up cost on {os.cpu_count()} cores, load average {load}, {args.rounds} rounds")
    figures = {python: Figures() for python in pythons}
    with DevStack(topic="bench-start", start_proxies=False) as stack:
        from triage_proxy.config.loader import load_settings

        config = stack.config_path
        port = load_settings(config).server.port
        log = stack.state_dir / "bench-start-proxies.log"
        for n in range(args.rounds):
            # A B, then B A: whichever goes first in a round runs ~20% slower here.
            for python in pythons if n % 2 == 0 else pythons[::-1]:
                cli = [python, "-m", "triage_cli.main"]
                seen = figures[python]
                seen.help_cpu.append(command_cpu([*cli, "--help"]))
                seen.check_cpu.append(command_cpu([*cli, "config", "check", "-c", str(config)]))
                cpu, wall = proxy_start(python, config, port, log)
                seen.proxy_cpu.append(cpu)
                seen.proxy_wall.append(wall)
    for python in pythons:
        print(f"\n{python}")
        for name, values in figures[python].samples().items():
            median, low, high = statistics.median(values), min(values), max(values)
            print(f"  {name:<34} {median * 1000:6.0f} ms  ({low * 1000:.0f}-{high * 1000:.0f})")
            if args.verbose:
                print("    " + " ".join(f"{x * 1000:.0f}" for x in values))
    if len(pythons) == 2:
        first, second = (figures[p].medians() for p in pythons)
        print("\nfirst / second (medians)")
        for name, value in first.items():
            print(f"  {name:<34} {value / second[name]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
