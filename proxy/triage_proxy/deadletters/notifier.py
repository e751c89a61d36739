"""Dead-letter notifications: a few aggregated summaries, never one message per dead letter.

Why: a person should learn that messages are being dead-lettered without reading
logs, but a poison-pill burst of 10,000 messages must not become 10,000 pages. So the
writer tells the notifier about each durable dead letter (`record`, cheap, on the event
loop), and the notifier sends a summary (count, per topic/partition the first and last
offsets, the most frequent reasons, the time span) to an SNS topic and/or a webhook:

- the first dead letter after a quiet spell goes out after a short gather delay
  (`DEFAULT_GATHER_S`, so a burst's start is seen together);
- after that, at most one summary per `notify_interval_s`, holding everything since
  the previous one; nothing waits longer than the interval (`next_send_at`, pure).

A failed send is logged, its counts go back into the next summary, and the next try
waits a full interval: notifications are best effort and never hold up dead-letter
writes or commits. (With two sinks of which one failed, the other sees those counts
again in the next summary.) Payloads are never sent, only reasons and coordinates.

Each external system sits behind the small `NotificationSink` Protocol: `SnsSink`
(boto3, same endpoint/credentials logic as the table), `WebhookSink` (a JSON POST with
urllib, no extra dependency) and `MemorySink` for unit tests.

Shutdown (`stop()`): stop waiting -> send what was recorded since the last summary (one
final summary, even inside the interval, bounded by `send_timeout_s`) -> end.

Error added to the tree of `errors.py`:

    UnavailableError
    +-- NotifyUnavailable         a sink did not take a summary (retried with the next)
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.errors import ConfigError, UnavailableError
from triage_proxy.lifecycle import Lifecycle, State
from triage_proxy.store.aws import aws_client, aws_errors
from triage_proxy.store.items import format_iso_ms
from triage_proxy.structs import DeadLetter
from triage_proxy.waiting import wait_any

logger = logging.getLogger(__name__)

DEFAULT_GATHER_S = 1.0
"""How long the first dead letter after a quiet spell waits for company."""
DEFAULT_SEND_TIMEOUT_S = 10.0
"""Longest one send may take (HTTP timeout; and stop()'s wait for the final summary)."""
TOP_REASONS = 5
"""Reasons listed in a summary, most frequent first."""
MAX_TRACKED_REASONS = 1000
"""Distinct reasons counted per summary; more are counted as `other_reasons`."""
SUMMARY_REASON_CHARS = 300
"""Reasons are counted by this prefix, so ids and traces at their end do not split a cause."""
MESSAGE_TYPE = "triage.dead_letters"


class NotifyUnavailable(UnavailableError):
    """A notification sink did not take a summary."""


# --- the policy (pure) ----------------------------------------------------------------


def next_send_at(
    opened_at: float, last_sent_at: float | None, interval_s: float, gather_s: float
) -> float:
    """When the summary of a window opened at `opened_at` may go out.

    Not before `gather_s` (capped at the interval) has passed since the window opened,
    and not before `interval_s` has passed since the last send (or failed try). Since a
    window opens only after the last send, nothing waits longer than `interval_s`.
    """
    earliest = opened_at + min(gather_s, interval_s)
    if last_sent_at is None:
        return earliest
    return max(earliest, last_sent_at + interval_s)


@dataclass(frozen=True)
class PartitionSummary:
    """Dead letters of one source partition within a summary."""

    topic: str
    """Source topic."""
    partition: int
    """Source partition."""
    count: int
    """Dead letters of this partition in the summary."""
    first_offset: int
    """Smallest offset among them."""
    last_offset: int
    """Largest offset among them."""


@dataclass(frozen=True)
class Summary:
    """One notification: what was dead-lettered since the previous one."""

    source: str
    """Which proxy sends it (e.g. "orders[3]")."""
    table: str
    """The dead-letter table that holds the messages."""
    count: int
    """Dead letters in this summary."""
    partitions: tuple[PartitionSummary, ...]
    """Per source partition, in (topic, partition) order."""
    top_reasons: tuple[tuple[str, int], ...]
    """Most frequent reasons with their counts, most frequent first."""
    other_reasons: int
    """Dead letters whose reason is not among `top_reasons`."""
    first_at_ms: int
    """Earliest dead_lettered_at among them (ms since the epoch)."""
    last_at_ms: int
    """Latest dead_lettered_at among them."""

    def to_json(self) -> dict[str, Any]:
        """The JSON document sent (SNS message body, webhook POST body)."""
        return {
            "type": MESSAGE_TYPE,
            "source": self.source,
            "table": self.table,
            "count": self.count,
            "first_dead_lettered_at": format_iso_ms(self.first_at_ms),
            "last_dead_lettered_at": format_iso_ms(self.last_at_ms),
            "partitions": [
                {
                    "topic": p.topic,
                    "partition": p.partition,
                    "count": p.count,
                    "first_offset": p.first_offset,
                    "last_offset": p.last_offset,
                }
                for p in self.partitions
            ],
            "top_reasons": [{"reason": r, "count": n} for r, n in self.top_reasons],
            "other_reasons": self.other_reasons,
        }

    def subject(self) -> str:
        """A one-line title (SNS subjects: at most 100 printable ASCII characters)."""
        where = ", ".join(f"{p.topic}[{p.partition}]" for p in self.partitions[:3])
        if len(self.partitions) > 3:
            where += ", ..."
        text = f"Triage: {self.count} dead letter{'s' if self.count != 1 else ''} in {where}"
        text = "".join(c if 32 <= ord(c) < 127 else "?" for c in text)
        return text if len(text) <= 100 else text[:97] + "..."


@dataclass
class _Partition:
    count: int = 0
    first: int = 0
    last: int = 0


@dataclass
class Window:
    """Counts of the dead letters recorded since the last summary (bounded memory)."""

    opened_at: float
    """Clock reading of the first dead letter recorded into it."""
    count: int = 0
    partitions: dict[tuple[str, int], _Partition] = field(default_factory=dict)
    reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    untracked: int = 0
    """Dead letters whose reason was not counted (over MAX_TRACKED_REASONS distinct)."""
    first_at_ms: int = 0
    last_at_ms: int = 0

    def add(self, dl: DeadLetter) -> None:
        record = dl.record
        stats = self.partitions.get((record.topic, record.partition))
        if stats is None:
            stats = self.partitions[(record.topic, record.partition)] = _Partition(
                0, record.offset, record.offset
            )
        stats.count += 1
        stats.first = min(stats.first, record.offset)
        stats.last = max(stats.last, record.offset)
        reason = dl.reason[:SUMMARY_REASON_CHARS]
        if reason in self.reasons or len(self.reasons) < MAX_TRACKED_REASONS:
            self.reasons[reason] += 1
        else:
            self.untracked += 1
        at = dl.dead_lettered_at_ms
        self.first_at_ms = at if self.count == 0 else min(self.first_at_ms, at)
        self.last_at_ms = at if self.count == 0 else max(self.last_at_ms, at)
        self.count += 1

    def merge(self, older: Window) -> None:
        """Fold an older window (a summary that failed to send) into this one."""
        if older.count == 0:
            return
        for key, theirs in older.partitions.items():
            ours = self.partitions.get(key)
            if ours is None:
                self.partitions[key] = _Partition(theirs.count, theirs.first, theirs.last)
            else:
                ours.count += theirs.count
                ours.first = min(ours.first, theirs.first)
                ours.last = max(ours.last, theirs.last)
        for reason, n in older.reasons.items():
            if reason in self.reasons or len(self.reasons) < MAX_TRACKED_REASONS:
                self.reasons[reason] += n
            else:
                self.untracked += n
        self.untracked += older.untracked
        self.first_at_ms = (
            older.first_at_ms if self.count == 0 else min(self.first_at_ms, older.first_at_ms)
        )
        self.last_at_ms = (
            older.last_at_ms if self.count == 0 else max(self.last_at_ms, older.last_at_ms)
        )
        self.count += older.count
        self.opened_at = min(self.opened_at, older.opened_at)

    def summary(self, source: str, table: str) -> Summary:
        top = tuple(self.reasons.most_common(TOP_REASONS))
        return Summary(
            source=source,
            table=table,
            count=self.count,
            partitions=tuple(
                PartitionSummary(topic, partition, s.count, s.first, s.last)
                for (topic, partition), s in sorted(self.partitions.items())
            ),
            top_reasons=top,
            other_reasons=self.count - sum(n for _, n in top),
            first_at_ms=self.first_at_ms,
            last_at_ms=self.last_at_ms,
        )


class Aggregator:
    """The notification policy: what to send and when, given the clock reading. No I/O.

    `record(dl, now)` counts a dead letter; `due_at()` says when the pending summary may
    go out (None: nothing pending); `take(now)` hands it over once due; `sent(ok, now)`
    reports the outcome (a failure puts the counts back for the next try).
    """

    def __init__(
        self, source: str, table: str, interval_s: float, gather_s: float = DEFAULT_GATHER_S
    ) -> None:
        if interval_s <= 0:
            raise ConfigError("dead_letters.notify_interval_s", "must be > 0")
        self.source = source
        self.table = table
        self.interval_s = interval_s
        self.gather_s = gather_s
        self._window: Window | None = None
        self._sending: Window | None = None
        self._last_sent_at: float | None = None

    def record(self, dl: DeadLetter, now: float) -> None:
        if self._window is None:
            self._window = Window(opened_at=now)
        self._window.add(dl)

    @property
    def pending(self) -> int:
        """Dead letters recorded and not yet in a summary that was sent."""
        return (self._window.count if self._window else 0) + (
            self._sending.count if self._sending else 0
        )

    def due_at(self) -> float | None:
        if self._window is None or self._sending is not None:
            return None
        return next_send_at(
            self._window.opened_at, self._last_sent_at, self.interval_s, self.gather_s
        )

    def take(self, now: float, *, force: bool = False) -> Summary | None:
        """The summary to send now, or None if nothing is due (`force`: due or not)."""
        due = self.due_at()
        if due is None or (now < due and not force):
            return None
        assert self._window is not None
        self._sending, self._window = self._window, None
        self._last_sent_at = now
        return self._sending.summary(self.source, self.table)

    def sent(self, ok: bool, now: float) -> None:
        """Outcome of the summary last taken; on failure its counts go back."""
        sending, self._sending = self._sending, None
        if ok or sending is None:
            return
        if self._window is None:
            self._window = sending
        else:
            self._window.merge(sending)


# --- sinks ----------------------------------------------------------------------------


class NotificationSink(Protocol):
    """Where summaries go; sync, called from a worker thread."""

    def send(self, summary: Summary) -> None:
        """Deliver one summary; raise NotifyUnavailable if it was not taken."""
        ...

    def close(self) -> None: ...


class SnsSink:
    """Publishes each summary to an SNS topic (JSON body, a short Subject)."""

    def __init__(
        self,
        settings: DeadLetterSettings,
        topic_arn: str,
        *,
        timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
    ) -> None:
        self.topic_arn = topic_arn
        self._client = aws_client(
            "sns", settings, connect_timeout_s=timeout_s / 2, read_timeout_s=timeout_s / 2
        )

    def send(self, summary: Summary) -> None:
        with aws_errors(f"SNS publish to {self.topic_arn}", NotifyUnavailable):
            self._client.publish(
                TopicArn=self.topic_arn,
                Subject=summary.subject(),
                Message=json.dumps(summary.to_json()),
            )

    def close(self) -> None:
        self._client.close()


class WebhookSink:
    """POSTs each summary as JSON to a URL (http or https); any 2xx means taken."""

    def __init__(self, url: str, *, timeout_s: float = DEFAULT_SEND_TIMEOUT_S) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError("dead_letters.notify_webhook_url", f"not an http(s) URL: {url!r}")
        self.url = url
        self._timeout_s = timeout_s
        self._where = f"{parts.scheme}://{parts.netloc}"  # logs never show paths (tokens)

    def send(self, summary: Summary) -> None:
        body = json.dumps(summary.to_json()).encode()
        request = urllib.request.Request(  # scheme checked in __init__: no file:// here
            self.url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "User-Agent": "triage-notifier"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            raise NotifyUnavailable(f"webhook {self._where} answered {exc.code}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise NotifyUnavailable(f"webhook {self._where} unreachable: {exc}") from exc

    def close(self) -> None:
        pass


class MemorySink:
    """In-memory twin for unit tests: keeps what it was sent; can be told to fail."""

    def __init__(self) -> None:
        self.summaries: list[Summary] = []
        self.fail = False

    def send(self, summary: Summary) -> None:
        if self.fail:
            raise NotifyUnavailable("memory sink told to fail")
        self.summaries.append(summary)

    def close(self) -> None:
        pass


# --- the component --------------------------------------------------------------------


NotifierState = State
"""The notifier's lifecycle states (the shared `lifecycle.State`)."""


class DeadLetterNotifier(Lifecycle):
    """Sends aggregated dead-letter summaries to its sinks, on the Aggregator's schedule.

    `record(dl)` is what the DeadLetterWriter calls (its `notifier` parameter); call it
    on the event loop thread. `clock` is monotonic seconds (injectable for tests). Its
    lifecycle is `lifecycle.Lifecycle`; stop() sends a final summary of what is pending
    (bounded by twice send_timeout_s).
    """

    name = "dead-letter notifier"

    def __init__(
        self,
        sinks: Sequence[NotificationSink],
        *,
        source: str,
        table: str,
        interval_s: float,
        gather_s: float = DEFAULT_GATHER_S,
        send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not sinks:
            raise ValueError("a notifier needs at least one sink")
        super().__init__(stop_timeout_s=send_timeout_s * 2)
        self._sinks = list(sinks)
        self._aggregator = Aggregator(source, table, interval_s, gather_s)
        self._clock = clock
        self._wakeup = asyncio.Event()
        self.sent = 0
        """Summaries delivered to every sink."""
        self.failed = 0
        """Summaries that at least one sink did not take (their counts went back)."""

    @property
    def pending(self) -> int:
        """Dead letters recorded but not yet in a delivered summary."""
        return self._aggregator.pending

    def record(self, dl: DeadLetter) -> None:
        """Count one durable dead letter; never blocks. Ignored once stopped."""
        if self._state is State.STOPPED:
            logger.debug("notifier stopped; not counting a dead letter")
            return
        self._aggregator.record(dl, self._clock())
        self._wakeup.set()

    # --- lifecycle (see lifecycle.Lifecycle) ---------------------------------------

    def _on_started(self) -> None:
        logger.info(
            "dead-letter notifier started: %s, at most one summary per %.0fs",
            ", ".join(type(s).__name__ for s in self._sinks),
            self._aggregator.interval_s,
        )

    def _on_stopping(self) -> None:
        logger.debug("dead-letter notifier stopping: sending the final summary")

    def _on_overran(self) -> None:
        logger.warning("the final dead-letter summary outlived its timeout; dropped")

    def _on_stopped(self) -> None:
        for sink in self._sinks:
            sink.close()

    def _on_finished(self) -> None:
        logger.info(
            "dead-letter notifier stopped: %d summaries sent, %d failed, %d dead letters unsent",
            self.sent,
            self.failed,
            self.pending,
        )

    # --- the background task --------------------------------------------------------

    async def _run(self) -> None:
        aggregator = self._aggregator
        while not self._closing.is_set():
            self._wakeup.clear()  # before due_at(): a record() from here on wakes _wait
            due = aggregator.due_at()
            wait = None if due is None else max(0.0, due - self._clock())
            if wait is None or wait > 0:
                # Until something is recorded, stop() is called, or `wait` passes.
                await wait_any(self._wakeup, self._closing, timeout=wait)
                continue
            summary = aggregator.take(self._clock())
            if summary is not None:
                await self._send(summary)
        summary = aggregator.take(self._clock(), force=True)
        if summary is not None:
            await self._send(summary)

    async def _send(self, summary: Summary) -> None:
        ok = True
        for sink in self._sinks:
            try:
                await asyncio.to_thread(sink.send, summary)
            except NotifyUnavailable as exc:
                ok = False
                logger.warning(
                    "dead-letter summary of %d not delivered (retrying with the next): %s",
                    summary.count,
                    exc,
                )
        self._aggregator.sent(ok, self._clock())
        if ok:
            self.sent += 1
        else:
            self.failed += 1


def notifier_from_settings(
    settings: DeadLetterSettings, source: str, *, clock: Callable[[], float] = time.monotonic
) -> DeadLetterNotifier | None:
    """The notifier `settings` ask for (SNS and/or webhook), or None when neither is set."""
    sinks: list[NotificationSink] = []
    if settings.notify_webhook_url:
        sinks.append(WebhookSink(settings.notify_webhook_url))
    if settings.notify_sns_topic_arn:
        sinks.append(SnsSink(settings, settings.notify_sns_topic_arn))
    if not sinks:
        return None
    return DeadLetterNotifier(
        sinks,
        source=source,
        table=settings.table,
        interval_s=settings.notify_interval_s,
        clock=clock,
    )
