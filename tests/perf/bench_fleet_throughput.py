"""Fleet throughput benchmark: no-op throughput of ONE fleet process serving 4 partitions,
driven by one topic-level Consumer per instance (2 instances), vs the single-partition
figure of bench_throughput in the same run (issue 12; target: >= 1x).

Why: a fleet process replaces one process per partition; it must not be slower than one
of them. Both measurements use the same messages (200,000 x 100 bytes by default, spread
round-robin over the 4 partitions in the fleet run), the same 2 instances x 256 handlers,
the same 0.1 s commit interval, and the same clock: from the first message handled until
every partition's committed offset reaches its end. The fleet process joins the group
with no `--partition` (the coordinator assigns it all 4), so its commits go through its
group member, as in production; the instances are each given its address and discover
the partitions with Topology.

    .venv/bin/python -m tests.perf.bench_fleet_throughput [--messages N] [--partitions 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.commit_watcher import CommitWatcher
from tests.perf.bench_throughput import measure
from tests.perf.common import Instances, bench_arguments, produce_values, table
from triage_cli.devstack import DevStack
from triage_cli.embedded import HOST
from triage_cli.supervisor import fleet_command

TARGET_RATIO = 1.0
READY_S = 120.0


def served(http_port: int) -> list[int]:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{http_port}/status", timeout=2) as reply:
            return list(json.loads(reply.read()).get("served", []))
    except OSError:
        return []


def measure_fleet(args: argparse.Namespace) -> float:
    """Messages/s of one fleet process serving `args.partitions` partitions."""
    from triage_proxy.settings import load_settings

    overrides = {"commit": {"interval_s": 0.1}}
    with DevStack(
        topic="bench-fleet-throughput",
        partitions=args.partitions,
        proxy_overrides=overrides,
        start_proxies=False,
    ) as stack:
        server = load_settings(stack.config_path).server
        assert server.http_port is not None
        log = open(stack.state_dir / "fleet-0.log", "ab")  # noqa: SIM115
        with log:
            pins = [a for p in range(args.partitions) for a in ("-p", str(p))]
            proxy = subprocess.Popen(
                fleet_command(stack.config_path, 0) + (pins if args.pinned else []),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        try:
            deadline = time.monotonic() + READY_S
            while sorted(served(server.http_port)) != list(range(args.partitions)):
                if time.monotonic() > deadline or proxy.poll() is not None:
                    raise RuntimeError(f"the fleet process never served; see {stack.state_dir}")
                time.sleep(0.2)
            bootstrap = stack.broker.bootstrap
            values = (b"x" * 100 for _ in range(args.messages))
            produce_values(bootstrap, stack.topic, values, partitions=args.partitions)
            expected = [
                len(range(p, args.messages, args.partitions)) for p in range(args.partitions)
            ]
            watcher = CommitWatcher(bootstrap, stack.group_id, stack.topic, args.partitions)
            instances = Instances(
                [f"{HOST}:{server.port}"], stack.token, args.instances, args.concurrency
            )
            try:
                committed_at = watcher.wait_for(expected, timeout_s=300, poll_s=0.02)
            finally:
                results = instances.stop()
                watcher.close()
        finally:
            proxy.terminate()
            proxy.wait(60)
    first = min(r.first for r in results if r.first)
    rate = float(args.messages) / (committed_at - first)
    print(
        table(
            [
                ("messages", f"{args.messages} x 100 bytes over {args.partitions} partitions"),
                ("instances x concurrency", f"{args.instances} x {args.concurrency}"),
                ("fleet process end to end", f"{committed_at - first:.2f} s"),
                ("fleet process messages/s", f"{rate:,.0f}"),
                ("per instance handled", ", ".join(str(r.handled) for r in results)),
            ]
        )
    )
    return rate


def main() -> int:
    parser = bench_arguments(messages=200_000, instances=2, concurrency=256)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument(
        "--pinned",
        action="store_true",
        help="the process pins the partitions (--partition) instead of joining the group: "
        "its commits go straight to the broker, not through a group member",
    )
    args = parser.parse_args()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"fleet no-op throughput on {os.cpu_count()} cores, load average {load}")
    print("single partition (bench_throughput's measurement):")
    single = measure(args, None)
    mode = "pinned" if args.pinned else "fleet"
    print(f"one {mode} process, {args.partitions} partitions:")
    fleet = measure_fleet(args)
    ratio = fleet / single.rate
    after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        table(
            [
                ("single partition msg/s", f"{single.rate:,.0f}"),
                (f"fleet process, {args.partitions} partitions msg/s", f"{fleet:,.0f}"),
                ("ratio", f"{ratio:.2f} (target >= {TARGET_RATIO})"),
                ("load average before / after", f"{load} / {after}"),
            ]
        )
    )
    ok = ratio >= TARGET_RATIO
    print(("PASS" if ok else "FAIL") + f" fleet / single >= {TARGET_RATIO}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
