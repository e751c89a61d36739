"""The proxy's own Python path per message, without a broker, a network or a client.

Why: `bench_throughput` charges the proxy's CPU per message, but on a shared 2-core
machine its figure moves 3.2-6.5 us with the same code, so a change of a few tenths of a
microsecond drowns. This drives one partition's dispatcher the way the no-op benchmark
does (fetched batches in, packed Deliveries frames out and serialized as gRPC would, every
frame acked back as one ack range by its instance), in one process on one thread, and
prints CPU microseconds per message by stage. Its times still move 30% from run to run
here, so the instructions per message decide: `--callgrind` runs the same loop once
without timing, under valgrind at two message counts, and the difference of the totals
over the difference of the counts is what one message costs (the start-up cancels out):

    valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null \
        .venv/bin/python tests/perf/bench_dispatch.py --callgrind --messages 20000  (, 60000)

Stages: `records_of` (the fetch's Records), `add` (window.add and the first deliveries:
pump, hand-out, the outbox's encoding), `serialize` (what gRPC does to each frame),
`settle` (window.settle and the refill its pump sends).

What it leaves out: librdkafka's and gRPC's C threads, the event loop's wake-ups, the
committer. Measured in `bench_throughput` beside it.

    .venv/bin/python -m tests.perf.bench_dispatch [--messages N] [--batch 2000]
        [--instances 2] [--credits 512] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable

from confluent_kafka import TIMESTAMP_CREATE_TIME, Message

from triage_proxy.config.loader import settings_from_dict
from triage_proxy.kafka.client import records_of
from triage_proxy.pipeline.dispatch import Dispatcher, Session
from triage_proxy.pipeline.tracker import CommitTracker
from triage_proxy.server.outbox import Outbox

TOPIC = "bench-dispatch"
SETTINGS = {
    "kafka": {"bootstrap_servers": "b", "topic": TOPIC, "group_id": "g"},
    "auth": {"token": "bench-dispatch-token-0123"},
    "dead_letters": {"table": "dlq"},
}


class Span:
    """An ack range as a Settle frame carries it."""

    __slots__ = ("first", "last")

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last


def consumed(start: int, count: int, value: bytes) -> list[Message]:
    """What librdkafka's consume() hands the fetch: `count` messages from `start`."""
    stamp = (TIMESTAMP_CREATE_TIME, 1_700_000_000_000)
    return [
        Message(topic=TOPIC, partition=0, offset=o, key=None, value=value, timestamp=stamp)
        for o in range(start, start + count)
    ]


def run(args: argparse.Namespace, clock: Callable[[], float]) -> dict[str, float]:
    """One pass over `args.messages`; seconds of `clock` spent per stage."""
    settings = settings_from_dict({**SETTINGS, "window": {"max_messages": args.window}}, {})
    tracker = CommitTracker(0)
    dispatcher = Dispatcher(settings, 0, tracker, lambda dl: None)
    sessions: list[Session] = [
        dispatcher.open_session(f"i{n}", args.credits, Outbox(TOPIC, 0, 4 << 20, True))
        for n in range(args.instances)
    ]
    value = b"x" * 100
    spent = {"records_of": 0.0, "add": 0.0, "serialize": 0.0, "settle": 0.0}
    next_offset = 0
    done = 0
    while done < args.messages:
        room = min(dispatcher.room_for, args.batch, args.messages - next_offset)
        messages = consumed(next_offset, room, value) if room > 0 else []
        t0 = clock()
        batch = records_of(TOPIC, messages)
        t1 = clock()
        if batch:
            dispatcher.add(batch)
            next_offset += len(batch)
        t2 = clock()
        # The stream handlers write each frame (gRPC serializes it), then the instances
        # ack every delivery of a frame as one range.
        acks: list[tuple[Session, list[Span]]] = []
        for session in sessions:
            outbox = session.outlet
            assert isinstance(outbox, Outbox)
            spans: list[Span] = []
            while not outbox.empty():
                frame = outbox.get_nowait()
                assert frame is not None
                frame.SerializeToString()
                packed = frame.deliveries.packed
                n = len(packed.offsets) // 8
                first = int.from_bytes(packed.offsets[:8], "little")
                spans.append(Span(first, first + n - 1))
            acks.append((session, spans))
        t3 = clock()
        for session, spans in acks:
            if spans:
                dispatcher.settle(session, (), (), spans)
                done += sum(s.last - s.first + 1 for s in spans)
        t4 = clock()
        spent["records_of"] += t1 - t0
        spent["add"] += t2 - t1
        spent["serialize"] += t3 - t2
        spent["settle"] += t4 - t3
    assert tracker.committable == args.messages, tracker
    return spent


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=2_000, help="records per fetch")
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--credits", type=int, default=512, help="credits per instance")
    parser.add_argument("--window", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--callgrind", action="store_true", help="one round, no timing (run under valgrind)"
    )
    args = parser.parse_args()
    gc.set_threshold(20_000, 10, 10)  # the proxy's policy (gctuning.py)
    gc.freeze()
    if args.callgrind:
        run(args, lambda: 0.0)
        return 0
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"dispatch path, {args.messages} messages, load average {load}")
    totals: list[float] = []
    for n in range(args.rounds):
        spent = run(args, time.process_time)
        total = sum(spent.values())
        totals.append(total)
        per = ", ".join(f"{k} {v / args.messages * 1e6:.2f}" for k, v in spent.items())
        print(f"  round {n + 1}: {total / args.messages * 1e6:.2f} us per message ({per})")
    best, median = min(totals), statistics.median(totals)
    print(
        f"  us per message: best {best / args.messages * 1e6:.2f}, "
        f"median {median / args.messages * 1e6:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
