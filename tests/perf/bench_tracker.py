"""Settle throughput of CommitTracker, and whether its cost stays flat as the window grows.

Why: the tracker sits on every message's ack path, so it must settle at least
1,000,000 offsets/s and must not slow down when many messages are in flight.
Run as a script: ``.venv/bin/python tests/perf/bench_tracker.py``. Only
settling is timed; tracking happens before the timer and is reported apart.
Exits 1 when a target is missed.
"""

from __future__ import annotations

import gc
import random
import sys
import time
from collections.abc import Callable

from triage_proxy.tracker import CommitTracker

MIN_SETTLES_PER_S = 1_000_000
MAX_COST_RATIO = 1.5
WINDOWS = (10**4, 10**5, 10**6)
SMALL, LARGE = WINDOWS[0], WINDOWS[-1]
START = 1_000_000_000
MIN_REPEATS = 3
SETTLES_PER_CASE = 3_000_000
"""Each case repeats until it has settled this many offsets; the fastest run counts."""


def _fresh(offsets: list[int]) -> list[int]:
    """Copy ints into new objects allocated in iteration order (keeps the loop cache-friendly)."""
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


def run_case(window: int, order: Callable[[list[int]], list[int]]) -> tuple[float, float]:
    """Best (track ns/op, settle ns/op) over repeated runs of one window and order."""
    offsets = list(range(START, START + window))
    settle_order = _fresh(order(offsets))
    best_track = best_settle = float("inf")
    for _ in range(max(MIN_REPEATS, SETTLES_PER_CASE // window)):
        tracker = CommitTracker(START)
        track = tracker.track
        settle = tracker.settle
        gc.disable()
        try:
            t0 = time.perf_counter_ns()
            for o in offsets:
                track(o)
            t1 = time.perf_counter_ns()
            for o in settle_order:
                settle(o)
            t2 = time.perf_counter_ns()
        finally:
            gc.enable()
        if tracker.pending or tracker.committable != START + window:
            raise AssertionError(f"tracker ended in a wrong state: {tracker!r}")
        best_track = min(best_track, (t1 - t0) / window)
        best_settle = min(best_settle, (t2 - t1) / window)
    return best_track, best_settle


def main() -> int:
    """Run every case, print the table and the verdict; return the exit code."""
    costs: dict[tuple[str, int], float] = {}
    header = f"{'window':>9}  {'order':<9}  {'settles/s':>12}  {'ns/settle':>9}  {'ns/track':>8}"
    print(header)
    print("-" * len(header))
    for name, order in ORDERS.items():
        for window in WINDOWS:
            track_ns, settle_ns = run_case(window, order)
            costs[name, window] = settle_ns
            print(
                f"{window:>9,}  {name:<9}  {1e9 / settle_ns:>12,.0f}  "
                f"{settle_ns:>9.1f}  {track_ns:>8.1f}"
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
