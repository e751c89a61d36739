"""No-op throughput: 200,000 messages of 100 bytes, no-op handler, 2 instances.

Target: at least 50,000 messages/s end to end with commits keeping up, i.e. from
the first message handled until the committed offset reaches the end. As the
side-by-side baseline, a plain confluent-kafka consumer reads the same partition
in this invocation (no handler work, no commits per message): the ceiling of
what one partition gives on this machine.

    .venv/bin/python -m tests.perf.bench_throughput [--messages N]
"""

from __future__ import annotations

import os
import sys
import time

from tests.perf.common import bench_arguments, produce_values, run_instances, table
from triage_cli.devstack import DevStack

TARGET_PER_S = 50_000


def plain_read(bootstrap: str, topic: str, count: int) -> float:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"plain-{time.time_ns()}"})
    consumer.assign([TopicPartition(topic, 0, 0)])
    seen, started = 0, time.perf_counter()
    while seen < count:
        seen += sum(1 for m in consumer.consume(5000, 1.0) if not m.error())
    elapsed = time.perf_counter() - started
    consumer.close()
    return elapsed


def main() -> int:
    args = bench_arguments(messages=200_000, instances=2, concurrency=256).parse_args()
    overrides = {"commit": {"interval_s": 0.1}}
    with DevStack(topic="bench-throughput", proxy_overrides=overrides) as stack:
        bootstrap = stack.broker.bootstrap
        produce_values(bootstrap, stack.topic, (b"x" * 100 for _ in range(args.messages)))
        plain_s = plain_read(bootstrap, stack.topic, args.messages)
        run = run_instances(stack, args, timeout_s=300, poll_s=0.02)
    committed_at, results = run.committed_at, run.results
    first = min(r.first for r in results)
    last = max(r.last for r in results)
    e2e = committed_at - first
    rate = args.messages / e2e
    print(f"no-op throughput on {os.cpu_count()} cores")
    print(
        table(
            [
                ("messages", f"{args.messages} x 100 bytes"),
                ("instances x concurrency", f"{args.instances} x {args.concurrency}"),
                ("Triage end to end (first handled -> all committed)", f"{e2e:.2f} s"),
                ("Triage messages/s", f"{rate:,.0f} (target >= {TARGET_PER_S:,})"),
                ("Triage first -> last handled", f"{last - first:.2f} s"),
                ("commit lag after last handled", f"{(committed_at - last) * 1000:.0f} ms"),
                ("per instance handled", ", ".join(str(r.handled) for r in results)),
                ("plain confluent-kafka read, same run", f"{args.messages / plain_s:,.0f}/s"),
            ]
        )
    )
    ok = rate >= TARGET_PER_S
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
