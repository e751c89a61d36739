"""Shared plumbing for the benchmark scripts: arguments, producing, running the consumer
instances against a dev stack until everything is committed, and printing tables.

Commit polling is shared with the fault suite: tests/commit_watcher.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
    started: float = 0.0
    """time.time() when the first handler started (0: none ran)."""


INSTANCE = [sys.executable, str(ROOT / "tests" / "perf" / "instance.py")]
"""The Python client's bench instance; with "--lean" its handler only counts."""


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
        command = command or INSTANCE
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

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

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
    frames: dict[str, list[tuple[str, float, float]]] = field(default_factory=dict)
    """With a profile directory: py-spy's top frames per process (`top_frames`)."""


def run_instances(
    stack: DevStack,
    args: argparse.Namespace,
    *,
    timeout_s: float,
    poll_s: float | None = None,
    profile: Path | None = None,
    profile_gil: bool = False,
    profile_native: bool = False,
    lean: bool = False,
) -> InstancesRun:
    """Start `args.instances` x `args.concurrency` instances, wait until all `args.messages`
    (spread round-robin over the partitions) are committed, then stop them.

    One partition: the instances run on its proxy. Several: each instance is ONE
    Consumer given the stack's endpoint, consuming every partition with one pool.
    With `profile`, py-spy samples the proxies and the instances until all is committed.
    `lean`: no-op handlers that only count (their results have no `finishes`)."""
    partitions = stack.partitions
    watcher = CommitWatcher(stack.broker.bootstrap, stack.group_id, stack.topic, partitions)
    expected = [len(range(p, args.messages, partitions)) for p in range(partitions)]
    info = stack.describe()
    targets = [p["target"] for p in info["proxies"]] if partitions == 1 else [info["endpoint"]]
    launched = time.time()
    command = [*INSTANCE, "--lean"] if lean else None
    instances = Instances(targets, stack.token, args.instances, args.concurrency, command)
    polling = {} if poll_s is None else {"poll_s": poll_s}
    profiler = None
    if profile is not None:
        # From the first commit on: not the instances' imports and connecting.
        while max(watcher.offsets()) <= 0:  # none yet, or the start offset 0
            time.sleep(0.01)
        pids = {f"proxy-{p}": stack.proxy_process(p).pid for p in range(partitions)}
        pids.update({f"instance-{i}": pid for i, pid in enumerate(instances.pids)})
        profiler = Profiler(pids, profile, gil=profile_gil, native=profile_native)
    try:
        committed_at = watcher.wait_for(expected, timeout_s=timeout_s, **polling)
    finally:
        if profiler is not None:
            profiler.stop()
        results = instances.stop()
        watcher.close()
    frames = {}
    if profiler is not None:
        frames = {name: top_frames(path) for name, path in profiler.files.items()}
    return InstancesRun(launched, committed_at, results, frames)


def status(stack: DevStack, partition: int = 0) -> dict[str, Any]:
    """The proxy's /status document (window, fetch_paused, counters)."""
    import urllib.request

    from triage_proxy.config.loader import load_settings

    address = load_settings(stack.config_path).server.http_address(partition)
    if address is None:
        raise RuntimeError("the dev stack's proxies serve no HTTP endpoint")
    with urllib.request.urlopen(f"http://127.0.0.1:{address[1]}/status", timeout=5) as answer:
        doc: dict[str, Any] = json.loads(answer.read())
    return doc


class Profiler:
    """py-spy record (raw collapsed stacks) on the given PIDs while it is open; stopped by
    PID with SIGINT so py-spy writes its file. `top_frames` sums the self and inclusive
    sample counts per frame: where the time goes, in text a report can quote."""

    def __init__(
        self,
        pids: dict[str, int],
        out_dir: Path,
        rate: int = 200,
        gil: bool = False,
        native: bool = False,
    ) -> None:
        """`gil`: sample only the thread holding the GIL (py-spy --gil): where the GIL goes.
        `native`: with the C frames (py-spy --native): what extension code costs."""
        out_dir.mkdir(parents=True, exist_ok=True)
        spy = Path(sys.executable).parent / "py-spy"
        if not spy.exists():
            raise FileNotFoundError(f"{spy}: install it with `.venv/bin/pip install py-spy`")
        self.files = {name: out_dir / f"{name}.txt" for name in pids}
        self._procs = [
            subprocess.Popen(
                [
                    str(spy),
                    "record",
                    "--pid",
                    str(pid),
                    "--rate",
                    str(rate),
                    "--format",
                    "raw",
                    "--threads",
                    # --native unwinds C stacks, which needs the process paused.
                    *([] if native else ["--nonblocking"]),
                    *(["--gil"] if gil else []),
                    *(["--native"] if native else []),
                    "--output",
                    str(self.files[name]),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for name, pid in pids.items()
        ]

    def stop(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in self._procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def top_frames(raw: Path, count: int = 15) -> list[tuple[str, float, float]]:
    """(function, self %, inclusive %) of py-spy's collapsed stacks, by self time; line
    numbers are dropped so a function's lines add up. Percentages of all samples of all
    threads (py-spy leaves idle threads out)."""
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    if not raw.exists():
        return []
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        samples = int(n)
        frames = [_LINE.sub(")", f) for f in stack.split(";")[2:]]  # thread id, thread name
        if not frames:
            continue
        total += samples
        own[frames[-1]] = own.get(frames[-1], 0) + samples
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + samples
    ranked = sorted(own.items(), key=lambda kv: -kv[1])[:count]
    return [(frame, 100 * n / total, 100 * inclusive[frame] / total) for frame, n in ranked]


def print_frames(frames: dict[str, list[tuple[str, float, float]]]) -> None:
    for name, top in frames.items():
        print(f"  py-spy top frames, {name} (self % / inclusive % of samples):")
        for frame, own, incl in top:
            print(f"    {own:5.1f} {incl:5.1f}  {frame}")


_LINE = re.compile(r":\d+\)$")
