"""The dead-letter writer: a nacked message is durable in DynamoDB before its offset settles.

Why: a dead letter takes the place of its message in Kafka, so the commit tracker may
move past the offset only once the table holds the message byte-exact. The writer
reports an item (``on_written``) strictly after DynamoDB accepted it. While DynamoDB is
down or throttling it keeps every item and retries forever with capped exponential
backoff; the offsets then simply do not commit and the in-flight window eventually
pauses fetching. Nothing is dropped, nothing is reported written that was not.

Writes go through `table.deadletters.DeadLetterStore`, a small sync Protocol with the
real `DynamoDBStore` and the in-memory `MemoryStore` for unit tests (the item format,
idempotent writes and S3 overflow are the store package's). `DeadLetterWriter` batches
submissions, runs `put_batch` in worker threads (up to `DEFAULT_MAX_IN_FLIGHT` batches
at once), retries what was not written, and tells an optional observer (the notifier)
about every dead letter once it is durable.

Unwritable dead letters, the policy. A dead letter too large for an item even with its
payload in S3 (or without `dead_letters.overflow_bucket`) can never be written as it is,
and writing it truncated or without its value would lose data. So the writer never sends
it (one oversized item would fail its whole batch forever) and holds it unwritten for
good; the partition's commit waits at its offset (later offsets are still delivered and
settled, and ride along in the commit's metadata), and a restart redelivers it. It is
made loud, not silent: one ERROR line naming the offset and the fix, `unwritable` (what
the proxy's /status, `triage status` and the `triage_dead_letters_unwritable` gauge show,
as degraded "dead_letters_unwritable"), and `on_unwritable(dl)`, with which the
dispatcher stops counting it as in flight so a drain does not wait for it; `flush` does
not wait for it either, so SIGTERM exits at once. The fix is almost always to set
`dead_letters.overflow_bucket` and restart. Client-sent metadata is bounded
(clienttext.py: consumer id, nack reason), so with a bucket every dead letter fits; the
proxy (app.py) and `triage config check` warn at start when no bucket is set
(`overflow_warning`).

Shutdown of the writer (`stop()`): stop taking batches -> let the `put_batch` calls in
flight finish and report what they wrote (no further retries) -> cancel only what
outlives `stop_timeout_s`. Whatever is still unwritten stays pending: its offsets do
not commit and Kafka redelivers it after a restart. Call `flush(timeout)` first to
write what can be written.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from triage_proxy.clienttext import for_log
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.errors import ConfigError, DeadLetterUnavailable, StateError
from triage_proxy.lifecycle import Lifecycle, State
from triage_proxy.observe.snapshot import UnwritableDeadLetter
from triage_proxy.pipeline.policies import backoff
from triage_proxy.store.deadletter_store import MAX_BATCH, DeadLetterStore
from triage_proxy.store.items import (
    MAX_ITEM_BYTES,
    DeadLetterKey,
    dead_letter_key,
    fits_with_overflow,
    item_size,
)
from triage_proxy.structs import DeadLetter
from triage_proxy.waiting import Sleep, wait_any

logger = logging.getLogger(__name__)

DEFAULT_MAX_IN_FLIGHT = 4
"""Batches being written at once."""
DEFAULT_STOP_TIMEOUT_S = 10.0
"""How long stop() lets in-flight writes finish before cancelling them."""
RETRY_BASE_S = 0.05
"""First backoff after a failed write; doubles per consecutive failure up to retry_max_s."""


NO_BUCKET_FIX = (
    "set dead_letters.overflow_bucket (payloads over the item limit then go to S3) and "
    "restart the proxy: the message is redelivered"
)
TOO_LARGE_EVEN_IN_S3_FIX = (
    "none by configuration: its metadata alone exceeds the item limit even with the payload "
    "in S3 (a bug: please report it); the message is redelivered after a restart"
)


def overflow_warning(settings: DeadLetterSettings) -> str | None:
    """What to warn about at start (`triage config check`, the writer): no overflow bucket
    means a record over DynamoDB's item limit cannot be dead-lettered. None with a bucket."""
    if settings.overflow_bucket is not None:
        return None
    return (
        f"dead_letters.overflow_bucket is not set: a dead letter over DynamoDB's item limit "
        f"({MAX_ITEM_BYTES:,} bytes) cannot be written, and the commit of its partition "
        f"would wait at its offset until a bucket is set"
    )


def unwritable_fix(settings: DeadLetterSettings) -> str:
    """What makes a dead letter over the item limit writable under `settings`."""
    return NO_BUCKET_FIX if settings.overflow_bucket is None else TOO_LARGE_EVEN_IN_S3_FIX


# --- the writer -----------------------------------------------------------------------


def backoff_delay(
    failures: int, cap: float, *, base: float = RETRY_BASE_S, rand: float = 1.0
) -> float:
    """Pause before the next try after `failures` consecutive failed writes (>= 1).

    `policies.backoff` from `base`, doubling up to `cap`, then scaled into [half, all] of
    itself by `rand` in [0, 1] ("equal jitter", so many proxies do not retry in step).
    """
    return backoff(failures, initial=base, cap=cap) * (0.5 + 0.5 * rand)


class DeadLetterObserver(Protocol):
    """Told about every dead letter once it is durable (the notifier); on the loop thread."""

    def record(self, dl: DeadLetter) -> None:
        """Take note of `dl`; must be cheap and must not block."""
        ...


WriterState = State
"""The writer's lifecycle states (the shared `lifecycle.State`)."""


@dataclass(slots=True)
class _Entry:
    seq: int
    """Submission order; flush() waits for every seq below its mark."""
    dl: DeadLetter
    key: DeadLetterKey


class DeadLetterWriter(Lifecycle):
    """Batches dead letters into the store and reports each once it is durable.

    `on_written(dl)` runs for every dead letter once the store holds it (the commit
    tracker settles its offset); then `notifier.record(dl)`, if a notifier is given.
    `on_unwritable(dl)` runs, inside `submit`, for a dead letter that can never be written
    (see the module docstring's policy).
    Its lifecycle (start once, stop safe twice, `async with`) is `lifecycle.Lifecycle`.
    """

    name = "dead-letter writer"

    def __init__(
        self,
        store: DeadLetterStore,
        settings: DeadLetterSettings,
        on_written: Callable[[DeadLetter], None],
        *,
        notifier: DeadLetterObserver | None = None,
        on_unwritable: Callable[[DeadLetter], None] | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
        sleep: Sleep = asyncio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if not 1 <= settings.batch_size <= MAX_BATCH:
            raise ConfigError("dead_letters.batch_size", f"must be 1..{MAX_BATCH}")
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        super().__init__(stop_timeout_s)
        self._store = store
        self._settings = settings
        self._on_written = on_written
        self._notifier = notifier
        self._on_unwritable = on_unwritable
        self._sleep = sleep
        self._rand = rand
        self._slots = asyncio.Semaphore(max_in_flight)
        self._wakeup = asyncio.Event()
        self._progress = asyncio.Event()
        self._queue: collections.deque[_Entry] = collections.deque()
        self._outstanding: collections.OrderedDict[int, None] = collections.OrderedDict()
        """Seqs submitted, writable and not yet written, oldest first."""
        self._parked: dict[int, UnwritableDeadLetter] = {}
        """Seq -> dead letter too large to ever write, in submission order."""
        self._next_seq = 0
        self._written = 0
        self._failed_writes = 0
        self._degraded_since: float | None = None

    # --- lifecycle (see lifecycle.Lifecycle) ---------------------------------------

    def _on_started(self) -> None:
        logger.info(
            "dead-letter writer started: table=%s batch=%d flush=%dms",
            self._settings.table,
            self._settings.batch_size,
            self._settings.flush_interval_ms,
        )

    def _on_stopping(self) -> None:
        # No new batches, no retries: the writes in flight finish and report.
        logger.debug("dead-letter writer stopping: finishing writes in flight")
        self._wakeup.set()

    def _on_overran(self) -> None:
        logger.warning(
            "dead-letter writes outlived the %.1fs stop timeout; cancelling them",
            self._stop_timeout_s,
        )

    def _on_stopped(self) -> None:
        self._notify()

    def _on_finished(self) -> None:
        logger.info(
            "dead-letter writer stopped: %d written, %d left unwritten (%d of them unwritable; "
            "offsets stay uncommitted)",
            self._written,
            self.pending,
            len(self._parked),
        )

    # --- the API --------------------------------------------------------------------

    def submit(self, dl: DeadLetter) -> None:
        """Queue `dl` for writing; never blocks, never drops. Call on the event loop thread.

        Raises StateError once the writer is stopping (nothing would write it).
        """
        if self._state in (State.STOPPING, State.STOPPED):
            raise StateError(f"dead-letter writer is {self._state.value}")
        seq = self._next_seq
        self._next_seq += 1
        if not fits_with_overflow(dl, self._settings, self._store.group):
            self._park(seq, dl)
            return
        self._outstanding[seq] = None
        self._queue.append(_Entry(seq, dl, dead_letter_key(dl)))
        self._wakeup.set()

    def _park(self, seq: int, dl: DeadLetter) -> None:
        """Hold `dl` unwritten for good: the module docstring's policy, loudly."""
        topic, partition, offset = dead_letter_key(dl)
        held = UnwritableDeadLetter(
            offset, item_size(dl, self._store.group), MAX_ITEM_BYTES, unwritable_fix(self._settings)
        )
        self._parked[seq] = held
        logger.error(
            "dead letter %s[%d]@%d (reason '%s', consumer '%s') needs %d bytes, over "
            "DynamoDB's item limit of %d: held unwritten, so the commit of %s[%d] cannot "
            "pass offset %d. Fix: %s",
            topic,
            partition,
            offset,
            for_log(dl.reason),
            for_log(dl.consumer_id),
            held.size,
            held.limit,
            topic,
            partition,
            offset,
            held.fix,
        )
        if self._on_unwritable is not None:
            self._on_unwritable(dl)

    @property
    def pending(self) -> int:
        """Dead letters submitted but not yet durably written (too-large ones included)."""
        return len(self._outstanding) + len(self._parked)

    @property
    def written(self) -> int:
        """Dead letters written and reported so far."""
        return self._written

    @property
    def too_large(self) -> int:
        """Dead letters held because they exceed DynamoDB's item limit (and no S3 helps)."""
        return len(self._parked)

    def unwritable(self, limit: int | None = None) -> tuple[UnwritableDeadLetter, ...]:
        """The dead letters held for good (the oldest `limit` of them), oldest first."""
        held = self._parked.values()
        return tuple(held if limit is None else itertools.islice(held, limit))

    @property
    def degraded(self) -> bool:
        """True while writes are failing or being throttled."""
        return self._degraded_since is not None

    async def flush(self, timeout: float) -> bool:  # noqa: ASYNC109 (API: flush(timeout=))
        """Wait until everything submitted so far is written; False on timeout.

        Also False at once when the writer is not running (nothing would progress), and
        as soon as only too-large dead letters are left among those submitted.
        """
        mark = self._next_seq
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._outstanding and next(iter(self._outstanding)) < mark:
            if self._state is not State.RUNNING or self._task is None or self._task.done():
                return False
            progress = self._progress
            try:
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await progress.wait()
            except TimeoutError:
                return False
        return not (self._parked and next(iter(self._parked)) < mark)

    # --- the background task --------------------------------------------------------

    def _notify(self) -> None:
        """Wake every flush() waiter: something was written or the state changed."""
        self._progress.set()
        self._progress = asyncio.Event()

    async def _run(self) -> None:
        try:
            async with asyncio.TaskGroup() as writes:
                while True:
                    await self._slots.acquire()
                    batch = await self._next_batch()
                    if batch is None:
                        self._slots.release()
                        break
                    writes.create_task(self._write(batch), name="dead-letter-batch")
        finally:
            self._notify()

    async def _next_batch(self) -> list[_Entry] | None:
        """Up to batch_size entries, waiting at most flush_interval_ms to fill; None to end."""
        queue = self._queue
        while not queue:
            if self._closing.is_set():
                return None
            self._wakeup.clear()
            await self._wakeup.wait()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settings.flush_interval_ms / 1000
        while len(queue) < self._settings.batch_size and not self._closing.is_set():
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._wakeup.wait()
        if self._closing.is_set():
            return None
        batch: list[_Entry] = []
        keys: set[DeadLetterKey] = set()
        later: list[_Entry] = []
        while queue and len(batch) < self._settings.batch_size:
            entry = queue.popleft()
            if entry.key in keys:  # one key twice in a batch fails the whole call
                later.append(entry)
            else:
                keys.add(entry.key)
                batch.append(entry)
        queue.extendleft(reversed(later))
        return batch

    async def _write(self, batch: list[_Entry]) -> None:
        """Write one batch until every entry is written or the writer stops."""
        try:
            todo = batch
            failures = 0
            while True:
                try:
                    unwritten = await asyncio.to_thread(self._store.put_batch, [e.dl for e in todo])
                except DeadLetterUnavailable as exc:
                    left, problem = todo, str(exc)
                else:
                    left = self._settle(todo, unwritten)
                    if not left:
                        self._recovered()
                        return
                    problem = f"{len(left)} of {len(todo)} items unprocessed (throttled)"
                failures += 1
                self._degrade(problem)
                if self._closing.is_set():
                    return  # stopping: `left` stays pending and its offsets uncommitted
                delay = backoff_delay(failures, self._settings.retry_max_s, rand=self._rand())
                await wait_any(self._closing, timeout=delay, sleep=self._sleep)  # stop() cuts it
                if self._closing.is_set():
                    return
                todo = left
        finally:
            self._slots.release()

    def _settle(self, todo: list[_Entry], unwritten: Sequence[DeadLetter]) -> list[_Entry]:
        """Report the written entries; return the ones still to write."""
        missing = {dead_letter_key(dl) for dl in unwritten}
        left: list[_Entry] = []
        written: list[_Entry] = []
        for entry in todo:
            if entry.key in missing:
                left.append(entry)
            else:
                del self._outstanding[entry.seq]
                written.append(entry)
        self._written += len(written)
        try:
            for entry in written:
                self._on_written(entry.dl)
                if self._notifier is not None:
                    self._notifier.record(entry.dl)
        finally:
            if written:
                self._notify()
        return left

    def _degrade(self, problem: str) -> None:
        self._failed_writes += 1
        if self._degraded_since is None:
            self._degraded_since = asyncio.get_running_loop().time()
            logger.warning(
                "dead-letter writes failing, retrying with backoff up to %.1fs "
                "(%d pending, offsets held): %s",
                self._settings.retry_max_s,
                self.pending,
                problem,
            )

    def _recovered(self) -> None:
        if self._degraded_since is None:
            return
        elapsed = asyncio.get_running_loop().time() - self._degraded_since
        logger.info(
            "dead-letter writes recovered after %.1fs and %d failed attempts (%d pending)",
            elapsed,
            self._failed_writes,
            self.pending,
        )
        self._degraded_since = None
        self._failed_writes = 0
