"""Topic benchmark: one Consumer per instance for every partition of a deployment.

(a) 4 partitions x 5,000 messages of the head-of-line workload (2 ms work, 1% slow at
500 ms, 0.5% poison pills) through 2 instances, each ONE `Consumer(concurrency=32)`
given the dev stack's endpoint. Targets: at least 20x the serial consumer over the same
20,000 messages, and fairness: the last partition to finish its work finishes within 25%
of the first (finish times measured from the first handled message).

(b) --failover: a standby waits for partition 0; its holder is killed with SIGKILL mid-run.
Targets: the Consumers handle partition 0 again within 2 x ownership.lease_s of the kill,
and lost = 0 (every offset of every partition committed, every poison pill dead-lettered).

The serial baseline over 20,000 messages would take minutes, so by default it is the
workload's serial work (`Workload.serial_ideal_s`: the sum of the handler sleeps, a lower
bound for a serial consumer, which favours serial); --measure-serial runs it as bench_hol does.

    .venv/bin/python -m tests.perf.bench_topic [--failover] [--measure-serial]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib

from tests.commit_watcher import CommitWatcher
from tests.perf.common import InstanceResult, Instances, bench_arguments, produce_values, table
from triage_cli.demo import Kind, Workload, count_dead_letters, run_serial_baseline
from triage_cli.devstack import DevStack, write_config
from triage_cli.embedded import HOST, free_port_block, stop_process, wait_for_port
from triage_cli.supervisor import proxy_command

TARGET_SPEEDUP = 20.0
FAIRNESS = 0.25
PARTITIONS = 4
LEASE_S = 3.0
KILL_AT = 0.3
"""Share of the messages committed when the holder of partition 0 is killed."""


def start_standby(stack: DevStack, partition: int) -> tuple[subprocess.Popen[bytes], str]:
    """A second `triage proxy` for `partition`, on its own ports: it waits for the lease."""
    with open(stack.config_path, "rb") as config:
        values = tomllib.load(config)
    base = free_port_block(2)
    values["server"] = {
        **values["server"],
        "port": base - partition,
        "http_port": base + 1 - partition,
    }
    path = stack.state_dir / "standby.toml"
    write_config(path, values)
    with open(stack.state_dir / "standby.log", "ab") as log:
        proc = subprocess.Popen(
            proxy_command(path, partition),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    return proc, f"{HOST}:{base}"


def main() -> int:
    parser = bench_arguments(messages=PARTITIONS * 5000, instances=2, concurrency=32)
    parser.add_argument("--failover", action="store_true")
    parser.add_argument("--measure-serial", action="store_true")
    args = parser.parse_args()
    workload = Workload.generate(args.messages)
    overrides = {"commit": {"interval_s": 0.1}, "ownership": {"lease_s": LEASE_S}}
    expected = [len(range(p, args.messages, PARTITIONS)) for p in range(PARTITIONS)]
    standby: subprocess.Popen[bytes] | None = None
    killed_at = 0.0
    stack = DevStack(topic="bench-topic", partitions=PARTITIONS, proxy_overrides=overrides)
    with stack:
        try:
            bootstrap = stack.broker.bootstrap
            values = (workload.value(i) for i in range(args.messages))
            produce_values(bootstrap, stack.topic, values, PARTITIONS)
            if args.measure_serial:
                serial_s = run_serial_baseline(bootstrap, stack.topic, workload, PARTITIONS)
            else:
                serial_s = workload.serial_ideal_s
            if args.failover:
                standby, standby_at = start_standby(stack, 0)
            watcher = CommitWatcher(bootstrap, stack.group_id, stack.topic, PARTITIONS)
            launched = time.time()
            instances = Instances(
                [stack.describe()["endpoint"]], stack.token, args.instances, args.concurrency
            )
            try:
                if args.failover:
                    deadline = time.monotonic() + 120
                    while sum(watcher.offsets()) < KILL_AT * args.messages:
                        assert time.monotonic() < deadline, "no progress before the kill"
                        time.sleep(0.02)
                    os.kill(stack.proxy_process(0).pid, signal.SIGKILL)
                    killed_at = time.time()
                committed_at = watcher.wait_for(expected, timeout_s=300, poll_s=0.02)
            finally:
                results = instances.stop()
                committed = watcher.offsets()
                watcher.close()
            dead = count_dead_letters(stack.aws.endpoint_url, stack.table)
            if standby is not None:
                wait_for_port(HOST, int(standby_at.rsplit(":", 1)[1]), 1, standby)
        finally:
            if standby is not None:
                stop_process(standby, 15)
    return report(
        args.instances * args.concurrency,
        workload,
        serial_s,
        args.measure_serial,
        expected,
        committed,
        dead,
        results,
        launched,
        committed_at,
        killed_at,
    )


def report(
    handlers: int,
    workload: Workload,
    serial_s: float,
    measured: bool,
    expected: list[int],
    committed: list[int],
    dead: int,
    results: list[InstanceResult],
    launched: float,
    committed_at: float,
    killed_at: float,
) -> int:
    first = min(r.first for r in results)
    triage_s = committed_at - first
    speedup = serial_s / triage_s
    # Per partition: when its last message was handled, from the first handled message.
    finished = {
        p: max(float(r.partitions[str(p)][1]) for r in results if str(p) in r.partitions) - first
        for p in range(len(expected))
    }
    spread = (max(finished.values()) - min(finished.values())) / min(finished.values())
    poison = workload.count(Kind.POISON)
    lost = sum(max(0, e - c) for e, c in zip(expected, committed, strict=True))
    lost += max(0, poison - dead)
    rows: list[tuple[str, object]] = [
        (
            "messages (ordinary/slow/poison)",
            f"{len(workload.kinds)} ({workload.count(Kind.ORDINARY)}"
            f"/{workload.count(Kind.SLOW)}/{poison}) over {len(expected)} partitions",
        ),
        (
            "serial consumer" + ("" if measured else " (its work: sum of handler sleeps)"),
            f"{serial_s:.2f} s",
        ),
        (f"Triage, {handlers} handlers, first handled -> all committed", f"{triage_s:.2f} s"),
        ("Triage, instances launched -> all committed", f"{committed_at - launched:.2f} s"),
        (f"ideal with {handlers} handlers", f"{workload.serial_ideal_s / handlers:.2f} s"),
        ("speed-up vs serial", f"{speedup:.1f}x (target >= {TARGET_SPEEDUP:.0f}x)"),
    ]
    for p, at in sorted(finished.items()):
        rows.append((f"partition {p}: last handled at", f"{at:.2f} s"))
    rows += [
        ("fairness: last vs first partition", f"+{spread * 100:.0f}% (target <= 25%)"),
        ("committed / expected", f"{committed} / {expected}"),
        ("dead letters in DynamoDB", f"{dead} (poison pills: {poison})"),
        ("lost", lost),
    ]
    ok = lost == 0
    if killed_at:
        # Handlers running at the kill still finish (their settlements are lost and the
        # standby redelivers): the Consumers followed when partition 0's finishes resume
        # after the longest gap since the kill.
        after = sorted(
            t
            for r in results
            for (t, _), p in zip(r.finishes, r.finish_partitions, strict=True)
            if p == 0 and t > killed_at
        )
        times = [killed_at, *after]
        resumed = max(range(1, len(times)), key=lambda i: times[i] - times[i - 1], default=0)
        follow = times[resumed] - killed_at if resumed else float("inf")
        rows.append(
            (
                "failover: kill -9 -> partition 0 handled again",
                f"{follow:.2f} s (target <= 2 x lease_s = {2 * LEASE_S:.0f} s)",
            )
        )
        ok = ok and follow <= 2 * LEASE_S
    else:
        ok = ok and speedup >= TARGET_SPEEDUP and spread <= FAIRNESS
    print(f"topic benchmark on {os.cpu_count()} cores" + (" (failover)" if killed_at else ""))
    print(table(rows))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
