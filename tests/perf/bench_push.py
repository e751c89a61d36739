"""Push delivery benchmarks: the proxy POSTs to a receiver on loopback (Node's `http`
module, tests/perf/push_receiver.js, so the receiver is not the limit).

    .venv/bin/python -m tests.perf.bench_push [--only single,batch,hol,adaptive,mixed]

Scenarios and targets (one partition, the embedded stack: Tansu, moto server, one proxy
process started after the records are produced):

    single    one record per POST (CloudEvents binary mode), no-op receiver:
              >= 8,000 msg/s (20,000 records)
    batch     batch = 500 (application/cloudevents-batch+json), no-op receiver:
              >= 80,000 msg/s (200,000 records), and the commit <= 2 s after the receiver
              answered the last request
    hol       the head-of-line demo workload (2 ms work, 1% at 500 ms, 0.5% poison) to a
              receiver with 32 handlers, against a plain serial consumer of the same records:
              >= 15x faster
    adaptive  a receiver that serves 16 requests at once (503 beyond) at 20 ms each (800/s):
              throughput >= 85% of capacity with 0 dead letters and the limit within 12-24
              after 10 s; then the receiver slows 10x for 10 s: the limit falls, and is back
              within 12-24 at most 15 s after the slowdown ends, 0 dead letters
    mixed     batch = 10 to a receiver that serves 16 requests at once (503 beyond) at 20 ms
              a record (800 records/s whatever the batch size), the records in spells
              that alternate requests of 1 record (4 KiB values, alone in a request) and
              full batches of 10 (small values): throughput >= 85% of capacity, 0 dead
              letters, and the limit never below 8 after the first 2 s (a 10-record
              request takes 10x a 1-record one, which is not queueing)

Messages/s is records / (the receiver's first request -> the commit of the last offset).
Each scenario prints PASS or FAIL; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.commit_watcher import CommitWatcher
from tests.perf.common import produce_values, table
from triage_cli.demo import Kind, Workload, count_dead_letters, run_serial_baseline
from triage_cli.devstack import DevStack
from triage_proxy.errors import ConfigError

RECEIVER = Path(__file__).with_name("push_receiver.js")


class Receiver:
    """The Node receiver as a child process: its port, stats on request, killed by PID."""

    def __init__(self, options: dict[str, Any]) -> None:
        self._proc = subprocess.Popen(
            ["node", str(RECEIVER), json.dumps(options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        self.port = int(json.loads(self._proc.stdout.readline())["port"])
        self.url = f"http://127.0.0.1:{self.port}/"
        self._lock = threading.Lock()

    def command(self, line: str) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(line + "\n")
        self._proc.stdin.flush()

    def stats(self) -> dict[str, int]:
        with self._lock:
            self.command("stats")
            assert self._proc.stdout is not None
            out: dict[str, int] = json.loads(self._proc.stdout.readline())
            return out

    def close(self) -> None:
        self._proc.kill()
        self._proc.wait(10)
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                pipe.close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Run:
    records: int
    seconds: float
    """The receiver's first request -> the commit of the last offset."""
    done: float
    """time.time() of the commit of the last offset."""
    dead: int
    push: dict[str, Any]


def push_status(stack: DevStack) -> dict[str, Any]:
    from triage_proxy.config.loader import load_settings

    port = load_settings(stack.config_path).server.http_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as answer:
        doc: dict[str, Any] = json.loads(answer.read())
    return doc["push"][0] if doc.get("push") else {}


def run_push(
    receiver: Receiver,
    values: list[bytes],
    target: dict[str, Any],
    topic: str,
    *,
    during: Any = None,
    timeout_s: float = 300.0,
) -> tuple[Run, DevStack]:
    overrides = {
        "push": [{"name": "bench", "url": receiver.url, **target}],
        "commit": {"interval_s": 0.1},
        "retry": {"initial_backoff_s": 0.05},
    }
    stack = DevStack(topic=topic, proxy_overrides=overrides, start_proxies=False)
    with stack:
        produce_values(stack.broker.bootstrap, stack.topic, values)
        watcher = CommitWatcher(stack.broker.bootstrap, stack.group_id, stack.topic, 1)
        try:
            stack.start_proxy(0)
            first = time.time()
            while receiver.stats()["requests"] == 0:
                first = time.time()
                time.sleep(0.002)
            if during is not None:
                during(stack)
            done = watcher.wait_for([len(values)], timeout_s=timeout_s)
            push = push_status(stack)
        finally:
            watcher.close()
        dead = count_dead_letters(stack.aws.endpoint_url, stack.table)
    return Run(len(values), done - first, done, dead, push), stack


def single(args: argparse.Namespace) -> bool:
    values = [b"v%d" % i for i in range(args.single_records)]
    with Receiver({"mode": "noop"}) as receiver:
        run, _ = run_push(receiver, values, {"max_concurrency": 64}, "bench-push-single")
    rate = run.records / run.seconds
    ok = rate >= 8000 and run.dead == 0
    print(
        table(
            [
                ("scenario", "single: one record per POST, no-op receiver"),
                ("records", run.records),
                ("seconds", f"{run.seconds:.2f}"),
                ("messages/s", f"{rate:,.0f} (target >= 8,000)"),
                ("limit at the end", run.push.get("limit")),
                (
                    "p50 / p99 round trip",
                    f"{run.push.get('latency_p50_s')} / {run.push.get('latency_p99_s')} s",
                ),
                ("dead letters", run.dead),
                ("result", "PASS" if ok else "FAIL"),
            ]
        )
    )
    return ok


def batch(args: argparse.Namespace) -> bool:
    values = [b"value-%08d" % i for i in range(args.batch_records)]
    last: list[float] = []

    def watch_receiver(receiver: Receiver) -> None:
        # When the receiver has seen every record, the proxy got its last answer (within
        # this poll's 5 ms); the commit is measured from then.
        def watch() -> None:
            while receiver.stats()["records"] < len(values):
                time.sleep(0.005)
            last.append(time.time())

        threading.Thread(target=watch, daemon=True).start()

    with Receiver({"mode": "noop"}) as receiver:
        run, _ = run_push(
            receiver,
            values,
            {"batch": 500, "max_concurrency": 16},
            "bench-push-batch",
            during=lambda stack: watch_receiver(receiver),
        )
    rate = run.records / run.seconds
    lag = run.done - last[0] if last else float("nan")
    ok = rate >= 80_000 and lag <= 2.0 and run.dead == 0
    print(
        table(
            [
                ("scenario", "batch: 500 records per POST, no-op receiver"),
                ("records", run.records),
                ("seconds", f"{run.seconds:.2f}"),
                ("messages/s", f"{rate:,.0f} (target >= 80,000)"),
                ("commit after the last answer", f"{lag:.3f} s (target <= 2 s)"),
                ("limit at the end", run.push.get("limit")),
                ("dead letters", run.dead),
                ("result", "PASS" if ok else "FAIL"),
            ]
        )
    )
    return ok


def hol(args: argparse.Namespace) -> bool:
    workload = Workload.generate(args.hol_records)
    values = [workload.value(i) for i in range(args.hol_records)]
    with DevStack(topic="bench-push-serial", start_proxies=False) as stack:
        produce_values(stack.broker.bootstrap, stack.topic, values)
        serial_s = run_serial_baseline(stack.broker.bootstrap, stack.topic, workload)
    receiver_options = {"mode": "demo", "handlers": 32, "work_ms": 2, "slow_ms": 500}
    with Receiver(receiver_options) as receiver:
        target = {"min_concurrency": 32, "max_concurrency": 64, "initial_concurrency": 48}
        run, _ = run_push(receiver, values, target, "bench-push-hol")
    speedup = serial_s / run.seconds
    poison = workload.count(Kind.POISON)
    ok = speedup >= 15 and run.dead == poison
    print(
        table(
            [
                ("scenario", "head-of-line demo workload, receiver with 32 handlers"),
                ("records", f"{run.records} ({workload.count(Kind.SLOW)} slow, {poison} poison)"),
                ("serial consumer", f"{serial_s:.2f} s"),
                ("through push", f"{run.seconds:.2f} s"),
                ("speedup", f"{speedup:.1f}x (target >= 15x)"),
                ("dead letters", f"{run.dead} (poison pills: {poison})"),
                ("result", "PASS" if ok else "FAIL"),
            ]
        )
    )
    return ok


def adaptive(args: argparse.Namespace) -> bool:
    """800/s of capacity for ~25 s of work at full speed, the slowdown in the middle."""
    capacity = 16 / 0.020
    records = args.adaptive_records
    values = [b"v%d" % i for i in range(records)]
    trace: list[tuple[float, int]] = []
    phases: dict[str, float] = {}

    def follow(stack: DevStack) -> None:
        def sample() -> None:
            start = time.time()
            phases["start"] = start
            slowed = False
            while True:
                now = time.time() - start
                try:
                    limit = int(push_status(stack).get("limit", 0))
                except (OSError, ConfigError):  # the stack is gone: the run ended
                    return
                trace.append((now, limit))
                if not slowed and now >= 10.0:
                    receiver.command("factor 10")
                    phases["slow_from"] = now
                    slowed = True
                if slowed and "slow_until" not in phases and now >= 20.0:
                    receiver.command("factor 1")
                    phases["slow_until"] = now
                time.sleep(0.25)

        threading.Thread(target=sample, daemon=True).start()

    with Receiver({"mode": "capacity", "capacity": 16, "delay_ms": 20}) as receiver:
        target = {"min_concurrency": 1, "max_concurrency": 64, "initial_concurrency": 4}
        run, _ = run_push(receiver, values, target, "bench-push-adaptive", during=follow)
        shed = receiver.stats()["shed"]
    # The limit just before the slowdown (9-10 s).
    before = [limit for t, limit in trace if 10.0 > t >= 10.0 - 0.01 or 9.0 <= t < 10.0]
    slow = [
        limit
        for t, limit in trace
        if phases.get("slow_from", 1e9) <= t < phases.get("slow_until", 0)
    ]
    after_end = phases.get("slow_until", 1e9) + 15.0
    recovered = [limit for t, limit in trace if after_end - 3.0 <= t <= after_end]
    # Throughput over the whole run, against the ideal: every record at capacity, plus
    # the 10 s of slowdown at a tenth of it.
    expected_s = records / capacity + 10.0 * (1 - 0.1)
    efficiency = expected_s / run.seconds
    ok = (
        run.dead == 0
        and efficiency >= 0.85
        and bool(before)
        and min(before) >= 12
        and max(before) <= 24
        and bool(slow)
        and min(slow) < min(before)
        and bool(recovered)
        and all(12 <= x <= 24 for x in recovered)
    )
    print(
        table(
            [
                ("scenario", "adaptive: 16 at once (503 beyond) x 20 ms, 10x slower 10-20 s"),
                ("records", records),
                ("seconds", f"{run.seconds:.2f} (ideal at capacity: {expected_s:.2f})"),
                ("throughput / capacity", f"{efficiency:.1%} (target >= 85%)"),
                ("limit at 9-10 s", f"{min(before, default=0)}-{max(before, default=0)} (12-24)"),
                ("limit while slowed", f"{min(slow, default=0)}-{max(slow, default=0)}"),
                (
                    "limit 12-15 s after",
                    f"{min(recovered, default=0)}-{max(recovered, default=0)} (12-24)",
                ),
                ("503s answered", shed),
                ("dead letters", f"{run.dead} (target 0)"),
                ("result", "PASS" if ok else "FAIL"),
            ]
        )
    )
    return ok


MIXED_SPELLS = 3
"""Spells of 1-record requests, each followed by a spell of 10-record requests."""
MIXED_BATCH = 10
MIXED_MAX_BATCH_BYTES = 4096
"""Ten small records' events fit in a request; one 4 KiB value's does not, so it goes
alone."""


def mixed(args: argparse.Namespace) -> bool:
    """Requests of 1 and of 10 records in turns, against a receiver whose cost is per
    record: the adaptive limit must read their different round trips as size, not
    queueing."""
    capacity = 16 / 0.020  # records/s: 16 at once, 20 ms a record
    alone = args.mixed_alone
    batched = args.mixed_batched
    values: list[bytes] = []
    for spell in range(MIXED_SPELLS):
        values += [b"%06d" % spell + b"x" * MIXED_MAX_BATCH_BYTES for _ in range(alone)]
        values += [b"v%d" % i for i in range(batched)]
    trace: list[tuple[float, int]] = []

    def follow(stack: DevStack) -> None:
        def sample() -> None:
            start = time.time()
            while True:
                try:
                    limit = int(push_status(stack).get("limit", 0))
                except (OSError, ConfigError):  # the stack is gone: the run ended
                    return
                trace.append((time.time() - start, limit))
                time.sleep(0.25)

        threading.Thread(target=sample, daemon=True).start()

    options = {"mode": "capacity", "capacity": 16, "delay_ms": 20, "per_record": True}
    with Receiver(options) as receiver:
        target = {
            "batch": MIXED_BATCH,
            "max_batch_bytes": MIXED_MAX_BATCH_BYTES,
            "min_concurrency": 1,
            "max_concurrency": 64,
            "initial_concurrency": 4,
        }
        run, _ = run_push(receiver, values, target, "bench-push-mixed", during=follow)
        stats = receiver.stats()
    expected_s = len(values) / capacity
    efficiency = expected_s / run.seconds
    late = [limit for t, limit in trace if t >= 2.0]
    floor = min(late, default=0)
    ok = run.dead == 0 and efficiency >= 0.85 and bool(late) and floor >= 8
    requests = stats["requests"] - stats["shed"]
    print(
        table(
            [
                (
                    "scenario",
                    "mixed: batch = 10, 16 at once (503 beyond) x 20 ms a record, "
                    "spells of 1-record and 10-record requests",
                ),
                ("records", f"{len(values)} ({MIXED_SPELLS} x ({alone} alone, {batched} small))"),
                (
                    "requests answered 200",
                    f"{requests} ({run.records / max(requests, 1):.1f} records each)",
                ),
                ("seconds", f"{run.seconds:.2f} (ideal at capacity: {expected_s:.2f})"),
                ("throughput / capacity", f"{efficiency:.1%} (target >= 85%)"),
                ("limit after 2 s", f"{floor}-{max(late, default=0)} (target >= 8)"),
                ("503s answered", stats["shed"]),
                ("dead letters", f"{run.dead} (target 0)"),
                ("result", "PASS" if ok else "FAIL"),
            ]
        )
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="single,batch,hol,adaptive,mixed")
    parser.add_argument("--single-records", type=int, default=20_000)
    parser.add_argument("--batch-records", type=int, default=200_000)
    parser.add_argument("--hol-records", type=int, default=5_000)
    parser.add_argument("--adaptive-records", type=int, default=24_000)
    parser.add_argument("--mixed-alone", type=int, default=400)
    parser.add_argument("--mixed-batched", type=int, default=2_000)
    args = parser.parse_args()
    scenarios = {
        "single": single,
        "batch": batch,
        "hol": hol,
        "adaptive": adaptive,
        "mixed": mixed,
    }
    results = [scenarios[name](args) for name in args.only.split(",") if name in scenarios]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
