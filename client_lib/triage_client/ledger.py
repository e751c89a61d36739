"""The ledger of one Consumer's deliveries in hand: for each stream, what waits for a handler
slot, what runs, and what finished and waits to be sent in a Settle or Release.

The handler pool owns the ledger; the streams and the Consumer ask it. A delivery's life is a
sequence of ledger calls:

    stream's Deliveries -> pool.submit -> queue()        queued, leased, outstanding
    (an isolated one)   -> pool.isolate -> hold()        held back (isolation.py), leased,
                           its turn: pool.run_isolated    outstanding; then queued first
                           -> admit()
    a slot frees        -> pick()                        running (busy)
    handler done        -> finished() (async handlers)   acks / nacks, no longer outstanding
                           vacate() + collect() (sync handlers: the result reaches the loop
                           in a batch, after the slot is already free)
    stream's writer     -> take_settlements() / take_releases()

Why one object: the pool and the stream both need these counts (the pool to choose the next
delivery and to know when everything drained, the stream to batch settlements, list leases
and stop), and when each changed the other's fields no one place said what the counts mean
or kept them consistent. Here only the ledger's methods change them; anyone may read an
`Account`'s fields.

Costs: the per-delivery calls (`pick`, `finished`, `vacate`) work on the `Account` the caller
already holds: no allocation and no lookup per delivery, only the call itself (tens of
nanoseconds, beside the ~800 ns the pool spends per delivery of a no-op handler).

Threads: with sync handlers, handler threads call `pick`, `vacate` and `idle` under `lock`
(the pool takes it once per result, together with its own thread-shared fields); the methods
the streams and the Consumer call on the loop (`take_back`, `leases`, `set_slots`,
`take_idled`) take it themselves. Everything else runs on the loop.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from triage_client.isolation import GATE, IsolationGate
from triage_client.message import Message
from triage_protocol import triage_pb2

if TYPE_CHECKING:
    from triage_client.stream import PartitionStream

__all__ = ["RELEASE", "UNCAPPED", "Account", "Ledger"]

UNCAPPED = 1 << 30
"""A stream's slot cap until a rebalance sets one: no cap."""
RELEASE = triage_pb2.Nack()
"""Result of a delivery a handler thread let go unstarted because of stop()."""

Result = tuple["Account", int, int, triage_pb2.Nack | None]
"""A handler thread's result on its way to the loop: (account, epoch, offset, nack or None)."""


class Account:
    """One stream's entries in the ledger. Read by anyone; changed only by `Ledger`."""

    __slots__ = (
        "acks",
        "busy",
        "dropped",
        "epoch",
        "held_back",
        "nacks",
        "outstanding",
        "queued",
        "releases",
        "running",
        "slots",
        "stream",
    )

    def __init__(self, stream: PartitionStream) -> None:
        self.stream = stream
        """The stream the entries are for (the pool tells it when results arrive)."""
        self.epoch = 0
        """Bumped when the stream's connection ends: results of handlers started before are
        stale (read by handler threads under the lock)."""
        self.outstanding = 0
        """Deliveries of the current epoch queued or running."""
        self.queued: deque[Message] = deque()
        """Deliveries waiting for a handler slot."""
        self.held_back: list[Message] = []
        """Isolated deliveries waiting for the process's turn (isolation.py): leased and
        outstanding, not queued for a slot."""
        self.busy = 0
        """Handlers running in the pool's slots for this stream, any epoch."""
        self.slots = UNCAPPED
        """Most handlers of this stream the pool runs at once (credits.py)."""
        self.running: set[int] = set()
        """Offsets the stream holds, running or queued: the next Extend lists them. A new
        epoch gets a new set, and a handler removes its offset from the set it started in,
        so one that outlives its connection never touches the next one's leases (even when
        the proxy redelivers its offset there)."""
        self.acks: list[int] = []
        """Offsets handled and not yet sent in a Settle."""
        self.nacks: list[triage_pb2.Nack] = []
        """Nacks not yet sent in a Settle."""
        self.releases: list[int] = []
        """Deliveries given back unstarted at stop(), not yet sent in a Release."""
        self.dropped = 0
        """Results the ledger dropped: a handler finished after its connection ended (the
        proxy redelivers it), or a handler thread gave its delivery back at stop()."""


class Ledger:
    """The counts the handler pool and its streams share (see the module doc)."""

    def __init__(self, gate: IsolationGate = GATE) -> None:
        self._gate = gate
        """While it is hushed for an isolated delivery, `pick` starts only that one."""
        self._admitted: Account | None = None
        """The stream whose queue an isolated delivery was last admitted to the front of."""
        self.lock = threading.Lock()
        """Guards what handler threads touch (see the module doc)."""
        self.outstanding = 0
        """Deliveries queued or running, of any stream and epoch."""
        self.queued = 0
        """Deliveries in the streams' queues."""
        self.ready: list[Account] = []
        """Accounts with queued deliveries."""
        self.idled = 0
        """Times a slot found nothing queued after a delivery, since `take_idled`."""
        self.busy = 0
        """Handlers running in the pool's slots, of any stream and epoch (the isolation
        gate waits for none to run before an isolated delivery's Started)."""
        self._turn = 0  # where the next tie-break starts, for round-robin among equals

    def open(self, stream: PartitionStream) -> Account:
        """A new stream's account."""
        return Account(stream)

    # -- the pool's side -------------------------------------------------------------------

    def queue(self, account: Account, messages: list[Message]) -> None:
        """A stream's new deliveries wait for a slot. Leases cover queued deliveries too:
        they are in this instance's hands and start as soon as a slot frees, however long
        the running ones take."""
        count = len(messages)
        if not count:
            return  # an empty queue must not be ready
        self.outstanding += count
        account.outstanding += count
        account.running.update(message.offset for message in messages)
        if not account.queued:
            self.ready.append(account)
        account.queued.extend(messages)
        self.queued += count

    def hold(self, account: Account, messages: list[Message]) -> None:
        """A stream's isolated deliveries wait for their turn (isolation.py), leased and
        outstanding like queued ones, but no slot picks them until `admit`."""
        count = len(messages)
        self.outstanding += count
        account.outstanding += count
        account.running.update(message.offset for message in messages)
        account.held_back.extend(messages)

    def admit(self, account: Account, message: Message) -> bool:
        """An isolated delivery's turn came: it goes first in its stream's queue. False when
        it is no longer held back (its stream gave it back or its connection ended)."""
        with self.lock:
            held_back = account.held_back
            for i, candidate in enumerate(held_back):
                if candidate is message:
                    del held_back[i]
                    break
            else:
                return False
            if not account.queued:
                self.ready.append(account)
            account.queued.appendleft(message)
            self.queued += 1
            self._admitted = account
        return True

    @property
    def hushed(self) -> bool:
        """The process is hushed for an isolated delivery (isolation.py): a slot that finds
        nothing to start is not idle for want of deliveries."""
        return self._gate.hushed is not None

    def pick(self) -> tuple[Account, Message] | None:
        """The next delivery for a free slot, counted as running: from the stream with the
        fewest running handlers among those under their cap, ties round-robin; None when
        every stream with queued deliveries is at its cap (or none has any). While the
        process is hushed for an isolated delivery, only that one, if it is queued here."""
        hushed = self._gate.hushed
        if hushed is not None:
            return self._pick_hushed(hushed)
        ready = self.ready
        count = len(ready)
        if count == 1:
            index = 0
            if ready[0].busy >= ready[0].slots:
                return None
        elif count:
            index = self._turn % count
            if ready[index].busy:  # else: none runs fewer, and it is first in turn
                start = index
                index = -1
                fewest = 1 << 62
                for step in range(count):
                    i = (start + step) % count
                    candidate = ready[i]
                    busy = candidate.busy
                    if busy < fewest and busy < candidate.slots:
                        index, fewest = i, busy
                        if not busy:
                            break  # none runs fewer, and the first in turn wins a tie
            if index < 0:
                return None
            self._turn = index + 1
        else:
            return None
        account = ready[index]
        queued = account.queued
        message = queued.popleft()
        self.queued -= 1
        if not queued:
            del ready[index]
        account.busy += 1
        self.busy += 1
        return account, message

    def _pick_hushed(self, hushed: Message) -> tuple[Account, Message] | None:
        account = self._admitted
        if account is None or not account.queued or account.queued[0] is not hushed:
            return None
        message = account.queued.popleft()
        self.queued -= 1
        if not account.queued:
            self.ready.remove(account)
        account.busy += 1
        self.busy += 1
        return account, message

    def finished(
        self,
        account: Account,
        epoch: int,
        running: set[int],
        offset: int,
        nack: triage_pb2.Nack | None,
    ) -> bool:
        """A handler on the loop is done with `offset`, picked at `epoch` with the lease set
        `running`: its slot frees and its result waits to be sent (None: ack), unless its
        connection ended meanwhile. True when the stream has nothing queued behind it."""
        running.discard(offset)
        account.busy -= 1
        self.busy -= 1
        self.outstanding -= 1
        if epoch != account.epoch:
            account.dropped += 1  # its connection ended: the proxy redelivers it
        else:
            account.outstanding -= 1
            if nack is None:
                account.acks.append(offset)
            else:
                account.nacks.append(nack)
        return not account.queued

    def vacate(self, account: Account, running: set[int], offset: int) -> None:
        """A handler's slot frees before its result is counted: a handler thread's result
        follows in `collect`; a handler that raised past the pool has none (its lease
        lapses and the proxy redelivers it)."""
        running.discard(offset)
        account.busy -= 1
        self.busy -= 1

    def idle(self) -> None:
        """A slot found nothing queued after a delivery."""
        self.idled += 1

    def collect(self, results: Sequence[Result], touched: dict[Account, None]) -> None:
        """Handler threads' results reach the loop: each waits to be sent (a RELEASE to be
        released), unless its connection ended meanwhile; their accounts are added to
        `touched`."""
        for account, epoch, offset, nack in results:
            touched[account] = None
            if epoch != account.epoch:
                account.dropped += 1  # its connection ended: the proxy redelivers it
                continue
            account.outstanding -= 1
            if nack is None:
                account.acks.append(offset)
            elif nack is RELEASE:
                account.dropped += 1
                account.releases.append(offset)
            else:
                account.nacks.append(nack)
        self.outstanding -= len(results)

    # -- the stream's side -----------------------------------------------------------------

    def take_back(self, account: Account, *, next_epoch: bool = False) -> list[Message]:
        """Remove a stream's queued and held-back, unstarted deliveries: at stop(), or, with
        `next_epoch`, because its connection ended; then, in one step, results of handlers
        still running on it are marked stale and the next connection gets a fresh lease
        set."""
        with self.lock:
            if next_epoch:
                account.epoch += 1
                account.running = set()
            taken = list(account.queued)
            if taken:
                self.queued -= len(taken)
                account.queued.clear()
                self.ready.remove(account)
            if account.held_back:
                taken.extend(account.held_back)
                account.held_back = []
            if taken:
                account.running.difference_update(message.offset for message in taken)
        self.outstanding -= len(taken)
        # handlers still running belong to the ended epoch now
        account.outstanding = 0 if next_epoch else account.outstanding - len(taken)
        return taken

    def forget(self, account: Account) -> int:
        """The stream's connection ended: its unsent results go (the proxy redelivers what
        it held); how many acks and nacks were dropped."""
        unsent = len(account.acks) + len(account.nacks)
        account.acks = []
        account.nacks = []
        account.releases = []
        return unsent

    def release(self, account: Account, offsets: Iterable[int]) -> None:
        """Deliveries the stream gives back unstarted (stop()): the next Release lists them."""
        account.releases.extend(offsets)

    def take_releases(self, account: Account) -> list[int]:
        """The offsets for the stream's next Release frame."""
        releases, account.releases = account.releases, []
        return releases

    def take_settlements(self, account: Account) -> tuple[list[int], list[triage_pb2.Nack]]:
        """The acks and nacks for the stream's next Settle frame."""
        acks, nacks = account.acks, account.nacks
        account.acks, account.nacks = [], []
        return acks, nacks

    def leases(self, account: Account) -> list[int]:
        """The offsets the stream holds right now, in order, for an Extend."""
        with self.lock:
            return sorted(account.running)

    # -- the Consumer's side ---------------------------------------------------------------

    def set_slots(self, accounts: Sequence[Account], slots: Sequence[int]) -> bool:
        """New slot caps from a rebalance, one per account; True when one was raised (idle
        slots may take what it allows now)."""
        raised = False
        with self.lock:
            for account, cap in zip(accounts, slots, strict=True):
                raised = raised or cap > account.slots
                account.slots = cap
        return raised

    def take_idled(self) -> int:
        """How many times a slot found nothing queued after finishing a delivery, since the
        last call: the Consumer's prefetch rule reads it (credits.grown)."""
        with self.lock:
            idled, self.idled = self.idled, 0
        return idled
