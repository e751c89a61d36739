"""Head-of-line benchmark: a plain serial consumer vs Triage with 32 concurrent handlers.

Workload: 5,000 messages of 2 ms work, 1% slow (500 ms), 0.5% poison pills (the
handler raises). Both run in this one invocation on the same machine, against the
embedded stack (`triage dev`'s Tansu, moto server and a proxy process). Triage runs
2 consumer instance processes x 16 handlers. Targets: at least 20x faster than
serial, and no stall: while ordinary work remains, messages keep finishing (the
longest gap between finishes stays far below one slow call).

It also prints the efficiency against the first-in-first-out bound of this workload
(tests/perf/fifo_bound.py: list scheduling of the exact durations, 2 ms / 500 ms / a pill
0, on the 32 handler slots): bound / (first handler start -> last handler return). The
instances start without a gate here, so one may run alone while the other connects;
bench_efficiency measures the same thing with every slot busy from time zero.

    .venv/bin/python -m tests.perf.bench_hol [--messages N]
"""

from __future__ import annotations

import itertools
import os
import sys

from tests.perf.common import bench_arguments, produce_values, run_instances, table
from tests.perf.fifo_bound import efficiency, fifo_bound
from triage_cli.demo import Kind, Workload, count_dead_letters, run_serial_baseline
from triage_cli.devstack import DevStack

TARGET_SPEEDUP = 20.0


def longest_stall(finishes: list[tuple[float, bool]], start: float) -> float:
    finishes = sorted(finishes)
    last_ordinary = max(t for t, ordinary in finishes if ordinary)
    times = [start] + [t for t, _ in finishes if t <= last_ordinary]
    return max(b - a for a, b in itertools.pairwise(times))


def main() -> int:
    args = bench_arguments(messages=5000, instances=2, concurrency=16).parse_args()
    workload = Workload.generate(args.messages)
    overrides = {"commit": {"interval_s": 0.1}}
    with DevStack(topic="bench-hol", proxy_overrides=overrides) as stack:
        bootstrap = stack.broker.bootstrap
        produce_values(bootstrap, stack.topic, (workload.value(i) for i in range(args.messages)))
        serial_s = run_serial_baseline(bootstrap, stack.topic, workload)
        run = run_instances(stack, args, timeout_s=300)
        dead = count_dead_letters(stack.aws.endpoint_url, stack.table)
    launched, committed_at, results = run.launched, run.committed_at, run.results
    first = min(r.first for r in results)
    handled_at = max(r.last for r in results)
    triage_s = committed_at - first
    finishes = [tuple(f) for r in results for f in r.finishes]
    stall = longest_stall(finishes, first)  # type: ignore[arg-type]
    handlers = args.instances * args.concurrency
    ideal = workload.serial_ideal_s / handlers
    durations = [0.0 if k is Kind.POISON else workload.work_s(k.value) for k in workload.kinds]
    bound = fifo_bound(durations, handlers)
    makespan = handled_at - min(r.started for r in results)
    speedup = serial_s / triage_s
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"head-of-line benchmark on {os.cpu_count()} cores, load average {load}")
    print(
        table(
            [
                (
                    "messages (ordinary/slow/poison)",
                    f"{args.messages} ({workload.count(Kind.ORDINARY)}"
                    f"/{workload.count(Kind.SLOW)}/{workload.count(Kind.POISON)})",
                ),
                ("serial confluent-kafka consumer", f"{serial_s:.2f} s"),
                (
                    f"Triage, {handlers} handlers, first handled -> all committed",
                    f"{triage_s:.2f} s",
                ),
                ("Triage, first -> last handled", f"{handled_at - first:.2f} s"),
                ("Triage, instances launched -> all committed", f"{committed_at - launched:.2f} s"),
                (f"ideal with {handlers} handlers", f"{ideal:.2f} s"),
                (f"FIFO bound with {handlers} handlers", f"{bound:.2f} s"),
                (
                    "efficiency: bound / (first start -> last handled)",
                    f"{efficiency(bound, makespan):.1%} ({makespan:.2f} s)",
                ),
                ("speed-up vs serial", f"{speedup:.1f}x (target >= {TARGET_SPEEDUP:.0f}x)"),
                (
                    "acked / nacked by handlers",
                    f"{sum(r.acked for r in results)} / {sum(r.nacked for r in results)}",
                ),
                ("dead letters in DynamoDB", dead),
                (
                    "longest stall while ordinary work remained",
                    f"{stall * 1000:.0f} ms (slow call {workload.slow_s * 1000:.0f} ms)",
                ),
            ]
        )
    )
    ok = speedup >= TARGET_SPEEDUP and stall < workload.slow_s / 5
    ok = ok and dead == workload.count(Kind.POISON)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
