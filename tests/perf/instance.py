"""A consumer instance for the benchmarks, run as its own process.

The value of each message says what the handler does: `poison...` raises, `crash...`
ends the process at once (os._exit(1), a crash-type poison pill; `crash:<ms>` after that
much work), `slow...` sleeps 500
ms, `ordinary...` sleeps 2 ms, `sleep:<ms>` sleeps that long, anything else returns at
once (no-op). Handlers are async (asyncio.sleep), the client's fast path. On SIGTERM it
stops gracefully and prints one JSON line: handled, acked, nacked, the first handler
start, first and last handler finish times (time.time()), every finish as (time,
was-ordinary) for the stall measurement, and per partition the messages handled and the
last finish time. With TRIAGE_BENCH_REDELIVERED=FILE it appends to FILE, as each handler
starts, the offset and attempt of every message on its second attempt or later: a crash
blamed on it (the benchmarks' only failures besides `poison`).

With `--lean` the handler is a true no-op that only counts and stamps its finish: the
throughput benchmark's handler. The default one's bookkeeping (a tuple per finish, four
prefix tests, per-partition entries) cost about a fifth of an instance's CPU there.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from tests.consumer_process import instance_arguments, run_consumer
from triage_client import Message


def append_line(path: str, line: str) -> None:
    """Append `line` before the handler runs, so a crash in it loses nothing (a few
    bytes: blocking the loop for them is cheaper than a thread hop)."""
    with open(path, "a") as log:
        log.write(line + "\n")


def main() -> None:
    parser = instance_arguments(default_id="bench")
    parser.add_argument("--lean", action="store_true", help="a no-op handler: counts only")
    args = parser.parse_args()
    stats: dict[str, float] = {
        "handled": 0,
        "acked": 0,
        "nacked": 0,
        "started": 0.0,
        "first": 0.0,
        "last": 0.0,
    }
    finishes: list[tuple[float, bool]] = []
    partitions: dict[int, list[float]] = {}
    finish_partitions: list[int] = []
    redelivered = os.environ.get("TRIAGE_BENCH_REDELIVERED")

    async def work(value: bytes) -> None:
        if value.startswith(b"crash"):
            if value.startswith(b"crash:"):
                await asyncio.sleep(int(value[6:]) / 1000)
            os._exit(1)
        if value.startswith(b"poison"):
            raise ValueError("poison pill")
        if value.startswith(b"slow"):
            await asyncio.sleep(0.5)
        elif value.startswith(b"ordinary"):
            await asyncio.sleep(0.002)
        elif value.startswith(b"sleep:"):
            await asyncio.sleep(int(value[6:].split(b":")[0]) / 1000)

    async def handle(message: Message) -> None:
        value = message.value or b""
        stats["started"] = stats["started"] or time.time()
        if redelivered and message.attempt > 1:
            append_line(redelivered, f"{message.offset} {message.attempt}")
        try:
            await work(value)
            stats["acked"] += 1
        except ValueError:
            stats["nacked"] += 1
            raise
        finally:
            now = time.time()
            stats["handled"] += 1
            stats["first"] = stats["first"] or now
            stats["last"] = now
            finishes.append((now, value.startswith(b"ordinary")))
            finish_partitions.append(message.partition)
            seen = partitions.setdefault(message.partition, [0, 0.0])
            seen[0] += 1
            seen[1] = now

    async def lean(message: Message) -> None:
        now = clock()
        stats["first"] = stats["first"] or now
        stats["last"] = now
        stats["handled"] += 1

    clock = time.time
    run_consumer(args, lean if args.lean else handle)
    if args.lean:
        stats["acked"] = stats["handled"]
        stats["started"] = stats["first"]
    print(
        json.dumps(
            {
                **stats,
                "finishes": finishes,
                "partitions": partitions,
                "finish_partitions": finish_partitions,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
