"""Shared plumbing for the benchmark scripts: producing, instances, tables.

Commit polling is shared with the fault suite: tests/commit_watcher.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

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
