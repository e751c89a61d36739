"""What the one per-message metric costs: the settle-latency histogram.

Why: every other metric is read at scrape time; this one is recorded on each ack and
nack, on the event-loop thread that also delivers. Run as a script:
``.venv/bin/python -m tests.perf.bench_metrics``. It times `LatencyHistogram.observe`
alone and a dispatcher settle of 1000-message batches with and without it (the
histogram swapped for a no-op), and exits 1 when an observation costs more than
MAX_OBSERVE_NS.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections.abc import Callable

from triage_protocol.constants import DEFAULT_FRAME_BYTES
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.observe.snapshot import LatencyHistogram
from triage_proxy.pipeline.dispatch import Dispatcher
from triage_proxy.pipeline.tracker import CommitTracker
from triage_proxy.server.outbox import Outbox
from triage_proxy.structs import Record

MAX_OBSERVE_NS = 400
BATCH = 1000
BATCHES = 200
ROUNDS = 5


class NoHistogram(LatencyHistogram):
    def observe(self, seconds: float, n: int = 1) -> None:
        pass


def best_ns(run: Callable[[], int]) -> float:
    """Fastest of ROUNDS runs, in ns per message."""
    best = float("inf")
    for _ in range(ROUNDS):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter_ns()
            n = run()
            best = min(best, (time.perf_counter_ns() - start) / n)
        finally:
            gc.enable()
    return best


def observe_only() -> int:
    h = LatencyHistogram()
    values = [i * 1e-4 for i in range(BATCH)] * BATCHES
    for v in values:
        h.observe(v)
    return len(values)


def settle_run(histogram: type[LatencyHistogram]) -> Callable[[], int]:
    settings = settings_from_dict(
        {
            "kafka": {"bootstrap_servers": "x", "topic": "t", "group_id": "g"},
            "auth": {"token": "0123456789abcdef"},
            "dead_letters": {"table": "dlq"},
            "window": {"max_messages": BATCH * 2},
        },
        {},
    )

    def run() -> int:
        tracker = CommitTracker(0)
        dispatcher = Dispatcher(settings, 0, tracker, lambda dl: None)
        dispatcher._window.settle_latency = histogram()  # the window observes each settle
        outbox = Outbox("t", 0, DEFAULT_FRAME_BYTES, packed=False)
        session = dispatcher.open_session("bench", BATCH, outbox)
        settle_ns = 0
        offset = 0
        for _ in range(BATCHES):
            dispatcher.add(
                Record("t", 0, o, None, b"v", (), 0) for o in range(offset, offset + BATCH)
            )
            acks = list(range(offset, offset + BATCH))
            start = time.perf_counter_ns()
            dispatcher.settle(session, acks, ())
            settle_ns += time.perf_counter_ns() - start
            offset += BATCH
            while not outbox.empty():
                outbox.get_nowait()
        return settle_ns

    return run


def timed_settle(histogram: type[LatencyHistogram]) -> float:
    run = settle_run(histogram)
    best = float("inf")
    for _ in range(ROUNDS):
        gc.collect()
        best = min(best, run() / (BATCH * BATCHES))
    return best


def main() -> int:
    asyncio.set_event_loop(asyncio.new_event_loop())  # the dispatcher's Events want one
    observe_ns = best_ns(observe_only)
    without = timed_settle(NoHistogram)
    with_ = timed_settle(LatencyHistogram)
    print(f"LatencyHistogram.observe: {observe_ns:.0f} ns per observation")
    print(f"settle, no histogram:    {without:.0f} ns per ack")
    print(f"settle, with histogram:  {with_:.0f} ns per ack ({with_ - without:+.0f} ns)")
    if observe_ns > MAX_OBSERVE_NS:
        print(f"FAIL: observe costs more than {MAX_OBSERVE_NS} ns", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
