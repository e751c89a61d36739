"""The isolation gate: one isolated delivery at a time in the whole process.

A proxy flags a suspect (a record whose earlier holder vanished) as isolated
(`Deliveries.isolated`) to a client whose Hello set `isolation`. When this process
crashes, each of its streams' proxies blames only the isolated delivery the stream had
reported started; so the process runs at most one isolated delivery at a time, across all
its streams and Consumers (one process holds streams to several proxies, and a crash pill
on one partition takes down the handlers of every other one):

    Deliveries.isolated ─> Ticket ─> GATE.enter ─> (its turn) GATE.hush
        ─> (no other handler runs, or HUSH_S passed) Started(offset)
        ─> the proxy records it and answers Started ─> handler slot
        ─> its Settle written ─> GATE.leave ─> the next ticket's turn

The others wait here, queued and leased (their offsets are in the Extend), never started:
if the process dies meanwhile, nobody blames them. A ticket leaves early when its stream
ends (its epoch is over: the proxy redelivers what it held) or gives it back unstarted.

The hush: from a ticket's turn until its Settle is written, the process's handler pools
start no other delivery (`IsolationGate.hushed`), and the Started waits until the handlers
already running are done; each wait at most HUSH_S. Why: a crash while the isolated
delivery is started is blamed on it, and a crash pill on its first delivery (not isolated:
nobody suspects it yet) would otherwise crash the process in that time: one already running
that crashes late, or one the process picks from a batch arriving meanwhile. In a crash
storm (each restarted process gets the same smallest-offset suspect and a batch holding a
new pill) one healthy suspect would be blamed again and again until dead-lettered. With the
hush, a pill that was running has crashed the process before the Started was sent, and one
that arrives later waits.

Thread-safe: tickets come from the event loops of any Consumer in the process; a ticket's
turn is handed to its own loop (`call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import suppress
from typing import TYPE_CHECKING

from triage_client.message import Message

if TYPE_CHECKING:
    from triage_client.stream import PartitionStream, StreamContext
    from triage_client.writer import StreamWriter
    from triage_protocol import triage_pb2

__all__ = ["GATE", "IsolationGate", "StreamTurn", "Ticket"]

HUSH_S = 1.0
"""Longest the process starts nothing new for an isolated delivery (`IsolationGate.hush`),
and longest its Started waits for the handlers already running (`StreamTurn._when_quiet`).
A suspect of up to about a second runs alone, so a crash pill on its first delivery can
neither start beside it nor, already running, crash after its Started and get it blamed.
A slower one runs on beside the others after it, so a process working through a crash's
suspects of many seconds each keeps its throughput. The price is time after a crash
(bench_crash_cost, against a 50 ms hush that did not wait: one pill among 400 messages of
100 ms, 1.38x the time without it against 1.16x; with eight pills, no healthy attempt
blamed against 13-16)."""

QUIET_POLL_S = 0.005
"""How often an isolated delivery whose turn came looks whether the handlers already
running in the process are done (then its Started goes out)."""

TURN_POLL_S = 0.05
"""How often a stream whose connection ended looks whether its isolated delivery's handler,
still running, is done (then the process's turn passes on)."""


class Ticket:
    """One isolated delivery waiting for (or holding) the process's turn."""

    __slots__ = ("epoch", "loop", "message", "on_turn", "owner", "started")

    def __init__(
        self,
        owner: object,
        message: Message,
        epoch: int,
        loop: asyncio.AbstractEventLoop,
        on_turn: Callable[[Ticket], None],
    ) -> None:
        self.owner = owner
        """The stream it came on (`drop` removes a stream's tickets)."""
        self.message = message
        self.epoch = epoch
        """The stream's connection it came on: stale once that connection ended."""
        self.loop = loop
        self.on_turn = on_turn
        """Called on `loop` when the ticket's turn comes."""
        self.started = False
        """The proxy answered its Started: it is in (or next for) a handler slot."""


class IsolationGate:
    """At most one ticket holds the turn; the rest wait in arrival order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: deque[Ticket] = deque()
        self._holder: Ticket | None = None
        self.hushed: Message | None = None
        """The isolated delivery the process is hushed for (`hush`): the pools start only
        it; None: they start anything. Read without the lock (one attribute)."""
        self._hush_for: Ticket | None = None
        self._listeners: dict[
            object,
            tuple[asyncio.AbstractEventLoop, Callable[[], None], Callable[[], int]],
        ] = {}

    def listen(
        self,
        owner: object,
        loop: asyncio.AbstractEventLoop,
        on_unhush: Callable[[], None],
        running: Callable[[], int] = lambda: 0,
    ) -> None:
        """`owner` (a handler pool) wants `on_unhush` called on `loop` when a hush ends;
        `running` says how many handlers it runs (`quiet`)."""
        with self._lock:
            self._listeners[owner] = (loop, on_unhush, running)

    def quiet(self) -> bool:
        """No handler runs in any pool of the process. Read without the pools' locks: while
        the process is hushed their counts only fall, and a stale read waits one poll."""
        with self._lock:
            counts = [running for _, _, running in self._listeners.values()]
        return not any(running() for running in counts)

    def unlisten(self, owner: object) -> None:
        with self._lock:
            self._listeners.pop(owner, None)

    def hush(self, ticket: Ticket, *, bounded: bool = True) -> None:
        """`ticket`'s turn came (called on its loop): the process starts nothing else until
        it leaves, or for HUSH_S from now. Unbounded (`bounded=False`) for a caller that
        bounds the wait itself and then hushes again with the bound (StreamTurn: the
        Started's wait, then the run)."""
        with self._lock:
            if self._holder is not ticket:
                return
            self._hush_for = ticket
            self.hushed = ticket.message
        if bounded:
            ticket.loop.call_later(HUSH_S, self._unhush, ticket)

    def _unhush(self, ticket: Ticket) -> None:
        with self._lock:
            if self._hush_for is not ticket:
                return
            self._hush_for = None
            self.hushed = None
            listeners = list(self._listeners.values())
        for loop, on_unhush, _ in listeners:
            with suppress(RuntimeError):  # its loop is closed: its Consumer is gone
                loop.call_soon_threadsafe(on_unhush)

    @property
    def holder(self) -> Ticket | None:
        """The ticket whose turn it is (None: nobody's)."""
        return self._holder

    @property
    def waiting(self) -> int:
        """Tickets waiting for their turn."""
        return len(self._waiting)

    def enter(self, ticket: Ticket) -> None:
        """Queue `ticket`; its turn comes when every ticket before it has left."""
        with self._lock:
            self._waiting.append(ticket)
        self._next()

    def leave(self, ticket: Ticket) -> None:
        """`ticket` is done (its result was sent, or it will never start): the next one's
        turn. A ticket that does not hold the turn is just taken out of the queue."""
        with self._lock:
            if self._holder is ticket:
                self._holder = None
            else:
                with suppress(ValueError):
                    self._waiting.remove(ticket)
                return
        self._unhush(ticket)
        self._next()

    def drop_waiting(self, owner: object) -> None:
        """`owner` is stopping: its waiting tickets go (it gave them back unstarted)."""
        with self._lock:
            self._waiting = deque(t for t in self._waiting if t.owner is not owner)

    def drop(self, owner: object) -> None:
        """`owner`'s connection ended: its tickets go (the proxy redelivers them)."""
        with self._lock:
            self._waiting = deque(t for t in self._waiting if t.owner is not owner)
            holder = self._holder
            if holder is None or holder.owner is not owner:
                return
            self._holder = None
        self._unhush(holder)
        self._next()

    def _next(self) -> None:
        while True:
            with self._lock:
                if self._holder is not None or not self._waiting:
                    return
                ticket = self._holder = self._waiting.popleft()
            try:
                ticket.loop.call_soon_threadsafe(ticket.on_turn, ticket)
            except RuntimeError:  # its loop is closed: its Consumer is gone
                with self._lock:
                    if self._holder is ticket:
                        self._holder = None
                continue
            return


GATE = IsolationGate()
"""The process's gate, shared by every Consumer in it."""


class StreamTurn:
    """One stream's side of the gate: its isolated deliveries wait here for the process's
    turn, then the writer sends Started; the turn passes on when its Settle is written, or
    when the connection ends (once a handler still running on it is done)."""

    def __init__(self, stream: PartitionStream, context: StreamContext, writer: StreamWriter):
        self._stream = stream
        self._ctx = context
        self._writer = writer
        self._turn: Ticket | None = None
        """This stream's isolated delivery holding the turn."""

    def isolate(self, messages: list[Message], isolated: Iterable[int]) -> None:
        """Deliveries of a frame that flags some isolated: those wait for the process's
        turn, the rest go to the pool as usual."""
        stream = self._stream
        pool = self._ctx.pool
        flagged = set(isolated)
        held = [m for m in messages if m.offset in flagged]
        pool.submit(stream.account, [m for m in messages if m.offset not in flagged])
        if not held:
            return
        loop = stream.loop
        assert loop is not None
        pool.isolate(stream.account, held)
        epoch = stream.account.epoch
        for message in held:
            GATE.enter(Ticket(stream, message, epoch, loop, self._on_turn))

    def _on_turn(self, ticket: Ticket) -> None:
        """`ticket`'s turn came (on the loop): ask the proxy to record it started."""
        stream = self._stream
        if (
            ticket.epoch != stream.account.epoch
            or stream.call is None
            or self._ctx.stopping.is_set()
        ):
            GATE.leave(ticket)  # its connection ended: the proxy redelivers it
            return
        self._turn = ticket
        GATE.hush(ticket, bounded=False)  # until the Started: `_when_quiet` bounds it
        self._when_quiet(ticket, ticket.loop.time() + HUSH_S)

    def _when_quiet(self, ticket: Ticket, deadline: float) -> None:
        """Send `ticket`'s Started once no other handler runs in the process, or at
        `deadline`. Why wait: a crash is blamed on the started isolated delivery, and a
        crash pill already running (on its first delivery, so not isolated) that crashes
        late would get this one blamed. While it waits the process is hushed, so the
        handlers running can only finish; one that crashes costs this one nothing."""
        if self._turn is not ticket or ticket.started:
            return  # given back or its connection ended meanwhile
        stream = self._stream
        if ticket.epoch != stream.account.epoch or stream.call is None:
            self._turn = None
            GATE.leave(ticket)  # its connection ended: the proxy redelivers it
            return
        loop = ticket.loop
        if not GATE.quiet() and loop.time() < deadline:
            loop.call_later(QUIET_POLL_S, self._when_quiet, ticket, deadline)
            return
        GATE.hush(ticket)  # the bound, for its own run
        self._writer.started(ticket.message.offset)

    def on_started(self, offsets: Iterable[int]) -> None:
        """The proxy recorded the Started: the delivery takes the next handler slot."""
        turn = self._turn
        if turn is None or turn.started or turn.message.offset not in offsets:
            return
        turn.started = True
        if not self._ctx.pool.run_isolated(self._stream.account, turn.message):
            self._turn = None  # given back meanwhile
            GATE.leave(turn)

    def settled(self, acks: list[int], nacks: list[triage_pb2.Nack]) -> None:
        """The writer sent these results: an isolated delivery among them passes its turn
        on."""
        turn = self._turn
        if turn is not None and turn.started:
            offset = turn.message.offset
            if offset in acks or any(nack.offset == offset for nack in nacks):
                self._turn = None
                GATE.leave(turn)  # its result is on the wire: the next one's turn

    def give_back(self) -> None:
        """stop() began: a turn not started yet, and the tickets waiting, go."""
        turn = self._turn
        if turn is not None and not turn.started:
            self._turn = None
            GATE.leave(turn)  # given back unstarted
        GATE.drop_waiting(self._stream)

    def connection_ended(self, leases: set[int], taken: list[Message]) -> None:
        """The connection ended (`leases`: its running offsets, `taken`: the queued ones
        taken back): the proxy redelivers the waiting tickets; a started turn passes on
        once its handler, if it still runs, is done."""
        GATE.drop_waiting(self._stream)  # a pending turn sees its epoch
        turn, self._turn = self._turn, None
        if turn is not None:
            offset = turn.message.offset
            if turn.started and offset in leases and all(m is not turn.message for m in taken):
                self._leave_when_done(turn, leases)  # its handler still runs
            else:
                GATE.leave(turn)

    def _leave_when_done(self, turn: Ticket, leases: set[int]) -> None:
        """The turn passes on once `turn`'s handler, still running though its connection
        ended, is done (its offset leaves the ended connection's lease set): until then it
        is the process's one started isolated delivery, and may still crash it."""
        loop = self._stream.loop
        if turn.message.offset not in leases or loop is None:
            GATE.leave(turn)
            return
        loop.call_later(TURN_POLL_S, self._leave_when_done, turn, leases)
