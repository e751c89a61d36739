"""Shared plumbing for the benchmark scripts: arguments, producing, running the consumer
instances against a dev stack until everything is committed, and printing tables.

Commit polling is shared with the fault suite: tests/commit_watcher.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from confluent_kafka import Producer

from tests.commit_watcher import CommitWatcher

if TYPE_CHECKING:
    from triage_cli.devstack import DevStack

ROOT = Path(__file__).resolve().parents[2]


def bench_arguments(messages: int, instances: int, concurrency: int) -> argparse.ArgumentParser:
    """--messages, --instances and --concurrency with this benchmark's defaults."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=messages)
    parser.add_argument("--instances", type=int, default=instances)
    parser.add_argument("--concurrency", type=int, default=concurrency)
    return parser


def produce_values(bootstrap: str, topic: str, values: Iterable[bytes], partitions: int = 1) -> int:
    producer = Producer(
        {"bootstrap.servers": bootstrap, "linger.ms": 5, "batch.num.messages": 10000}
    )
    n = 0
    for n, value in enumerate(values, 1):
        while True:
            try:
                producer.produce(topic, value=value, partition=(n - 1) % partitions)
                break
            except BufferError:
                producer.poll(0.01)
        if n % 5000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0
    return n


@dataclass
class InstanceResult:
    handled: int
    acked: int
    nacked: int
    first: float
    last: float
    finishes: list[tuple[float, bool]]
    partitions: dict[str, list[float]] = field(default_factory=dict)
    """partition (a JSON key) -> [messages handled, time.time() of the last finish]."""
    finish_partitions: list[int] = field(default_factory=list)
    """The partition of each entry of `finishes`."""
    """partition (a JSON key) -> [messages handled, time.time() of the last finish]."""


class Instances:
    """Consumer instance processes (tests/perf/instance.py), stopped by PID."""

    def __init__(
        self,
        targets: list[str],
        token: str,
        per_target: int,
        concurrency: int,
        command: list[str] | None = None,
    ) -> None:
        """`command` runs one instance (default: tests/perf/instance.py, the Python client);
        it takes --target, --concurrency and --id and prints one JSON line on SIGTERM."""
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TRIAGE_TOKEN": token}
        command = command or [sys.executable, str(ROOT / "tests" / "perf" / "instance.py")]
        self._procs = [
            subprocess.Popen(
                [
                    *command,
                    "--target",
                    target,
                    "--concurrency",
                    str(concurrency),
                    "--id",
                    f"bench-{i}-{target}",
                ],
                stdout=subprocess.PIPE,
                env=env,
            )
            for target in targets
            for i in range(per_target)
        ]

    def stop(self) -> list[InstanceResult]:
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        results = []
        for proc in self._procs:
            try:
                out, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            line = out.decode().strip().splitlines()
            if line:
                results.append(InstanceResult(**json.loads(line[-1])))
        return results


def table(rows: list[tuple[str, Any]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


@dataclass
class InstancesRun:
    launched: float
    """time.time() when the instance processes were started."""
    committed_at: float
    """time.time() when the committed offset reached the last message."""
    results: list[InstanceResult]
    """What each instance reported when it was stopped."""


def run_instances(
    stack: DevStack,
    args: argparse.Namespace,
    *,
    timeout_s: float,
    poll_s: float | None = None,
) -> InstancesRun:
    """Start `args.instances` x `args.concurrency` instances, wait until all `args.messages`
    (spread round-robin over the partitions) are committed, then stop them.

    One partition: the instances run on its proxy, as before. Several: each instance is ONE
    Consumer given the stack's endpoint, consuming every partition with one pool."""
    partitions = stack.partitions
    watcher = CommitWatcher(stack.broker.bootstrap, stack.group_id, stack.topic, partitions)
    expected = [len(range(p, args.messages, partitions)) for p in range(partitions)]
    info = stack.describe()
    targets = [p["target"] for p in info["proxies"]] if partitions == 1 else [info["endpoint"]]
    launched = time.time()
    instances = Instances(targets, stack.token, args.instances, args.concurrency)
    polling = {} if poll_s is None else {"poll_s": poll_s}
    try:
        committed_at = watcher.wait_for(expected, timeout_s=timeout_s, **polling)
    finally:
        results = instances.stop()
        watcher.close()
    return InstancesRun(launched, committed_at, results)
