"""The scheduler: hands queued records to instances by credit, fairly, within rate caps.

It owns the queues: `ready` (in offset order, retries at the front), `suspects` (by
offset: `SuspectQueue`) and `large`. Each pump gives every instance with credit an even
share of what is queued and then rotates the session table, so the first in line changes
from pump to pump. A pump
hands each instance one batch; the window marks it held (`Window.hand_out`), the
instance's outlet (the server) encodes it into frames, and the leases start:

    pump ─> share per instance ─> batch ─> Window.hand_out ─> Outlet.send ─> Leases.add
                                                                 │
                               too large for any frame to it <───┘ (`_too_large`)

Refills: an instance with REFILL_MIN_CREDITS credits or more on this stream gets nothing
while fewer than half of them are free, for at most REFILL_LINGER_S: it still holds over
half its credits' worth, and waiting lets one frame carry what several Settles freed.
Each Deliveries frame (and the Settle the client answers it with) costs a fixed gRPC write
and read on both sides, and a client spreading its credits over many partitions' streams
settles each a little at a time: refilled Settle by Settle, a 16-partition process sent
frames of ~100 records and spent more per message on frames than on records
(bench_fleet_throughput). A stream with fewer credits (slow handlers, an explicit small
prefetch) is refilled as each one frees, and a stream that holds less than half its credits
is refilled at once, so a trickle waits for nothing.

Suspects: records whose instance vanished or whose lease lapsed while holding them. One
of them may be a crash-type poison pill, so an instance holds at most one suspect at a
time: when the pill crashes it again, the only other suspect it takes down is none, and
healthy neighbours do not follow the pill from instance to instance until they run out
of attempts with it. To an `isolating` instance (Hello.isolation) the suspect goes alone in
a frame flagged isolated (`Outlet.send_isolated`), and the instance's other streams, to
this proxy or others, see to it that its process runs one such delivery at a time (see
policies.blamed_on_vanish). The deliveries that were no suspects, held beside a suspect
an isolating instance started and crashed on, do not become suspects: they come back to
the front of `ready` (policies.judged_on_vanish, acquitted).

Large records: a delivery over the frame limit of the instance it was about to go to
waits in `large` for a connected instance whose limit takes it, and is dead-lettered once
no connected instance's limit does (a record no consumer can receive would otherwise
break every stream it is sent on, and come back until its attempts are used up).

With `[rate_limit]`, a batch stops where the token buckets (policies.py) run dry and a
pump is scheduled for when they refill.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from collections.abc import Callable, Iterable

from triage_proxy.pipeline.dispatch.leases import Leases
from triage_proxy.pipeline.dispatch.sessions import Session, Sessions
from triage_proxy.pipeline.dispatch.window import Counters, Entry, EntryState, Window
from triage_proxy.pipeline.policies import RateLimit

REFILL_MIN_CREDITS = 128
"""Sessions with at least this many credits are refilled half their credits at a time
(see the module docstring); with fewer, as soon as one is free."""
REFILL_LINGER_S = 0.005
"""Longest a refill of fewer than half a session's credits is held back."""

DeadLetterEntry = Callable[[Entry, str, str], None]
"""Hands an entry to the dead-letter writer with a reason and the consumer id."""


class SuspectQueue:
    """Suspects waiting for an instance, smallest offset first (a deque's `popleft`,
    `[0]`, `extend`, `len`). Offset order, not arrival: a suspect back from its
    redelivery gap (a crash pill, blamed) holds the commit at the smallest offset, and
    after a crash its partition may have as many suspects queued as the process held
    deliveries, each run one at a time; at the back of them it waited out all of them
    (55 s after an 8.6 s gap, measured), not its gap."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[int, Entry]] = []  # offsets are unique within a partition

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:  # tested on every pump
        return bool(self._heap)

    def __getitem__(self, index: int) -> Entry:
        if index != 0:
            raise IndexError("only the first suspect can be read")
        return self._heap[0][1]

    def extend(self, entries: Iterable[Entry]) -> None:
        heap = self._heap
        for entry in entries:
            heapq.heappush(heap, (entry.record.offset, entry))

    def popleft(self) -> Entry:
        return heapq.heappop(self._heap)[1]


class Scheduler:
    """Credit-based, fair hand-out of one partition's queued records."""

    def __init__(
        self,
        sessions: Sessions,
        window: Window,
        leases: Leases,
        counters: Counters,
        rate: RateLimit | None,
        dead_letter: DeadLetterEntry,
        monotonic: Callable[[], float],
    ) -> None:
        self._sessions = sessions
        self._window = window
        self._leases = leases
        self._counters = counters
        self._rate = rate
        """The [rate_limit] caps; None (no caps) costs `pump` one attribute test."""
        self._rate_wake: asyncio.TimerHandle | None = None
        """The pending pump for when the caps let the next record go."""
        self._linger_wake: asyncio.TimerHandle | None = None
        """The pending pump for a refill held back (`_refillable`)."""
        self._dead_letter = dead_letter
        self._monotonic = monotonic
        self._ready: deque[Entry] = deque()
        self._suspects = SuspectQueue()
        self._large: deque[Entry] = deque()
        self._delivering = True

    @property
    def queued(self) -> int:
        """Records ready for delivery, suspects included."""
        return len(self._ready) + len(self._suspects) + len(self._large)

    def stop_delivering(self) -> None:
        """Shutdown: hand out nothing new."""
        self._delivering = False

    # --- the queues -----------------------------------------------------------------------

    def queue(self, entries: Iterable[Entry]) -> None:
        """READY `entries` go at the back, in order."""
        self._ready.extend(entries)

    def queue_front(self, entries: list[Entry]) -> None:
        """READY `entries` (in offset order) go at the front, before what waits."""
        self._ready.extendleft(reversed(entries))

    def queue_first(self, entry: Entry) -> None:
        self._ready.appendleft(entry)

    def queue_suspects(self, entries: list[Entry]) -> None:
        """READY suspects wait for an instance that holds none, smallest offset first."""
        self._suspects.extend(entries)

    # --- pumping --------------------------------------------------------------------------

    def pump(self) -> None:
        """Deliver ready records to instances with credit, an even share each.

        An instance gets a suspect only while it holds none.
        """
        if self._large and self._delivering:
            self._pump_large()
        ready, suspects = self._ready, self._suspects
        while (ready or suspects) and self._delivering:
            open_ = self._refillable()
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
                    if batch[0].suspect and session.isolating:
                        self._deliver(session, batch[:1], isolated=True)
                        del batch[0]
                    if batch:
                        self._deliver(session, batch)
                    delivered = True
            if not delivered:
                return  # only suspects left, and every instance with credit holds one
            self._sessions.rotate()

    def _refillable(self) -> list[Session]:
        """The sessions to hand records to now, in serving order: those with credit, less
        any with REFILL_MIN_CREDITS or more that have fewer than half of them free, until
        one has waited REFILL_LINGER_S for more (see the module docstring)."""
        open_: list[Session] = []
        now = -1.0
        for session in self._sessions:
            credits = session.credits
            available = credits - len(session.held)
            if available <= 0:
                continue
            if 2 * available >= credits or credits < REFILL_MIN_CREDITS:
                open_.append(session)
                continue
            if now < 0:
                now = self._monotonic()
            since = session.short_since
            if since is None:
                session.short_since = since = now
            waited = now - since
            if waited >= REFILL_LINGER_S:
                open_.append(session)
            else:
                self._linger(REFILL_LINGER_S - waited)
        return open_

    def _linger(self, delay: float) -> None:
        """Pump again in `delay` seconds, for a refill held back (once at a time)."""
        self._linger_wake = _wake(self._linger_wake, delay, self._on_linger_wake)

    def _on_linger_wake(self) -> None:
        self._linger_wake = None
        self.pump()

    def _take_within_rate(self, n: int, suspect_first: bool) -> list[Entry]:
        """`pump`'s batch under `[rate_limit]`: up to `n` records (a suspect first) while
        the caps allow; when they stop it, a pump is scheduled for when tokens refill."""
        rate, now = self._rate, self._monotonic()
        assert rate is not None
        batch: list[Entry] = []
        queues: tuple[SuspectQueue | deque[Entry], ...] = (
            (self._suspects, self._ready) if suspect_first else (self._ready,)
        )
        for queue in queues:
            while queue and len(batch) < n:
                size = queue[0].size
                if not rate.admit(size, now):
                    self._pump_after(rate.wait_s(size, now))
                    return batch
                batch.append(queue.popleft())
                if queue is self._suspects:
                    break  # one suspect per batch, as in `pump`
        return batch

    def _pump_after(self, delay: float) -> None:
        """Pump again in `delay` seconds, when the rate caps allow (once at a time)."""
        self._rate_wake = _wake(self._rate_wake, delay, self._on_rate_wake)

    def _on_rate_wake(self) -> None:
        self._rate_wake = None
        self.pump()

    def _pump_large(self) -> None:
        """Hand each record of `large` to an instance with credit whose frame limit takes
        it; dead-letter those no connected instance's limit takes (`_too_large`)."""
        sessions = [s for s in self._sessions if not s.closed]
        if not sessions:
            return  # nobody to ask: they wait, like every queued record
        waiting: deque[Entry] = deque()
        large, self._large = self._large, waiting
        rate, now = self._rate, self._monotonic()
        while large:
            entry = large.popleft()
            able = [s for s in sessions if s.outlet.fits(entry)]
            if not able:
                self._too_large(sessions[0], entry)
                continue
            open_ = [s for s in able if s.available > 0]
            if not open_ or (rate is not None and not rate.admit(entry.size, now)):
                waiting.append(entry)
                continue
            self._deliver(open_[0], [entry], isolated=entry.suspect and open_[0].isolating)

    def _deliver(self, session: Session, batch: list[Entry], *, isolated: bool = False) -> None:
        """Hand `batch` to `session`: held and leased from now, encoded by its outlet
        (`isolated`: one suspect, flagged). What no frame to it can carry is taken back
        (`_too_large`)."""
        session.short_since = None
        now = self._monotonic()
        deadline = now + self._leases.ack_deadline_s
        leased, redelivered = self._window.hand_out(session, batch, now, deadline)
        if isolated:
            frames, refused = session.outlet.send_isolated(batch[0])
        else:
            frames, refused = session.outlet.send(batch)
        self._counters.frames_out += frames
        if refused:
            self._window.take_back(session, refused)
            gone = {entry.record.offset for entry in refused}
            leased = [offset for offset in leased if offset not in gone]
            redelivered -= sum(1 for entry in refused if entry.attempt)
            for entry in refused:
                self._too_large(session, entry)
            if not leased:
                return
        self._leases.add(deadline, leased)
        self._window.busy()
        self._counters.delivered += len(leased)
        self._counters.redelivered += redelivered

    def _too_large(self, session: Session, entry: Entry) -> None:
        """`entry`'s delivery alone is over `session`'s frame limit: it waits for an
        instance whose limit takes it, or, when no connected instance's does, it is
        dead-lettered (see the module docstring)."""
        sessions = [s for s in self._sessions if not s.closed]
        if any(s.outlet.fits(entry) for s in sessions):
            entry.state = EntryState.READY
            self._large.append(entry)
            return
        largest = max((s.max_frame_bytes for s in sessions), default=0)
        largest = max(largest, session.max_frame_bytes)
        need = session.outlet.frame_needed(entry)
        entry.attempt = max(entry.attempt, 1)
        entry.suspect = False
        self._dead_letter(
            entry,
            f"record of {entry.size} bytes needs a frame of {need} bytes, over the "
            f"consumer's frame limit of {largest} bytes (Hello.max_frame_bytes)",
            session.consumer_id,
        )
        self._window.update_events()


def _wake(
    pending: asyncio.TimerHandle | None, delay: float, callback: Callable[[], None]
) -> asyncio.TimerHandle | None:
    """`callback` in `delay` seconds unless `pending` is on its way already. Without a
    running loop (unit tests) nothing is scheduled: the next pump or tick does it."""
    if pending is not None:
        return pending
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return loop.call_later(delay, callback)
