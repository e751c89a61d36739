"""Memory with large records: the proxy's resident memory stays bounded by its window.

`--records` records of 1 MiB (default 2,000; the full-size run is 20,000) go through one
proxy with `window.max_bytes` at its default (64 MiB) to one instance whose handlers take
`--work-ms` each (default 20 ms x 8 handlers: the consumer is the bottleneck, so the window
fills and fetching must pause and resume). Sampled throughout: the proxy's RSS (psutil)
and its /status (fetch_paused, window bytes). Targets: RSS <= max_bytes + 200 MB at every
sample, fetching paused and resumed, nothing lost (every record acked, none dead-lettered,
the committed offset at the end). Also printed: the proxy's idle RSS, and per partition
the idle RSS / PSS of each proxy of an idle 4-partition dev stack (which runs one
process per partition).

Why 2,000 and not 20,000 by default: `triage dev`'s Tansu keeps the log in memory
(`--storage-engine memory://`), not on disk, so 20,000 x 1 MiB would be 20 GiB of
broker RAM on a 24 GiB machine shared with other work. 2,000 is still 31x the window,
which is what the test is about; `--records 20000` runs the full size where it fits.

    .venv/bin/python -m tests.perf.bench_memory [--records N] [--work-ms MS]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import psutil

from tests.commit_watcher import CommitWatcher
from tests.perf.common import Instances, status, table
from triage_cli.demo import count_dead_letters
from triage_cli.devstack import DevStack
from triage_proxy.config.sections import DEFAULT_WINDOW_BYTES

RECORD_BYTES = 1024 * 1024
HEADROOM = 200 * 1000 * 1000
"""Issue 15: RSS <= window.max_bytes + 200 MB."""
MB = 1024 * 1024


@dataclass
class Samples:
    rss: list[tuple[float, int]] = field(default_factory=list)
    paused: list[tuple[float, bool, int]] = field(default_factory=list)
    """(time, fetch_paused, window_bytes) from /status."""
    broker_rss: int = 0


def sample(stack: DevStack, stop: threading.Event, out: Samples) -> None:
    proxy = psutil.Process(stack.proxy_process(0).pid)
    broker = psutil.Process(stack.broker.pid)
    next_status = 0.0
    while not stop.is_set():
        now = time.monotonic()
        out.rss.append((now, proxy.memory_info().rss))
        out.broker_rss = max(out.broker_rss, broker.memory_info().rss)
        if now >= next_status:
            try:
                doc = status(stack)
                out.paused.append((now, bool(doc["fetch_paused"]), int(doc["window_bytes"])))
            except OSError:
                pass
            next_status = now + 0.1
        stop.wait(0.05)


def produce_large(bootstrap: str, topic: str, records: int, work_ms: int) -> float:
    """Records of exactly 1 MiB whose value starts `sleep:<work_ms>:<index>:` (what the
    instance's handler sleeps), then random bytes."""
    from confluent_kafka import Producer

    producer = Producer(
        {"bootstrap.servers": bootstrap, "linger.ms": 5, "message.max.bytes": 2 * RECORD_BYTES}
    )
    body = os.urandom(RECORD_BYTES)
    started = time.monotonic()
    for i in range(records):
        head = f"sleep:{work_ms}:{i}:".encode()
        value = head + body[len(head) :]
        while True:
            try:
                producer.produce(topic, value=value, partition=0)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    if producer.flush(300) != 0:
        raise RuntimeError("produce did not complete")
    return time.monotonic() - started


def idle_per_partition(partitions: int = 4) -> tuple[list[int], list[int]]:
    """RSS and PSS of each proxy of an idle `partitions`-partition dev stack."""
    with DevStack(topic="bench-memory-idle", partitions=partitions) as stack:
        time.sleep(2.0)
        procs = [psutil.Process(stack.proxy_process(p).pid) for p in range(partitions)]
        infos = [p.memory_full_info() for p in procs]
        return [i.rss for i in infos], [getattr(i, "pss", i.rss) for i in infos]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--work-ms", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"memory with 1 MiB records on {os.cpu_count()} cores, load average {load}")
    samples = Samples()
    stop = threading.Event()
    with DevStack(topic="bench-memory") as stack:
        time.sleep(1.0)
        idle_rss = psutil.Process(stack.proxy_process(0).pid).memory_info().rss
        sampler = threading.Thread(target=sample, args=(stack, stop, samples), daemon=True)
        sampler.start()
        produce_s = produce_large(stack.broker.bootstrap, stack.topic, args.records, args.work_ms)
        watcher = CommitWatcher(stack.broker.bootstrap, stack.group_id, stack.topic, 1)
        target = stack.describe()["proxies"][0]["target"]
        started = time.monotonic()
        instances = Instances([target], stack.token, 1, args.concurrency)
        try:
            watcher.wait_for([args.records], timeout_s=1800, poll_s=0.1)
            consumed_s = time.monotonic() - started
        finally:
            results = instances.stop()
            watcher.close()
            stop.set()
            sampler.join(5)
        final_rss = psutil.Process(stack.proxy_process(0).pid).memory_info().rss
        dead = count_dead_letters(stack.aws.endpoint_url, stack.table)
    rss_each, pss_each = idle_per_partition()
    peak = max(rss for _, rss in samples.rss)
    limit = DEFAULT_WINDOW_BYTES + HEADROOM
    states = [p for _, p, _ in samples.paused]
    pauses = sum(1 for a, b in itertools.pairwise(states) if not a and b)
    resumes = sum(1 for a, b in itertools.pairwise(states) if a and not b)
    peak_window = max((w for _, _, w in samples.paused), default=0)
    acked = sum(r.acked for r in results)
    lost = args.records - acked - dead
    print(
        table(
            [
                ("records", f"{args.records} x 1 MiB ({args.records * RECORD_BYTES / 1e9:.1f} GB)"),
                ("produce", f"{produce_s:.1f} s"),
                ("consume (instance started -> all committed)", f"{consumed_s:.1f} s"),
                ("window.max_bytes (default)", f"{DEFAULT_WINDOW_BYTES / MB:.0f} MiB"),
                ("proxy RSS idle", f"{idle_rss / MB:.0f} MiB"),
                (
                    "proxy RSS peak / at the end",
                    f"{peak / MB:.0f} / {final_rss / MB:.0f} MiB (limit {limit / MB:.0f} MiB)",
                ),
                ("window bytes peak (/status)", f"{peak_window / MB:.0f} MiB"),
                (
                    "fetch paused / resumed (/status every 0.1 s)",
                    f"{pauses} / {resumes} times, paused in {sum(states)} of {len(states)} reads",
                ),
                ("Tansu RSS peak (holds the log in memory)", f"{samples.broker_rss / MB:.0f} MiB"),
                ("acked / dead letters / lost", f"{acked} / {dead} / {lost}"),
                (
                    "idle 4-partition stack, per proxy RSS",
                    ", ".join(f"{r / MB:.0f}" for r in rss_each) + " MiB",
                ),
                (
                    "idle 4-partition stack, per proxy PSS",
                    ", ".join(f"{p / MB:.0f}" for p in pss_each) + " MiB",
                ),
            ]
        )
    )
    checks = [
        (
            peak <= limit,
            f"proxy RSS <= window.max_bytes + 200 MB at every sample ({len(samples.rss)})",
        ),
        (pauses >= 1 and resumes >= 1, "fetching paused and resumed"),
        (lost == 0 and dead == 0 and acked >= args.records, "nothing lost"),
    ]
    for good, what in checks:
        print(("PASS " if good else "FAIL ") + what)
    ok = all(good for good, _ in checks)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
