"""Commit tracking for one partition: which offset is safe to commit.

Why: the proxy hands messages out in any order and they settle (ack or durable
dead letter) in any order, but Kafka only stores one committed offset per
partition. The safe value is the smallest offset not yet settled; everything
settled above it is reported separately so it can ride along in the commit
metadata and a restarted proxy does not redeliver it.

How: offsets are kept in fixed-size pages (``bytearray`` of per-offset states)
held in a dict keyed by ``offset >> _PAGE_BITS`` and in a deque in offset
order. A settle is one dict lookup and one byte write; the committable offset
advances with a byte check in the contiguous case and ``bytearray.find``
(memchr) across gaps. Pages exist only where offsets are tracked, so a gap of
any size costs at most one new page, and pages are dropped once the
committable offset passes them. Memory is bounded by the window (tracked
offsets from the committable offset to the last tracked one): about 1.1 bytes
per offset when offsets are contiguous, at worst one page (~1 KiB) per tracked
offset when every offset sits alone in its page (a heavily compacted topic).
It also counts records (not offsets: a compacted topic has gaps) for the bound on what
a kill -9 can redeliver: how many were tracked, and how many of them the committer says
are durably recorded as settled (`mark_durable`); the window takes no more records while
`undurable` fills it (dispatch/window.py, policies.window_room).

This module is pure logic: no I/O, no clock, no logging.
"""

from __future__ import annotations

from collections import deque

__all__ = ["CommitTracker"]

_PAGE_BITS = 10
"""log2 of the offsets per page. Smaller pages waste less on sparse (compacted) topics, but
at 256 the extra page objects push a 10**6 window out of cache (see tests/perf)."""
_PAGE_SIZE = 1 << _PAGE_BITS
_PAGE_MASK = _PAGE_SIZE - 1

# Per-offset states stored in a page. Untracked slots (gaps) stay 0.
_UNTRACKED = 0
_PENDING = 1
_SETTLED = 2
_PENDING_SETTLED = bytes.maketrans(bytes([_PENDING]), bytes([_SETTLED]))
"""A page slice with every pending offset settled (gaps and settled ones unchanged)."""
_PENDING_RUN = bytes([_PENDING]) * _PAGE_SIZE
"""A page of pending offsets, sliced by `track_span`."""


class CommitTracker:
    """Tracks fetched offsets of one partition and computes the committable offset."""

    __slots__ = (
        "_durable",
        "_head",
        "_last",
        "_order",
        "_pages",
        "_pending",
        "_tail",
        "_tail_no",
        "_tracked",
    )

    def __init__(self, start_offset: int) -> None:
        """Start at ``start_offset``, the committed position fetching resumes from."""
        if start_offset < 0:
            raise ValueError(f"start_offset must be >= 0, got {start_offset}")
        self._last = start_offset - 1
        """Last tracked offset, or start_offset - 1 before the first track."""
        self._head = start_offset
        """Smallest pending offset; meaningful only while _pending > 0."""
        self._pending = 0
        """Number of tracked offsets not yet settled."""
        self._pages: dict[int, bytearray] = {}
        """Page number -> per-offset states of that page."""
        self._order: deque[tuple[int, bytearray]] = deque()
        """Live pages in offset order; the first holds _head while _pending > 0."""
        self._tail = bytearray()
        """The page holding _last (a placeholder when _tail_no is -1)."""
        self._tail_no = -1
        """Page number of _tail, or -1 when no page is live."""
        self._tracked = 0
        """Records tracked so far (gaps not counted)."""
        self._durable = 0
        """Of those, how many the committer found durably recorded as settled."""

    def track(self, offset: int) -> None:
        """Record a fetched offset; offsets must strictly increase."""
        if offset <= self._last:
            raise ValueError(f"offset {offset} is not above the last tracked offset {self._last}")
        self._last = offset
        page_no = offset >> _PAGE_BITS
        if page_no != self._tail_no:
            self._start_page(page_no)
        self._tail[offset & _PAGE_MASK] = _PENDING
        if not self._pending:
            self._head = offset
        self._pending += 1
        self._tracked += 1

    def _start_page(self, page_no: int) -> None:
        """A new tail page for offsets of `page_no` (once per page, off the per-offset path)."""
        tail = bytearray(_PAGE_SIZE)
        self._pages[page_no] = tail
        self._order.append((page_no, tail))
        self._tail = tail
        self._tail_no = page_no

    def track_span(self, first: int, last: int) -> None:
        """Record every offset of first..last as fetched (a contiguous run of a fetch, in
        order, above the last tracked offset): per page one slice write, not a Python step
        per offset. Same result as `track` for each offset in turn."""
        if first <= self._last:
            raise ValueError(f"offset {first} is not above the last tracked offset {self._last}")
        if last < first:
            return
        offset = first
        while offset <= last:
            page_no = offset >> _PAGE_BITS
            if page_no != self._tail_no:
                self._start_page(page_no)
            start = offset & _PAGE_MASK
            stop = min(_PAGE_SIZE, start + last - offset + 1)
            self._tail[start:stop] = _PENDING_RUN[: stop - start]
            offset += stop - start
        if not self._pending:
            self._head = first
        self._pending += last - first + 1
        self._tracked += last - first + 1
        self._last = last

    def settle(self, offset: int) -> bool:
        """Mark a pending offset settled; False if it was not pending."""
        page = self._pages.get(offset >> _PAGE_BITS)
        if page is None:
            return False
        slot = offset & _PAGE_MASK
        if page[slot] != _PENDING:
            return False
        page[slot] = _SETTLED
        self._pending -= 1
        if offset != self._head:
            return True
        if not self._pending:
            # Nothing in flight: committable is last + 1; drop every page.
            self._pages.clear()
            self._order.clear()
            self._tail = bytearray()
            self._tail_no = -1
            return True
        # Contiguous fast path: the next offset is the new head.
        slot += 1
        if slot < _PAGE_SIZE and page[slot] == _PENDING:
            self._head = offset + 1
            return True
        self._advance(page, slot)
        return True

    def settle_span(self, first: int, last: int) -> int:
        """Settle every pending offset of first..last at once (a Settle's ack range); gaps
        and settled offsets in it are left alone. Returns how many were pending: per page
        one count and one translate, not a Python step per offset."""
        if last < first or not self._pending:
            return 0
        head = self._head
        settled = 0
        offset = first
        while offset <= last:
            page_no = offset >> _PAGE_BITS
            start = offset & _PAGE_MASK
            stop = min(_PAGE_SIZE, start + last - offset + 1)
            offset = ((page_no + 1) << _PAGE_BITS) if stop == _PAGE_SIZE else last + 1
            page = self._pages.get(page_no)
            if page is None:
                continue
            n = page.count(_PENDING, start, stop)
            if n:
                page[start:stop] = page[start:stop].translate(_PENDING_SETTLED)
                settled += n
        if not settled:
            return 0
        self._pending -= settled
        if not self._pending:
            self._pages.clear()
            self._order.clear()
            self._tail = bytearray()
            self._tail_no = -1
        elif first <= head <= last:
            self._advance(self._order[0][1], head & _PAGE_MASK)
        return settled

    def _advance(self, page: bytearray, slot: int) -> None:
        """Move _head to the next pending offset at or after ``slot`` of the head page."""
        order = self._order
        found = page.find(_PENDING, slot)
        while found < 0:
            page_no, _ = order.popleft()
            del self._pages[page_no]
            page = order[0][1]
            found = page.find(_PENDING)
        self._head = (order[0][0] << _PAGE_BITS) | found

    def is_pending(self, offset: int) -> bool:
        """Whether ``offset`` is tracked and not yet settled."""
        page = self._pages.get(offset >> _PAGE_BITS)
        return page is not None and page[offset & _PAGE_MASK] == _PENDING

    @property
    def committable(self) -> int:
        """The offset to commit: the smallest pending one, else last tracked + 1."""
        return self._head if self._pending else self._last + 1

    @property
    def next_offset(self) -> int:
        """Last tracked offset + 1: where fetching continues (a floor for the log end)."""
        return self._last + 1

    @property
    def pending(self) -> int:
        """Number of tracked offsets not yet settled."""
        return self._pending

    @property
    def tracked(self) -> int:
        """Records tracked so far."""
        return self._tracked

    @property
    def settled(self) -> int:
        """Records tracked and settled so far: every one is either pending or settled."""
        return self._tracked - self._pending

    def settled_above_count(self) -> int:
        """How many settled records lie above the committable offset: one C-level count
        per live page, O(window / 1024)."""
        if not self._pending:
            return 0
        order = iter(self._order)
        _, first = next(order)
        count = first.count(_SETTLED, self._head & _PAGE_MASK)
        for _, page in order:
            count += page.count(_SETTLED)
        return count

    def below(self) -> int:
        """Records below the committable offset (all settled): what a plain commit of it
        records. O(window / 1024)."""
        return self.settled - self.settled_above_count()

    @property
    def durable(self) -> int:
        """Records the committer found durably recorded as settled (`mark_durable`)."""
        return self._durable

    @property
    def undurable(self) -> int:
        """Records tracked whose settlement is not durably recorded yet: the pending ones
        and the settled ones no commit or checkpoint has recorded. What a kill -9 now could
        redeliver, at most."""
        return self._tracked - self._durable

    def mark_durable(self, records: int) -> None:
        """`records` of the tracked records (a count the committer took with `settled` or
        `below` when it encoded a commit or checkpoint) are durably recorded now. Counts
        below the current mark change nothing: the mark only rises."""
        if records > self._durable:
            self._durable = min(records, self.settled)

    def settled_above(self) -> list[int]:
        """Sorted settled offsets above the committable offset; O(window)."""
        if not self._pending:
            return []
        head = self._head
        out: list[int] = []
        for page_no, page in self._order:
            base = page_no << _PAGE_BITS
            slot = page.find(_SETTLED)
            while slot >= 0:
                offset = base + slot
                if offset > head:
                    out.append(offset)
                slot = page.find(_SETTLED, slot + 1)
        return out

    def __repr__(self) -> str:
        return (
            f"CommitTracker(committable={self.committable}, pending={self._pending}, "
            f"last={self._last})"
        )
