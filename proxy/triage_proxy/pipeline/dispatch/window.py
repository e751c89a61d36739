"""The in-flight window: every fetched record from its fetch until it is settled.

The window owns the entries (one per unsettled record, in offset order), their bytes,
which instance holds each one (`Session.held` and `Session.suspects` are its ledger of
that instance: written only here), the failed-delivery counts the committer persists,
what a previous run settled or counted (carryover.py), and the four events the rest of the partition
waits on (`room`, `quiet`, `caught_up`, `durability`).

With `bounded` (the settled-above checkpoint is on) the window counts a record from its
fetch until a commit or checkpoint durably recorded it as settled, not only until it
settled (policies.window_room): a kill -9 then redelivers at most `max_messages` records,
wherever it lands, a restarted proxy's catch-up burst included.

An entry's life, and the part that moves it (the state is `Entry.state`):

    fetched ─ add ─> READY ──── scheduler.py hands it out ───> HELD ─ ack ─> settled (gone)
                      │  ^                                      │
                      │  └──── redelivery.py (after BACKOFF) <──┤ nack with retry, lease
                      │                                         │ lapsed, instance gone
                      └─ WAITING (keylocks.py)                  └─ nack ─> DEAD_LETTERING
                                                                           │ written: gone
                                                                           └> UNWRITABLE

Nothing here does I/O or decides a policy; the loops over a batch are written out
(no call per record) because they run once per message at full speed.
"""

from __future__ import annotations

import asyncio
import enum
import operator
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from triage_proxy.observe.snapshot import LatencyHistogram
from triage_proxy.pipeline.dispatch.carryover import Carryover
from triage_proxy.pipeline.policies import durability_due, window_room
from triage_proxy.pipeline.tracker import CommitTracker
from triage_proxy.structs import Record

if TYPE_CHECKING:
    from triage_proxy.pipeline.dispatch.sessions import Session


class EntryState(enum.Enum):
    READY = "ready"
    """Waiting for an instance with credit."""
    HELD = "held"
    """Delivered; the holder has not settled it yet (its lease is running)."""
    BACKOFF = "backoff"
    """Waiting out a backoff before it is ready again: nacked with retry, or (`suspect`)
    its instance vanished or its lease lapsed again."""
    WAITING = "waiting"
    """Ordering by key: an earlier record with the same key is not done yet."""
    DEAD_LETTERING = "dead_lettering"
    """Waiting for its dead letter to be durably written."""
    UNWRITABLE = "unwritable"
    """Its dead letter can never be written (deadletters/writer.py): unsettled until a restart."""


NOT_ACQUITTED = (0, -1)
"""`Entry.acquittals` of a record never acquitted at a crash (or a suspect since)."""


class Entry:
    """One unsettled record in the window, with its delivery state."""

    __slots__ = (
        "acquittals",
        "attempt",
        "deadline",
        "delivered_at",
        "fetched_at",
        "holder",
        "record",
        "size",
        "state",
        "suspect",
    )

    record: Record
    size: int
    """Key + value bytes (Record.size when it has headers)."""
    attempt: int
    """Deliveries so far (the current one included while HELD)."""
    holder: Session | None
    state: EntryState
    deadline: float
    """When the current delivery's lease expires (monotonic seconds)."""
    suspect: bool
    """Its instance vanished (or its lease lapsed) while holding it: maybe a poison pill.
    Set from then until it is settled or handled (see scheduler.py, `suspects`)."""
    acquittals: tuple[int, int]
    """How often it was held at a crash blamed on another record and went back as no
    suspect, and that record's offset the last time: NOT_ACQUITTED until its first
    acquittal, and again once it becomes a suspect (policies.judged_on_vanish)."""
    fetched_at: float
    """When it entered the window (monotonic seconds; for the oldest unsettled age)."""
    delivered_at: float
    """When its current delivery went out (monotonic seconds; for the settle latency)."""

    @classmethod
    def of(cls, record: Record, fetched_at: float = 0.0) -> Entry:
        """One entry (`fetched` is the one place that builds them)."""
        return cls.fetched([record], fetched_at)[0]

    @classmethod
    def fetched(cls, batch: list[Record], fetched_at: float) -> list[Entry]:
        """An entry for each record of `batch`, READY, built without a call per record:
        one is built per fetched message, and a call through `type` to an `__init__` was
        5% of the dispatch path's instructions (bench_dispatch)."""
        new = object.__new__
        ready = EntryState.READY
        out: list[Entry] = []
        append = out.append
        for record in batch:
            entry = new(cls)
            entry.record = record
            _, _, _, key, value, headers, _ = record
            if headers:
                entry.size = record.size
            else:
                entry.size = (0 if key is None else len(key)) + (0 if value is None else len(value))
            entry.attempt = 0
            entry.holder = None
            entry.state = ready
            entry.deadline = 0.0
            entry.suspect = False
            entry.acquittals = NOT_ACQUITTED
            entry.fetched_at = fetched_at
            entry.delivered_at = 0.0
            append(entry)
        return out


@dataclass
class Counters:
    """Running totals the proxy reports (metrics and status read these). Each is counted
    by the one part that does what it names."""

    fetched: int = 0
    delivered: int = 0
    redelivered: int = 0
    acked: int = 0
    nacked: int = 0
    retried: int = 0
    expired: int = 0
    extended: int = 0
    rejected: int = 0
    released: int = 0
    skipped_settled: int = 0
    dead_lettered: int = 0
    frames_out: int = 0
    settle_frames: int = 0
    sessions_opened: int = 0
    sessions_closed: int = 0


class Span(Protocol):
    """Acks of first..last (a Settle's ack range)."""

    @property
    def first(self) -> int: ...

    @property
    def last(self) -> int: ...


class Nack(Protocol):
    """A nack as the consumer sent it."""

    @property
    def offset(self) -> int: ...

    @property
    def reason(self) -> str: ...

    @property
    def retry(self) -> bool: ...


SIZE = operator.attrgetter("size")
"""Entry.size, as a C-level getter for whole batches."""
_OFFSET = operator.itemgetter(2)
"""Record.offset, as a C-level getter for whole batches."""


class Window:
    """Every unsettled record and who holds it; see the module docstring."""

    def __init__(
        self,
        max_messages: int,
        max_bytes: int,
        refill: int,
        tracker: CommitTracker,
        counters: Counters,
        *,
        already_settled: Collection[int] = (),
        prior_failures: Mapping[int, int] | None = None,
        bounded: bool = False,
    ) -> None:
        self._max_messages = max_messages
        self._bounded = bounded
        """Count records until their settlement is durable (module docstring)."""
        self._max_bytes = max_bytes
        self._refill = refill
        """Hysteresis: once full, fetch again only when this many records fit, not for
        every few settled messages (each fetch round trip has a fixed cost)."""
        self._tracker = tracker
        self._counters = counters
        self._entries: dict[int, Entry] = {}
        self._bytes = 0
        self._held = 0
        """Entries in some session's `held`."""
        self._dead_lettering = 0
        """Entries handed to the dead-letter writer, not durable yet."""
        self.carryover = Carryover(tracker, self._entries, already_settled, prior_failures)
        """What a previous run left and this run leaves: settled-above offsets, failure
        counts (carryover.py)."""
        self.settle_latency = LatencyHistogram()
        """Delivery -> ack/nack, per settled delivery (see metrics.py for its cost)."""
        self.room = asyncio.Event()
        """Set while the window has room for a worthwhile fetch (see `_refill`)."""
        self.room.set()
        self.quiet = asyncio.Event()
        """Set while nothing is delivered-and-unsettled or being dead-lettered (drain)."""
        self.quiet.set()
        self.caught_up = asyncio.Event()
        """Set each time every fetched record got settled (the tracker has none pending
        any more); the committer clears it once it looked. Its cue to commit without
        waiting for its tick (committer.py)."""
        self._pending = False
        """The tracker had records pending at the last `update_events`."""
        self.durability = asyncio.Event()
        """Set when recording what settled (a commit, a checkpoint) would make room for a
        fetch the bounded window holds back (policies.durability_due); the committer
        clears it once it looked: its cue to commit without waiting for its tick."""

    # --- what the window holds ----------------------------------------------------------

    @property
    def entries(self) -> Mapping[int, Entry]:
        """The unsettled records by offset, in offset order (read-only to other parts)."""
        return self._entries

    @property
    def in_window(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    @property
    def room_for(self) -> int:
        """How many more records the window takes before it is full (0 when full)."""
        if self._bytes >= self._max_bytes:
            return 0
        return self._room()

    def _room(self) -> int:
        """The room by count of records (policies.window_room)."""
        return window_room(
            max_messages=self._max_messages,
            unsettled=len(self._entries),
            undurable=self._tracker.undurable,
            bounded=self._bounded,
        )

    @property
    def in_flight(self) -> int:
        """Records delivered and not settled, plus dead letters not yet durable (not the
        unwritable ones: nothing can settle those before a restart)."""
        return self._held + self._dead_lettering

    @property
    def oldest_fetched_at(self) -> float | None:
        """When the oldest unsettled record entered the window (monotonic), None if empty."""
        # The dict keeps insertion (= offset) order, so its first entry is the oldest.
        for entry in self._entries.values():
            return entry.fetched_at
        return None

    @property
    def oldest(self) -> Entry | None:
        """The unsettled record with the smallest offset (what the commit waits for)."""
        for entry in self._entries.values():
            return entry
        return None

    def update_events(self) -> None:
        if self.room_for >= self._refill:
            self.room.set()
        else:
            self.room.clear()
        if self._bounded:
            tracker = self._tracker
            if durability_due(
                room=self._room(),
                settled_waiting=tracker.settled - tracker.durable,
                refill=self._refill,
                low=max(self._refill, self._max_messages // 2),
            ):
                self.durability.set()
        if self._held or self._dead_lettering:
            self.quiet.clear()
        else:
            self.quiet.set()
        if self._tracker.pending:
            self._pending = True
        elif self._pending:
            self._pending = False
            self.caught_up.set()

    # --- records in -----------------------------------------------------------------------

    def add(self, batch: list[Record], now: float) -> list[Entry]:
        """Take freshly fetched records (in offset order) in; return their entries, READY,
        without the ones a previous run settled. An entry that failed in a previous run
        comes with that run's count as its `attempt` (its caller continues it)."""
        first, last = batch[0].offset, batch[-1].offset
        if (
            last - first + 1 == len(batch)
            and not (self.carryover.skip or self.carryover.prior)
            and list(map(_OFFSET, batch)) == list(range(first, last + 1))
        ):
            # The common batch: the same steps in bulk (one tracker call, one dict update).
            self._tracker.track_span(first, last)
            new = Entry.fetched(batch, now)
            self._entries.update(zip(range(first, last + 1), new, strict=True))
            self._bytes += sum(map(SIZE, new))
            self._counters.fetched += len(new)
            return new
        track = self._tracker.track
        carryover = self.carryover
        skip = carryover.skip
        prior = carryover.prior
        entries = self._entries
        new = []
        size = 0
        for record in batch:
            offset = record.offset
            track(offset)
            if skip and offset in skip:
                # Settled by a previous run above its committed offset: not again.
                skip.discard(offset)
                self._tracker.settle(offset)
                self._counters.skipped_settled += 1
                continue
            entry = Entry.of(record, now)
            entries[offset] = entry
            size += entry.size
            if prior and offset in prior:
                entry.attempt = carryover.counts[offset] = prior.pop(offset)
            new.append(entry)
        self._bytes += size
        self._counters.fetched += len(new)
        return new

    # --- who holds what -------------------------------------------------------------------

    def hand_out(
        self, session: Session, batch: list[Entry], now: float, deadline: float
    ) -> tuple[list[int], int]:
        """`batch` goes to `session` now, each delivery leased until `deadline`: count the
        attempt, record the holder. Returns (the offsets, how many are redeliveries)."""
        held = session.held
        leased: list[int] = []
        lease = leased.append
        held_state = EntryState.HELD
        redelivered = 0
        for entry in batch:
            attempt = entry.attempt = entry.attempt + 1
            if attempt > 1:
                redelivered += 1
            entry.state = held_state
            entry.holder = session
            offset = entry.record[2]
            if entry.suspect:
                session.suspects += 1
                session.started.discard(offset)
            held[offset] = entry
            entry.deadline = deadline
            entry.delivered_at = now
            lease(offset)
        self._held += len(batch)
        return leased, redelivered

    def busy(self) -> None:
        """Deliveries went out: not quiet until they settle."""
        self.quiet.clear()

    def take_back(self, session: Session, entries: Sequence[Entry]) -> None:
        """Undo `hand_out` for `entries` (no frame could carry them): READY, not held, the
        attempt not counted."""
        for entry in entries:
            del session.held[entry.record.offset]
            entry.attempt -= 1
            entry.holder = None
            entry.state = EntryState.READY
            if entry.suspect:
                session.suspects -= 1
        self._held -= len(entries)

    def settle(
        self,
        session: Session,
        acks: Sequence[int],
        ranges: Sequence[Span],
        nacks: Sequence[Nack],
        now: float,
        *,
        ordered: bool,
    ) -> tuple[list[int], list[Entry], list[Entry], list[Nack]]:
        """Apply a batch of settlements from `session`: acked entries leave the window (and
        settle in the tracker), nacked ones leave `session`. Returns (the offsets it does
        not hold, the acked entries when `ordered` (their keys move on), the nacked entries
        and their nacks)."""
        rejected: list[int] = []
        done: list[Entry] = []
        keyed = done.append if ordered else None
        held = session.held
        entries = self._entries
        freed = 0
        acked = 0
        suspects = 0
        # Deliveries of one frame share `delivered_at`: one histogram step per run of them.
        observe = self.settle_latency.observe
        seen_at, seen = 0.0, 0
        settle = self._tracker.settle
        for offset in acks:
            entry = held.pop(offset, None)
            if entry is None:
                rejected.append(offset)
                continue
            if entry.delivered_at != seen_at:
                if seen:
                    observe(now - seen_at, seen)
                seen_at, seen = entry.delivered_at, 0
            seen += 1
            if entry.suspect:
                entry.suspect = False
                suspects += 1
            settle(offset)
            del entries[offset]
            freed += entry.size
            acked += 1
            if keyed is not None:
                keyed(entry)
        settle_span = self._tracker.settle_span
        pop = held.pop
        for span in ranges:
            first, last = span.first, span.last
            start = first  # the run of held offsets settled in the tracker in one call
            for offset in range(first, last + 1):
                entry = pop(offset, None)
                if entry is None:
                    rejected.append(offset)
                    if start < offset:
                        settle_span(start, offset - 1)
                    start = offset + 1
                    continue
                if entry.delivered_at != seen_at:
                    if seen:
                        observe(now - seen_at, seen)
                    seen_at, seen = entry.delivered_at, 0
                seen += 1
                if entry.suspect:
                    entry.suspect = False
                    suspects += 1
                del entries[offset]
                freed += entry.size
                acked += 1
                if keyed is not None:
                    keyed(entry)
            if start <= last:
                settle_span(start, last)
        if seen:
            observe(now - seen_at, seen)
        nacked: list[Entry] = []
        their: list[Nack] = []
        for nack in nacks:
            entry = held.pop(nack.offset, None)
            if entry is None:
                rejected.append(nack.offset)
                continue
            observe(now - entry.delivered_at)
            if entry.suspect:  # it was handled, so it is no crash-type pill
                entry.suspect = False
                suspects += 1
            nacked.append(entry)
            their.append(nack)
        session.suspects -= suspects
        self._held -= acked + len(nacked)
        self._bytes -= freed
        self._counters.acked += acked
        return rejected, done, nacked, their

    def extend(self, session: Session, offsets: Sequence[int], deadline: float) -> list[int]:
        """Push the leases of what `session` holds among `offsets` out to `deadline`;
        returns the offsets extended (an offset named twice is extended once)."""
        held = session.held
        extended = []
        for offset in dict.fromkeys(offsets):
            entry = held.get(offset)
            if entry is not None:
                entry.deadline = deadline
                extended.append(offset)
        return extended

    def expire(self, offsets: list[int], now: float) -> list[tuple[Entry, Session]]:
        """Of the leases on `offsets` that came due, the ones still running (not settled,
        redelivered or extended since): their entries leave their holders. Returns each
        with the session that held it."""
        entries = self._entries
        held_state = EntryState.HELD
        expired: list[tuple[Entry, Session]] = []
        for offset in offsets:
            entry = entries.get(offset)
            if (
                entry is None
                or entry.state is not held_state
                or entry.deadline > now
                or entry.holder is None
            ):
                continue  # settled, redelivered or extended since (or named twice)
            session = entry.holder
            entry.holder = None
            del session.held[offset]
            if entry.suspect:
                session.suspects -= 1
            expired.append((entry, session))
        self._held -= len(expired)
        return expired

    def release(self, session: Session, offsets: Sequence[int]) -> tuple[list[Entry], list[int]]:
        """Take `offsets` back from `session`; returns (their entries, offsets it did not
        hold)."""
        rejected: list[int] = []
        back: list[Entry] = []
        held = session.held
        for offset in offsets:
            entry = held.pop(offset, None)
            if entry is None:
                rejected.append(offset)
            else:
                if entry.suspect:
                    session.suspects -= 1
                back.append(entry)
        self._held -= len(back)
        return back, rejected

    def take_all(self, session: Session) -> list[Entry]:
        """Everything `session` holds (it is gone), in offset order."""
        held = sorted(session.held.values(), key=lambda e: e.record.offset)
        session.held.clear()
        session.suspects = 0
        self._held -= len(held)
        return held

    # --- dead letters ---------------------------------------------------------------------

    def dead_lettering(self, entry: Entry) -> None:
        """`entry` goes to the dead-letter writer; it settles once the writer says so."""
        entry.state = EntryState.DEAD_LETTERING
        entry.holder = None
        self._dead_lettering += 1

    def dead_letter_written(self, offset: int) -> bool:
        """The writer made the dead letter of `offset` durable: it settles now. False when
        it is no longer (or not) being dead-lettered."""
        entry = self._entries.get(offset)
        if entry is None or entry.state is not EntryState.DEAD_LETTERING:
            return False
        del self._entries[offset]
        self._dead_lettering -= 1
        self._bytes -= entry.size
        self._tracker.settle(offset)
        self._counters.dead_lettered += 1
        return True

    def dead_letter_unwritable(self, offset: int) -> bool:
        """The writer can never write the dead letter of `offset`: it stays unsettled (a
        restart redelivers it) but no longer counts as in flight."""
        entry = self._entries.get(offset)
        if entry is None or entry.state is not EntryState.DEAD_LETTERING:
            return False
        entry.state = EntryState.UNWRITABLE
        self._dead_lettering -= 1
        return True
