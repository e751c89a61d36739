"""The dispatcher: hands fetched records to consumer instances by credit, fairly.

It owns the in-flight window (every fetched record until it is settled), the
sessions of connected instances and what each one holds. Acks settle offsets in
the commit tracker at once; nacks go to the dead-letter writer and settle only
when it reports the item durably written.

A delivery fails (and uses up its attempt) when it is nacked with retry, when its
ack deadline passes (its lease expires), or when its instance vanishes. The pure
policy `after_failure` then says: redeliver or, once the attempts are exhausted,
dead-letter it with the last cause. A retry nack waits `retry_delay`; a vanished
instance or a lapsed lease waits `redelivery_delay` (the first time not at all, then
gaps that add up to `delivery.redelivery_span_s`, so a fleet in a crash loop cannot
use up a healthy message's attempts in seconds) and goes out as a suspect. The failed
counts of the window (`failures`) are persisted by the committer in the checkpoint
item, and a restarted proxy continues them (`prior_failures`), so a crash-type pill
reaches its limit across restarts. Rules for settlements that do not match a held
delivery:

- a settlement for an offset the instance does not hold (forged, duplicate, or
  late: its lease expired and it went back to the queue) is rejected, reported
  back to the instance and counted; the redelivered attempt decides;
- `release` (a stopping instance giving back what it never started) returns
  deliveries without using an attempt.

With `delivery.ordering = "key"` a key is owned by one entry at a time, from the
moment it enters the queue until it is acked or handed to the dead-letter writer;
later records with that key wait behind it, so they are never in flight together
and go in offset order. Null keys are unordered.

Everything here runs on the event loop thread and does no I/O: sending a frame
is putting it on the session's outbox, which the gRPC stream drains.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import logging
import operator
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from triage_protocol import triage_pb2 as pb
from triage_protocol.constants import DEFAULT_FRAME_BYTES, MAX_REASON_CHARS
from triage_proxy.clienttext import for_log
from triage_proxy.config.settings import Settings
from triage_proxy.observe.snapshot import LatencyHistogram
from triage_proxy.pipeline.policies import (
    Outcome,
    after_failure,
    rate_limit,
    redelivery_delay,
    retry_delay,
)
from triage_proxy.pipeline.timers import Timers
from triage_proxy.pipeline.tracker import CommitTracker
from triage_proxy.server.encoding import (
    FRAME_TARGET_BYTES,
    PACKED_ITEM_BYTES,
    PACKED_MAX_RECORD_BYTES,
    PACKED_OVERHEAD_BYTES,
    attempt_size,
    delivery_base_size,
    fill_packed,
    frame_header_size,
    frame_room,
    frame_size,
    item_size,
)
from triage_proxy.structs import DeadLetter, Record
from triage_proxy.waiting import wait_any

logger = logging.getLogger(__name__)

FRAME_OVERHEAD_BYTES = 64 * 1024
"""Room left in a frame for protobuf framing and headers of a single large record."""
TICK_S = 0.05
"""How often expired leases and due retries are looked at."""


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


class Entry:
    """One unsettled record in the window, with its delivery state."""

    __slots__ = (
        "attempt",
        "deadline",
        "delivered_at",
        "fetched_at",
        "holder",
        "last_cause",
        "record",
        "size",
        "state",
        "suspect",
        "wire",
    )

    def __init__(self, record: Record, fetched_at: float = 0.0) -> None:
        self.record = record
        _, _, offset, key, value, headers, timestamp = record
        if headers:
            self.size = record.size
            self.wire = delivery_base_size(record)
        else:
            # Record.size and framing.delivery_base_size in one pass, inlined, for the common
            # record without headers (one built per fetched message; checked against both in
            # tests/unit/test_framing.py).
            size = wire = 0
            if key is not None:
                size = k = len(key)
                wire = 1 + (1 if k < 128 else (k.bit_length() + 6) // 7) + k
            if value is not None:
                v = len(value)
                size += v
                wire += 1 + (1 if v < 128 else (v.bit_length() + 6) // 7) + v
            if offset:
                wire += 11 if offset < 0 else 1 + (offset.bit_length() + 6) // 7
            if timestamp:
                wire += 11 if timestamp < 0 else 1 + (timestamp.bit_length() + 6) // 7
            self.size = size
            self.wire = wire
        """Serialized bytes of its Delivery without the attempt (server/encoding.py)."""
        self.attempt = 0
        self.holder: Session | None = None
        self.state = EntryState.READY
        self.last_cause = ""
        self.deadline = 0.0
        """When the current delivery's lease expires (monotonic seconds)."""
        self.suspect = False
        """Its instance vanished (or its lease lapsed) while holding it: maybe a poison pill.
        Set from then until it is settled or handled (see `Dispatcher._suspects`)."""
        self.fetched_at = fetched_at
        """When it entered the window (monotonic seconds; for the oldest unsettled age)."""
        self.delivered_at = 0.0
        """When its current delivery went out (monotonic seconds; for the settle latency)."""


_SIZE = operator.attrgetter("size")
_OFFSET = operator.itemgetter(2)
"""Record.offset, as a C-level getter for whole batches."""


@dataclass
class Counters:
    """Running totals the proxy reports (metrics and status read these)."""

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


class Session:
    """One connected consumer instance: its credits, what it holds, its outbox."""

    __slots__ = (
        "closed",
        "consumer_id",
        "credits",
        "held",
        "max_frame_bytes",
        "outbox",
        "packed",
        "suspects",
    )

    def __init__(
        self,
        consumer_id: str,
        credits: int,
        max_frame_bytes: int = DEFAULT_FRAME_BYTES,
        packed: bool = False,
    ) -> None:
        self.consumer_id = consumer_id
        self.credits = credits
        self.max_frame_bytes = max_frame_bytes
        """Largest frame (serialized bytes) this instance receives; no frame exceeds it."""
        self.packed = packed
        """The instance reads Deliveries.packed (its Hello said so): see `Dispatcher._deliver`."""
        self.suspects = 0
        """Suspect records this instance holds (at most one at a time, see `_pump`)."""
        self.held: dict[int, Entry] = {}
        self.outbox: asyncio.Queue[pb.ProxyFrame | None] = asyncio.Queue()
        self.closed = False

    @property
    def available(self) -> int:
        return self.credits - len(self.held)

    def take_unsent(self) -> list[int]:
        """Empty the outbox; return the offsets of the deliveries it still held (their
        frames, built by `Dispatcher._deliver`, never reached the wire)."""
        unsent: list[int] = []
        outbox = self.outbox
        while not outbox.empty():
            frame = outbox.get_nowait()
            if frame is not None and frame.HasField("deliveries"):
                deliveries = frame.deliveries
                unsent.extend(d.offset for d in deliveries.deliveries)
                if deliveries.HasField("packed"):
                    offsets = array("q", deliveries.packed.offsets)
                    if sys.byteorder == "big":
                        offsets.byteswap()
                    unsent.extend(offsets)
        return unsent


class Dispatcher:
    """Credit-based, fair fan-out of one partition's records; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        partition: int,
        tracker: CommitTracker,
        dead_letter: Callable[[DeadLetter], None],
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        already_settled: Collection[int] = (),
        prior_failures: Mapping[int, int] | None = None,
    ) -> None:
        self._topic = settings.kafka.topic
        self._partition = partition
        self._max_messages = settings.window.max_messages
        self._max_bytes = settings.window.max_bytes
        # Hysteresis: once full, fetch again only when a worthwhile batch fits, not for
        # every few settled messages (each fetch round trip has a fixed cost).
        self._refill = max(1, min(settings.kafka.fetch_batch, self._max_messages // 4))
        self._max_attempts = settings.delivery.max_attempts
        self._ack_deadline_s = settings.delivery.ack_deadline_s
        self._span_s = settings.delivery.redelivery_span_s
        self._retry = settings.retry
        self._ordered = settings.delivery.ordering == "key"
        self._max_record_bytes = settings.server.max_frame_bytes - FRAME_OVERHEAD_BYTES
        self._server_frame_bytes = settings.server.max_frame_bytes
        self._frame_header = frame_header_size(self._topic, partition)
        """Serialized bytes of the topic and partition every Deliveries frame carries."""
        self._tracker = tracker
        self._dead_letter = dead_letter
        self._clock = clock
        self._monotonic = monotonic
        self._skip = set(already_settled)
        """Offsets a previous run settled above its committed offset (commit metadata)."""
        self._skip_sorted = sorted(self._skip)
        """The same, in order, for `settled_ahead` (the part not fetched yet)."""
        self._prior = {o: n for o, n in (prior_failures or {}).items() if o not in self._skip}
        """Failed deliveries a previous run counted (checkpoint item), by offset, until the
        offset is fetched again; its entry then continues from there."""
        self._failures: dict[int, int] = {}
        """Failed deliveries by offset, of entries that failed at least once. Written only
        when a delivery fails; offsets settled since are dropped when it is read
        (`failures`) or grows past `_failures_cap`, so settling costs nothing here."""
        self._failures_cap = 1024
        self.failures_version = 0
        """Moves whenever a count in `failures` went up (the committer's cue to write it)."""
        self._entries: dict[int, Entry] = {}
        self._ready: deque[Entry] = deque()
        self._large: deque[Entry] = deque()
        """Records whose delivery is over the frame limit of the instance they were about
        to go to, waiting for a connected instance whose limit takes them (`_pump_large`);
        dead-lettered once no connected instance's limit does."""
        self._suspects: deque[Entry] = deque()
        """Records whose instance vanished or whose lease expired while holding them. One
        of them may be a crash-type poison pill, so an instance holds at most one suspect at
        a time: when the pill crashes it again, the only other suspect it takes down is
        none, and healthy neighbours do not follow the pill from instance to instance until
        they run out of attempts with it."""
        self._sessions: list[Session] = []
        # Leases: one (deadline, offsets) batch per delivered frame or Extend, in deadline
        # order (the ack deadline is a constant, so appends stay sorted). An offset is
        # expired only if its entry is still held with that deadline: settling costs
        # nothing, unlike a per-offset timer (measured 2.4 us per message).
        self._lease_batches: deque[tuple[float, list[int]]] = deque()
        self._lease_refs = 0
        self._backoffs: Timers[int] = Timers()
        """Entries in BACKOFF by offset; suspects go back to `_suspects` when due."""
        self._key_owner: dict[bytes, Entry] = {}
        self._key_waiting: dict[bytes, deque[Entry]] = {}
        self._bytes = 0
        self.counters = Counters()
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
        """The tracker had records pending at the last `_update_window_events`."""
        self._dead_lettering = 0
        self._delivering = True
        self._ended = False
        """Shutdown ended the streams (`end_sessions`): closing ones fail nothing."""
        self._rate = rate_limit(settings.rate_limit, monotonic())
        """The [rate_limit] caps; None (no caps) costs `_pump` one attribute test."""
        self._rate_wake: asyncio.TimerHandle | None = None
        """The pending pump for when the caps let the next record go."""

    # --- window -----------------------------------------------------------------------

    @property
    def in_window(self) -> int:
        """Fetched records not yet settled."""
        return len(self._entries)

    @property
    def window_bytes(self) -> int:
        return self._bytes

    @property
    def room_for(self) -> int:
        """How many more records the window takes before it is full (0 when full)."""
        if self._bytes >= self._max_bytes:
            return 0
        return max(0, self._max_messages - len(self._entries))

    @property
    def sessions(self) -> Sequence[Session]:
        return tuple(self._sessions)

    @property
    def oldest_fetched_at(self) -> float | None:
        """When the oldest unsettled record entered the window (monotonic), None if empty."""
        # The dict keeps insertion (= offset) order, so its first entry is the oldest.
        for entry in self._entries.values():
            return entry.fetched_at
        return None

    @property
    def queued(self) -> int:
        """Records ready for delivery, suspects included."""
        return len(self._ready) + len(self._suspects) + len(self._large)

    @property
    def in_flight(self) -> int:
        """Records delivered and not settled, plus dead letters not yet durable (not the
        unwritable ones: nothing can settle those before a restart)."""
        return sum(len(s.held) for s in self._sessions) + self._dead_lettering

    def stop_delivering(self) -> None:
        """Shutdown: hand out nothing new; what is held may still be settled."""
        self._delivering = False

    def _update_window_events(self) -> None:
        if self.room_for >= self._refill:
            self.room.set()
        else:
            self.room.clear()
        if self.in_flight:
            self.quiet.clear()
        else:
            self.quiet.set()
        if self._tracker.pending:
            self._pending = True
        elif self._pending:
            self._pending = False
            self.caught_up.set()

    # --- records in -------------------------------------------------------------------

    def add(self, records: Iterable[Record]) -> None:
        """Take freshly fetched records (in offset order) into the window and deliver."""
        batch = records if isinstance(records, list) else list(records)
        if not batch:
            return
        first, last = batch[0].offset, batch[-1].offset
        if (
            last - first + 1 == len(batch)
            and not (self._skip or self._prior or self._ordered)
            and list(map(_OFFSET, batch)) == list(range(first, last + 1))
        ):
            self._add_run(batch, first, last)
            return
        track = self._tracker.track
        skip = self._skip
        prior = self._prior
        entries = self._entries
        ready = self._ready.append
        ordered = self._ordered
        max_record = self._max_record_bytes
        now = self._monotonic()
        added = 0
        size = 0
        for record in batch:
            offset = record.offset
            track(offset)
            if skip and offset in skip:
                # Settled by a previous run above its committed offset: not again.
                skip.discard(offset)
                self._tracker.settle(offset)
                self.counters.skipped_settled += 1
                continue
            entry = Entry(record, now)
            entries[offset] = entry
            size += entry.size
            added += 1
            if prior and offset in prior:
                # It failed in a previous run: the count goes on (see `_continue`).
                entry.attempt = self._failures[offset] = prior.pop(offset)
            if entry.size > max_record:
                entry.attempt = 1
                self._to_dead_letter(
                    entry, f"message of {entry.size} bytes exceeds server.max_frame_bytes", ""
                )
            elif ordered and record.key is not None and record.key in self._key_owner:
                entry.state = EntryState.WAITING
                self._key_waiting.setdefault(record.key, deque()).append(entry)
            else:
                if ordered and record.key is not None:
                    self._key_owner[record.key] = entry
                if entry.attempt:
                    self._continue(entry)
                else:
                    ready(entry)
        self._bytes += size
        self.counters.fetched += added
        self._update_window_events()
        self._pump()

    def _add_run(self, batch: list[Record], first: int, last: int) -> None:
        """`add` for the common batch: offsets first..last without a gap, none settled or
        failed by a previous run, no ordering by key. The same steps in bulk: one tracker
        call, one dict update, one extend of the ready queue."""
        now = self._monotonic()
        self._tracker.track_span(first, last)
        new = [Entry(record, now) for record in batch]
        self._entries.update(zip(range(first, last + 1), new, strict=True))
        sizes = list(map(_SIZE, new))
        self._bytes += sum(sizes)
        self.counters.fetched += len(new)
        if max(sizes) <= self._max_record_bytes:
            self._ready.extend(new)
        else:
            max_record = self._max_record_bytes
            for entry in new:
                if entry.size > max_record:
                    entry.attempt = 1
                    reason = f"message of {entry.size} bytes exceeds server.max_frame_bytes"
                    self._to_dead_letter(entry, reason, "")
                else:
                    self._ready.append(entry)
        self._update_window_events()
        self._pump()

    def _continue(self, entry: Entry) -> None:
        """`entry` failed `entry.attempt` times before a restart and may go now: it goes on
        from there, as a suspect after the gap its count calls for, or to the dead-letter
        table if those were all its attempts."""
        failed = entry.attempt
        if after_failure(failed, self._max_attempts) is Outcome.DEAD_LETTER:
            reason = f"delivery attempts exhausted ({failed}) before a proxy restart"
            self._to_dead_letter(entry, reason, "")
        else:
            self._redeliver([entry])

    def failures(self) -> dict[int, int]:
        """Failed deliveries by offset of the unsettled records that failed at least once,
        including a previous run's counts for offsets not fetched again yet (what the
        committer persists; see `prior_failures`)."""
        self._prune_failures()
        return {**self._prior, **self._failures}

    def settled_ahead(self) -> list[int]:
        """Offsets a previous run settled that this run has not fetched yet (sorted, all at
        or above where fetching continues): still settled, so the committer keeps them in
        what it records. Without them a restarted proxy's first commits would record only
        the part of that run's set its fetch had reached (the window may hold it back for
        long), and a kill then would redeliver the rest."""
        ahead = self._skip_sorted
        if not ahead:
            return []
        start = bisect.bisect_left(ahead, self._tracker.next_offset)
        if start == len(ahead):
            self._skip_sorted = []  # all fetched: nothing to look at again
            return []
        return ahead[start:]

    def _prune_failures(self) -> None:
        entries = self._entries
        self._failures = {o: n for o, n in self._failures.items() if o in entries}
        self._failures_cap = max(1024, 2 * len(self._failures))

    # --- sessions ---------------------------------------------------------------------

    def open_session(
        self,
        consumer_id: str,
        credits: int,
        max_frame_bytes: int = DEFAULT_FRAME_BYTES,
        packed: bool = False,
    ) -> Session:
        """A new instance's session; no frame sent to it exceeds `max_frame_bytes` (nor
        server.max_frame_bytes); `packed`: it reads packed deliveries (Hello)."""
        session = Session(
            consumer_id, credits, min(max_frame_bytes, self._server_frame_bytes), packed
        )
        self._sessions.append(session)
        self.counters.sessions_opened += 1
        logger.info("instance %s connected with %d credits", for_log(consumer_id), credits)
        self._pump()
        return session

    def close_session(self, session: Session) -> None:
        """The instance is gone: each held delivery failed (attempt used up).

        A gracefully stopping instance first releases what it never started (`release`),
        so only deliveries that may have reached a handler count as attempts here. Streams
        the proxy itself ends at shutdown (`end_sessions`) use no attempt either: that is
        not the messages' doing, and their counts outlive this run (`failures`).
        """
        if session.closed:
            return
        session.closed = True
        self._sessions.remove(session)
        self.counters.sessions_closed += 1
        held = sorted(session.held.values(), key=lambda e: e.record.offset)
        session.held.clear()
        if self._ended:
            self._give_back(session, held)
            logger.info(
                "stream of %s ended; %d records it held not counted as attempts",
                session.consumer_id,
                len(held),
            )
            session.outbox.put_nowait(None)
            self._update_window_events()
            return
        cause = f"instance {session.consumer_id} disconnected while handling it"
        back: list[Entry] = []
        for entry in held:
            if self._failed(entry, cause, session.consumer_id):
                back.append(entry)
        later = self._redeliver(back)
        logger.info(
            "instance %s disconnected; %d records back to the queue (%d after a backoff)",
            for_log(session.consumer_id),
            len(back),
            later,
        )
        session.outbox.put_nowait(None)
        self._update_window_events()
        self._pump()

    def end_sessions(self) -> None:
        """Ask every stream to finish (shutdown); their close_session follows."""
        self._ended = True
        for session in self._sessions:
            session.outbox.put_nowait(None)

    def end_session_now(self, session: Session) -> None:
        """End `session`'s stream at once (its app's token was revoked). What is queued for
        it was never sent: it goes back without using an attempt; what it did receive fails
        when the stream closes (close_session)."""
        unsent = session.take_unsent()
        if not session.closed:
            self.release(session, unsent)  # also: no credits, nothing new
        session.outbox.put_nowait(None)

    # --- settlements ------------------------------------------------------------------

    def settle(
        self,
        session: Session,
        acks: Sequence[int],
        nacks: Sequence[pb.Nack],
        ranges: Sequence[pb.OffsetRange] = (),
    ) -> list[int]:
        """Apply a batch of settlements from `session` (`ranges`: acks of first..last, each
        offset checked like one in `acks`); return the offsets it did not hold."""
        self.counters.settle_frames += 1
        rejected: list[int] = []
        held = session.held
        entries = self._entries
        ordered = self._ordered
        freed = 0
        acked = 0
        now = self._monotonic()
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
                session.suspects -= 1
            settle(offset)
            del entries[offset]
            freed += entry.size
            acked += 1
            if ordered:
                self._release_key(entry)
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
                    session.suspects -= 1
                del entries[offset]
                freed += entry.size
                acked += 1
                if ordered:
                    self._release_key(entry)
            if start <= last:
                settle_span(start, last)
        if seen:
            observe(now - seen_at, seen)
        self._bytes -= freed
        self.counters.acked += acked
        for nack in nacks:
            entry = held.pop(nack.offset, None)
            if entry is None:
                rejected.append(nack.offset)
                continue
            self.counters.nacked += 1
            observe(now - entry.delivered_at)
            if entry.suspect:  # it was handled, so it is no crash-type pill
                entry.suspect = False
                session.suspects -= 1
            reason = nack.reason[:MAX_REASON_CHARS] or "nacked without a reason"
            if not nack.retry:
                self._to_dead_letter(entry, reason, session.consumer_id)
            elif self._failed(entry, reason, session.consumer_id):
                self.counters.retried += 1
                entry.state = EntryState.BACKOFF
                delay = retry_delay(entry.attempt, self._retry)
                self._backoffs.schedule(nack.offset, self._monotonic() + delay)
        if rejected:
            self.counters.rejected += len(rejected)
            logger.warning(
                "rejected %d settlements from %s for offsets it does not hold",
                len(rejected),
                for_log(session.consumer_id),
            )
        self._update_window_events()
        self._pump()
        return rejected

    def extend(self, session: Session, offsets: Sequence[int]) -> None:
        """The instance is still working on these: push their ack deadlines out."""
        deadline = self._monotonic() + self._ack_deadline_s
        held = session.held
        extended = []
        for offset in dict.fromkeys(offsets):  # an offset named twice is extended once
            entry = held.get(offset)
            if entry is not None:
                entry.deadline = deadline
                extended.append(offset)
        if extended:
            self._add_lease_batch(deadline, extended)
        self.counters.extended += len(extended)

    def _add_lease_batch(self, deadline: float, offsets: list[int]) -> None:
        self._lease_batches.append((deadline, offsets))
        self._lease_refs += len(offsets)
        if self._lease_refs > 4 * max(self._max_messages, 1024):
            self._compact_leases()

    def _compact_leases(self) -> None:
        """Drop references to settled offsets; amortized O(1) per delivery. A batch wholly
        below the committable offset is all settled and goes without a look at each offset
        (a C-level max instead of a dict lookup per offset: most batches, when handlers
        keep up)."""
        entries = self._entries
        committable = self._tracker.committable
        kept: deque[tuple[float, list[int]]] = deque()
        refs = 0
        for deadline, offsets in self._lease_batches:
            if max(offsets) < committable:
                continue
            live = [
                o
                for o in offsets
                if (e := entries.get(o)) is not None
                and e.state is EntryState.HELD
                and e.deadline == deadline
            ]
            if live:
                kept.append((deadline, live))
                refs += len(live)
        self._lease_batches, self._lease_refs = kept, refs

    def grant(self, session: Session, credits: int) -> None:
        """The instance's credits from now on (a Grant frame). Lowering takes back nothing
        it holds: it just gets nothing more until it holds fewer. Ignored once the instance
        released (it is stopping: credits 0) or is gone."""
        if session.closed or session.credits == 0:
            return
        session.credits = credits
        self._pump()

    def release(self, session: Session, offsets: Sequence[int]) -> list[int]:
        """The instance is stopping: take back what it never started, send it nothing more.

        Released deliveries do not count as attempts. Returns the offsets it did not hold.
        """
        session.credits = 0
        rejected: list[int] = []
        back: list[Entry] = []
        for offset in offsets:
            entry = session.held.pop(offset, None)
            if entry is None:
                rejected.append(offset)
            else:
                back.append(entry)
        self.counters.released += self._give_back(session, back)
        self.counters.rejected += len(rejected)
        self._update_window_events()
        self._pump()
        return rejected

    def _give_back(self, session: Session, entries: list[Entry]) -> int:
        """`entries`, taken from `session.held`, go back to the queue without using an
        attempt (suspects stay suspects). Returns how many were not suspects."""
        back: list[Entry] = []
        for entry in entries:
            entry.holder = None
            entry.attempt -= 1
            if entry.suspect:
                session.suspects -= 1
                entry.suspect = False
                self._suspect([entry])
            else:
                back.append(entry)
        self._requeue_front(back)
        return len(back)

    def _failed(self, entry: Entry, cause: str, consumer_id: str) -> bool:
        """A delivery of `entry` failed: True to redeliver, False if it was dead-lettered."""
        entry.holder = None
        entry.last_cause = cause
        failures = self._failures
        failures[entry.record.offset] = entry.attempt  # every counted delivery failed
        self.failures_version += 1
        if len(failures) > self._failures_cap:
            self._prune_failures()
        if after_failure(entry.attempt, self._max_attempts) is Outcome.DEAD_LETTER:
            self._to_dead_letter(
                entry, f"delivery attempts exhausted ({entry.attempt}): {cause}", consumer_id
            )
            return False
        return True

    def _redeliver(self, entries: list[Entry]) -> int:
        """Their instance vanished or their lease lapsed: each goes out again as a suspect,
        at once or after `redelivery_delay` in BACKOFF. Returns how many wait."""
        now_: list[Entry] = []
        waiting = 0
        at = self._monotonic()
        for entry in entries:
            delay = redelivery_delay(entry.attempt, self._max_attempts, self._span_s)
            if delay > 0:
                entry.state = EntryState.BACKOFF
                entry.suspect = True
                self._backoffs.schedule(entry.record.offset, at + delay)
                waiting += 1
            else:
                now_.append(entry)
        self._suspect(now_)
        return waiting

    def _suspect(self, entries: list[Entry]) -> None:
        entries.sort(key=lambda e: e.record.offset)
        for entry in entries:
            entry.state = EntryState.READY
            entry.suspect = True
        self._suspects.extend(entries)

    def _requeue_front(self, entries: list[Entry]) -> None:
        entries.sort(key=lambda e: e.record.offset)
        for entry in entries:
            entry.state = EntryState.READY
        self._ready.extendleft(reversed(entries))

    def _to_dead_letter(self, entry: Entry, reason: str, consumer_id: str) -> None:
        entry.state = EntryState.DEAD_LETTERING
        entry.holder = None
        self._dead_lettering += 1
        if self._ordered:
            self._release_key(entry)  # it is out of the consumers' hands: the key moves on
        self._dead_letter(
            DeadLetter(
                record=entry.record,
                reason=reason,
                attempts=entry.attempt,
                consumer_id=consumer_id,
                dead_lettered_at_ms=int(self._clock() * 1000),
            )
        )

    def _release_key(self, entry: Entry) -> None:
        """Ordering by key: `entry` is done; the next record with its key may go."""
        key = entry.record.key
        if key is None or self._key_owner.get(key) is not entry:
            return
        waiting = self._key_waiting.get(key)
        if not waiting:
            del self._key_owner[key]
            return
        successor = waiting.popleft()
        if not waiting:
            del self._key_waiting[key]
        self._key_owner[key] = successor
        if successor.attempt:  # it failed in a previous run (nothing else delivered it)
            self._continue(successor)
            return
        successor.state = EntryState.READY
        self._ready.append(successor)

    def dead_letter_written(self, dl: DeadLetter) -> None:
        """The writer made `dl` durable: only now may its offset count as settled."""
        offset = dl.record.offset
        entry = self._entries.get(offset)
        if entry is None or entry.state is not EntryState.DEAD_LETTERING:
            return
        del self._entries[offset]
        self._dead_lettering -= 1
        self._bytes -= entry.size
        self._tracker.settle(offset)
        self.counters.dead_lettered += 1
        self._update_window_events()
        self._pump()

    def dead_letter_unwritable(self, dl: DeadLetter) -> None:
        """The writer can never write `dl` (deadletters/writer.py): its offset stays unsettled, so
        the commit waits there and a restart redelivers it, but it no longer counts as in
        flight, so a drain (`quiet`) does not wait for what cannot happen."""
        entry = self._entries.get(dl.record.offset)
        if entry is None or entry.state is not EntryState.DEAD_LETTERING:
            return
        entry.state = EntryState.UNWRITABLE
        self._dead_lettering -= 1
        self._update_window_events()

    # --- timers -----------------------------------------------------------------------

    def tick(self) -> None:
        """Expire overdue leases and make due retries ready again."""
        now = self._monotonic()
        back: list[Entry] = []
        batches = self._lease_batches
        due: list[int] = []
        while batches and batches[0][0] <= now:
            _, offsets = batches.popleft()
            self._lease_refs -= len(offsets)
            due.extend(offsets)
        for offset in due:
            entry = self._entries.get(offset)
            if (
                entry is None
                or entry.state is not EntryState.HELD
                or entry.deadline > now
                or entry.holder is None
            ):
                continue  # settled, redelivered or extended since
            session = entry.holder
            del session.held[offset]
            if entry.suspect:
                session.suspects -= 1
            self.counters.expired += 1
            cause = (
                f"ack deadline of {self._ack_deadline_s:g} s passed at instance "
                f"{session.consumer_id}"
            )
            if self._failed(entry, cause, session.consumer_id):
                back.append(entry)
        if back:
            logger.warning("%d deliveries passed their ack deadline; redelivering", len(back))
            self._redeliver(back)
        suspects: list[Entry] = []
        for offset in self._backoffs.pop_due(now):
            entry = self._entries.get(offset)
            if entry is not None and entry.state is EntryState.BACKOFF:
                if entry.suspect:
                    suspects.append(entry)
                else:
                    entry.state = EntryState.READY
                    self._ready.appendleft(entry)
        if suspects:
            self._suspect(suspects)
        self._update_window_events()
        self._pump()

    async def run_timers(self, closing: asyncio.Event) -> None:
        """Tick until `closing` is set (owned by the proxy's task group)."""
        while not await wait_any(closing, timeout=TICK_S):
            self.tick()

    # --- delivery ---------------------------------------------------------------------

    def _pump(self) -> None:
        """Deliver ready records to instances with credit, an even share each.

        An instance gets a suspect (see `_suspects`) only while it holds none.
        """
        if self._large and self._delivering:
            self._pump_large()
        ready, suspects = self._ready, self._suspects
        while (ready or suspects) and self._delivering:
            open_ = [s for s in self._sessions if s.available > 0]
            if not open_:
                return
            share = -(-(len(ready) + min(len(suspects), len(open_))) // len(open_))
            delivered = False
            for session in open_:
                n = min(session.available, share)
                if n <= 0 or not (ready or suspects):
                    break
                if self._rate is None:
                    batch = [suspects.popleft()] if suspects and not session.suspects else []
                    batch.extend(ready.popleft() for _ in range(min(n - len(batch), len(ready))))
                else:
                    batch = self._take_within_rate(n, bool(suspects) and not session.suspects)
                if batch:
                    self._deliver(session, batch)
                    delivered = True
            if not delivered:
                return  # only suspects left, and every instance with credit holds one
            # Rotate so the first instance in line changes from pump to pump.
            self._sessions.append(self._sessions.pop(0))

    def _take_within_rate(self, n: int, suspect_first: bool) -> list[Entry]:
        """`_pump`'s batch under `[rate_limit]`: up to `n` records (a suspect first) while
        the caps allow; when they stop it, a pump is scheduled for when tokens refill."""
        rate, now = self._rate, self._monotonic()
        assert rate is not None
        batch: list[Entry] = []
        queues = (self._suspects, self._ready) if suspect_first else (self._ready,)
        for queue in queues:
            while queue and len(batch) < n:
                size = queue[0].size
                if not rate.admit(size, now):
                    self._pump_after(rate.wait_s(size, now))
                    return batch
                batch.append(queue.popleft())
                if queue is self._suspects:
                    break  # one suspect per batch, as in `_pump`
        return batch

    def _pump_after(self, delay: float) -> None:
        """Pump again in `delay` seconds (once; without a loop, unit tests, tick() pumps)."""
        if self._rate_wake is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._rate_wake = loop.call_later(delay, self._on_rate_wake)

    def _on_rate_wake(self) -> None:
        self._rate_wake = None
        self._pump()

    def _item(self, entry: Entry) -> int:
        """Serialized bytes `entry`'s next delivery adds to a frame (framing.item_size)."""
        return item_size(entry.wire + attempt_size(entry.attempt + 1))

    def _fits(self, session: Session, item: int) -> bool:
        """Whether a delivery of `item` bytes fits a frame to `session` (`_deliver`'s rule)."""
        return item <= frame_room(session.max_frame_bytes, self._frame_header)

    def _too_large(self, session: Session, entry: Entry) -> None:
        """`entry`'s delivery alone is over `session`'s frame limit: it waits for an
        instance whose limit takes it, or, when no connected instance's does, it is
        dead-lettered (a record no consumer can receive would otherwise break every stream
        it is sent on, and come back until its attempts are used up)."""
        item = self._item(entry)
        if any(self._fits(s, item) for s in self._sessions if not s.closed):
            entry.state = EntryState.READY
            self._large.append(entry)
            return
        largest = max((s.max_frame_bytes for s in self._sessions), default=0)
        largest = max(largest, session.max_frame_bytes)
        need = frame_size(self._frame_header, item)
        entry.attempt = max(entry.attempt, 1)
        entry.suspect = False
        self._to_dead_letter(
            entry,
            f"record of {entry.size} bytes needs a frame of {need} bytes, over the "
            f"consumer's frame limit of {largest} bytes (Hello.max_frame_bytes)",
            session.consumer_id,
        )
        self._update_window_events()

    def _pump_large(self) -> None:
        """Hand each record of `_large` to an instance with credit whose frame limit takes
        it; dead-letter those no connected instance's limit takes (`_too_large`)."""
        sessions = [s for s in self._sessions if not s.closed]
        if not sessions:
            return  # nobody to ask: they wait, like every queued record
        waiting: deque[Entry] = deque()
        large, self._large = self._large, waiting
        rate, now = self._rate, self._monotonic()
        while large:
            entry = large.popleft()
            item = self._item(entry)
            able = [s for s in sessions if self._fits(s, item)]
            if not able:
                self._too_large(sessions[0], entry)
                continue
            open_ = [s for s in able if s.available > 0]
            if not open_ or (rate is not None and not rate.admit(entry.size, now)):
                waiting.append(entry)
                continue
            self._deliver(open_[0], [entry])

    def _deliver(self, session: Session, batch: list[Entry]) -> None:
        """Send `batch` to `session` in frames: each filled up to FRAME_TARGET_BYTES (or the
        instance's limit when smaller), counted in serialized bytes (server/encoding.py); a record
        alone may take a frame up to the limit, and one over it goes to `_too_large`. To an
        instance that reads packed deliveries, records without headers and up to
        PACKED_MAX_RECORD_BYTES go in the frame's packed columns (`fill_packed`), the rest
        as repeated Delivery messages."""
        header = self._frame_header
        room = frame_room(session.max_frame_bytes, header)
        target = frame_room(min(session.max_frame_bytes, FRAME_TARGET_BYTES), header)
        packing = session.packed
        # A packing session reserves the packed sub-message's framing in every frame.
        start = PACKED_OVERHEAD_BYTES if packing else 0
        frame: pb.ProxyFrame | None = None
        used = 0
        packed: list[Record] = []
        attempts: list[int] = []
        retried = False  # a packed record of this frame is a redelivery: send attempts
        held = session.held
        redelivered = 0
        delivered = 0
        now = self._monotonic()
        deadline = now + self._ack_deadline_s
        leased: list[int] = []
        lease = leased.append
        held_state = EntryState.HELD
        add = None
        for entry in batch:
            attempt = entry.attempt + 1
            record = entry.record
            pack = packing and not record[5] and entry.size <= PACKED_MAX_RECORD_BYTES
            if pack:
                item = entry.size + PACKED_ITEM_BYTES
            else:
                # item_size(entry.wire + attempt_size(attempt)), inlined: an attempt below 128
                # is a 2-byte field, and a Delivery is never empty (it has its attempt).
                d = entry.wire + (2 if attempt < 128 else attempt_size(attempt))
                item = 1 + (d.bit_length() + 6) // 7 + d
            if frame is not None and used + item > target:
                if packed:
                    fill_packed(frame.deliveries.packed, packed, attempts if retried else None)
                    packed, attempts, retried = [], [], False
                session.outbox.put_nowait(frame)
                self.counters.frames_out += 1
                frame = None
            if frame is None:
                if item > room:
                    self._too_large(session, entry)
                    continue
                frame, used = pb.ProxyFrame(), start
                deliveries = frame.deliveries
                deliveries.topic = self._topic
                deliveries.partition = self._partition
                add = deliveries.deliveries.add
            used += item
            delivered += 1
            entry.attempt = attempt
            if attempt > 1:
                redelivered += 1
            entry.state = held_state
            entry.holder = session
            if entry.suspect:
                session.suspects += 1
            _, _, offset, key, value, headers, timestamp = record
            held[offset] = entry
            entry.deadline = deadline
            entry.delivered_at = now
            lease(offset)
            if pack:
                packed.append(record)
                attempts.append(attempt)
                if attempt != 1:
                    retried = True
                continue
            assert add is not None
            # One add() with every field (None leaves an optional unset): as fast as
            # setting them one by one on protobuf's upb backend, and fewer bytecodes.
            delivery = add(
                offset=offset, key=key, value=value, timestamp_ms=timestamp, attempt=attempt
            )
            if headers:
                for name, data in headers:
                    delivery.headers.add(key=name, value=data)
        if frame is not None:
            if packed:
                fill_packed(frame.deliveries.packed, packed, attempts if retried else None)
            session.outbox.put_nowait(frame)
            self.counters.frames_out += 1
        if not leased:
            return  # every record was over the limit
        self._add_lease_batch(deadline, leased)
        self.quiet.clear()
        self.counters.delivered += delivered
        self.counters.redelivered += redelivered
