"""A push target: to each partition's dispatcher, one more consumer instance, whose
credits follow the target's adaptive concurrency limit.

    dispatcher --send(entries)--> Lane (the session's outlet, one per partition)
        Lane worker: waits for a request slot -> takes a batch -> starts a request task
    request task: endpoint call -> outcomes -> settle / nack / give back -> limiter sample

What a target owns:

- the limit (`AdaptiveLimit`) and the count of requests in flight, shared by its lanes: no
  more than `limit` requests are in flight to the endpoint from this process;
- one `Lane` per partition it serves: the session in that partition's dispatcher, the
  queue of deliveries not yet sent, and the worker task that sends them;
- the pause: after an outage (connection refused), a refusal (a 404, a 401), an
  overload with Retry-After, or an overload without it once the limit is at its floor
  (it cannot fall further), no request starts until the pause ends; what the lanes
  hold goes back to the dispatcher without using an attempt, and their credits drop to
  0, so no lease runs out while the endpoint cannot be reached.

Credits: each lane gets an even share of `limit x batch` (at least one batch), so the
records the dispatcher hands over are the ones the requests can carry soon; a record
queued in a lane is leased, and a lease that lapsed while queued would cost an attempt.
The lease of what a request carries is renewed when the request starts.

Lifecycle (`lifecycle.Lifecycle`, as the dead-letter writer's): `start()` once (opens the
connection pool or channel; a second start raises StateError), `stop()` safe twice or
before start, `async with`. Partitions are attached only while it runs, and a request
is sent only before it stopped (StateError otherwise: a send after close is a bug). The
target's task waits for `stop()`, then: every lane ends (its worker starts no request)
-> the requests in flight end by themselves, up to the stop timeout (`timeout_s` twice,
the longest a request can take, plus a second) -> what outlives it is cancelled, and a
cancelled request gives its records back without an attempt -> each lane gives back what
it queued and closes its session -> the connections close. `stop(abandon=True)` cancels
the requests in flight at once: the proxy's shutdown, once the pipelines drained (their
drain timeout is the deadline, and it has passed).

An endpoint that goes away during requests (a reset connection; a gRPC consumer gone),
or a batch that gets no answer in time, is judged as a client instance that vanished,
each record of those requests started (Verdict.SUSPECT, the dispatcher's `suspect`,
policies.blamed_on_vanish): a suspect
uses an attempt, the rest go back as suspects without one, and the scheduler gives each
lane at most one suspect at a time. So a record that crashes the receiver every time is
dead-lettered after at most `max_attempts + 1` crashes, and the records in flight beside
it lose nothing. A gRPC consumer that is gone is stopped with `stop()`, not abandoned:
its calls in flight end by themselves (each with its own answer, so each is judged), and
none starts after.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from triage_proxy.errors import StateError
from triage_proxy.lifecycle import Lifecycle, State
from triage_proxy.observe.snapshot import PUSH_BUCKETS_S, LatencyHistogram, PushTargetSnapshot
from triage_proxy.pipeline.dispatch import Dispatcher, Entry, Session
from triage_proxy.pipeline.policies import backoff
from triage_proxy.push.limit import AdaptiveLimit, LimitSettings
from triage_proxy.push.responses import Outcome, Verdict
from triage_proxy.structs import Record
from triage_proxy.waiting import wait_any

__all__ = ["Call", "Lane", "PushTarget", "TargetShape"]

logger = logging.getLogger(__name__)

PAUSE_INITIAL_S = 0.5
"""The first pause after an outage or a refusal; it doubles per failure in a row."""
PAUSE_MAX_S = 30.0
"""The longest pause: an endpoint back up is found within this."""
LANE_FRAME_BYTES = 2**31 - 1
"""A lane takes any record: the request's size is the target's concern (batch bytes)."""
STOP_MARGIN_S = 1.0
"""At stop, requests in flight get the longest they can take (`timeout_s` twice: a gRPC
call may wait that long for its connection, then as long for its answer) and this."""


class PushNack(NamedTuple):
    """A nack the way the dispatcher takes one (the window's `Nack`)."""

    offset: int
    reason: str
    retry: bool


@dataclass(frozen=True, slots=True)
class TargetShape:
    """What every target has, whatever it speaks."""

    name: str
    """The target's name (config), in logs, status and metrics."""
    limit: LimitSettings
    """Its concurrency bounds."""
    batch: int
    """Records per request at most (1: one record per request)."""
    max_batch_bytes: int
    """Bytes per request at most (a single larger record still goes, alone)."""
    timeout_s: float
    """A request's deadline; its lease is renewed when it starts."""


class Call(NamedTuple):
    """One request's result: an outcome per record (in the order sent), whether the
    endpoint dropped it as overloaded (a limiter signal), the response class, and whether
    the endpoint answered (an HTTP status, a gRPC response or status of the consumer's):
    round trips that got no answer (a timeout, a reset, no connection) count as errors,
    the others as latency."""

    outcomes: list[Outcome]
    dropped: bool
    kind: str
    answered: bool = True


class Lane:
    """One partition of one target: the dispatcher session's outlet and its worker."""

    def __init__(self, target: PushTarget, dispatcher: Dispatcher) -> None:
        self.target = target
        self.dispatcher = dispatcher
        self.queue: deque[Entry] = deque()
        self.ended = False
        self.wake = asyncio.Event()
        self.inflight: set[asyncio.Task[None]] = set()
        self.acks: list[int] = []
        self.nacks: list[PushNack] = []
        """Settlements of answers that arrived in this turn of the event loop: applied
        together, once (`flush`), so a burst of answers costs one settle and one pump."""
        self._flush_due = False
        self.session: Session = dispatcher.open_session(
            f"push:{target.shape.name}", target.credits_per_lane(), self
        )

    # --- the Outlet the dispatcher sends to ----------------------------------------------

    @property
    def max_frame_bytes(self) -> int:
        return LANE_FRAME_BYTES

    def send(self, entries: list[Entry]) -> tuple[int, Sequence[Entry]]:
        self.queue.extend(entries)
        self.wake.set()
        return 1, ()

    def send_isolated(self, entry: Entry) -> tuple[int, Sequence[Entry]]:
        return self.send([entry])  # never called: a push lane is not `isolating`

    def fits(self, entry: Entry) -> bool:
        return True

    def frame_needed(self, entry: Entry) -> int:
        return entry.size

    def take_unsent(self) -> list[int]:
        offsets = [e.record.offset for e in self.queue]
        self.queue.clear()
        return offsets

    def end(self) -> None:
        self.ended = True
        self.wake.set()

    # --- the worker ----------------------------------------------------------------------

    def take(self) -> tuple[list[Entry], list[object]]:
        """The next request's records (at most `batch` of them and `max_batch_bytes` as
        the target encodes them; a larger record goes alone) and their encodings."""
        target = self.target
        shape = target.shape
        if shape.batch == 1:
            entry = self.queue.popleft()
            return [entry], [target.prepare(entry.record)[0]]
        taken: list[Entry] = []
        payloads: list[object] = []
        size = target.batch_overhead
        while self.queue and len(taken) < shape.batch:
            entry = self.queue[0]
            payload, n = target.prepare(entry.record)
            if taken and size + n > shape.max_batch_bytes:
                break
            taken.append(self.queue.popleft())
            payloads.append(payload)
            size += n
        return taken, payloads

    async def run(self) -> None:
        """Send what the dispatcher hands over until the lane ends; then close the session
        (owned by the target's task set)."""
        target = self.target
        try:
            while True:
                while not self.queue and not self.ended:
                    self.wake.clear()
                    await self.wake.wait()
                if self.ended:
                    break
                if not await target.acquire(self):
                    continue
                if not self.queue:  # given back during the wait (a pause)
                    target.release_slot()
                    continue
                entries, payloads = self.take()
                if min(e.deadline for e in entries) < target.lease_needed():
                    offsets = [e.record.offset for e in entries]
                    self.dispatcher.extend(self.session, offsets)
                task = asyncio.create_task(target.deliver(self, entries, payloads))
                self.inflight.add(task)
                task.add_done_callback(self.inflight.discard)
            self.stop_taking()
            if self.inflight:
                await asyncio.wait(set(self.inflight))
        finally:
            self.stop_taking()
            for task in list(self.inflight):
                task.cancel()  # a cancelled request gives its records back
            if self.inflight:
                await asyncio.wait(set(self.inflight))
            self.flush()
            self.stop_taking()
            self.dispatcher.close_session(self.session)

    def stop_taking(self) -> None:
        """The lane ends: the dispatcher sends it nothing more (records that requests in
        flight give back would otherwise come straight back to it, and be held when its
        session closes), and what it queued, never sent, goes back without an attempt."""
        if not self.session.closed:
            self.dispatcher.release(self.session, self.take_unsent())

    def settle_soon(self, acks: list[int], nacks: list[PushNack]) -> None:
        self.acks += acks
        self.nacks += nacks
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._flush_due = False
        acks, self.acks = self.acks, []
        nacks, self.nacks = self.nacks, []
        if (acks or nacks) and not self.session.closed:
            self.dispatcher.settle(self.session, acks, nacks)

    def give_back(self, offsets: list[int]) -> None:
        """Return deliveries to the dispatcher without using an attempt."""
        if offsets and not self.session.closed:
            self.dispatcher.give_back(self.session, offsets)

    def suspect(self, offsets: list[int], cause: str) -> None:
        """These failed together and nothing says which one caused it (Verdict.SUSPECT):
        the blame rule judges them (a suspect uses an attempt, the rest go back as
        suspects)."""
        if offsets and not self.session.closed:
            self.flush()  # answers that came before, first
            self.dispatcher.suspect(self.session, offsets, cause)


class PushTarget(Lifecycle):
    """One `[[push]]` target in this process; subclasses say how a call is made (`call`)
    and what they connect and disconnect (`_connect`, `_disconnect`). Its lifecycle is
    `lifecycle.Lifecycle` (the module docstring has the order at stop)."""

    def __init__(
        self, shape: TargetShape, *, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(stop_timeout_s=2 * shape.timeout_s + STOP_MARGIN_S)
        self.name = f"push target {shape.name}"
        self.shape = shape
        self.limiter = AdaptiveLimit(shape.limit)
        self._monotonic = monotonic
        self._lanes: dict[int, Lane] = {}
        self._workers: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        """Set while no lane worker runs."""
        self._idle.set()
        self._lane_failure: BaseException | None = None
        """What the first lane worker that died of a bug raised: stop() re-raises it."""
        self._abandon = asyncio.Event()
        """Set by stop(abandon=True): cancel the requests in flight now."""
        self._inflight = 0
        self._slot_freed = asyncio.Event()
        self._paused_until = 0.0
        self._failures = 0
        self._credits = 0
        self.condition = "ok"
        """What the target is doing, for status: ok, or why it waits."""
        self.latency = LatencyHistogram(PUSH_BUCKETS_S)
        """Request round trips that got an answer."""
        self.responses: dict[str, int] = {}
        """Requests by answer class: 2xx, 4xx, 5xx, timeout, refused, reset, ..."""
        self.records: dict[str, int] = {}
        """Records by verdict: ack, nack, retry, overload, refused, outage, suspect."""
        self.errors = 0
        """Requests that failed without an answer (timeouts, resets, refusals)."""

    # --- partitions ----------------------------------------------------------------------

    def attach(self, partition: int, dispatcher: Dispatcher) -> None:
        """Serve `partition` too: a session in its dispatcher, and a worker. Only while
        the target runs (StateError otherwise)."""
        if self._state is not State.RUNNING:
            raise StateError(f"{self.name} is {self._state.value}: it takes no partition")
        if partition in self._lanes:
            return
        lane = Lane(self, dispatcher)
        self._lanes[partition] = lane
        task = asyncio.create_task(lane.run(), name=f"push {self.shape.name} p{partition}")
        self._workers.add(task)
        self._idle.clear()
        task.add_done_callback(lambda t: self._worker_ended(t, partition, lane))
        self._regrant()

    def _worker_ended(self, task: asyncio.Task[None], partition: int, lane: Lane) -> None:
        """A lane worker ended. One that died of a bug has given its records back (its
        `finally`), but its partition would go unserved without a word until stop():
        say so at once, let the partition be attached again, and re-raise it at stop()."""
        self._workers.discard(task)
        if not self._workers:
            self._idle.set()
        if task.cancelled() or (exc := task.exception()) is None:
            return
        logger.error(
            "%s: the worker of partition %d died of a bug; the partition is not pushed "
            "until it is assigned here again",
            self.name,
            partition,
            exc_info=exc,
        )
        if self._lanes.get(partition) is lane:
            del self._lanes[partition]
            self._regrant()  # the other lanes share what it had
        if self._lane_failure is None:
            self._lane_failure = exc

    def detach(self, partition: int) -> None:
        """Stop serving `partition` (its pipeline stops): the lane ends after its requests."""
        lane = self._lanes.pop(partition, None)
        if lane is not None:
            lane.end()
            self._regrant()

    def credits_per_lane(self) -> int:
        """An even share of what `limit` requests carry, at least one batch."""
        if self._paused_until > self._monotonic():
            return 0
        lanes = max(len(self._lanes), 1)
        return max(self.shape.batch, math.ceil(self.limiter.limit * self.shape.batch / lanes))

    def _regrant(self) -> None:
        credits = self.credits_per_lane()
        if credits == self._credits:
            return
        self._credits = credits
        for lane in self._lanes.values():
            lane.dispatcher.grant(lane.session, credits)

    # --- request slots -------------------------------------------------------------------

    async def acquire(self, lane: Lane) -> bool:
        """Wait for a request slot (and the end of a pause); False if the lane ended."""
        while not lane.ended:
            wait = self._paused_until - self._monotonic()
            if wait <= 0:
                if self._credits == 0:
                    self._regrant()  # the pause is over
                if self._inflight < self.limiter.limit:
                    self._inflight += 1
                    return True
            self._slot_freed.clear()
            lane.wake.clear()
            await wait_any(self._slot_freed, lane.wake, timeout=wait if wait > 0 else None)
        return False

    def release_slot(self) -> None:
        self._inflight -= 1
        self._slot_freed.set()

    # --- delivering ----------------------------------------------------------------------

    def lease_needed(self) -> float:
        """A lease must run past this (monotonic) time for a request starting now: past
        its timeout, with a second to settle the answer."""
        return self._monotonic() + self.shape.timeout_s + 1.0

    batch_overhead = 0
    """Bytes a batched request's body has beyond what `prepare` counts for its records."""

    def prepare(self, record: Record) -> tuple[object, int]:
        """`record` as a request carries it, and its bytes there (what `max_batch_bytes`
        counts); encoded once, when the lane takes it."""
        return record, record.size

    async def call(self, records: list[Record], payloads: list[object]) -> Call:
        """Send `records` (prepared as `payloads`) in one request; an outcome per record.
        Subclasses call `_check_sending()` first."""
        raise NotImplementedError

    def _check_sending(self) -> None:
        """A request goes out only between start() and the end of stop() (the requests
        a stopping target finishes included): StateError otherwise."""
        if self._state in (State.NEW, State.STOPPED):
            raise StateError(f"{self.name} is {self._state.value}: it sends nothing")

    async def deliver(self, lane: Lane, entries: list[Entry], payloads: list[object]) -> None:
        """One request: call, then settle what it says (owned by the lane's set)."""
        records = [e.record for e in entries]
        inflight = self._inflight
        started = self._monotonic()
        try:
            result = await self.call(records, payloads)
        except asyncio.CancelledError:
            lane.give_back([r.offset for r in records])
            self.release_slot()
            raise
        now = self._monotonic()
        self.responses[result.kind] = self.responses.get(result.kind, 0) + 1
        if result.answered:
            self.latency.observe(now - started)
        else:
            self.errors += 1
        self.limiter.on_sample(now, now - started, inflight, result.dropped, len(records))
        self.release_slot()
        self._apply(lane, records, result.outcomes)
        self._regrant()

    def _apply(self, lane: Lane, records: list[Record], outcomes: list[Outcome]) -> None:
        acks: list[int] = []
        nacks: list[PushNack] = []
        back: list[int] = []
        suspects: list[int] = []
        suspect_reason = ""
        pause: Outcome | None = None
        for record, outcome in zip(records, outcomes, strict=True):
            verdict = outcome.verdict
            self.records[verdict.value] = self.records.get(verdict.value, 0) + 1
            if verdict is Verdict.ACK:
                acks.append(record.offset)
            elif verdict is Verdict.NACK:
                nacks.append(PushNack(record.offset, outcome.reason, False))
            elif verdict is Verdict.RETRY:
                nacks.append(PushNack(record.offset, outcome.reason, True))
            elif verdict is Verdict.SUSPECT:
                suspects.append(record.offset)
                suspect_reason = outcome.reason
            else:
                back.append(record.offset)
                pause = outcome
        if acks or nacks:
            self._failures = 0 if not back else self._failures
            if self.condition != "ok" and not back:
                logger.info("push target %s: delivering again", self.shape.name)
                self.condition = "ok"
            lane.settle_soon(acks, nacks)
        if back:
            lane.give_back(back)
        if suspects:
            lane.suspect(suspects, suspect_reason)
        if pause is not None:
            self._pause(pause)

    def _pause(self, outcome: Outcome) -> None:
        """Stop starting requests for a while; what the lanes hold goes back."""
        if (
            outcome.verdict is Verdict.OVERLOAD
            and outcome.retry_after_s is None
            and self.limiter.limit > self.shape.limit.min_limit
        ):
            # The limit fell, and that is the back-off while it can fall. At its floor an
            # endpoint that still sheds load (a 503 for every request, say) would get each
            # record again at once, as fast as it answers: the target pauses instead.
            return
        now = self._monotonic()
        if self._paused_until > now:
            return
        self._failures += 1
        delay = outcome.retry_after_s
        if delay is None:
            delay = backoff(self._failures, initial=PAUSE_INITIAL_S, cap=PAUSE_MAX_S)
        self._paused_until = now + delay
        self.condition = f"{outcome.verdict.value}: {outcome.reason} (waiting {delay:.1f} s)"
        logger.warning("push target %s paused: %s", self.shape.name, self.condition)
        for lane in self._lanes.values():
            lane.give_back(lane.take_unsent())
        self._regrant()

    # --- lifecycle (see lifecycle.Lifecycle and the module docstring) -------------------

    async def stop(self, *, abandon: bool = False) -> None:
        """End every lane; the requests in flight end by themselves up to the stop
        timeout, or are cancelled at once with `abandon` (their records go back without
        an attempt); then the connections close. Safe twice; `abandon` also cuts short a
        stop() already waiting."""
        if abandon:
            self._abandon.set()
        await super().stop()

    async def _run(self) -> None:
        try:
            await self._closing.wait()
            for partition in list(self._lanes):
                self.detach(partition)
            await wait_any(self._idle, self._abandon)
        finally:
            # Abandoned, or past the stop timeout (this task is cancelled): a cancelled
            # worker cancels its requests, and they give their records back.
            for task in list(self._workers):
                task.cancel()
            if self._workers:
                await asyncio.wait(set(self._workers))
            await self._disconnect()
        if self._lane_failure is not None:
            raise self._lane_failure

    def _connect(self) -> None:
        """Open the connection pool or channel (at start)."""

    async def _disconnect(self) -> None:
        """Close what `_connect` opened (at the end of stop, once no request is left)."""

    def _on_started(self) -> None:
        self._connect()
        logger.debug("%s started", self.name)

    def _on_stopping(self) -> None:
        logger.debug(
            "%s stopping: %d requests in flight%s",
            self.name,
            self._inflight,
            " (cancelled)" if self._abandon.is_set() else "",
        )

    def _on_overran(self) -> None:
        logger.warning(
            "%s: requests in flight outlived the %.1f s stop timeout; cancelled, their "
            "records go back without an attempt",
            self.name,
            self._stop_timeout_s,
        )

    def _on_finished(self) -> None:
        logger.debug("%s stopped", self.name)

    def snapshot(self) -> PushTargetSnapshot:
        """What status and metrics show of this target now."""
        return PushTargetSnapshot(
            name=self.shape.name,
            limit=self.limiter.limit,
            in_flight=self._inflight,
            partitions=tuple(sorted(self._lanes)),
            state=self.condition,
            latency=self.latency.copy(),
            responses=dict(self.responses),
            records=dict(self.records),
            errors=self.errors,
        )
