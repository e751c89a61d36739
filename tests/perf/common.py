"""Shared plumbing for the benchmark scripts: the stack, instances, commit polling."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition

ROOT = Path(__file__).resolve().parents[2]


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


class CommitWatcher:
    """Polls a group's committed offsets (one long-lived client, cheap to poll)."""

    def __init__(self, bootstrap: str, group: str, topic: str, partitions: int) -> None:
        self._consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
        self._tps = [TopicPartition(topic, p) for p in range(partitions)]

    def offsets(self) -> list[int]:
        return [tp.offset for tp in self._consumer.committed(self._tps, 10)]

    def wait_for(self, expected: list[int], timeout_s: float, poll_s: float = 0.01) -> float:
        """Block until the committed offsets equal `expected`; return time.time() then."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.offsets() == expected:
                return time.time()
            if time.monotonic() > deadline:
                raise TimeoutError(f"committed {self.offsets()}, expected {expected}")
            time.sleep(poll_s)

    def close(self) -> None:
        self._consumer.close()


@dataclass
class InstanceResult:
    handled: int
    acked: int
    nacked: int
    first: float
    last: float
    finishes: list[tuple[float, bool]]


class Instances:
    """Consumer instance processes (tests/perf/instance.py), stopped by PID."""

    def __init__(self, targets: list[str], token: str, per_target: int, concurrency: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TRIAGE_TOKEN": token}
        self._procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(ROOT / "tests" / "perf" / "instance.py"),
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
