"""The consumer: one gRPC stream to the proxy, many concurrent handlers, batched settlements.

How a delivery flows:

    reader  --Deliveries-->  local queue  -->  `concurrency` handler slots
    handler returns / raises  -->  ack / nack batch  --Settle-->  proxy (the writer)

The proxy keeps at most `credits = concurrency + prefetch` unsettled deliveries at this
instance, so a free handler slot finds the next message already queued instead of idling
for a round trip, and a slow message only ever occupies its own slot. Async handlers run in
`concurrency` worker tasks on the event loop (no thread hop per message: the fast path);
sync handlers run in a ThreadPoolExecutor and report back to the loop in batches.
Settlements go out when the batch is large, after a short delay, or when the local queue
drains (the moment the proxy's next batch is needed).

A broken stream is reopened with capped, jittered backoff. Each stream is an epoch: results
of handlers that started on an earlier stream are dropped and counted, never settled on the
new stream, because the proxy redelivers whatever the broken stream held.

Leases: the proxy redelivers a delivery left unsettled for the Welcome's `ack_deadline_ms`.
Every third of that deadline one Extend frame lists the offsets this instance holds right
then (running or queued for a handler slot, not yet settled), so long work keeps its lease
and so do the deliveries queued behind it (as Pub/Sub's client does); a per-stream ticker
task asks for it and the writer builds and sends it, so frames never interleave and an
offset is never extended after its settlement was sent. A delivery whose instance dies or
hangs its event loop stops being extended and is redelivered after the deadline.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
import os
import random
import socket
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Any, TypeAlias, cast

import grpc

from triage_client._proto import triage_pb2
from triage_client.errors import Retry, StateError, error_for_status
from triage_client.message import ConsumerStats, Message, make_message

__all__ = ["Consumer", "Handler", "backoff_delay"]

logger = logging.getLogger(__name__)

Handler = Callable[[Message], Any] | Callable[[Message], Awaitable[Any]]
"""Returning acks the message; raising nacks it (raise `Retry`, or an exception the Consumer's
`retry_on` lists, to ask for redelivery)."""
_AsyncHandler = Callable[[Message], Awaitable[Any]]
# grpc.aio's classes are generic only in the type stubs, hence the string.
_Call: TypeAlias = "grpc.aio.StreamStreamCall[triage_pb2.ConsumerFrame, triage_pb2.ProxyFrame]"
_Consume: TypeAlias = (
    "grpc.aio.StreamStreamMultiCallable[triage_pb2.ConsumerFrame, triage_pb2.ProxyFrame]"
)

DEFAULT_CONCURRENCY = 16
DEFAULT_MAX_BACKOFF_S = 5.0
INITIAL_BACKOFF_S = 0.05
SETTLE_BATCH = 256
"""Settlements that are sent at once without waiting for the queue to drain (measured: one
Settle per drained batch beats sending half-batches early, which costs CPU for no gain)."""
SETTLE_DELAY_S = 0.002
"""Longest a settlement waits for company before it is sent."""
MAX_REASON_CHARS = 1000
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CLOSE_TIMEOUT_S = 5.0
"""How long stop() waits for the proxy to end the stream after the half-close."""

_SERVICE = triage_pb2.DESCRIPTOR.services_by_name["Triage"]
_CONSUME = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['Consume'].name}"
_MAX_CREDITS = 2**32 - 1  # Hello.credits is a uint32
_SKIPPED = -1  # epoch of a delivery a handler thread let go because its stream died
_RELEASE = triage_pb2.Nack()  # result of a delivery a handler thread let go because of stop()


class _State(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    STOPPED = "stopped"


def backoff_delay(
    failures: int,
    *,
    initial: float = INITIAL_BACKOFF_S,
    cap: float = DEFAULT_MAX_BACKOFF_S,
    rand: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait before reconnect number `failures` (0-based): exponential, capped,
    with jitter over the upper half so many instances do not reconnect in lockstep."""
    ceiling = min(cap, initial * 2.0 ** min(failures, 32))
    return ceiling / 2 + ceiling / 2 * rand()


def _reason(exc: BaseException) -> str:
    """The nack reason for a handler's exception: `Type: message`, bounded and valid UTF-8."""
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 - a broken __str__ must not lose the nack
        text = f"{type(exc).__name__}: <unprintable>"
    if len(text) > MAX_REASON_CHARS:
        text = text[: MAX_REASON_CHARS - 3] + "..."
    # protobuf strings must be valid UTF-8; lone surrogates would make the frame unsendable
    return text.encode("utf-8", "replace").decode("utf-8")


def _nack(
    offset: int, exc: BaseException, retry_on: tuple[type[BaseException], ...]
) -> triage_pb2.Nack:
    return triage_pb2.Nack(offset=offset, reason=_reason(exc), retry=isinstance(exc, retry_on))


def _is_async(handler: Handler) -> bool:
    # type(...).__call__ catches instances of classes with an `async def __call__`
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        type(handler).__call__
    )


async def _await(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


class Consumer:
    """Consumes one proxy's deliveries with a handler: return to ack, raise to nack.

    `run()` blocks until `stop()`; `run_async()` does the same in the caller's event loop.
    A Consumer runs once. Shutdown order on stop(): stop taking deliveries (queued ones are
    released for the proxy to redeliver) -> wait for running handlers -> send their
    settlements -> half-close the stream -> wait for the proxy to end it -> return.

    A handler that raises `Retry`, or an instance of a class in `retry_on`, nacks with
    retry=True: the proxy redelivers the message after its backoff (until its attempt limit).
    Any other exception nacks with retry=False: the proxy dead-letters the message now.
    While a delivery is in this instance's hands (running or queued), its lease is extended
    automatically every third of the proxy's ack deadline (see the module docstring).
    """

    def __init__(
        self,
        target: str,
        token: str,
        handler: Handler,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        prefetch: int | None = None,
        consumer_id: str | None = None,
        secure: bool = False,
        max_backoff: float = DEFAULT_MAX_BACKOFF_S,
        retry_on: tuple[type[BaseException], ...] = (),
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
    ) -> None:
        """Configure, without connecting.

        concurrency: most handlers running at once (threads for a sync handler).
        prefetch: deliveries queued locally beyond the running ones (default: concurrency),
            so handlers never wait for a round trip; credits = concurrency + prefetch.
        consumer_id: stable instance name recorded on dead letters (default: host-pid).
        secure: TLS with the system's root certificates (default: plaintext).
        max_backoff: longest wait, in seconds, between reconnect attempts.
        retry_on: exception classes (subclasses included) that nack with retry=True, as
            `Retry` always does, e.g. `(TimeoutError, ConnectionError)` for a flaky downstream.
        root_certificates: PEM bytes of the CA that signed the proxy's certificate, for a
            private CA (implies TLS).
        certificate_chain, private_key: PEM bytes of this app's client certificate and its
            key, for a proxy that requires client certificates (mTLS; implies TLS).
        """
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        prefetch = concurrency if prefetch is None else prefetch
        if prefetch < 0:
            raise ValueError(f"prefetch must not be negative, got {prefetch}")
        if concurrency + prefetch > _MAX_CREDITS:
            raise ValueError("concurrency + prefetch does not fit the protocol's uint32 credits")
        if max_backoff <= 0:
            raise ValueError(f"max_backoff must be positive, got {max_backoff}")
        for cls in retry_on:
            if not (isinstance(cls, type) and issubclass(cls, BaseException)):
                raise TypeError(f"retry_on takes exception classes, got {cls!r}")
        if (certificate_chain is None) != (private_key is None):
            raise ValueError("give certificate_chain and private_key together")
        self._target = target
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._handler = handler
        self._async = _is_async(handler)
        self._concurrency = concurrency
        self._credits = concurrency + prefetch
        self._batch_limit = min(SETTLE_BATCH, self._credits)
        self._consumer_id = consumer_id or f"{socket.gethostname()}-{os.getpid()}"
        self._credentials: grpc.ChannelCredentials | None = None
        if secure or root_certificates or certificate_chain:
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates, private_key, certificate_chain
            )
        self._max_backoff = max_backoff
        self._retry_on: tuple[type[BaseException], ...] = (Retry, *retry_on)

        self._state = _State.IDLE
        # stop() may run on any thread or in a signal handler: it only sets this flag and
        # schedules _begin_stop on the loop (no locks, which a signal handler could deadlock on).
        self._stop_requested = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = asyncio.Event()
        self._closing = False  # workers exit when they see it

        # Everything below is touched only on the loop thread, except where noted.
        self._epoch = 0  # read by handler threads
        self._call: _Call | None = None
        self._established = False
        self._held = 0  # delivered on this stream and not yet settled
        self._over_warned = False
        self._outstanding = 0  # queued or running handlers, any epoch
        self._drained = asyncio.Event()  # set whenever _outstanding drops to 0
        self._acks: list[int] = []
        self._nacks: list[triage_pb2.Nack] = []
        self._releases: list[int] = []
        """Deliveries given back unstarted at stop(): sent as Release, no attempt used."""
        self._flush_wanted = asyncio.Event()
        self._flush_timer: asyncio.TimerHandle | None = None
        self._running: set[int] = set()
        """Offsets whose handlers run on this stream: the next Extend lists them. Handler
        threads change it under _results_lock. A new stream gets a new set, and a handler
        removes its offset from the set it started in, so one that outlives its stream never
        touches the next stream's leases (even when that stream redelivers its offset)."""
        self._extend_due = False  # the ticker asked the writer for an Extend
        # async handlers
        self._pending: deque[Message] = deque()
        self._idle_workers: deque[asyncio.Future[None]] = deque()
        self._wakes_pending = 0
        self._deck_check_scheduled = False
        # sync handlers: threads append results here and wake the loop once per batch
        self._pool: ThreadPoolExecutor | None = None
        self._results_lock = threading.Lock()
        self._results: list[tuple[int, int, triage_pb2.Nack | None]] = []
        self._collect_scheduled = False

        self._delivered = 0
        self._acked = 0
        self._nacked = 0
        self._rejected = 0
        self._dropped = 0
        self._streams = 0
        self._extended = 0

    @property
    def consumer_id(self) -> str:
        """The name this instance gives the proxy."""
        return self._consumer_id

    @property
    def credits(self) -> int:
        """Most unsettled deliveries the proxy may send this instance."""
        return self._credits

    @property
    def stats(self) -> ConsumerStats:
        """Counters since creation (a snapshot; safe to read from any thread)."""
        return ConsumerStats(
            delivered=self._delivered,
            acked=self._acked,
            nacked=self._nacked,
            rejected=self._rejected,
            dropped=self._dropped,
            reconnects=max(0, self._streams - 1),
            extended=self._extended,
        )

    # -- lifecycle -------------------------------------------------------------------------

    def run(self) -> None:
        """Consume until stop(); blocks this thread, which must not be running an event loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(self.run_async())
        else:
            raise StateError("run() blocks; inside an event loop use `await run_async()`")

    async def run_async(self) -> None:
        """Consume until stop(), in the running event loop.

        Raises AuthenticationError (or another StreamError) when the proxy refuses the
        stream for good; transient failures are retried, never raised.
        """
        if self._state is not _State.IDLE:
            raise StateError("a Consumer runs once; create a new one")
        self._state = _State.RUNNING
        loop = asyncio.get_running_loop()
        self._loop = loop
        if self._stop_requested:  # stop() ran before run(): it could not reach the loop
            self._begin_stop()
        logger.info(
            "consumer %s starting: target %s, concurrency %d, credits %d, %s handler",
            self._consumer_id,
            self._target,
            self._concurrency,
            self._credits,
            "async" if self._async else "sync",
        )
        workers: list[asyncio.Task[None]] = []
        clean = False
        channel = self._open_channel()
        try:
            if self._async:
                workers = [
                    loop.create_task(self._worker(), name=f"triage-handler-{i}")
                    for i in range(self._concurrency)
                ]
            else:
                self._pool = ThreadPoolExecutor(self._concurrency, "triage-handler")
            consume: _Consume = channel.stream_stream(
                _CONSUME,
                request_serializer=triage_pb2.ConsumerFrame.SerializeToString,
                response_deserializer=triage_pb2.ProxyFrame.FromString,
            )
            await self._reconnect_loop(consume)
            # Handlers that outlived a broken stream: run() never returns under running user code.
            while self._outstanding:
                self._drained.clear()
                await self._drained.wait()
            clean = True
        finally:
            self._loop = None
            self._state = _State.STOPPED
            await self._close_handlers(workers, clean)
            await channel.close()
            logger.info("consumer %s stopped", self._consumer_id)

    def stop(self) -> None:
        """Ask run() to finish: safe from any thread, a signal handler or a handler; idempotent.

        Returns at once; run() returns once running handlers have finished and their
        settlements were sent.
        """
        self._stop_requested = True
        loop = self._loop
        if loop is None:
            return
        with suppress(RuntimeError):  # the loop already closed: run() has returned
            loop.call_soon_threadsafe(self._begin_stop)

    def _begin_stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        released = len(self._pending)
        self._releases.extend(message.offset for message in self._pending)
        with self._results_lock:
            self._running.difference_update(message.offset for message in self._pending)
        self._pending.clear()
        self._outstanding -= released
        self._dropped += released
        logger.info(
            "consumer %s stopping: %d deliveries in flight, %d queued ones released",
            self._consumer_id,
            self._outstanding,
            released,
        )
        if self._call is not None and not self._established:
            self._call.cancel()  # nothing to settle yet: do not wait for a slow connect
        if not self._outstanding:
            self._drained.set()
        self._flush_wanted.set()

    async def _close_handlers(self, workers: list[asyncio.Task[None]], clean: bool) -> None:
        """Idle workers exit when woken; after a failure, running ones are cancelled too."""
        self._closing = True
        while self._idle_workers:
            fut = self._idle_workers.popleft()
            if not fut.done():
                fut.set_result(None)
        if not clean:
            for task in workers:
                task.cancel()
        if workers:
            await asyncio.gather(*workers, return_exceptions=True)
        if self._pool is not None:
            # After a clean run every thread is idle, so waiting is instant.
            self._pool.shutdown(wait=clean, cancel_futures=True)
        logger.debug("consumer %s: handler slots closed", self._consumer_id)

    def _open_channel(self) -> grpc.aio.Channel:
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # gRPC's own reconnect backoff defaults to 1 s growing to 120 s; keep it in step
            # with ours so a restarted proxy is found again within max_backoff.
            ("grpc.initial_reconnect_backoff_ms", int(INITIAL_BACKOFF_S * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(self._max_backoff * 1000)),
        ]
        if self._credentials is not None:
            return grpc.aio.secure_channel(self._target, self._credentials, options)
        return grpc.aio.insecure_channel(self._target, options)

    # -- streams ---------------------------------------------------------------------------

    async def _reconnect_loop(self, consume: _Consume) -> None:
        failures = 0
        while not self._stopping.is_set():
            try:
                await self._stream(consume)
            except grpc.aio.AioRpcError as exc:
                if self._stopping.is_set():
                    break
                error = error_for_status(exc.code(), exc.details())
                if error is not None:
                    raise error from exc
                problem = f"{exc.code().name}: {exc.details()}"
            else:
                if self._stopping.is_set():
                    break
                problem = "the proxy ended the stream"
            finally:
                self._end_stream()
            failures = 0 if self._established else failures + 1
            delay = backoff_delay(failures, cap=self._max_backoff)
            logger.warning(
                "consumer %s: stream to %s lost (%s); reconnecting in %.2f s",
                self._consumer_id,
                self._target,
                problem,
                delay,
            )
            with suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)

    async def _stream(self, consume: _Consume) -> None:
        """One stream, from Hello to its end; the reader owns the outcome."""
        self._streams += 1
        self._established = False
        self._over_warned = False
        self._flush_wanted.clear()
        call = consume(metadata=self._metadata)
        self._call = call
        loop = asyncio.get_running_loop()
        deadline_ms: asyncio.Future[int] = loop.create_future()  # the Welcome's ack deadline
        writer = loop.create_task(self._write_loop(call), name="triage-writer")
        ticker = loop.create_task(self._extend_loop(deadline_ms), name="triage-extender")
        try:
            await self._read_loop(call, deadline_ms)
        finally:
            writer.cancel()
            ticker.cancel()
            await asyncio.wait([writer, ticker])
            call.cancel()
            if not ticker.cancelled() and (bug := ticker.exception()) is not None:
                raise bug
            if not writer.cancelled():
                exc = writer.exception()
                # A failed write also fails the read, which reports it; anything else is a bug.
                if exc is not None and not isinstance(
                    exc, grpc.aio.AioRpcError | asyncio.InvalidStateError
                ):
                    raise exc

    def _end_stream(self) -> None:
        """Forget what the dead stream held: the proxy redelivers all of it."""
        self._epoch += 1
        self._call = None
        released = len(self._pending)
        self._pending.clear()
        self._outstanding -= released
        unsent = len(self._acks) + len(self._nacks)
        self._acks = []
        self._nacks = []
        self._releases = []
        self._running = set()
        self._extend_due = False
        self._dropped += released + unsent
        self._held = 0
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if released or unsent:
            logger.debug(
                "consumer %s: dropped %d queued deliveries and %d unsent settlements",
                self._consumer_id,
                released,
                unsent,
            )
        if not self._outstanding:
            self._drained.set()

    async def _read_loop(self, call: _Call, deadline_ms: asyncio.Future[int]) -> None:
        task = asyncio.current_task()
        while True:
            try:
                frame = await call.read()
            except asyncio.CancelledError:
                # grpc.aio raises CancelledError when *we* cancelled the call (stop() before
                # Welcome, a failed writer, the close timeout); that ends this stream normally.
                if task is None or task.cancelling():
                    raise
                return
            if not isinstance(frame, triage_pb2.ProxyFrame):  # EOF: the proxy ended the stream
                return
            kind = frame.WhichOneof("frame")
            if kind == "deliveries":
                self._on_deliveries(frame.deliveries)
            elif kind == "rejected":
                self._rejected += len(frame.rejected.offsets)
                logger.warning(
                    "consumer %s: proxy rejected %d settlements: %s",
                    self._consumer_id,
                    len(frame.rejected.offsets),
                    frame.rejected.reason,
                )
            elif kind == "welcome":
                self._established = True
                welcome = frame.welcome
                if not deadline_ms.done():
                    deadline_ms.set_result(welcome.ack_deadline_ms)
                logger.info(
                    "consumer %s connected to %s: %s[%d], ack deadline %d ms, max attempts %d",
                    self._consumer_id,
                    self._target,
                    welcome.topic,
                    welcome.partition,
                    welcome.ack_deadline_ms,
                    welcome.max_attempts,
                )

    async def _write_loop(self, call: _Call) -> None:
        hello = triage_pb2.Hello(consumer_id=self._consumer_id, credits=self._credits)
        try:
            await call.write(triage_pb2.ConsumerFrame(hello=hello))
            while True:
                await self._flush_wanted.wait()
                self._flush_wanted.clear()
                await self._flush(call)
                if self._stopping.is_set() and not self._outstanding:
                    while self._acks or self._nacks or self._releases:
                        await self._flush(call)
                    await call.done_writing()
                    logger.debug(
                        "consumer %s: final settlements sent, half-closed", self._consumer_id
                    )
                    await asyncio.sleep(CLOSE_TIMEOUT_S)
                    logger.warning(
                        "consumer %s: proxy did not end the stream %.0f s after half-close",
                        self._consumer_id,
                        CLOSE_TIMEOUT_S,
                    )
                    call.cancel()
                    return
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            raise  # the call is over and its status is known: the reader reports it
        except BaseException:
            call.cancel()  # wake the reader, which reports how the stream ended
            raise

    async def _extend_loop(self, deadline_ms: asyncio.Future[int]) -> None:
        """The stream's ticker: every third of the ack deadline, while handlers run, ask the
        writer for an Extend (a deadline of 0 means leases never lapse: nothing to do)."""
        interval = (await deadline_ms) / 3000
        if not interval:
            return
        while True:
            await asyncio.sleep(interval)
            if self._running:
                self._extend_due = True
                self._flush_wanted.set()

    async def _flush(self, call: _Call) -> None:
        if self._extend_due:
            # Listed at send time, before any settlement that follows it: a handler that has
            # finished is out of the set before its result can be settled, so the proxy never
            # sees an offset extended after it was settled.
            self._extend_due = False
            with self._results_lock:
                offsets = sorted(self._running)
            if offsets:
                extend = triage_pb2.Extend(offsets=offsets)
                await call.write(triage_pb2.ConsumerFrame(extend=extend))
                self._extended += len(offsets)
        if self._releases:
            releases, self._releases = self._releases, []
            self._held -= len(releases)
            await call.write(triage_pb2.ConsumerFrame(release=triage_pb2.Release(offsets=releases)))
        acks, nacks = self._acks, self._nacks
        if not acks and not nacks:
            return
        self._acks, self._nacks = [], []
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        self._held -= len(acks) + len(nacks)
        try:
            await call.write(
                triage_pb2.ConsumerFrame(settle=triage_pb2.Settle(acks=acks, nacks=nacks))
            )
        except BaseException:
            self._dropped += len(acks) + len(nacks)
            raise
        self._acked += len(acks)
        self._nacked += len(nacks)

    def _on_flush_timer(self) -> None:
        self._flush_timer = None
        self._flush_wanted.set()

    # -- deliveries and settlements ----------------------------------------------------------

    def _on_deliveries(self, batch: triage_pb2.Deliveries) -> None:
        topic, partition = batch.topic, batch.partition
        messages: list[Message] = []
        append = messages.append
        for d in batch.deliveries:
            hs = d.headers
            append(
                make_message(
                    topic,
                    partition,
                    d.offset,
                    d.key if d.HasField("key") else None,
                    d.value if d.HasField("value") else None,
                    # iterating an empty repeated field costs microseconds: skip it
                    [(h.key, h.value if h.HasField("value") else None) for h in hs] if hs else [],
                    d.timestamp_ms,
                    d.attempt,
                )
            )
        count = len(messages)
        self._established = True
        self._delivered += count
        self._held += count
        if self._held > self._credits and not self._over_warned:
            self._over_warned = True
            logger.warning(
                "consumer %s: proxy sent %d unsettled deliveries, more than the %d credits",
                self._consumer_id,
                self._held,
                self._credits,
            )
        if self._stopping.is_set():
            self._dropped += count  # released: the proxy redelivers them
            self._releases.extend(message.offset for message in messages)
            self._flush_wanted.set()
            return
        self._outstanding += count
        # Leases cover queued deliveries too: they are in this instance's hands and will
        # start as soon as a handler slot frees, however long the running ones take.
        with self._results_lock:
            self._running.update(message.offset for message in messages)
        if self._pool is None:
            self._pending.extend(messages)
            if not self._wakes_pending:
                self._wake_worker()
        else:
            submit, run, epoch, running = (
                self._pool.submit,
                self._run_sync,
                self._epoch,
                self._running,
            )
            for message in messages:
                submit(run, message, epoch, running)

    def _after_settle(self, queue_drained: bool) -> None:
        """Send now if the batch is full or nobody is queued behind it; else soon."""
        if not self._outstanding:
            self._drained.set()
        if not self._acks and not self._nacks:
            if self._stopping.is_set() and not self._outstanding:
                self._flush_wanted.set()  # let the writer half-close
            return
        if queue_drained or len(self._acks) + len(self._nacks) >= self._batch_limit:
            self._flush_wanted.set()
        elif self._flush_timer is None and self._loop is not None:
            self._flush_timer = self._loop.call_later(SETTLE_DELAY_S, self._on_flush_timer)

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
        if self._pending and not self._wakes_pending:
            self._wake_worker()

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        pending = self._pending
        handler = cast(_AsyncHandler, self._handler)
        retry_on = self._retry_on
        streak = 0
        while not self._closing:
            if not pending:
                fut: asyncio.Future[None] = loop.create_future()
                self._idle_workers.append(fut)
                await fut
                if self._closing:
                    return
                self._wakes_pending -= 1
                streak = 0
                continue
            message = pending.popleft()
            if pending and not self._deck_check_scheduled:
                # If this handler suspends, the rest of the queue needs another worker; checking
                # on the next loop turn costs nothing when handlers finish without suspending.
                self._deck_check_scheduled = True
                loop.call_soon(self._check_deck)
            epoch = self._epoch
            offset = message.offset
            running = self._running  # this stream's: see _running
            running.add(offset)
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
                    running.discard(offset)  # no settlement: let the lease lapse
                    raise
                nack = _nack(offset, exc, retry_on)
            running.discard(offset)
            self._outstanding -= 1
            if epoch != self._epoch:
                self._dropped += 1
            elif nack is None:
                self._acks.append(offset)
            else:
                self._nacks.append(nack)
            self._after_settle(not pending)
            streak += 1
            if streak >= self._batch_limit:
                # Handlers that never suspend would starve the reader and writer.
                streak = 0
                await asyncio.sleep(0)

    # -- sync handlers: a thread pool, results handed back in batches -----------------------

    def _run_sync(self, message: Message, epoch: int, running: set[int]) -> None:
        """Runs in a handler thread; `running` is the set of the stream it was delivered on."""
        nack = None
        offset = message.offset
        lock = self._results_lock
        if epoch != self._epoch:
            epoch = _SKIPPED  # queued behind a dead stream: the proxy redelivers it
        elif self._stop_requested:
            nack = _RELEASE  # queued behind stop(): give it back unstarted
        else:
            try:
                result = self._handler(message)
                if inspect.isawaitable(result) and (loop := self._loop) is not None:
                    asyncio.run_coroutine_threadsafe(_await(result), loop).result()
            except Exception as exc:  # noqa: BLE001 - raising is how a handler says nack
                nack = _nack(offset, exc, self._retry_on)
            except BaseException as exc:
                if not isinstance(exc, self._retry_on):
                    with lock:
                        running.discard(offset)  # no settlement: let the lease lapse
                    raise
                nack = _nack(offset, exc, self._retry_on)
        with lock:
            running.discard(offset)
            self._results.append((epoch, offset, nack))
            if self._collect_scheduled:
                return
            self._collect_scheduled = True
        loop = self._loop
        if loop is not None:
            with suppress(RuntimeError):  # loop closed after a failed run(): nothing to settle
                loop.call_soon_threadsafe(self._collect)

    def _collect(self) -> None:
        with self._results_lock:
            results, self._results = self._results, []
            self._collect_scheduled = False
        current = self._epoch
        for epoch, offset, nack in results:
            if epoch != current:
                self._dropped += 1
            elif nack is _RELEASE:
                self._dropped += 1
                self._releases.append(offset)
            elif nack is None:
                self._acks.append(offset)
            else:
                self._nacks.append(nack)
        self._outstanding -= len(results)
        # At most `concurrency` run at once, so at or below it nothing waits in the pool's queue.
        self._after_settle(self._outstanding <= self._concurrency)
