"""A consumer instance for the benchmarks, run as its own process.

The value of each message says what the handler does: `poison...` raises,
`slow...` sleeps 500 ms, `ordinary...` sleeps 2 ms, `sleep:<ms>` sleeps that
long, anything else returns at once (no-op). Handlers are async (asyncio.sleep),
the client's fast path. On SIGTERM it stops gracefully and prints one JSON line:
handled, acked, nacked, first and last handler finish times (time.time()), and
every finish as (time, was-ordinary) for the stall measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time

from triage_client import Consumer, Message


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--id", default="bench")
    args = parser.parse_args()
    stats: dict[str, float] = {"handled": 0, "acked": 0, "nacked": 0, "first": 0.0, "last": 0.0}
    finishes: list[tuple[float, bool]] = []

    async def work(value: bytes) -> None:
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

    consumer = Consumer(
        args.target,
        os.environ["TRIAGE_TOKEN"],
        handle,
        concurrency=args.concurrency,
        consumer_id=args.id,
    )
    signal.signal(signal.SIGTERM, lambda *_: consumer.stop())
    consumer.run()
    print(json.dumps({**stats, "finishes": finishes}), flush=True)


if __name__ == "__main__":
    main()
