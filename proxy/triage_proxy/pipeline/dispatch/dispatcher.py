"""The dispatcher: the one object the fetcher, the committer and the service talk to.

It wires the parts of one partition's dispatch together and turns each call into the
parts' per-batch steps; it owns no state of its own but the settings they share:

    window.py      the records from fetch to settle, who holds each, the events
    carryover.py   what crosses a restart: settled-above offsets, failure counts
    sessions.py    the connected instances (and the Outlet each one's frames go to)
    scheduler.py   the queues, fair hand-out by credit, rate caps, large records
    leases.py      ack deadlines, Extend, which deliveries lapsed
    redelivery.py  failed deliveries: backoff, suspects, dead letters, give-backs
    keylocks.py    with ordering by key: one record per key in the consumers' hands

Acks settle offsets in the commit tracker at once; nacks go to the dead-letter writer
and settle only when it reports the item durably written. Rules for settlements that do
not match a held delivery:

- a settlement for an offset the instance does not hold (forged, duplicate, or late:
  its lease expired and it went back to the queue) is rejected, reported back to the
  instance and counted; the redelivered attempt decides;
- `release` (a stopping instance giving back what it never started) returns deliveries
  without using an attempt.

Each call that changes what is queued or held ends the same way: the window's events
are brought up to date, then the scheduler pumps.

Everything here runs on the event loop thread and does no I/O: sending a frame is
handing a batch to the session's outlet, whose queue the gRPC stream drains.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from triage_proxy.clienttext import for_log
from triage_proxy.config.settings import Settings
from triage_proxy.observe.snapshot import Blocking, LatencyHistogram
from triage_proxy.pipeline.dispatch.keylocks import KeyLocks
from triage_proxy.pipeline.dispatch.leases import Leases
from triage_proxy.pipeline.dispatch.redelivery import Redelivery
from triage_proxy.pipeline.dispatch.scheduler import Scheduler
from triage_proxy.pipeline.dispatch.sessions import Outlet, Session, Sessions
from triage_proxy.pipeline.dispatch.window import SIZE, Counters, Entry, Nack, Span, Window
from triage_proxy.pipeline.policies import Judgement, judged_on_vanish, rate_limit
from triage_proxy.pipeline.tracker import CommitTracker
from triage_proxy.structs import DeadLetter, Record
from triage_proxy.waiting import wait_any

logger = logging.getLogger(__name__)

FRAME_OVERHEAD_BYTES = 64 * 1024
"""Room left in a frame for protobuf framing and headers of a single large record."""
STARTED_KEPT = 16
"""Started offsets a session keeps before those it no longer holds are dropped."""
TICK_S = 0.05
"""How often expired leases and due retries are looked at."""


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
        bounded: bool = False,
    ) -> None:
        """`bounded`: the window counts a record until its settlement is durably recorded
        (window.py; on when the committer keeps the settled-above checkpoint)."""
        self.partition = partition
        window = settings.window
        delivery = settings.delivery
        self._ordered = delivery.ordering == "key"
        self._max_record_bytes = settings.server.max_frame_bytes - FRAME_OVERHEAD_BYTES
        self._monotonic = monotonic
        self.counters = Counters()
        self._filled = asyncio.Event()
        """Set by `add`: the timers, asleep while the window was empty, tick again."""
        self.timers_asleep = False
        """The timers wait for records, not for a tick (`run_timers`: the window is empty)."""
        self._window = Window(
            window.max_messages,
            window.max_bytes,
            max(1, min(settings.kafka.fetch_batch, window.max_messages // 4)),
            tracker,
            self.counters,
            already_settled=already_settled,
            prior_failures=prior_failures,
            bounded=bounded,
        )
        self._sessions = Sessions(self.counters)
        self._leases = Leases(
            delivery.ack_deadline_s, window.max_messages, self._window, tracker, self.counters
        )
        self._scheduler = Scheduler(
            self._sessions,
            self._window,
            self._leases,
            self.counters,
            rate_limit(settings.rate_limit, monotonic()),
            self._dead_letter_entry,
            monotonic,
        )
        self._keys = KeyLocks() if self._ordered else None
        self._redelivery = Redelivery(
            max_attempts=delivery.max_attempts,
            span_s=delivery.redelivery_span_s,
            retry=settings.retry,
            window=self._window,
            scheduler=self._scheduler,
            keys=self._keys,
            counters=self.counters,
            dead_letter=dead_letter,
            clock=clock,
            monotonic=monotonic,
        )

    # --- what the snapshot, the fetcher and the committer read ----------------------------

    @property
    def in_window(self) -> int:
        """Fetched records not yet settled."""
        return self._window.in_window

    @property
    def window_bytes(self) -> int:
        return self._window.bytes

    @property
    def room_for(self) -> int:
        """How many more records the window takes before it is full (0 when full)."""
        return self._window.room_for

    @property
    def room(self) -> asyncio.Event:
        """Set while the window has room for a worthwhile fetch."""
        return self._window.room

    @property
    def quiet(self) -> asyncio.Event:
        """Set while nothing is delivered-and-unsettled or being dead-lettered (drain)."""
        return self._window.quiet

    @property
    def caught_up(self) -> asyncio.Event:
        """Set each time every fetched record got settled (the committer's cue)."""
        return self._window.caught_up

    @property
    def durability(self) -> asyncio.Event:
        """Set when a commit now would let the bounded window fetch again (the committer's
        cue; it clears it)."""
        return self._window.durability

    def durable_moved(self) -> None:
        """The committer recorded more settled records durably: the bounded window may
        have room again."""
        self._window.update_events()

    @property
    def settle_latency(self) -> LatencyHistogram:
        return self._window.settle_latency

    @property
    def sessions(self) -> Sequence[Session]:
        return self._sessions.snapshot()

    @property
    def oldest_fetched_at(self) -> float | None:
        """When the oldest unsettled record entered the window (monotonic), None if empty."""
        return self._window.oldest_fetched_at

    @property
    def blocking(self) -> Blocking | None:
        """The unsettled record with the smallest offset, and what it waits for."""
        entry = self._window.oldest
        if entry is None:
            return None
        holder = entry.holder
        offset = entry.record.offset
        return Blocking(
            offset=offset,
            state=entry.state.value,
            fetched_at=entry.fetched_at,
            attempt=entry.attempt,
            holder=holder.consumer_id if holder is not None else None,
            suspect=entry.suspect,
            started=holder is None or not holder.isolating or offset in holder.started,
        )

    @property
    def queued(self) -> int:
        """Records ready for delivery, suspects included."""
        return self._scheduler.queued

    @property
    def in_flight(self) -> int:
        """Records delivered and not settled, plus dead letters not yet durable."""
        return self._window.in_flight

    @property
    def failures_version(self) -> int:
        """Moves whenever a count in `failures` went up (the committer's cue to write it)."""
        return self._window.carryover.failures_version

    def failures(self) -> dict[int, int]:
        """Failed deliveries by offset of the unsettled records (what the committer keeps)."""
        return self._window.carryover.failures()

    def settled_ahead(self) -> list[int]:
        """A previous run's settled offsets this run has not fetched yet (sorted)."""
        return self._window.carryover.settled_ahead()

    def stop_delivering(self) -> None:
        """Shutdown: hand out nothing new; what is held may still be settled."""
        self._scheduler.stop_delivering()

    # --- records in -----------------------------------------------------------------------

    def add(self, records: Iterable[Record]) -> None:
        """Take freshly fetched records (in offset order) into the window and deliver."""
        batch = records if isinstance(records, list) else list(records)
        if not batch:
            return
        window = self._window
        resuming = window.carryover.resuming
        before = window.bytes
        new = window.add(batch, self._monotonic())
        self._filled.set()
        # No record is larger than the bytes the whole batch added: only a batch that
        # added more than one frame carries is looked at record by record.
        if window.bytes - before > self._max_record_bytes and (
            max(map(SIZE, new)) > self._max_record_bytes
        ):
            new = self._oversized(new)
        if self._keys is not None:
            new = self._keys.admit(new)
        if resuming and any(entry.attempt for entry in new):
            # It failed in a previous run: the count goes on.
            for entry in new:
                if entry.attempt:
                    self._redelivery.resume(entry)
                else:
                    self._scheduler.queue((entry,))
        else:
            self._scheduler.queue(new)
        self._window.update_events()
        self._scheduler.pump()

    def _oversized(self, entries: list[Entry]) -> list[Entry]:
        """Dead-letter the records no frame the proxy sends can carry; return the rest."""
        kept: list[Entry] = []
        for entry in entries:
            if entry.size > self._max_record_bytes:
                entry.attempt = 1
                reason = f"message of {entry.size} bytes exceeds server.max_frame_bytes"
                self._redelivery.dead_letter(entry, reason, "")
            else:
                kept.append(entry)
        return kept

    # --- sessions -------------------------------------------------------------------------

    def open_session(
        self, consumer_id: str, credits: int, outlet: Outlet, *, isolating: bool = False
    ) -> Session:
        """A new instance's session; its deliveries go to `outlet` (`isolating`: its Hello
        set `isolation`, see policies.judged_on_vanish)."""
        session = self._sessions.open(consumer_id, credits, outlet, isolating=isolating)
        self._scheduler.pump()
        return session

    def close_session(self, session: Session) -> None:
        """The instance is gone: each held delivery failed (attempt used up).

        A gracefully stopping instance first releases what it never started (`release`),
        so only deliveries that may have reached a handler count as attempts here. Streams
        the proxy itself ends at shutdown (`end_sessions`) use no attempt either: that is
        not the messages' doing, and their counts outlive this run (`failures`).
        """
        if not self._sessions.close(session):
            return
        held = self._window.take_all(session)
        if self._sessions.ended:
            self._redelivery.give_back(held)
            logger.info(
                "stream of %s ended; %d records it held not counted as attempts",
                session.consumer_id,
                len(held),
            )
            session.outlet.end()
            self._window.update_events()
            return
        # The consumer id goes in the dead letter's own field, not in the reason: one reason
        # for every crash pill, so grouping dead letters by reason groups them.
        cause = "its instance disconnected while handling it"
        started = session.started
        began = [e.record.offset in started for e in held] if session.isolating else None
        blamed, back, later, acquitted = self._judge_vanished(
            held, began, cause, session.consumer_id
        )
        logger.info(
            "instance %s disconnected; %d records back to the queue (%d blamed, %d after "
            "a backoff, %d acquitted as ordinary deliveries, the crash being blamed on "
            "its started suspect)",
            for_log(session.consumer_id),
            back,
            blamed,
            later,
            acquitted,
        )
        session.outlet.end()
        self._window.update_events()
        self._scheduler.pump()

    def end_sessions(self) -> None:
        """Ask every stream to finish (shutdown); their close_session follows."""
        self._sessions.end_all()

    def end_session_now(self, session: Session) -> None:
        """End `session`'s stream at once (its app's token was revoked). What is queued for
        it was never sent: it goes back without using an attempt; what it did receive fails
        when the stream closes (close_session)."""
        unsent = session.outlet.take_unsent()
        if not session.closed:
            self.release(session, unsent)  # also: no credits, nothing new
        session.outlet.end()

    # --- what instances say ---------------------------------------------------------------

    def settle(
        self,
        session: Session,
        acks: Sequence[int],
        nacks: Sequence[Nack],
        ranges: Sequence[Span] = (),
    ) -> list[int]:
        """Apply a batch of settlements from `session` (`ranges`: acks of first..last, each
        offset checked like one in `acks`); return the offsets it did not hold."""
        self.counters.settle_frames += 1
        rejected, done, nacked, their = self._window.settle(
            session, acks, ranges, nacks, self._monotonic(), ordered=self._keys is not None
        )
        if self._keys is not None and done:
            self._redelivery.proceed(self._keys.release(done))
        if nacked:
            self._redelivery.nacked(session.consumer_id, nacked, their)
        if rejected:
            self.counters.rejected += len(rejected)
            logger.warning(
                "rejected %d settlements from %s for offsets it does not hold",
                len(rejected),
                for_log(session.consumer_id),
            )
        self._window.update_events()
        self._scheduler.pump()
        return rejected

    def started(self, session: Session, offsets: Sequence[int]) -> None:
        """The instance is about to start these isolated deliveries (a Started frame): a
        suspect it holds is from now on the one its vanishing would blame."""
        if not session.isolating:
            return
        started, held = session.started, session.held
        if len(started) >= STARTED_KEPT:
            started.intersection_update(held)  # settled or lapsed since: no evidence now
        for offset in offsets:
            entry = held.get(offset)
            if entry is not None and entry.suspect:
                started.add(offset)

    def extend(self, session: Session, offsets: Sequence[int]) -> None:
        """The instance is still working on these: push their ack deadlines out."""
        self._leases.extend(session, offsets, self._monotonic())

    def grant(self, session: Session, credits: int) -> None:
        """The instance's credits from now on (a Grant frame); see `Sessions.grant`."""
        if self._sessions.grant(session, credits):
            self._scheduler.pump()

    def release(self, session: Session, offsets: Sequence[int]) -> list[int]:
        """The instance is stopping: take back what it never started, send it nothing more.

        Released deliveries do not count as attempts. Returns the offsets it did not hold.
        """
        self._sessions.stopping(session)
        back, rejected = self._window.release(session, offsets)
        self.counters.released += self._redelivery.give_back(back)
        self.counters.rejected += len(rejected)
        self._window.update_events()
        self._scheduler.pump()
        return rejected

    def give_back(self, session: Session, offsets: Sequence[int]) -> list[int]:
        """Take these back from an instance that stays (a push target whose endpoint was
        overloaded or out): redelivered to anyone, no attempt used. Returns the offsets it
        did not hold."""
        back, rejected = self._window.release(session, offsets)
        self.counters.released += self._redelivery.give_back(back)
        self.counters.rejected += len(rejected)
        self._window.update_events()
        self._scheduler.pump()
        return rejected

    def suspect(self, session: Session, offsets: Sequence[int], cause: str) -> list[int]:
        """These failed together at a push target, and nothing says which one caused it
        (the endpoint went away while they were in flight to it, a batch got no answer in
        time): judged as the deliveries of an instance that vanished, each of them
        started (policies.judged_on_vanish). A suspect uses an attempt (a crash-type
        pill is one from its second crash on); the others go back as suspects without one.
        Returns the offsets it did not hold."""
        back, rejected = self._window.release(session, offsets)
        self._judge_vanished(back, [True] * len(back), cause, session.consumer_id, isolating=False)
        self.counters.rejected += len(rejected)
        self._window.update_events()
        self._scheduler.pump()
        return rejected

    def _judge_vanished(
        self,
        held: list[Entry],
        began: list[bool] | None,
        cause: str,
        consumer_id: str,
        *,
        isolating: bool = True,
    ) -> tuple[int, int, int, int]:
        """`held` comes back from a holder that vanished (`began`: which it started, None
        when it reports nothing; `isolating`: the holder's own Started reports, not a push
        target's every record): `judged_on_vanish` says who uses an
        attempt; the rest go back without one, acquitted (as ordinary deliveries) or as
        suspects. Returns (blamed, back in the queue, of
        those after a backoff, of those acquitted); a blamed one out of attempts is
        dead-lettered."""
        again: list[Entry] = []
        cleared: list[Entry] = []
        acquitted: list[Entry] = []
        verdicts = judged_on_vanish(
            [e.record.offset for e in held],
            [e.suspect for e in held],
            [e.acquittals for e in held],
            began,
            isolating=isolating,
        )
        culprit = -1
        for entry, verdict in zip(held, verdicts, strict=True):
            if verdict is Judgement.SUSPECT:
                cleared.append(entry)
            elif verdict is Judgement.ACQUITTED:
                acquitted.append(entry)
            else:
                culprit = entry.record.offset
                if self._redelivery.failed(entry, cause, consumer_id):
                    again.append(entry)
        later = self._redelivery.redeliver(again)
        self._redelivery.clear(cleared)
        if acquitted:
            self._redelivery.acquit(acquitted, culprit)
        back = len(again) + len(cleared) + len(acquitted)
        return len(held) - len(cleared) - len(acquitted), back, later, len(acquitted)

    # --- what the dead-letter writer says -------------------------------------------------

    def dead_letter_written(self, dl: DeadLetter) -> None:
        """The writer made `dl` durable: only now may its offset count as settled."""
        if self._window.dead_letter_written(dl.record.offset):
            self._window.update_events()
            self._scheduler.pump()

    def dead_letter_unwritable(self, dl: DeadLetter) -> None:
        """The writer can never write `dl` (deadletters/writer.py): its offset stays
        unsettled, so the commit waits there and a restart redelivers it, but it no longer
        counts as in flight, so a drain (`quiet`) does not wait for what cannot happen."""
        if self._window.dead_letter_unwritable(dl.record.offset):
            self._window.update_events()

    def _dead_letter_entry(self, entry: Entry, reason: str, consumer_id: str) -> None:
        self._redelivery.dead_letter(entry, reason, consumer_id)

    # --- timers ---------------------------------------------------------------------------

    def tick(self) -> None:
        """Expire overdue leases and make due retries ready again."""
        now = self._monotonic()
        back: list[Entry] = []
        deadline_s = self._leases.ack_deadline_s
        for entry, session in self._leases.expire(now):
            cause = f"ack deadline of {deadline_s:g} s passed at its instance"
            if self._redelivery.failed(entry, cause, session.consumer_id):
                back.append(entry)
        if back:
            logger.warning("%d deliveries passed their ack deadline; redelivering", len(back))
            self._redelivery.redeliver(back)
        self._redelivery.due(now)
        self._window.update_events()
        self._scheduler.pump()

    async def run_timers(self, closing: asyncio.Event) -> None:
        """Tick until `closing` is set (owned by the proxy's task group).

        While the window is empty nothing can come due (a lease, a retry's backoff and a
        dead letter in flight all belong to records in it), so the timers wait for `add`
        instead of waking TICK_S apart: an idle partition costs no wake-ups here."""
        filled = self._filled
        while not closing.is_set():
            if not self._window.in_window:
                filled.clear()
                self.timers_asleep = True
                try:
                    await wait_any(closing, filled)
                finally:
                    self.timers_asleep = False
                continue
            if await wait_any(closing, timeout=TICK_S):
                return
            self.tick()
