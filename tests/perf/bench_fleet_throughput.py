"""Fleet throughput benchmark: no-op throughput of ONE fleet process serving 4 partitions,
driven by one topic-level Consumer per instance (2 instances), vs the single-partition
figure of bench_throughput in the same run (target: >= 1x).

Why: a fleet process replaces one process per partition; it must not be slower than one
of them. Both measurements use the same messages (200,000 x 100 bytes by default, spread
round-robin over the 4 partitions in the fleet run), the same 2 instances x 256 no-op
handlers (instance.py --lean), the same 0.1 s commit interval, and the same clock: from
the first message handled until every partition's committed offset reaches its end. The
fleet process joins the group with no `--partition` (the coordinator assigns it all 4),
so its commits go through its group member, as in production; the instances are each
given its address and discover the partitions with Topology.

Beside the rates it prints, per measurement, the CPU each role spent per 1,000 messages
(proxy, instances, broker: cpumeter.py; load moves the rates far more than these) and the
proxy's Deliveries / Settle frame counts, and per partition when its commit reached the
end (seconds after the first handled: the tail, which partition finished last).
`--profile DIR` samples the fleet process and the instances with py-spy (and the single
partition's processes) and prints their top frames; `--fleet-only` skips the
single-partition measurement; `--rounds N` repeats the pair N times, alternating which
goes first, and judges the median ratio.

    .venv/bin/python -m tests.perf.bench_fleet_throughput [--messages N] [--partitions 4]
        [--profile DIR [--profile-gil]] [--fleet-only] [--rounds N] [--fleet-first]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.commit_watcher import CommitWatcher
from tests.perf.bench_throughput import measure
from tests.perf.common import (
    INSTANCE,
    Instances,
    Profiler,
    bench_arguments,
    print_frames,
    produce_values,
    table,
    top_frames,
)
from tests.perf.cpumeter import CpuMeter, cpu_row, last_window
from triage_cli.devstack import DevStack
from triage_cli.embedded import HOST
from triage_cli.supervisor import fleet_command

TARGET_RATIO = 1.0
READY_S = 120.0


def process_status(http_port: int) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{http_port}/status", timeout=2) as reply:
            doc: dict[str, Any] = json.loads(reply.read())
            return doc
    except OSError:
        return {}


def served(http_port: int) -> list[int]:
    return list(process_status(http_port).get("served", []))


def frame_counts(http_port: int) -> str:
    """Deliveries frames out / Settle frames in, summed over the partitions served."""
    parts = process_status(http_port).get("partitions", [])
    out = sum(p.get("counters", {}).get("frames_out", 0) for p in parts)
    settles = sum(p.get("counters", {}).get("settle_frames", 0) for p in parts)
    return f"{out} / {settles}"


def measure_fleet(args: argparse.Namespace) -> float:
    """Messages/s of one fleet process serving `args.partitions` partitions."""
    from triage_proxy.config.loader import load_settings

    overrides: dict[str, Any] = {"commit": {"interval_s": 0.1}}
    with DevStack(
        topic="bench-fleet-throughput",
        partitions=args.partitions,
        proxy_overrides=overrides,
        start_proxies=False,
    ) as stack:
        server = load_settings(stack.config_path).server
        address = server.http_address(0)
        assert address is not None, "the fleet is watched through its /status"
        assert address[1], "the fleet's /status needs a fixed server.http_port"
        http = address[1]
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
            while sorted(served(http)) != list(range(args.partitions)):
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
            # The handler of bench_throughput's single partition (run_instances' lean):
            # the shared bench handler's bookkeeping cost the instances ~20% of their time
            # (py-spy), paid by the fleet's side only.
            instances = Instances(
                [f"{HOST}:{server.port}"],
                stack.token,
                args.instances,
                args.concurrency,
                [*INSTANCE, "--lean"],
            )
            profiler = None
            if args.profile is not None:
                # From the first commit on: not the instances' imports and connecting.
                while max(watcher.offsets()) <= 0:
                    time.sleep(0.01)
                pids = {"fleet-proxy": proxy.pid}
                pids.update({f"instance-{i}": pid for i, pid in enumerate(instances.pids)})
                profiler = Profiler(pids, args.profile / "fleet", gil=args.profile_gil)
            try:
                committed_at = watcher.wait_for(expected, timeout_s=300, poll_s=0.02)
            finally:
                if profiler is not None:
                    profiler.stop()
                results = instances.stop()
                watcher.close()
            frames = frame_counts(http)
            if profiler is not None:
                print_frames({name: top_frames(path) for name, path in profiler.files.items()})
        finally:
            proxy.terminate()
            proxy.wait(60)
    first = min(r.first for r in results if r.first)
    rate = float(args.messages) / (committed_at - first)
    tail = []
    for p in range(args.partitions):
        reached = watcher.reached.get(p, committed_at)
        tail.append(f"p{p} {reached - first:.2f}")
    print(
        table(
            [
                ("messages", f"{args.messages} x 100 bytes over {args.partitions} partitions"),
                ("instances x concurrency", f"{args.instances} x {args.concurrency}"),
                ("fleet process end to end", f"{committed_at - first:.2f} s"),
                ("fleet process messages/s", f"{rate:,.0f}"),
                ("first -> last handled", f"{max(r.last for r in results) - first:.2f} s"),
                ("per instance handled", ", ".join(str(r.handled) for r in results)),
                ("per partition: committed, s", ", ".join(tail)),
                ("proxy frames: Deliveries out / Settle in", frames),
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
    parser.add_argument(
        "--profile", type=Path, default=None, help="py-spy the fleet process and instances"
    )
    parser.add_argument("--profile-gil", action="store_true", help="py-spy --gil")
    parser.add_argument("--fleet-only", action="store_true", help="skip the single partition")
    parser.add_argument(
        "--fleet-first",
        action="store_true",
        help="the first round measures the fleet first (rounds alternate from there): "
        "single rounds run one by one can alternate too",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure single and fleet this many times, alternating which goes first, and "
        "judge the median ratio (a shared machine's load moves one pair by +-30%%)",
    )
    args = parser.parse_args()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"fleet no-op throughput on {os.cpu_count()} cores, load average {load}")
    ratios: list[float] = []
    for n in range(args.rounds):
        ratios.append(measure_round(args, fleet_first=(n % 2 == 1) != args.fleet_first))
    after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    ratio = statistics.median(ratios)
    rows = [("ratio", f"{ratio:.2f} (target >= {TARGET_RATIO})")]
    if len(ratios) > 1:
        rows = [
            ("ratios, round by round", ", ".join(f"{r:.2f}" for r in ratios)),
            ("median ratio", f"{ratio:.2f} (target >= {TARGET_RATIO})"),
            (
                "rounds at or above 1.0x / 0.9x",
                f"{sum(r >= 1.0 for r in ratios)} / {sum(r >= 0.9 for r in ratios)} "
                f"of {len(ratios)}",
            ),
        ]
    print(table([*rows, ("load average before / after", f"{load} / {after}")]))
    ok = ratio >= TARGET_RATIO
    print(("PASS" if ok else "FAIL") + f" fleet / single >= {TARGET_RATIO}")
    return 0 if ok else 1


def measure_round(args: argparse.Namespace, *, fleet_first: bool) -> float:
    """One single-partition and one fleet measurement (in that order, or fleet first);
    their ratio."""
    single = float("nan")

    def measure_single() -> None:
        nonlocal single
        print("single partition (bench_throughput's measurement):")
        profile = args.profile / "single" if args.profile is not None else None
        with CpuMeter() as meter:
            measured = measure(args, profile, args.profile_gil)
        single = measured.rate
        window = last_window(meter, args.messages / single)
        print(table([("CPU ms per 1,000 messages", cpu_row(window, args.messages))]))

    if not args.fleet_only and not fleet_first:
        measure_single()
    mode = "pinned" if args.pinned else "fleet"
    print(f"one {mode} process, {args.partitions} partitions:")
    with CpuMeter() as meter:
        fleet = measure_fleet(args)
    window = last_window(meter, args.messages / fleet)
    print(table([("CPU ms per 1,000 messages", cpu_row(window, args.messages))]))
    if not args.fleet_only and fleet_first:
        measure_single()
    ratio = fleet / single
    print(
        table(
            [
                ("single partition msg/s", f"{single:,.0f}"),
                (f"fleet process, {args.partitions} partitions msg/s", f"{fleet:,.0f}"),
                ("this round's ratio", f"{ratio:.2f}"),
            ]
        )
    )
    return ratio


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
