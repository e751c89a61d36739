"""The isolation gate: one isolated delivery at a time in the whole process.

A proxy flags a suspect (a record whose earlier holder vanished) as isolated
(`Deliveries.isolated`) to a client whose Hello set `isolation`. When this process
crashes, each of its streams' proxies blames only the isolated delivery the stream had
reported started; so the process runs at most one isolated delivery at a time, across all
its streams and Consumers (one process holds streams to several proxies, and a crash pill
on one partition takes down the handlers of every other one):

    Deliveries.isolated ─> Ticket ─> GATE.enter ─> (its turn) stream.on_admitted
        ─> Started(offset) ─> the proxy records it and answers Started ─> handler slot
        ─> its Settle written ─> GATE.leave ─> the next ticket's turn

The others wait here, queued and leased (their offsets are in the Extend), never started:
if the process dies meanwhile, nobody blames them. A ticket leaves early when its stream
ends (its epoch is over: the proxy redelivers what it held) or gives it back unstarted.

Thread-safe: tickets come from the event loops of any Consumer in the process; a ticket's
turn is handed to its own loop (`call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from contextlib import suppress

from triage_client.message import Message

__all__ = ["GATE", "IsolationGate", "Ticket"]


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
