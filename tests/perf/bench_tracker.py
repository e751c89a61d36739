"""Settle throughput of CommitTracker, and whether its cost stays flat as the window grows.

Why: the tracker sits on every message's ack path, so it must settle at least
1,000,000 offsets/s and must not slow down when many messages are in flight.
Run as a script: ``.venv/bin/python -m tests.perf.bench_tracker``. Settling
and tracking are timed apart (offsets are contiguous); ns/settle is the one
judged.
Exits 1 when a target is missed.
"""

from __future__ import annotations

import gc
import random
import sys
import time
from collections.abc import Callable

from triage_proxy.pipeline.tracker import CommitTracker

MIN_SETTLES_PER_S = 1_000_000
MAX_COST_RATIO = 1.5
WINDOWS = (10**4, 10**5, 10**6)
SMALL, LARGE = WINDOWS[0], WINDOWS[-1]
START = 1_000_000_000
SETTLES_PER_RUN = 1_000_000
"""Every timed run settles this many offsets: one tracker of the largest window, or many of
a smaller one, so small and large windows are timed over equally long stretches."""
ROUNDS = 5
"""Runs per case; the fastest counts. Cases are interleaved round by round so that load
from other processes on this shared machine hits every case alike."""


def _fresh(offsets: list[int]) -> list[int]:
    """Copy ints into new objects, allocated in iteration order as a consumer would see them."""
    return [o + 0 for o in offsets]


def in_order(offsets: list[int]) -> list[int]:
    """Settle oldest first: the common case, the committable offset moves every time."""
    return list(offsets)


def reverse(offsets: list[int]) -> list[int]:
    """Settle newest first: nothing commits until the very last settle."""
    return offsets[::-1]


def shuffled(offsets: list[int]) -> list[int]:
    """Settle in uniformly random order across the window."""
    out = list(offsets)
    random.Random(42).shuffle(out)
    return out


ORDERS: dict[str, Callable[[list[int]], list[int]]] = {
    "in-order": in_order,
    "reverse": reverse,
    "shuffled": shuffled,
}


def run_case(window: int, settle_order: list[int]) -> tuple[float, float]:
    """One run over trackers of ``window`` offsets: (track ns/op, settle ns/op)."""
    trackers = [CommitTracker(START) for _ in range(SETTLES_PER_RUN // window)]
    # Each tracker settles its own copy, so every window streams the same 10**6 int objects
    # and differences in cost come from the tracker, not from a small list staying in cache.
    settle_orders = [_fresh(settle_order) for _ in trackers]
    offsets = range(START, START + window)
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        for tracker in trackers:
            track = tracker.track
            for o in offsets:
                track(o)
        t1 = time.perf_counter_ns()
        for tracker, own_order in zip(trackers, settle_orders, strict=True):
            settle = tracker.settle
            for o in own_order:
                settle(o)
        t2 = time.perf_counter_ns()
    finally:
        gc.enable()
    for tracker in trackers:
        if tracker.pending or tracker.committable != START + window:
            raise AssertionError(f"tracker ended in a wrong state: {tracker!r}")
    ops = len(trackers) * window
    return (t1 - t0) / ops, (t2 - t1) / ops


def main() -> int:
    """Run every case, print the table and the verdict; return the exit code."""
    cases = [(name, window) for name in ORDERS for window in WINDOWS]
    settle_orders = {
        (name, window): ORDERS[name](list(range(START, START + window))) for name, window in cases
    }
    track_ns = dict.fromkeys(cases, float("inf"))
    costs = dict.fromkeys(cases, float("inf"))
    for _ in range(ROUNDS):
        for case in cases:
            track, settle = run_case(case[1], settle_orders[case])
            track_ns[case] = min(track_ns[case], track)
            costs[case] = min(costs[case], settle)
    header = f"{'window':>9}  {'order':<9}  {'settles/s':>12}  {'ns/settle':>9}  {'ns/track':>8}"
    print(header)
    print("-" * len(header))
    for name, window in cases:
        settle_ns = costs[name, window]
        print(
            f"{window:>9,}  {name:<9}  {1e9 / settle_ns:>12,.0f}  "
            f"{settle_ns:>9.1f}  {track_ns[name, window]:>8.1f}"
        )
    print()
    ratios = {name: costs[name, LARGE] / costs[name, SMALL] for name in ORDERS}
    for name, ratio in ratios.items():
        print(f"cost ratio {LARGE:,} / {SMALL:,} window, {name:<9}: {ratio:.2f}x")
    print()
    slowest = min(1e9 / ns for ns in costs.values())
    throughput_ok = slowest >= MIN_SETTLES_PER_S
    flat_ok = max(ratios.values()) <= MAX_COST_RATIO
    print(
        f"{'PASS' if throughput_ok else 'FAIL'}: slowest case {slowest:,.0f} settles/s "
        f"(target >= {MIN_SETTLES_PER_S:,})"
    )
    print(
        f"{'PASS' if flat_ok else 'FAIL'}: worst cost ratio {max(ratios.values()):.2f}x "
        f"(target <= {MAX_COST_RATIO}x)"
    )
    return 0 if throughput_ok and flat_ok else 1


if __name__ == "__main__":
    sys.exit(main())
