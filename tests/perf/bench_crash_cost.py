"""What one crash-type poison pill costs the healthy messages around it, in time.

Workload: `--messages` messages of `--work-ms` work on one partition, handled by one
consumer process of `--concurrency` handlers (default prefetch), run twice in this one
invocation against the embedded stack: once as is (the baseline), once with a crash pill
(the handler calls os._exit(1)) at `--pill-at`. A loop restarts the consumer process
whenever it dies, as a supervisor would. Printed for each run: the time from the first
message handed out until every healthy message is acked (read from the proxy's `acked`
counter), the consumer's restarts, and the dead letters; then the ratio of the two
times. The pill itself is dead-lettered after `delivery.max_attempts` blamed crashes
(docs/concepts/suspects-and-blame.md), so the commit waits for it longer than the
healthy messages do: that wait is the redelivery span, not what is measured here.

    .venv/bin/python -m tests.perf.bench_crash_cost [--messages N] [--work-ms MS]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from dataclasses import dataclass

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


def run(args: argparse.Namespace, *, pill: bool) -> Run:
    """One run on a stack of its own: produce, consume with restarts, measure."""
    healthy = args.messages - (1 if pill else 0)
    values = [
        b"crash" if pill and i == args.pill_at else b"sleep:%d:%d" % (args.work_ms, i)
        for i in range(args.messages)
    ]
    overrides = {"commit": {"interval_s": 0.1}}
    topic = "bench-crash-pill" if pill else "bench-crash-none"
    with DevStack(topic=topic, proxy_overrides=overrides) as stack:
        produce_values(stack.broker.bootstrap, stack.topic, values)
        target = stack.describe()["proxies"][0]["target"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TRIAGE_TOKEN": stack.token}
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
    return Run(done - started, restarts, dead)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=400)
    parser.add_argument("--work-ms", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--pill-at", type=int, default=100)
    args = parser.parse_args()
    base = run(args, pill=False)
    crash = run(args, pill=True)
    print(f"{args.messages} messages x {args.work_ms} ms, 1 consumer x {args.concurrency}:")
    print(
        table(
            [
                ("no pill: healthy acked in", f"{base.healthy_s:.1f} s"),
                ("one crash pill: healthy acked in", f"{crash.healthy_s:.1f} s"),
                ("crash / no pill", f"{crash.healthy_s / base.healthy_s:.2f}x"),
                ("consumer restarts (pill run)", crash.restarts),
                ("dead letters (pill run)", crash.dead_letters),
            ]
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
