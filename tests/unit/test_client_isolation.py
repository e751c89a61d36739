"""The client's isolation gate (triage_client.isolation) and the ledger's held-back
deliveries: one isolated delivery at a time in the whole process, across streams and
across Consumers on other event loops."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, cast

import pytest

from triage_client import Message, isolation
from triage_client.isolation import GATE, IsolationGate, Ticket
from triage_client.ledger import Ledger
from triage_client.pool import HandlerPool


def message(offset: int) -> Message:
    return Message("t", 0, offset, None, b"", [], 0, 2)


def test_one_ticket_at_a_time_across_the_streams_of_a_process() -> None:
    gate = IsolationGate()
    turns: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        owners = ["p0", "p1", "p2"]
        tickets = [
            Ticket(owner, message(i), 0, loop, lambda t: turns.append(cast(str, t.owner)))
            for i, owner in enumerate(owners)
        ]
        for ticket in tickets:
            gate.enter(ticket)
        await asyncio.sleep(0)
        assert turns == ["p0"]  # the others wait, unstarted
        assert gate.holder is tickets[0]
        assert gate.waiting == 2
        gate.leave(tickets[1])  # not its turn: only out of the queue
        await asyncio.sleep(0)
        assert turns == ["p0"]
        gate.leave(tickets[0])
        await asyncio.sleep(0)
        assert turns == ["p0", "p2"]
        gate.leave(tickets[2])
        assert gate.holder is None

    asyncio.run(main())


def test_a_stream_that_ended_gives_up_its_turn_and_its_waiting_tickets() -> None:
    gate = IsolationGate()
    turns: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def on_turn(t: Ticket) -> None:
            turns.append(t.message.offset)

        a, b = object(), object()
        gate.enter(Ticket(a, message(1), 0, loop, on_turn))
        gate.enter(Ticket(a, message(2), 0, loop, on_turn))
        gate.enter(Ticket(b, message(3), 0, loop, on_turn))
        await asyncio.sleep(0)
        assert turns == [1]
        gate.drop(a)  # its connection ended: holder and waiting ticket go
        await asyncio.sleep(0)
        assert turns == [1, 3]
        gate.enter(Ticket(a, message(4), 0, loop, on_turn))
        gate.drop_waiting(a)  # stopping: waiting ones go, the holder stays
        assert gate.waiting == 0
        holder = gate.holder
        assert holder is not None
        assert holder.message.offset == 3

    asyncio.run(main())


def test_consumers_on_two_event_loops_never_run_two_isolated_deliveries_at_once() -> None:
    """Two Consumers of one process, each on its own loop thread, with 20 isolated
    deliveries each: each runs only in its turn, which passes on when it is done."""
    gate = IsolationGate()
    lock = threading.Lock()
    running = 0
    most = 0
    done: list[int] = []

    async def consumer(base: int) -> None:
        loop = asyncio.get_running_loop()
        finished = asyncio.Event()

        async def run(ticket: Ticket) -> None:
            nonlocal running, most
            with lock:
                running += 1
                most = max(most, running)
            await asyncio.sleep(0.001)  # the handler
            with lock:
                running -= 1
                done.append(ticket.message.offset)
                if sum(1 for o in done if o // 100 == base // 100) == 20:
                    finished.set()
            gate.leave(ticket)

        tasks: set[asyncio.Task[None]] = set()

        def on_turn(ticket: Ticket) -> None:
            task = loop.create_task(run(ticket))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        for i in range(20):
            gate.enter(Ticket(object(), message(base + i), 0, loop, on_turn))
        await asyncio.wait_for(finished.wait(), 60)

    threads = [threading.Thread(target=asyncio.run, args=(consumer(b),)) for b in (100, 200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert sorted(done) == [*range(100, 120), *range(200, 220)]
    assert most == 1


def test_a_ticket_whose_loop_closed_passes_the_turn_on() -> None:
    gate = IsolationGate()
    dead = asyncio.new_event_loop()
    dead.close()
    turns: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate.enter(Ticket(object(), message(1), 0, dead, lambda t: turns.append(1)))
        gate.enter(Ticket(object(), message(2), 0, loop, lambda t: turns.append(2)))
        await asyncio.sleep(0)

    asyncio.run(main())
    assert turns == [2]


def test_held_back_deliveries_are_leased_and_outstanding_and_go_first_when_admitted() -> None:
    ledger = Ledger()
    a = ledger.open(cast(Any, "a"))
    ledger.queue(a, [message(1), message(2)])
    held = message(7)
    ledger.hold(a, [held])
    assert (ledger.outstanding, a.outstanding, ledger.queued) == (3, 3, 2)
    assert ledger.leases(a) == [1, 2, 7]
    assert ledger.admit(a, held)
    assert not ledger.admit(a, held)  # once
    picked = ledger.pick()
    assert picked is not None
    assert picked[1] is held  # first in its stream's queue


def test_a_streams_take_back_includes_what_is_held_back_for_the_turn() -> None:
    ledger = Ledger()
    a = ledger.open(cast(Any, "a"))
    held = message(5)
    ledger.hold(a, [held])
    ledger.queue(a, [message(6)])
    taken = ledger.take_back(a, next_epoch=True)
    assert sorted(m.offset for m in taken) == [5, 6]
    assert (ledger.outstanding, a.outstanding, a.running) == (0, 0, set())
    assert not ledger.admit(a, held)  # given back: its turn passes on


def test_a_hushed_process_starts_only_its_isolated_delivery_until_it_leaves() -> None:
    """From an isolated delivery's turn until it leaves, no slot starts another delivery
    of any stream: a crash meanwhile is its own, or a handler's already running."""
    gate = IsolationGate()
    ledger = Ledger(gate)
    a, b = ledger.open(cast(Any, "a")), ledger.open(cast(Any, "b"))
    ledger.queue(a, [message(1)])
    ledger.queue(b, [message(2)])
    held = message(7)
    ledger.hold(a, [held])
    unhushed: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate.listen("pool", loop, lambda: unhushed.append("kick"))
        ticket = Ticket("a", held, 0, loop, gate.hush)
        gate.enter(ticket)
        await asyncio.sleep(0)  # its turn: hushed
        assert gate.hushed is held
        assert ledger.hushed
        assert ledger.pick() is None, "nothing else starts while the Started is on its way"
        assert ledger.admit(a, held)
        picked = ledger.pick()
        assert picked is not None
        assert picked[1] is held
        assert ledger.pick() is None, "nor while the isolated delivery runs"
        gate.leave(ticket)
        assert gate.hushed is None
        await asyncio.sleep(0)
        assert unhushed == ["kick"]
        picks = [ledger.pick(), ledger.pick()]
        assert sorted(p[1].offset for p in picks if p is not None) == [1, 2]

    asyncio.run(main())


def test_a_hush_ends_after_hush_s_while_a_slow_isolated_delivery_runs_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(isolation, "HUSH_S", 0.2)  # the bound's logic, not its length
    gate = IsolationGate()
    ledger = Ledger(gate)
    a = ledger.open(cast(Any, "a"))
    ledger.queue(a, [message(1)])

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ended = asyncio.Event()
        gate.listen("pool", loop, ended.set)
        ticket = Ticket("a", message(7), 0, loop, gate.hush)
        started = loop.time()
        gate.enter(ticket)
        await asyncio.wait_for(ended.wait(), 30)
        assert loop.time() - started >= isolation.HUSH_S
        assert gate.holder is ticket, "the turn stays with the slow delivery"
        picked = ledger.pick()
        assert picked is not None
        assert picked[1].offset == 1
        gate.unlisten("pool")

    asyncio.run(main())


@pytest.mark.parametrize("sync", [False, True], ids=["async handler", "sync handler"])
def test_a_pool_runs_no_other_handler_while_the_process_is_hushed(
    sync: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real pool and the process's gate: deliveries queued during the hush wait for the
    isolated one to leave, then run (sync handlers: threads that find the process hushed end
    their drain job, and the hush's end submits new ones). The hush outlasts the test (a
    busy machine must not see HUSH_S end it early)."""
    monkeypatch.setattr(isolation, "HUSH_S", 600.0)
    ran: list[int] = []
    lock = threading.Lock()
    isolated_ran = threading.Event()
    all_ran = threading.Event()

    def record(m: Message) -> None:
        with lock:
            ran.append(m.offset)
            if m.offset == 7:
                isolated_ran.set()
            if len(ran) == 4:
                all_ran.set()

    async def record_async(m: Message) -> None:
        record(m)

    class Stream:
        def after_settle(self, drained: bool, **_: Any) -> bool:
            return False

    async def main() -> None:
        loop = asyncio.get_running_loop()
        pool = HandlerPool(record if sync else record_async, 4, (), 16)
        pool.start(loop)
        account = pool.ledger.open(cast(Any, Stream()))
        held = message(7)
        pool.isolate(account, [held])
        ticket = Ticket("s", held, 0, loop, GATE.hush)
        GATE.enter(ticket)
        await asyncio.sleep(0)
        try:
            assert GATE.hushed is held
            pool.submit(account, [message(1), message(2), message(3)])
            assert pool.run_isolated(account, held)
            assert await asyncio.to_thread(isolated_ran.wait, 30)
            for _ in range(3):
                await asyncio.sleep(0)  # the workers' turns: they find nothing to start
            with lock:
                assert ran == [7]
            GATE.leave(ticket)
            assert await asyncio.to_thread(all_ran.wait, 30)
            assert sorted(ran) == [1, 2, 3, 7]
        finally:
            GATE.leave(ticket)
            await pool.close(clean=True)

    asyncio.run(main())


class _Writer:
    """A stream writer that records the Started frames it is asked to send."""

    def __init__(self) -> None:
        self.started_offsets: list[int] = []
        self.sent = asyncio.Event()

    def started(self, offset: int) -> None:
        self.started_offsets.append(offset)
        self.sent.set()


class _Stream:
    def __init__(self, pool: HandlerPool, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.call = object()  # connected
        self.account = pool.ledger.open(cast(Any, self))

    def after_settle(self, drained: bool, **_: Any) -> bool:
        return False


class _Context:
    def __init__(self, pool: HandlerPool) -> None:
        self.pool = pool
        self.stopping = asyncio.Event()


class _SlowNeighbour:
    """The real pool on the process's gate, one handler in it running until `release`,
    and a stream's turn whose Started frames `writer` records."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.release = asyncio.Event()
        self.began = asyncio.Event()
        self.pool = HandlerPool(self._handler, 4, (), 16)
        self.pool.start(loop)
        self.stream = _Stream(self.pool, loop)
        self.writer = _Writer()
        context = cast(Any, _Context(self.pool))
        self.turn = isolation.StreamTurn(cast(Any, self.stream), context, cast(Any, self.writer))

    async def _handler(self, m: Message) -> None:
        self.began.set()
        await self.release.wait()

    async def __aenter__(self) -> _SlowNeighbour:
        self.pool.submit(self.stream.account, [message(1)])
        await asyncio.wait_for(self.began.wait(), 30)
        return self

    async def __aexit__(self, *_: object) -> None:
        self.release.set()
        self.turn.give_back()
        if GATE.holder is not None:
            GATE.leave(GATE.holder)
        await self.pool.close(clean=True)


def test_an_isolated_deliverys_started_waits_for_the_handlers_already_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A crash pill already running when a suspect's turn comes (not isolated: its first
    delivery) may crash the process late: the suspect's Started waits until no handler
    runs, so that crash cannot be blamed on it. The real pool and the process's gate."""
    monkeypatch.setattr(isolation, "HUSH_S", 600.0)  # no deadline within the test
    polls = 0
    polled = asyncio.Event()
    quiet = GATE.quiet

    def counting_quiet() -> bool:
        nonlocal polls
        polls += 1
        if polls >= 3:
            polled.set()
        return quiet()

    monkeypatch.setattr(GATE, "quiet", counting_quiet)

    async def main() -> None:
        async with _SlowNeighbour(asyncio.get_running_loop()) as it:
            it.turn.isolate([message(7)], [7])
            await asyncio.wait_for(polled.wait(), 30)  # it looked, and found one running
            assert it.writer.started_offsets == []
            assert GATE.hushed is not None, "nothing new starts meanwhile"
            it.release.set()  # the running handler ends: the Started goes out
            await asyncio.wait_for(it.writer.sent.wait(), 30)
            assert it.writer.started_offsets == [7]

    asyncio.run(main())


def test_an_isolated_deliverys_started_waits_no_longer_than_hush_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A handler that runs on (a slow one, or a hung one) holds the Started back for HUSH_S
    at most: the suspect is not starved."""
    monkeypatch.setattr(isolation, "HUSH_S", 0.2)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with _SlowNeighbour(loop) as it:
            turned = loop.time()
            it.turn.isolate([message(7)], [7])
            await asyncio.wait_for(it.writer.sent.wait(), 30)
            assert loop.time() - turned >= isolation.HUSH_S
            assert it.writer.started_offsets == [7]
            assert it.pool.ledger.busy == 1, "the slow handler still runs"

    asyncio.run(main())
