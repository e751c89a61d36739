"""One process of `--consumers` Consumer objects x `--concurrency` SYNC handlers (`--async`:
async ones), for bench_efficiency, held at a start gate so that every handler slot is busy
at time zero.

Why a gate: the first-in-first-out bound assumes every slot is free at time 0. Without
it, whichever process connects first runs alone for as long as the other takes to
import and connect, and the efficiency would measure process start-up, not the proxy.
Each handler waits on the gate; once all `consumers x concurrency` are waiting the
process prints `ready`; a byte on stdin opens the gate (the parent takes time zero when
it writes it).

Value format: `<kind>:<milliseconds>:<index>`; kind `poison` raises at once (a nack
without retry: dead-lettered after one delivery), any other kind sleeps that long (`await
asyncio.sleep` in an async handler). On SIGTERM every Consumer stops gracefully and one
JSON line is printed: per delivery [offset, start, finish, slot, consumer index,
was-poison] (slot: the handler thread, or for an async handler the pool's worker task),
times from time.monotonic() (CLOCK_MONOTONIC: one clock for every process on the host).
`--shared-loop` runs every Consumer in one event loop (`run_async` under one
`asyncio.gather`) instead of one `run()` thread each (whose Consumers, with sync handlers,
share the client's one loop thread too since loop.py). `--prefetch N`: Consumer(prefetch=N)
instead of the default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time

from triage_client import Consumer, Message


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--consumers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--id", default="slots")
    parser.add_argument("--switch-interval-ms", type=float, default=None)
    parser.add_argument("--prefetch", type=int, default=None)
    parser.add_argument("--async", dest="asynchronous", action="store_true")
    parser.add_argument(
        "--shared-loop",
        action="store_true",
        help="run every Consumer in one event loop (run_async + gather), not one loop each",
    )
    args = parser.parse_args()
    if args.switch_interval_ms is not None:
        # An experiment on GIL hand-off between the Consumers' loops and handler threads.
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    slots = args.consumers * args.concurrency
    gate = threading.Event()
    lock = threading.Lock()
    waiting = [0]
    records: list[tuple[int, float, float, int, int, bool]] = []

    def handler(index: int) -> object:
        def handle(message: Message) -> None:
            if not gate.is_set():
                with lock:
                    waiting[0] += 1
                    if waiting[0] == slots:
                        print("ready", flush=True)
                gate.wait()
            start = time.monotonic()
            kind, ms, _ = (message.value or b"::").split(b":", 2)
            poison = kind == b"poison"
            try:
                if poison:
                    raise ValueError("poison pill")
                time.sleep(int(ms) / 1000)
            finally:
                # list.append is atomic under the GIL: no lock on the measured path.
                records.append(
                    (message.offset, start, time.monotonic(), threading.get_ident(), index, poison)
                )

        async def handle_async(message: Message) -> None:
            if not gate.is_set():
                await wait_gate()
            start = time.monotonic()
            kind, ms, _ = (message.value or b"::").split(b":", 2)
            poison = kind == b"poison"
            try:
                if poison:
                    raise ValueError("poison pill")
                await asyncio.sleep(int(ms) / 1000)
            finally:
                slot = id(asyncio.current_task())  # the pool's worker task: one per slot
                records.append((message.offset, start, time.monotonic(), slot, index, poison))

        return handle_async if args.asynchronous else handle

    events: dict[asyncio.AbstractEventLoop, asyncio.Event] = {}
    """For async handlers: the gate as an event in each Consumer's loop."""

    async def wait_gate() -> None:
        loop = asyncio.get_running_loop()
        with lock:
            if gate.is_set():
                return
            event = events.setdefault(loop, asyncio.Event())
            waiting[0] += 1
            if waiting[0] == slots:
                print("ready", flush=True)
        await event.wait()

    token = os.environ["TRIAGE_TOKEN"]
    consumers = [
        Consumer(
            args.target,
            token,
            handler(i),  # type: ignore[arg-type]
            concurrency=args.concurrency,
            prefetch=args.prefetch,
            consumer_id=f"{args.id}-{i}",
        )
        for i in range(args.consumers)
    ]

    def open_gate() -> None:
        sys.stdin.buffer.read(1)
        with lock:
            gate.set()
            for loop, event in events.items():
                loop.call_soon_threadsafe(event.set)

    threading.Thread(target=open_gate, daemon=True).start()
    if args.shared_loop:

        async def together() -> None:
            await asyncio.gather(*(c.run_async() for c in consumers))

        threads = [threading.Thread(target=asyncio.run, args=(together(),))]
    else:
        threads = [threading.Thread(target=c.run) for c in consumers]
    done = threading.Event()

    def stop(*_: object) -> None:
        with lock:
            gate.set()
            for loop, event in events.items():
                loop.call_soon_threadsafe(event.set)
        for consumer in consumers:
            consumer.stop()
        done.set()

    signal.signal(signal.SIGTERM, stop)
    for thread in threads:
        thread.start()
    while not done.wait(0.2):
        pass
    for thread in threads:
        thread.join(60)
    print(json.dumps({"records": records}), flush=True)


if __name__ == "__main__":
    main()
