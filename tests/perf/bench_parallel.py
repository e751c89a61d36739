"""Confluent Parallel Consumer's comparison workload, through Triage.

10,000 messages, each with a random 0-5 ms of work, 100 concurrent handlers in
total (2 instance processes x 50). Confluent publishes 2.83 s for this workload
with its Parallel Consumer unordered and 22.2 s serial; the target here is under
1.0 s end to end. A serial consumer runs the same workload in this invocation as
the side-by-side baseline (its work is the sum of the sleeps).

    .venv/bin/python -m tests.perf.bench_parallel
"""

from __future__ import annotations

import os
import random
import sys
import time

from tests.perf.common import bench_arguments, produce_values, run_instances, table
from triage_cli.devstack import DevStack

TARGET_S = 1.0


def serial(bootstrap: str, topic: str, count: int) -> float:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"serial-{time.time_ns()}",
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    seen, started = 0, time.perf_counter()
    while seen < count:
        for m in consumer.consume(500, 1.0):
            if m.error():
                continue
            seen += 1
            time.sleep(int((m.value() or b"sleep:0")[6:]) / 1000)
    elapsed = time.perf_counter() - started
    consumer.close()
    return elapsed


def main() -> int:
    parser = bench_arguments(messages=10_000, instances=2, concurrency=50)
    parser.add_argument("--skip-serial", action="store_true")
    args = parser.parse_args()
    rng = random.Random(11)
    work_ms = [rng.randint(0, 5) for _ in range(args.messages)]
    overrides = {"commit": {"interval_s": 0.05}}
    with DevStack(topic="bench-parallel", proxy_overrides=overrides) as stack:
        bootstrap = stack.broker.bootstrap
        produce_values(bootstrap, stack.topic, (b"sleep:%d" % ms for ms in work_ms))
        run = run_instances(stack, args, timeout_s=120)
        serial_s = None if args.skip_serial else serial(bootstrap, stack.topic, args.messages)
    committed_at, results = run.committed_at, run.results
    first = min(r.first for r in results)
    last = max(r.last for r in results)
    e2e = committed_at - first
    handlers = args.instances * args.concurrency
    rows = [
        ("messages, work", f"{args.messages}, random 0-5 ms (sum {sum(work_ms) / 1000:.1f} s)"),
        ("handlers", f"{handlers} ({args.instances} instances x {args.concurrency})"),
        ("Triage: first handled -> all committed", f"{e2e:.3f} s (target < {TARGET_S} s)"),
        ("Triage: first -> last handled", f"{last - first:.3f} s"),
        ("ideal with this many handlers", f"{sum(work_ms) / 1000 / handlers:.3f} s"),
        ("handled", sum(r.handled for r in results)),
    ]
    if serial_s is not None:
        rows.append(("serial consumer, same run", f"{serial_s:.2f} s ({serial_s / e2e:.1f}x)"))
    rows.append(("Parallel Consumer (published)", "2.83 s unordered, 22.2 s serial"))
    print(f"parallel-consumer workload on {os.cpu_count()} cores")
    print(table(rows))
    ok = e2e < TARGET_S
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
