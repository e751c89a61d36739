"""The session table: the consumer instances connected to the partition now.

A session is one instance's stream: its credits and its outlet, the server's end of the
stream (server/outbox.py) that turns the batches the dispatcher hands it into frames.
The table owns the sessions' order, which the scheduler rotates so the first instance in
line changes from pump to pump, and whether the proxy itself ended the streams
(shutdown). What a session holds is the window's ledger (window.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Protocol

from triage_proxy.clienttext import for_log
from triage_proxy.pipeline.dispatch.window import Counters, Entry

logger = logging.getLogger(__name__)


class Outlet(Protocol):
    """Where a session's deliveries go: the server's end of its stream, which encodes
    them into frames no larger than the instance takes."""

    @property
    def max_frame_bytes(self) -> int:
        """Largest frame (serialized bytes) the instance receives."""
        ...

    def send(self, entries: list[Entry]) -> tuple[int, Sequence[Entry]]:
        """Queue `entries` (their `attempt` counts this delivery) in frames; returns (the
        frames queued, the entries no frame to this instance can carry: not sent)."""
        ...

    def send_isolated(self, entry: Entry) -> tuple[int, Sequence[Entry]]:
        """`send` one suspect alone, flagged isolated (Deliveries.isolated); only to a
        session that is `isolating`."""
        ...

    def fits(self, entry: Entry) -> bool:
        """Whether a frame to this instance carries `entry`'s next delivery."""
        ...

    def frame_needed(self, entry: Entry) -> int:
        """Bytes of a frame carrying `entry`'s next delivery alone."""
        ...

    def take_unsent(self) -> list[int]:
        """Empty the queue; return the offsets of the deliveries in it (never sent)."""
        ...

    def end(self) -> None:
        """The stream ends after what is queued."""
        ...


class Session:
    """One connected consumer instance: its credits, what it holds, its outlet."""

    __slots__ = (
        "closed",
        "consumer_id",
        "credits",
        "held",
        "isolating",
        "outlet",
        "short_since",
        "started",
        "stopping",
        "suspects",
    )

    def __init__(
        self, consumer_id: str, credits: int, outlet: Outlet, *, isolating: bool = False
    ) -> None:
        self.consumer_id = consumer_id
        self.credits = credits
        self.outlet = outlet
        self.held: dict[int, Entry] = {}
        """Offsets it holds (the window's ledger: written only by window.py)."""
        self.suspects = 0
        """Suspect records it holds (at most one at a time, see scheduler.py); the
        window's ledger too."""
        self.isolating = isolating
        """The instance honours isolated deliveries (Hello.isolation): its suspects go out
        flagged, alone, and it reports which one it starts (Started)."""
        self.started: set[int] = set()
        """Offsets of suspects it reported started (and held then); the blame evidence."""
        self.short_since: float | None = None
        """When the scheduler first held back a refill of fewer than half its credits
        (monotonic); None after each delivery (scheduler.py)."""
        self.closed = False
        self.stopping = False
        """It released what it never started: it gets nothing more, whatever its credits."""

    @property
    def available(self) -> int:
        return self.credits - len(self.held)

    @property
    def max_frame_bytes(self) -> int:
        return self.outlet.max_frame_bytes


class Sessions:
    """The connected instances of one partition, in the order the scheduler serves them."""

    def __init__(self, counters: Counters) -> None:
        self._counters = counters
        self._sessions: list[Session] = []
        self.ended = False
        """Shutdown ended the streams (`end_all`): closing ones fail nothing."""

    def __iter__(self) -> Iterator[Session]:
        return iter(self._sessions)

    def __len__(self) -> int:
        return len(self._sessions)

    def snapshot(self) -> tuple[Session, ...]:
        return tuple(self._sessions)

    def open(
        self, consumer_id: str, credits: int, outlet: Outlet, *, isolating: bool = False
    ) -> Session:
        session = Session(consumer_id, credits, outlet, isolating=isolating)
        self._sessions.append(session)
        self._counters.sessions_opened += 1
        logger.info("instance %s connected with %d credits", for_log(consumer_id), credits)
        return session

    def close(self, session: Session) -> bool:
        """Take `session` out of the table; False if it was closed already."""
        if session.closed:
            return False
        session.closed = True
        self._sessions.remove(session)
        self._counters.sessions_closed += 1
        return True

    def end_all(self) -> None:
        """Ask every stream to finish (shutdown); their close follows."""
        self.ended = True
        for session in self._sessions:
            session.outlet.end()

    def grant(self, session: Session, credits: int) -> bool:
        """The instance's credits from now on. Lowering takes back nothing it holds: it
        just gets nothing more until it holds fewer. False (ignored) once the instance
        released (it is stopping) or is gone. Credits of 0 pause an instance that stays
        (a push target whose endpoint is down)."""
        if session.closed or session.stopping:
            return False
        session.credits = credits
        return True

    def stopping(self, session: Session) -> None:
        """The instance is stopping: it gets nothing more."""
        session.stopping = True
        session.credits = 0

    def rotate(self) -> None:
        """The first in line goes last (fairness between pumps)."""
        self._sessions.append(self._sessions.pop(0))
