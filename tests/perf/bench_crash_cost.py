"""What crash-type poison pills cost the healthy messages around them, in time and in
attempts.

Workload: `--messages` messages of `--work-ms` work on one partition, handled by one
consumer process of `--concurrency` handlers (default prefetch), run twice in this one
invocation against the embedded stack: once as is (the baseline), once with `--pills`
crash pills (the handler calls os._exit(1), at once or after `--pill-ms` of work) from
`--pill-at` on, evenly spaced. A loop restarts the consumer process whenever it dies, as a
supervisor would. Printed for each run: the time from the first message handed out until
every healthy message is acked (read from the proxy's `acked` counter), the consumer's
restarts, the dead letters, and the attempts healthy messages were blamed for (each
healthy handler run on attempt 2 or later: a crash was blamed on it, as nothing else fails
here); then the ratio of the two times. With many pills, a healthy record is blamed when a
pill on its first delivery crashes the process while the healthy one is its isolated
suspect: a pill that crashes after some work (`--pill-ms`) runs into that more often than
one that crashes at once. A pill itself is dead-lettered after `delivery.max_attempts`
blamed crashes (docs/concepts/suspects-and-blame.md), so the commit waits for it longer
than the healthy messages do: that wait is the redelivery span, not what is measured here.

    .venv/bin/python -m tests.perf.bench_crash_cost [--messages N] [--work-ms MS]
        [--concurrency N] [--pills N] [--pill-at OFFSET] [--pill-ms MS]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.perf.common import INSTANCE, ROOT, produce_values, status, table
from triage_cli.demo import count_dead_letters
from triage_cli.devstack import DevStack

POLL_S = 0.05
TIMEOUT_S = 600.0


@dataclass
class Run:
    healthy_s: float
    """From the first message handed out until every healthy one was acked."""
    restarts: int
    dead_letters: int
    blamed: int
    """Attempts healthy messages lost to crashes blamed on them."""
    most_blamed: int
    """The most attempts one healthy message lost so."""


def pill_offsets(args: argparse.Namespace) -> set[int]:
    """Where the pills are: `--pills` of them from `--pill-at` on, evenly spaced."""
    step = max(1, (args.messages - args.pill_at) // max(1, args.pills))
    return {args.pill_at + i * step for i in range(args.pills)} & set(range(args.messages))


def run(args: argparse.Namespace, *, pill: bool) -> Run:
    """One run on a stack of its own: produce, consume with restarts, measure."""
    pills = pill_offsets(args) if pill else set()
    healthy = args.messages - len(pills)
    crash = b"crash:%d" % args.pill_ms if args.pill_ms else b"crash"
    values = [
        crash if i in pills else b"sleep:%d:%d" % (args.work_ms, i) for i in range(args.messages)
    ]
    redelivered = Path(tempfile.mkdtemp(prefix="bench-crash-")) / "redelivered"
    overrides = {"commit": {"interval_s": 0.1}}
    topic = "bench-crash-pill" if pill else "bench-crash-none"
    with DevStack(topic=topic, proxy_overrides=overrides) as stack:
        produce_values(stack.broker.bootstrap, stack.topic, values)
        target = stack.describe()["proxies"][0]["target"]
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "TRIAGE_TOKEN": stack.token,
            "TRIAGE_BENCH_REDELIVERED": str(redelivered),
        }
        command = [*INSTANCE, "--target", target, "--concurrency", str(args.concurrency)]
        restarts = 0
        started = None
        deadline = time.monotonic() + TIMEOUT_S
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
        try:
            while True:
                counters = status(stack).get("counters", {})
                if started is None and counters.get("delivered", 0) > 0:
                    started = time.monotonic()
                if counters.get("acked", 0) >= healthy:
                    break
                if proc.poll() is not None:  # crashed: start it again, as a supervisor
                    restarts += 1
                    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{counters.get('acked', 0)} of {healthy} acked")
                time.sleep(POLL_S)
            done = time.monotonic()
        finally:
            proc.kill()
            proc.wait()
        dead = count_dead_letters(stack.aws.endpoint_url, stack.table)
    assert started is not None
    lost: dict[int, int] = {}  # healthy offset -> its highest attempt, less the first
    if redelivered.exists():
        for line in redelivered.read_text().splitlines():
            offset, attempt = map(int, line.split())
            if offset not in pills:
                lost[offset] = max(lost.get(offset, 0), attempt - 1)
        redelivered.unlink()
    redelivered.parent.rmdir()
    return Run(done - started, restarts, dead, sum(lost.values()), max(lost.values(), default=0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=400)
    parser.add_argument("--work-ms", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--pill-at", type=int, default=100)
    parser.add_argument("--pills", type=int, default=1)
    parser.add_argument(
        "--pill-ms", type=int, default=0, help="work before a pill crashes (0: at once)"
    )
    args = parser.parse_args()
    base = run(args, pill=False)
    crash = run(args, pill=True)
    print(
        f"{args.messages} messages x {args.work_ms} ms, 1 consumer x {args.concurrency},"
        f" {len(pill_offsets(args))} pill(s) crashing after {args.pill_ms} ms:"
    )
    print(
        table(
            [
                ("no pill: healthy acked in", f"{base.healthy_s:.1f} s"),
                ("with the pills: healthy acked in", f"{crash.healthy_s:.1f} s"),
                ("with the pills / no pill", f"{crash.healthy_s / base.healthy_s:.2f}x"),
                ("consumer restarts (pill run)", crash.restarts),
                ("dead letters (pill run)", crash.dead_letters),
                ("healthy attempts blamed (pill run)", crash.blamed),
                ("most blamed on one healthy message", crash.most_blamed),
                ("healthy attempts blamed (no pill)", base.blamed),
            ]
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
