"""Keyed deadlines: the dispatcher's backoff timers (a message waiting to be redelivered).

Why: a message nacked with retry, or one whose instance vanished, waits out a backoff
before it is handed out again. That is "wake this key at time t" with replacement and
cancellation, and must stay cheap at a window of many thousands of messages. (Ack
deadlines are not kept here: the dispatcher keeps one deadline per delivered batch,
which costs a settle nothing; see dispatch/leases.py.)

How: a binary heap of ``(due, seq, key)`` entries with lazy deletion. ``seq`` is a
global counter stamped on every schedule; ``_live`` maps each key to the ``(due, seq)``
of its current entry, so an entry is stale exactly when its ``seq`` no longer matches.
``seq`` also breaks ties in schedule order and keeps keys out of comparisons, so keys
only need to be hashable. Cancelling or rescheduling leaves the old entry in the heap;
whenever stale entries outnumber live ones the heap is rebuilt from ``_live``. The
rebuild costs O(live + stale) < O(2 * stale) and each stale entry was made by one
operation since the last rebuild, so every operation stays O(log n) amortized and the
heap never holds more than twice the live keys.

This module is pure logic: no I/O, no clock (``now`` is passed in), no logging.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["Timers"]

K = TypeVar("K", bound=Hashable)


class Timers(Generic[K]):
    """A set of keys, each with one deadline; the due ones are popped in deadline order."""

    __slots__ = ("_heap", "_live", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        """Entries ``(due, seq, key)``; stale ones linger until popped or compacted."""
        self._live: dict[K, tuple[float, int]] = {}
        """Key -> ``(due, seq)`` of its one live heap entry."""
        self._seq = 0
        """Stamp of the next schedule; strictly increasing."""

    def schedule(self, key: K, due: float) -> None:
        """Set ``key``'s deadline to ``due``, replacing any earlier or later one."""
        if due != due:  # NaN would break the heap order
            raise ValueError("due must not be NaN")
        seq = self._seq
        self._seq = seq + 1
        self._live[key] = (due, seq)
        heapq.heappush(self._heap, (due, seq, key))
        self._maybe_compact()

    def cancel(self, key: K) -> bool:
        """Drop ``key``'s deadline; False if it had none."""
        if self._live.pop(key, None) is None:
            return False
        self._maybe_compact()
        return True

    def pop_due(self, now: float) -> list[K]:
        """Remove and return the keys due at or before ``now``: by deadline, ties by schedule."""
        heap = self._heap
        live = self._live
        out: list[K] = []
        while heap and heap[0][0] <= now:
            _, seq, key = heapq.heappop(heap)
            entry = live.get(key)
            if entry is not None and entry[1] == seq:
                del live[key]
                out.append(key)
        if out:
            self._maybe_compact()
        return out

    def next_due(self) -> float | None:
        """The earliest deadline, or None when nothing is scheduled."""
        heap = self._heap
        live = self._live
        while heap:
            _, seq, key = heap[0]
            entry = live.get(key)
            if entry is not None and entry[1] == seq:
                return heap[0][0]
            heapq.heappop(heap)
        return None

    def due_of(self, key: K) -> float | None:
        """``key``'s deadline, or None when it is not scheduled."""
        entry = self._live.get(key)
        return None if entry is None else entry[0]

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __repr__(self) -> str:
        return f"Timers(scheduled={len(self._live)}, next_due={self.next_due()})"

    def _maybe_compact(self) -> None:
        """Rebuild the heap from the live keys once stale entries outnumber them."""
        live = len(self._live)
        if len(self._heap) - live > live:
            heap = [(due, seq, key) for key, (due, seq) in self._live.items()]
            heapq.heapify(heap)
            self._heap = heap
