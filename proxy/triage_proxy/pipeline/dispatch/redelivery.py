"""Redelivery: what becomes of a delivery that failed, and of records given back.

A delivery fails (and uses up its attempt) when it is nacked with retry, when its ack
deadline passes (its lease expires), or when its instance vanishes and the evidence
points at it (`judged_on_vanish`: the isolated suspect it reported started, or for an
older client the only delivery it held or its one suspect); the other deliveries of a
vanished instance go back without using an attempt, as ordinary deliveries when the
crash was blamed on one of them and they were no suspects (`acquit`, at most twice in a
row), else as suspects (`clear`). The pure policy
`after_failure` then says: redeliver or, once the attempts are exhausted, dead-letter it
with the last cause. A retry nack waits `retry_delay` in BACKOFF; a vanished instance or
a lapsed lease waits `redelivery_delay` (the first time not at all, then gaps that add
up to `delivery.redelivery_span_s`, so a fleet in a crash loop cannot use up a healthy
message's attempts in seconds) and goes out as a suspect (scheduler.py gives each
instance at most one). The failed counts are the window's (`Carryover.count_failure`); a
restarted proxy continues them (`resume`), so a crash-type pill reaches its limit across
restarts.

    failed ──> after_failure ──> DEAD_LETTER: dead_letter() ──> the writer (partition.py)
                     │
                     └─ REDELIVER: nack with retry ──> BACKOFF (retry_delay) ──┐
                                   lapsed / vanished ─> suspect, at once or    │
                                   after BACKOFF (redelivery_delay) ───────────┤
                                                                  `due` ───────┴─> queued

Giving back (`give_back`: an instance releasing what it never started, or a stream the
proxy ended) returns records to the front of the queue without using an attempt.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

from triage_protocol.constants import MAX_REASON_CHARS
from triage_proxy.config.sections import RetrySettings
from triage_proxy.pipeline.dispatch.keylocks import KeyLocks
from triage_proxy.pipeline.dispatch.scheduler import Scheduler
from triage_proxy.pipeline.dispatch.window import (
    NOT_ACQUITTED,
    Counters,
    Entry,
    EntryState,
    Nack,
    Window,
)
from triage_proxy.pipeline.policies import Outcome, after_failure, redelivery_delay, retry_delay
from triage_proxy.pipeline.timers import Timers
from triage_proxy.structs import DeadLetter

_BY_OFFSET = operator.attrgetter("record.offset")


class Redelivery:
    """Failed deliveries of one partition: backoff timers, suspects, dead letters."""

    def __init__(
        self,
        *,
        max_attempts: int,
        span_s: float,
        retry: RetrySettings,
        window: Window,
        scheduler: Scheduler,
        keys: KeyLocks | None,
        counters: Counters,
        dead_letter: Callable[[DeadLetter], None],
        clock: Callable[[], float],
        monotonic: Callable[[], float],
    ) -> None:
        self._max_attempts = max_attempts
        self._span_s = span_s
        self._retry = retry
        self._window = window
        self._scheduler = scheduler
        self._keys = keys
        """Ordering by key (None: unordered)."""
        self._counters = counters
        self._dead_letter = dead_letter
        self._clock = clock
        self._monotonic = monotonic
        self._backoffs: Timers[int] = Timers()
        """Entries in BACKOFF by offset; suspects go back to the suspects when due."""

    def failed(self, entry: Entry, cause: str, consumer_id: str) -> bool:
        """A delivery of `entry` failed: True to redeliver, False if it was dead-lettered."""
        entry.holder = None
        self._window.carryover.count_failure(entry)
        if after_failure(entry.attempt, self._max_attempts) is Outcome.DEAD_LETTER:
            self.dead_letter(
                entry, f"delivery attempts exhausted ({entry.attempt}): {cause}", consumer_id
            )
            return False
        return True

    def nacked(self, consumer_id: str, entries: list[Entry], nacks: Sequence[Nack]) -> None:
        """`entries` were nacked with `nacks` (the same order): dead-letter now, or (retry)
        after a backoff while attempts are left."""
        self._counters.nacked += len(entries)
        for entry, nack in zip(entries, nacks, strict=True):
            reason = nack.reason[:MAX_REASON_CHARS] or "nacked without a reason"
            if not nack.retry:
                self.dead_letter(entry, reason, consumer_id)
            elif self.failed(entry, reason, consumer_id):
                self._counters.retried += 1
                entry.state = EntryState.BACKOFF
                delay = retry_delay(entry.attempt, self._retry)
                self._backoffs.schedule(nack.offset, self._monotonic() + delay)

    def redeliver(self, entries: list[Entry]) -> int:
        """Their instance vanished or their lease lapsed: each goes out again as a suspect,
        at once or after `redelivery_delay` in BACKOFF. Returns how many wait."""
        now_: list[Entry] = []
        waiting = 0
        at = self._monotonic()
        for entry in entries:
            delay = redelivery_delay(entry.attempt, self._max_attempts, self._span_s)
            if delay > 0:
                entry.state = EntryState.BACKOFF
                entry.suspect = True
                entry.acquittals = NOT_ACQUITTED
                self._backoffs.schedule(entry.record.offset, at + delay)
                waiting += 1
            else:
                now_.append(entry)
        self._suspect(now_)
        return waiting

    def clear(self, entries: list[Entry]) -> None:
        """`entries` were held by an instance that vanished, nothing points at them, and
        they are not acquitted (`judged_on_vanish`: nothing explains the crash, or they
        were suspects already, or were acquitted as often as it allows): back as suspects
        at once, without using an attempt."""
        for entry in entries:
            entry.holder = None
            entry.attempt -= 1
        self._suspect(entries)

    def acquit(self, entries: list[Entry], culprit: int) -> None:
        """`entries` were held by an instance that vanished, and the crash was blamed on
        the record at `culprit` (policies.judged_on_vanish): back to the front of the
        queue as ordinary deliveries, without using an attempt."""
        for entry in entries:
            entry.holder = None
            entry.attempt -= 1
            times, _ = entry.acquittals
            entry.acquittals = (times + 1, culprit)
            entry.state = EntryState.READY
        entries.sort(key=_BY_OFFSET)
        self._scheduler.queue_front(entries)

    def give_back(self, entries: list[Entry]) -> int:
        """`entries`, taken from an instance, go back to the queue without using an
        attempt (suspects stay suspects). Returns how many were not suspects."""
        back: list[Entry] = []
        for entry in entries:
            entry.holder = None
            entry.attempt -= 1
            if entry.suspect:
                entry.suspect = False
                self._suspect([entry])
            else:
                back.append(entry)
        back.sort(key=_BY_OFFSET)
        for entry in back:
            entry.state = EntryState.READY
        self._scheduler.queue_front(back)
        return len(back)

    def resume(self, entry: Entry) -> None:
        """`entry` failed `entry.attempt` times before a restart and may go now: it goes on
        from there, as a suspect after the gap its count calls for, or to the dead-letter
        table if those were all its attempts."""
        failed = entry.attempt
        if after_failure(failed, self._max_attempts) is Outcome.DEAD_LETTER:
            reason = f"delivery attempts exhausted ({failed}) before a proxy restart"
            self.dead_letter(entry, reason, "")
        else:
            self.redeliver([entry])

    def dead_letter(self, entry: Entry, reason: str, consumer_id: str) -> None:
        """Hand `entry` to the dead-letter writer; it settles once the writer says so."""
        self._window.dead_lettering(entry)
        if self._keys is not None:
            # It is out of the consumers' hands: the key moves on.
            self.proceed(self._keys.release((entry,)))
        self._dead_letter(
            DeadLetter(
                record=entry.record,
                reason=reason,
                attempts=entry.attempt,
                consumer_id=consumer_id,
                dead_lettered_at_ms=int(self._clock() * 1000),
            )
        )

    def proceed(self, successors: list[Entry]) -> None:
        """Ordering by key: `successors` own their keys now and may go (one that failed
        in a previous run continues its count: nothing else delivered it)."""
        for successor in successors:
            if successor.attempt:
                self.resume(successor)
            else:
                successor.state = EntryState.READY
                self._scheduler.queue((successor,))

    def due(self, now: float) -> None:
        """Backoffs that ran out by `now` are queued again (suspects with the suspects)."""
        entries = self._window.entries
        suspects: list[Entry] = []
        for offset in self._backoffs.pop_due(now):
            entry = entries.get(offset)
            if entry is not None and entry.state is EntryState.BACKOFF:
                if entry.suspect:
                    suspects.append(entry)
                else:
                    entry.state = EntryState.READY
                    self._scheduler.queue_first(entry)
        if suspects:
            self._suspect(suspects)

    def _suspect(self, entries: list[Entry]) -> None:
        entries.sort(key=_BY_OFFSET)
        for entry in entries:
            entry.state = EntryState.READY
            entry.suspect = True
            entry.acquittals = NOT_ACQUITTED
        self._scheduler.queue_suspects(entries)
