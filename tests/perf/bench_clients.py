"""The TypeScript client beside the Python client, in one run.

Two workloads, each the one of an existing benchmark:
- no-op throughput (bench_throughput): 200,000 messages of 100 bytes, no-op handlers,
  2 instances x 256 handlers; messages/s from the first message handled until the
  committed offset reaches the end;
- head-of-line (bench_hol): 5,000 messages of 2 ms work, 1% slow (500 ms), 0.5% poison,
  2 instances x 16 handlers; the time from the first handled to all committed, the longest
  stall while ordinary work remained, and the dead letters written.

Each client's turn runs on a fresh dev stack (Tansu, moto server, one proxy) with the same
settings and its own freshly produced copy of the workload: on one shared stack, whichever
client went second was slower, from what the first turn left behind. `--typescript-first`
swaps the order (a check that the order does not matter). The
instances are tests/perf/instance.py (Python) and clients/typescript/bench/instance.js
(TypeScript): the same handler, the same report. Prints both figures and the ratio
TypeScript / Python; PASS when both clients lose nothing (every message committed, every
poison pill dead-lettered) and the TypeScript client reaches at least 80% of the Python
client's no-op throughput.

    .venv/bin/python -m tests.perf.bench_clients [--messages N] [--hol-messages N]
        [--only noop|hol] [--typescript-first]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tests.commit_watcher import CommitWatcher
from tests.perf.bench_hol import longest_stall
from tests.perf.common import ROOT, InstanceResult, Instances, produce_values, table
from tests.perf.cpumeter import cpu_seconds
from triage_cli.demo import Kind, Workload, count_dead_letters
from triage_cli.devstack import DevStack

if TYPE_CHECKING:
    from collections.abc import Iterable

PACKAGE = ROOT / "clients" / "typescript"
MIN_THROUGHPUT_RATIO = 0.8
"""The TypeScript client's no-op messages/s, as a share of the Python client's, to PASS."""


def typescript_command() -> list[str]:
    """The TypeScript bench instance, built first if it is not (`npm ci` when needed)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        sys.exit("bench_clients needs Node.js 20 and npm on PATH")
    if not (PACKAGE / "node_modules").is_dir():
        subprocess.run([npm, "ci"], cwd=PACKAGE, check=True, stdout=subprocess.DEVNULL)
    if not (PACKAGE / "dist" / "index.js").is_file():
        subprocess.run([npm, "run", "build"], cwd=PACKAGE, check=True, stdout=subprocess.DEVNULL)
    return [node, str(PACKAGE / "bench" / "instance.js")]


@dataclass
class Turn:
    """One client's turn on a workload."""

    client: str
    count: int
    """Messages produced for this turn."""
    launched: float
    """time.time() when the instances were started."""
    committed_at: float
    """time.time() when the committed offset reached the end of this turn's messages."""
    results: list[InstanceResult]
    dead_letters: int
    """Dead letters written during this turn (its stack's table)."""
    proxy_cpu: float = 0.0
    """CPU seconds the proxy used from the instances' launch to all committed: what the
    client's protocol choices (packed deliveries, ack ranges, frame sizes) cost the proxy,
    steadier than messages/s on a shared machine."""

    @property
    def first(self) -> float:
        return min(r.first for r in self.results)

    @property
    def last(self) -> float:
        return max(r.last for r in self.results)

    @property
    def seconds(self) -> float:
        """First message handled -> all committed."""
        return self.committed_at - self.first

    @property
    def rate(self) -> float:
        return self.count / self.seconds


def take_turns(
    topic: str,
    clients: dict[str, list[str]],
    values: list[bytes],
    args: argparse.Namespace,
    concurrency: int,
    poll_s: float,
) -> list[Turn]:
    """For each client in order, on a fresh dev stack: produce `values`, run
    `args.instances` instances until the committed offset covers them, stop the instances.

    Why a fresh stack per turn: on a shared one the second turn was slower for either
    client (head-of-line 1.56 s first vs 3.15 s second for the same client), from what the
    first turn left behind (the broker's log, the proxy's and the table's state)."""
    return [
        one_turn(topic, client, command, values, args, concurrency, poll_s)
        for client, command in clients.items()
    ]


def one_turn(
    topic: str,
    client: str,
    command: list[str],
    values: list[bytes],
    args: argparse.Namespace,
    concurrency: int,
    poll_s: float,
) -> Turn:
    overrides = {"commit": {"interval_s": 0.1}}
    with DevStack(topic=topic, proxy_overrides=overrides) as stack:
        watcher = CommitWatcher(stack.broker.bootstrap, stack.group_id, stack.topic, 1)
        target = stack.describe()["proxies"][0]["target"]
        try:
            end = produce_values(stack.broker.bootstrap, stack.topic, iter(values))
            proxy_pid = stack.proxy_process(0).pid
            cpu_before = cpu_seconds(proxy_pid)
            launched = time.time()
            instances = Instances([target], stack.token, args.instances, concurrency, command)
            try:
                committed_at = watcher.wait_for([end], timeout_s=300, poll_s=poll_s)
                proxy_cpu = cpu_seconds(proxy_pid) - cpu_before
            finally:
                results = instances.stop()
            dead = count_dead_letters(stack.aws.endpoint_url, stack.table)
        finally:
            watcher.close()
    return Turn(client, len(values), launched, committed_at, results, dead, proxy_cpu)


def ratio(turns: Iterable[Turn], figure: str, fmt: str) -> str:
    by = {t.client: getattr(t, figure) for t in turns}
    return f"{by['typescript'] / by['python']:{fmt}}x"


def noop(args: argparse.Namespace, clients: dict[str, list[str]]) -> tuple[bool, str]:
    values = [b"x" * 100] * args.messages
    turns = take_turns("bench-clients-noop", clients, values, args, args.concurrency, 0.02)
    rows = [("messages per client", f"{args.messages} x 100 bytes, no-op handler")]
    rows.append(("instances x concurrency", f"{args.instances} x {args.concurrency}"))
    for t in turns:
        rows.append((f"{t.client}: first handled -> all committed", f"{t.seconds:.2f} s"))
        rows.append((f"{t.client}: messages/s", f"{t.rate:,.0f}"))
        per_message = f"{t.proxy_cpu / t.count * 1e6:.1f} us/message"
        rows.append((f"{t.client}: proxy CPU, launch -> committed", per_message))
        handled = ", ".join(str(r.handled) for r in t.results)
        rows.append((f"{t.client}: per instance handled", handled))
    rows.append(("messages/s, TypeScript / Python", ratio(turns, "rate", ".2f")))
    by = {t.client: t for t in turns}
    ok = by["typescript"].rate >= MIN_THROUGHPUT_RATIO * by["python"].rate
    return ok, table(rows)


def hol(args: argparse.Namespace, clients: dict[str, list[str]]) -> tuple[bool, str]:
    workload = Workload.generate(args.hol_messages)
    values = [workload.value(i) for i in range(args.hol_messages)]
    turns = take_turns("bench-clients-hol", clients, values, args, args.hol_concurrency, 0.01)
    handlers = args.instances * args.hol_concurrency
    poison = workload.count(Kind.POISON)
    rows = [
        (
            "messages per client (ordinary/slow/poison)",
            f"{args.hol_messages} ({workload.count(Kind.ORDINARY)}"
            f"/{workload.count(Kind.SLOW)}/{poison})",
        ),
        (f"ideal with {handlers} handlers", f"{workload.serial_ideal_s / handlers:.2f} s"),
        ("serial work (sum of handler times)", f"{workload.serial_ideal_s:.1f} s"),
    ]
    ok = True
    for t in turns:
        finishes = [(f[0], bool(f[1])) for r in t.results for f in r.finishes]
        stall = longest_stall(finishes, t.first)
        rows.append((f"{t.client}: first handled -> all committed", f"{t.seconds:.2f} s"))
        rows.append(
            (
                f"{t.client}: longest stall while ordinary work remained",
                f"{stall * 1000:.0f} ms (slow call {workload.slow_s * 1000:.0f} ms)",
            )
        )
        rows.append((f"{t.client}: dead letters", f"{t.dead_letters} (poison {poison})"))
        ok = ok and t.dead_letters == poison and stall < workload.slow_s / 5
    rows.append(("time, TypeScript / Python", ratio(turns, "seconds", ".2f")))
    return ok, table(rows)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=200_000, help="no-op messages per client")
    parser.add_argument("--concurrency", type=int, default=256, help="no-op handlers per instance")
    parser.add_argument("--hol-messages", type=int, default=5000)
    parser.add_argument("--hol-concurrency", type=int, default=16)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--only", choices=["noop", "hol"])
    parser.add_argument("--typescript-first", action="store_true")
    args = parser.parse_args()
    python = [sys.executable, str(ROOT / "tests" / "perf" / "instance.py")]
    order = [("python", python), ("typescript", typescript_command())]
    clients = dict(reversed(order) if args.typescript_first else order)
    print(f"TypeScript client beside the Python client on {os.cpu_count()} cores")
    print(f"(turn order: {', '.join(clients)})")
    ok = True
    if args.only in (None, "noop"):
        passed, text = noop(args, clients)
        print("no-op throughput")
        print(text)
        ok = ok and passed
    if args.only in (None, "hol"):
        passed, text = hol(args, clients)
        print("head-of-line workload")
        print(text)
        ok = ok and passed
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
