"""A consumer for bench_latency, run as its own process: through Triage (`--target`) or a
plain confluent-kafka consumer of the same partition (`--bootstrap`, `--topic`).

Value format: `<phase>:<index>:<produced>`, `produced` = time.monotonic_ns() when the
producer handed the message to produce() (CLOCK_MONOTONIC is one clock for every process
on the host, and never steps). At handler start the latency is now - produced. The
first message of phase 0 (warm-up) prints `warm`, so the benchmark knows this consumer
is connected and reading before it measures. On SIGTERM it stops (Triage: gracefully)
and prints one JSON line: `latencies` [[phase, index, ns, offset, start], ...] (`start`:
time.monotonic_ns() at handler start), `returned`
{phase: time.monotonic_ns() when the last handler of that phase returned} and `probes`
{index: time.monotonic_ns() when the handler of that probe (phase 99) returned}; through
Triage also `received` [ns, first offset, last offset, ...]: when the client began unpacking
each frame of packed deliveries (for the benchmark's decomposition; a wrapper of
`triage_client.message.unpack_messages`, nothing on the wire changes) and `gc` [ns, pause ns,
generation, ...]: each collection of the cyclic garbage collector in this process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import threading
import time
from array import array
from typing import Any

from triage_client import Consumer, Message

WARM_UP = 0
PROBE = 99


class Recorder:
    def __init__(self) -> None:
        self.latencies = array("q")
        """phase, index, ns, offset, start per message, flat: an array holds no objects the
        garbage collector tracks (a list of 200,000 tuples made this process's collections
        the bench's own: a full one walked them all, 23 ms)."""
        self.received = array("q")
        self.returned: dict[int, int] = {}
        self.probes: dict[int, int] = {}
        self.collections = array("q")
        self._warm = False

    def start(self, value: bytes, offset: int) -> tuple[int, int]:
        now = time.monotonic_ns()
        phase, index, produced = (int(x) for x in value.split(b":"))
        self.latencies.extend((phase, index, now - produced, offset, now))
        return phase, index

    def end(self, phase: int, index: int) -> None:
        self.returned[phase] = now = time.monotonic_ns()
        if phase == PROBE:
            self.probes[index] = now
        if phase == WARM_UP and not self._warm:
            self._warm = True
            print("warm", flush=True)

    def dump(self) -> None:
        doc = {
            "latencies": [
                list(self.latencies[k : k + 5]) for k in range(0, len(self.latencies), 5)
            ],
            "returned": self.returned,
            "probes": self.probes,
            "received": list(self.received),
            "gc": list(self.collections),
        }
        print(json.dumps(doc), flush=True)


def trace_receipt(recorder: Recorder) -> None:
    """Stamp when the client unpacks each frame of deliveries (before the pool queues
    them for a handler): a wrapper of the message module's unpack_messages (which
    `messages_of` calls for a frame's packed columns)."""
    from triage_client import message

    unpack = message.unpack_messages
    received = recorder.received

    def traced(topic: str, partition: int, packed: Any) -> Any:
        now = time.monotonic_ns()
        messages = unpack(topic, partition, packed)
        if messages:
            received.extend((now, messages[0].offset, messages[-1].offset))
        return messages

    message.unpack_messages = traced


def trace_collections(recorder: Recorder) -> None:
    """Record each collection of the cyclic garbage collector: (start ns, pause ns, gen)."""
    began = [0]
    collections = recorder.collections

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.monotonic_ns()
        else:
            collections.extend((began[0], time.monotonic_ns() - began[0], info["generation"]))

    gc.callbacks.append(on_gc)


def through_triage(args: argparse.Namespace, recorder: Recorder) -> None:
    trace_receipt(recorder)
    trace_collections(recorder)
    handler: Any
    if args.sync:

        def handler(message: Message) -> None:
            recorder.end(*recorder.start(message.value or b"", message.offset))

    else:

        async def handler(message: Message) -> None:
            recorder.end(*recorder.start(message.value or b"", message.offset))

    consumer = Consumer(
        args.target,
        os.environ["TRIAGE_TOKEN"],
        handler,
        concurrency=args.concurrency,
        prefetch=args.prefetch,
    )
    signal.signal(signal.SIGTERM, lambda *_: consumer.stop())
    consumer.run()


def plain(args: argparse.Namespace, recorder: Recorder) -> None:
    from confluent_kafka import OFFSET_END, Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": args.bootstrap,
            "group.id": f"latency-plain-{time.time_ns()}",
            "fetch.wait.max.ms": args.fetch_wait_ms,
            **dict(pair.split("=", 1) for pair in args.client),
        }
    )
    consumer.assign([TopicPartition(args.topic, 0, OFFSET_END)])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.is_set():
        message = consumer.poll(0.1)
        if message is None or message.error():
            continue
        offset = message.offset()
        assert offset is not None  # a message without an error has one
        recorder.end(*recorder.start(message.value() or b"", offset))
    consumer.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prefetch", type=int)
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--bootstrap")
    parser.add_argument("--topic")
    parser.add_argument("--fetch-wait-ms", type=int, default=100)
    parser.add_argument("--client", action="append", default=[], help="PROP=VALUE for librdkafka")
    args = parser.parse_args()
    recorder = Recorder()
    if args.target:
        through_triage(args, recorder)
    else:
        plain(args, recorder)
    recorder.dump()


if __name__ == "__main__":
    main()
