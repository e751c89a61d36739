"""The handler pool: `concurrency` slots shared by every partition stream of one Consumer.

Each stream keeps its own local queue of deliveries waiting for a slot, in the pool's ledger
(ledger.py: the counts the pool and the streams share, changed only by its methods). When a
slot frees, the pool takes the next delivery from the stream with the fewest handlers running
right now (ties go round-robin), skipping a stream that runs as many as its cap (`Account.slots`,
set by the Consumer's rebalance, see credits.py: while several partitions have a backlog each
may run at most an even share of the slots). So a partition with a backlog of slow messages
cannot take the slots another partition's backlog needs, not even in the moments that
partition's queue is empty while its next deliveries are on the way (a plain
fewest-running-first choice would give such a slot to the slow backlog, for a whole slow
message): it never starves the others. A cap may leave a slot idle for that moment; that is
the price of the reservation.

Async handlers run in `concurrency` worker tasks on the event loop (no thread hop per
message: the fast path). Sync handlers run in a ThreadPoolExecutor of `concurrency` threads,
each running one drain job while deliveries are queued: it picks the next delivery when the
previous one is done (so the choice above is made when a slot frees, not when a delivery
arrives), and threads report results back to the loop in batches. Results go to the stream
they were delivered on, which batches them into Settle frames; a result whose stream broke
meanwhile (an older epoch) is dropped.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Any, cast

from triage_client.isolation import GATE
from triage_client.ledger import RELEASE, Account, Ledger, Result
from triage_client.message import Message
from triage_protocol import triage_pb2
from triage_protocol.constants import MAX_REASON_CHARS

__all__ = ["MAX_REASON_CHARS", "SETTLE_DELAY_S", "Handler", "HandlerPool", "nack_reason"]

logger = logging.getLogger(__name__)

Handler = Callable[[Message], Any] | Callable[[Message], Awaitable[Any]]
"""Returning acks the message; raising nacks it (raise `Retry`, or an exception the Consumer's
`retry_on` lists, to ask for redelivery)."""
_AsyncHandler = Callable[[Message], Awaitable[Any]]

SETTLE_DELAY_S = 0.002
"""Longest a settlement waits for company before it is sent (the streams' flush timer, and
the tick on which sync handlers' results are collected while they keep coming)."""


def nack_reason(exc: BaseException) -> str:
    """The nack reason for a handler's exception: `Type: message`, bounded and valid UTF-8."""
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 - a broken __str__ must not lose the nack
        text = f"{type(exc).__name__}: <unprintable>"
    if len(text) > MAX_REASON_CHARS:
        # cut to 3 characters short and "...", so the dead letter shows where it was cut
        text = text[: MAX_REASON_CHARS - 3] + "..."
    # protobuf strings must be valid UTF-8; lone surrogates would make the frame unsendable
    return text.encode("utf-8", "replace").decode("utf-8")


def _nack(
    offset: int, exc: BaseException, retry_on: tuple[type[BaseException], ...]
) -> triage_pb2.Nack:
    return triage_pb2.Nack(offset=offset, reason=nack_reason(exc), retry=isinstance(exc, retry_on))


def is_async(handler: Handler) -> bool:
    """True for a coroutine function, or an object whose class has an `async def __call__`."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        type(handler).__call__
    )


async def _await(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


class HandlerPool:
    """`concurrency` handler slots fed by every stream's local queue (see the module doc).

    Touched on the loop thread only, except where noted: in sync mode the handler threads
    pick deliveries and hand back results under the ledger's lock, which also guards the
    pool's own fields they share (jobs, results, the tick).
    """

    def __init__(
        self,
        handler: Handler,
        concurrency: int,
        retry_on: tuple[type[BaseException], ...],
        batch_limit: int,
    ) -> None:
        self._handler = handler
        self.is_async = is_async(handler)
        self._concurrency = concurrency
        self._retry_on = retry_on
        self._batch_limit = batch_limit
        self.stop_requested = False
        """Set by Consumer.stop() from any thread: handler threads stop starting deliveries."""
        self.ledger = Ledger()
        """What each stream has queued, running and finished (ledger.py)."""
        self.drained = asyncio.Event()
        """Set whenever `outstanding` drops to 0."""
        self._lock = self.ledger.lock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False  # workers exit when they see it
        # async handlers
        self._workers: list[asyncio.Task[None]] = []
        self._idle_workers: deque[asyncio.Future[None]] = deque()
        self._wakes_pending = 0
        self._deck_check_scheduled = False
        # sync handlers: threads append results here and wake the loop once per batch
        self._executor: ThreadPoolExecutor | None = None
        self._jobs = 0  # drain jobs submitted and not finished: at most `concurrency`
        self._results: list[Result] = []
        self._collect_scheduled = False
        self._tick: asyncio.TimerHandle | None = None  # the next collection tick (lock)
        self.on_idle: Callable[[], None] | None = None
        """Called on the loop once results show a slot found nothing queued (the Consumer's
        prefetch rule)."""
        self._awaiting_tick: dict[Account, None] = {}  # streams it is to flush

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # A hush ended: slots may start what waited. The gate reads the running count.
        GATE.listen(self, loop, self.kick, self._running)
        if self.is_async:
            self._workers = [
                loop.create_task(self._worker(), name=f"triage-handler-{i}")
                for i in range(self._concurrency)
            ]
        else:
            self._executor = ThreadPoolExecutor(self._concurrency, "triage-handler")

    async def close(self, clean: bool) -> None:
        """Idle workers exit when woken; after a failure, running ones are cancelled too."""
        self._closing = True
        GATE.unlisten(self)
        with self._lock:
            tick, self._tick = self._tick, None
        if tick is not None:
            tick.cancel()
        while self._idle_workers:
            fut = self._idle_workers.popleft()
            if not fut.done():
                fut.set_result(None)
        if not clean:
            for task in self._workers:
                task.cancel()
        if self._workers:
            await asyncio.gather(*self._workers, return_exceptions=True)
        if self._executor is not None:
            # After a clean run every thread is idle, so waiting is instant.
            self._executor.shutdown(wait=clean, cancel_futures=True)
        self._loop = None

    # -- the loop side ---------------------------------------------------------------------

    def _running(self) -> int:
        """Handlers running in the slots (any thread: one read of a count)."""
        return self.ledger.busy

    @property
    def outstanding(self) -> int:
        """Deliveries queued or running, of any stream and epoch."""
        return self.ledger.outstanding

    def submit(self, account: Account, messages: list[Message]) -> None:
        """Queue a stream's new deliveries for the slots (on the loop)."""
        if not messages:
            return
        if self._executor is None:
            self.ledger.queue(account, messages)
            if not self._wakes_pending:
                self._wake_worker()
            return
        ledger = self.ledger
        with self._lock:
            ledger.queue(account, messages)
            idle = min(self._concurrency - self._jobs, ledger.queued)
            self._jobs += idle
        for _ in range(idle):
            self._executor.submit(self._drain)

    def isolate(self, account: Account, messages: list[Message]) -> None:
        """Hold a stream's isolated deliveries back until their turn (`run_isolated`)."""
        self.ledger.hold(account, messages)

    def run_isolated(self, account: Account, message: Message) -> bool:
        """An isolated delivery's turn came and the proxy recorded it started: it takes the
        next free slot of its stream. False if its stream no longer holds it back."""
        if not self.ledger.admit(account, message):
            return False
        self.kick()
        return True

    def take_back(self, account: Account, *, next_epoch: bool = False) -> list[Message]:
        """Remove a stream's queued, unstarted deliveries (`Ledger.take_back`)."""
        taken = self.ledger.take_back(account, next_epoch=next_epoch)
        if not self.ledger.outstanding:
            self.drained.set()
        return taken

    def kick(self) -> None:
        """Caps were raised or a hush ended (on the loop): put idle slots to work on what
        they allow now."""
        queued = self.ledger.queued
        if not queued:
            return
        if self._executor is None:
            for _ in range(min(queued, len(self._idle_workers))):
                self._wake_worker()
            return
        with self._lock:
            idle = min(self._concurrency - self._jobs, self.ledger.queued)
            self._jobs += idle
        for _ in range(idle):
            self._executor.submit(self._drain)

    # -- async handlers: worker tasks on the loop ------------------------------------------

    def _wake_worker(self) -> None:
        idle = self._idle_workers
        while idle:
            fut = idle.popleft()
            if not fut.done():
                self._wakes_pending += 1
                fut.set_result(None)
                return

    def _check_deck(self) -> None:
        self._deck_check_scheduled = False
        if self.ledger.ready and not self._wakes_pending:
            self._wake_worker()

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        ledger = self.ledger
        ready = ledger.ready
        pick = ledger.pick
        finished = ledger.finished
        handler = cast(_AsyncHandler, self._handler)
        retry_on = self._retry_on
        streak = 0  # deliveries since this worker last waited for work: an idle counts after one
        unyielded = 0  # deliveries since this worker last gave the loop a turn
        while not self._closing:
            picked = pick() if ready else None
            if picked is None:
                if streak and not ledger.hushed:
                    ledger.idle()
                    if self.on_idle is not None:
                        self.on_idle()
                fut: asyncio.Future[None] = loop.create_future()
                self._idle_workers.append(fut)
                await fut
                if self._closing:
                    return
                self._wakes_pending -= 1
                streak = 0
                continue
            account, message = picked
            if ready and not self._deck_check_scheduled:
                # If this handler suspends, the rest of the queue needs another worker; checking
                # on the next loop turn costs nothing when handlers finish without suspending.
                self._deck_check_scheduled = True
                loop.call_soon(self._check_deck)
            epoch = account.epoch
            offset = message.offset
            running = account.running  # this epoch's: see Account.running
            nack = None
            try:
                await handler(message)
            except asyncio.CancelledError as exc:
                if task is not None and task.cancelling():
                    raise
                nack = _nack(offset, exc, retry_on)  # the handler's own, not ours
            except Exception as exc:  # noqa: BLE001 - raising is how a handler says nack
                nack = _nack(offset, exc, retry_on)
            except BaseException as exc:
                if not isinstance(exc, retry_on):
                    ledger.vacate(account, running, offset)  # no settlement: the lease lapses
                    raise
                nack = _nack(offset, exc, retry_on)
            account.stream.after_settle(finished(account, epoch, running, offset, nack))
            if not ledger.outstanding:
                self.drained.set()
            streak += 1
            unyielded += 1
            if unyielded >= self._batch_limit:
                # Handlers that never suspend would starve the reader and writer. (A counter
                # of its own: resetting `streak` here hid the idle that follows a queue of
                # exactly a multiple of the batch, so the default prefetch never grew.)
                unyielded = 0
                await asyncio.sleep(0)

    # -- sync handlers: a thread pool, results handed back in batches -----------------------

    def _drain(self) -> None:
        """A handler thread's job: run queued deliveries, each picked when the previous one
        is done (so the choice is made when a slot frees), until none is left. Reporting a
        result and picking the next take one lock acquisition."""
        lock = self._lock
        ledger = self.ledger
        with lock:
            picked = ledger.pick()
            if picked is None:
                self._jobs -= 1
                return
            account, message = picked
            epoch, running = account.epoch, account.running
        while True:
            offset = message.offset
            nack = self._run_sync(message, account, running)
            with lock:
                ledger.vacate(account, running, offset)
                results = self._results
                results.append((account, epoch, offset, nack))
                picked = ledger.pick()
                if picked is None:
                    self._jobs -= 1
                    if not ledger.hushed:
                        ledger.idle()
                else:
                    account, message = picked
                    epoch, running = account.epoch, account.running
                # While the loop's collection tick runs, a result waits for it, unless this
                # slot found nothing left to run (its refill is due) or the batch is full.
                wake = not self._collect_scheduled and (
                    self._tick is None or picked is None or len(results) >= self._batch_limit
                )
                if wake:
                    self._collect_scheduled = True
            loop = self._loop
            if wake and loop is not None:
                with suppress(RuntimeError):  # loop closed after a failed run(): nothing to do
                    loop.call_soon_threadsafe(self._collect)
            if picked is None:
                return

    def _run_sync(
        self, message: Message, account: Account, running: set[int]
    ) -> triage_pb2.Nack | None:
        """Runs in a handler thread: the handler's verdict on one delivery (None: ack)."""
        if self.stop_requested:
            return RELEASE  # queued behind stop(): give it back unstarted
        try:
            result = self._handler(message)
            if inspect.isawaitable(result) and (loop := self._loop) is not None:
                asyncio.run_coroutine_threadsafe(_await(result), loop).result()
        except Exception as exc:  # noqa: BLE001 - raising is how a handler says nack
            return _nack(message.offset, exc, self._retry_on)
        except BaseException as exc:
            if isinstance(exc, self._retry_on):
                return _nack(message.offset, exc, self._retry_on)
            with self._lock:
                self.ledger.vacate(account, running, message.offset)  # the lease lapses
                # this job ends here: another one takes over what is still queued
                replace = self.ledger.queued > 0 and self._executor is not None
                if not replace:
                    self._jobs -= 1
            if replace and self._executor is not None:
                self._executor.submit(self._drain)
            raise
        return None

    def _collect(self, due: bool = False) -> None:
        """Hand the threads' results to their streams (on the loop): woken by a thread, or
        by the tick (`due`: the results waited up to a tick, so they are sent now). While
        results keep coming and deliveries are outstanding the tick runs, so a stream need
        not arm a flush timer of its own: the next tick sends what it left."""
        with self._lock:
            results, self._results = self._results, []
            self._collect_scheduled = False
        touched = self._awaiting_tick
        if due:
            self._awaiting_tick = {}
        elif not results:
            return
        ledger = self.ledger
        ledger.collect(results, touched)
        if ledger.idled and self.on_idle is not None:
            self.on_idle()
        ticking = bool(results) and ledger.outstanding > 0 and not self._closing
        if ticking and self._tick is None and self._loop is not None:
            self._arm_tick()
        ticking = self._tick is not None
        waiting = self._awaiting_tick
        for account in touched:
            if account.stream.after_settle(not account.queued, due=due, timer=not ticking):
                waiting[account] = None  # its results wait for company: a later tick sends them
        if not ticking or due:
            touched.clear()
        if waiting and self._tick is None and self._loop is not None:
            self._arm_tick()
        if not ledger.outstanding:
            self.drained.set()

    def _arm_tick(self) -> None:
        """Collect again at the next multiple of SETTLE_DELAY_S on the loop's clock: the
        ticks of every Consumer sharing a loop fall together, one wake-up for all."""
        loop = self._loop
        assert loop is not None
        when = (math.floor(loop.time() / SETTLE_DELAY_S) + 1) * SETTLE_DELAY_S
        handle = loop.call_at(when, self._on_tick)
        with self._lock:
            self._tick = handle

    def _on_tick(self) -> None:
        with self._lock:
            self._tick = None
        self._collect(due=True)
