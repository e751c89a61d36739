"""The workload of bench_efficiency run by a perfect in-process FIFO dispatcher: the
runtime's own floor, with no Kafka, no proxy and no client.

Why: the FIFO bound (fifo_bound.py) counts each handler's work exactly as prescribed, but
a handler's `time.sleep(0.001)` or `await asyncio.sleep(0.001)` takes longer than 1 ms
(timer slack, thread wake-ups, the GIL; asyncio waits in epoll, whose timeout is whole
milliseconds, rounded up). This process runs the same handlers on `--slots` threads (or
async tasks in one event loop, `--async`), each taking the next message in offset order
the moment it frees (list scheduling, exactly the bound's schedule), so its makespan is
what Python itself needs for the workload on this machine at this moment. Measured beside
a Triage run, it splits Triage's distance from the bound into the runtime's share and
Triage's own.

Reads the workload as JSON on stdin (`[[kind, ms], ...]`); prints one JSON line:
`{"makespan": s, "cpu": s, "records": [[offset, start, finish], ...]}`, times from
time.monotonic(), `cpu` the process's CPU seconds over the run (every thread).
A `poison` message raises at once, like slots_instance.py's handler.

    python tests/perf/fifo_ideal.py --slots 32 [--async] < workload.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import threading
import time


def work(kind: str, ms: int) -> None:
    """slots_instance.py's sync handler: a pill raises at once, the rest sleep."""
    if kind == "poison":
        raise ValueError("poison pill")
    time.sleep(ms / 1000)


async def work_async(kind: str, ms: int) -> None:
    """slots_instance.py's async handler."""
    if kind == "poison":
        raise ValueError("poison pill")
    await asyncio.sleep(ms / 1000)


def makespan(records: list[list[float]]) -> float:
    """First start -> last finish: the run's time zero is when its first message starts,
    as Triage's is when the gate opens on deliveries every slot already holds."""
    return max(r[2] for r in records) - min(r[1] for r in records)


def run_threads(kinds: list[tuple[str, int]], slots: int) -> tuple[float, list[list[float]]]:
    """`slots` threads, each taking the next offset under one lock as it frees."""
    lock = threading.Lock()
    offsets = iter(range(len(kinds)))
    records: list[list[float]] = []
    start_line = threading.Barrier(slots + 1)

    def slot() -> None:
        start_line.wait()
        while True:
            with lock:  # the start is stamped in offset order, as list scheduling starts them
                offset = next(offsets, None)
                start = time.monotonic()
            if offset is None:
                return
            kind, ms = kinds[offset]
            with contextlib.suppress(ValueError):
                work(kind, ms)
            records.append([offset, start, time.monotonic()])

    threads = [threading.Thread(target=slot) for _ in range(slots)]
    for thread in threads:
        thread.start()
    start_line.wait()
    for thread in threads:
        thread.join()
    return makespan(records), records


async def run_tasks(kinds: list[tuple[str, int]], slots: int) -> tuple[float, list[list[float]]]:
    """`slots` tasks in one event loop, each taking the next offset as it frees."""
    offsets = iter(range(len(kinds)))
    records: list[list[float]] = []

    async def slot() -> None:
        for offset in offsets:  # one loop thread: no lock needed
            kind, ms = kinds[offset]
            start = time.monotonic()
            with contextlib.suppress(ValueError):
                await work_async(kind, ms)
            records.append([offset, start, time.monotonic()])

    await asyncio.gather(*(slot() for _ in range(slots)))
    return makespan(records), records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slots", type=int, required=True)
    parser.add_argument("--async", dest="asynchronous", action="store_true")
    args = parser.parse_args()
    kinds = [(str(kind), int(ms)) for kind, ms in json.load(sys.stdin)]
    cpu = time.process_time()
    if args.asynchronous:
        span, records = asyncio.run(run_tasks(kinds, args.slots))
    else:
        span, records = run_threads(kinds, args.slots)
    cpu = time.process_time() - cpu
    print(json.dumps({"makespan": span, "cpu": cpu, "records": records}), flush=True)


if __name__ == "__main__":
    main()
