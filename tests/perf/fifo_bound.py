"""The first-in-first-out bound: the makespan of a perfect FIFO schedule of a workload.

Why: a benchmark that only reports "N times faster than serial" hides the proxy's own
overhead once the work is short. The honest yardstick is what `slots` handlers would
need if nothing else cost time: messages start in offset order (the proxy hands the
window out in offset order), each on whichever slot frees first (list scheduling), and
the run ends when the last one finishes. Efficiency = bound / measured makespan.

Durations: each message's handler time, exactly as the workload prescribes it (the
sleep it asks for), not as measured; a handler that overruns its sleep therefore counts
against the measured run. A poison pill's handler raises at once, so it holds a slot
for no time: duration 0, one delivery. A plain raise is a nack without retry, which the
proxy dead-letters at once (`policies.after_failure` redelivers only failures that
asked for it: retry nacks, lapsed leases, vanished instances), so `max_attempts` and
the retry backoff never apply to it; its dead-letter write happens in the proxy beside
the handlers and shows only in the commit time, which the benchmarks report apart. A
workload whose pills asked for redelivery would need release times (each redelivery
after `retry_delay`) and is not what this bound models.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable


def fifo_bound(durations: Iterable[float], slots: int) -> float:
    """Makespan of list-scheduling `durations` in order onto `slots` identical slots, all
    free at time 0: each job starts when the earliest slot frees (never before the job
    ahead of it started). 0 for no jobs."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    free_at = [0.0] * slots  # a min-heap of the times each slot frees
    end = 0.0
    for duration in durations:
        if not (0 <= duration < math.inf):
            raise ValueError(f"durations must be finite and >= 0, got {duration}")
        start = heapq.heappop(free_at)
        finish = start + duration
        heapq.heappush(free_at, finish)
        end = max(end, finish)
    return end


def efficiency(bound_s: float, measured_s: float) -> float:
    """bound / measured (1.0: as fast as a perfect FIFO schedule)."""
    if measured_s <= 0:
        raise ValueError(f"measured must be > 0, got {measured_s}")
    return bound_s / measured_s
